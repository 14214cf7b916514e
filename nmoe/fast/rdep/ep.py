"""Expert parallelism over RDEP: differentiable dispatch / return, and gradient reduction that knows which
parameters are expert-sharded.
"""

# The backward of a dispatch is a return and the backward of a return is a dispatch. A return's gradient
# dout [T, K, H] is one row per slot, so it travels through a second group whose tokens are the T*K slots
# with top_k = 1: row_id = src*T*K + t*K + k is the forward's row_id, and the owner receives the gradient
# rows in the forward's receive order.

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from nmoe.fast.combine import combine
from nmoe.fast.gemm import grouped_gemm, grouped_gemm_act
from nmoe.fast.rdep.group import RdepGroup, RdepShape, rdep_dispatch, rdep_return

EXPERT_SHARDED = "_nmoe_expert_sharded"
"""Attribute set on a parameter whose rows live on one rank only (experts [r*n_local, (r+1)*n_local))."""


def slot_shape(shape: RdepShape) -> RdepShape:
    """The backward group's shape: one token per forward slot, top_k 1, same capacity."""
    return replace(shape, tokens=shape.tokens * shape.top_k, top_k=1)


@dataclass(frozen=True)
class Exchange:
    """The two groups of one MoE layer on this rank: `fwd` (tokens, top_k) and `slots` (T*K, 1)."""

    fwd: RdepGroup
    slots: RdepGroup


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, ids: Tensor, ex: Exchange) -> tuple[Tensor, Tensor, Tensor]:
        recv = rdep_dispatch(ex.fwd, x, ids)
        ctx.ex, ctx.dispatch = ex, ex.fwd.dispatches
        counts, n_recv = recv.counts.clone(), recv.n_recv.clone()
        ctx.mark_non_differentiable(counts, n_recv)
        return recv.x.clone(), counts, n_recv

    @staticmethod
    def backward(ctx: Any, dx_recv: Tensor, *_: Any) -> tuple[Tensor, None, None]:
        if ctx.ex.fwd.dispatches != ctx.dispatch:  # the receive window no longer holds this forward's row_ids
            raise RuntimeError("ep_dispatch backward: its group dispatched again after this forward (an "
                               "Exchange shared by two MoE layers, or a recompute); give every MoE layer its "
                               "own Exchange and do not recompute ep_dispatch")
        back = rdep_return(ctx.ex.fwd, dx_recv.contiguous())
        return back.float().sum(1).to(dx_recv.dtype), None, None


class _Return(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_recv: Tensor, ids: Tensor, ex: Exchange) -> Tensor:
        ctx.ex = ex
        ctx.save_for_backward(ids)
        return rdep_return(ex.fwd, y_recv.contiguous()).clone()

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor, None, None]:
        (ids,) = ctx.saved_tensors
        t, k, h = dout.shape
        recv = rdep_dispatch(ctx.ex.slots, dout.reshape(t * k, h).contiguous(), ids.reshape(t * k, 1))
        live = torch.arange(recv.x.shape[0], device=recv.x.device) < recv.n_recv
        return torch.where(live[:, None], recv.x, torch.zeros_like(recv.x)), None, None


def ep_dispatch(x: Tensor, ids: Tensor, ex: Exchange) -> tuple[Tensor, Tensor, Tensor]:
    """(rows [capacity, H] at this owner in (local expert, src, t, k) order, counts per local expert,
    n_recv); differentiable in x: the gradient of each received row goes back and is summed over k."""
    out: tuple[Tensor, Tensor, Tensor] = _Dispatch.apply(x, ids, ex)  # type: ignore[no-untyped-call]
    return out


def ep_return(y_recv: Tensor, ids: Tensor, ex: Exchange) -> Tensor:
    """[T, K, H] of this rank's slots from the owners' expert outputs; differentiable in y_recv."""
    out: Tensor = _Return.apply(y_recv, ids, ex)  # type: ignore[no-untyped-call]
    return out


def mark_expert_sharded(*params: Tensor) -> None:
    for p in params:
        setattr(p, EXPERT_SHARDED, True)


def reduce_grads(params: Iterable[Tensor], world: int, all_reduce_sum: Callable[[Tensor], None]) -> None:
    """Data + expert parallel gradients for a loss averaged over ranks: replicated parameters are summed
    across ranks and divided by world; an expert-sharded parameter already holds every rank's tokens'
    contribution (RDEP brought them to its owner), so it is only divided by world, never communicated."""
    for p in params:
        if p.grad is None:
            continue
        if not getattr(p, EXPERT_SHARDED, False):
            all_reduce_sum(p.grad)
        p.grad.div_(world)


def ep_routed(x: Tensor, weights: Tensor, ids: Tensor, w_up: Tensor, w2: Tensor, activation: str,
              routed_scale: float, shared: Tensor | None, ex: Exchange) -> Tensor:
    """The routed half of moe_layer with experts sharded over ranks: this rank's tokens x [T,D] and router
    output (weights, ids) [T,K]; its experts w_up [n_local, N, D], w2 [n_local, D, I]. Each received row
    meets the same kernels as in one process, so out and the expert gradients match it row for row."""
    rows, counts, _ = ep_dispatch(x, ids, ex)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    y = grouped_gemm(grouped_gemm_act(rows, w_up, offs, activation), w2, offs)
    return combine(ep_return(y, ids, ex), weights, routed_scale, shared)
