"""Expert parallelism over RDEP: differentiable dispatch / return through one Exchange that serves every MoE
layer of the model (a dispatch keeps its receive order for its backward's return)."""

# The backward of a dispatch is a return and the backward of a return is a dispatch. A return's gradient
# dout [T, K, H] is one row per slot, so it travels through a second group whose tokens are the T*K slots
# with top_k = 1: row_id = src*T*K + t*K + k is the forward's row_id, and the owner receives the gradient
# rows in the forward's receive order.

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from nmoe.fast.activation import BY_NAME
from nmoe.fast.combine import combine
from nmoe.fast.experts import fp8_experts
from nmoe.fast.gemm import grouped_gemm, grouped_gemm_act
from nmoe.fast.rdep.group import RdepGroup, RdepShape, rdep_dispatch, rdep_return
from nmoe.fast.rdep.window import Exchange as HandleExchange


def slot_shape(shape: RdepShape) -> RdepShape:
    """The backward group's shape: one token per forward slot, top_k 1, same capacity."""
    return replace(shape, tokens=shape.tokens * shape.top_k, top_k=1)


@dataclass(frozen=True)
class Exchange:
    """This rank's two groups: `fwd` (tokens, top_k) and `slots` (T*K, 1). Every MoE layer may share one:
    each forward dispatch keeps its own receive order, and the windows are reused layer after layer."""

    fwd: RdepGroup
    slots: RdepGroup

    @classmethod
    def open(cls, shape: RdepShape, rank: int, device: torch.device, handles: HandleExchange) -> Exchange:
        """Collective: every rank of the group opens its windows together."""
        fwd = RdepGroup(shape, rank, device, handles)
        return cls(fwd, RdepGroup(slot_shape(shape), rank, device, handles))

    def check(self) -> None:
        """Raise the first error a kernel reported (overflow, silent peer); a host read, no sync."""
        self.fwd.check()
        self.slots.check()

    def close(self) -> None:
        """After a barrier that every rank passed after its last RDEP call."""
        self.fwd.close()
        self.slots.close()


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, ids: Tensor, ex: Exchange) -> tuple[Tensor, Tensor, Tensor]:
        recv = rdep_dispatch(ex.fwd, x, ids)
        ctx.ex, ctx.sent = ex, recv.kept()
        counts, n_recv = recv.counts.clone(), recv.n_recv.clone()
        ctx.mark_non_differentiable(counts, n_recv)
        return recv.x.clone(), counts, n_recv

    @staticmethod
    def backward(ctx: Any, dx_recv: Tensor, *_: Any) -> tuple[Tensor, None, None]:
        back = rdep_return(ctx.ex.fwd, dx_recv.contiguous(), ctx.sent)
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


def ep_routed(x: Tensor, weights: Tensor, ids: Tensor, w_up: Tensor, w2: Tensor, activation: str,
              routed_scale: float, shared: Tensor | None, ex: Exchange, dtype: str = "bf16") -> Tensor:
    """The routed half of moe_layer with experts sharded over ranks; each received row meets the same kernels
    as in one process, so out and the expert gradients match it row for row."""
    # Inputs: this rank's tokens x [T,D] and router output (weights, ids) [T,K]; its experts w_up
    # [n_local, N, D], w2 [n_local, D, I]. fp8 experts: bf16 rows travel and are quantized at their owner
    # (per row, as one process quantizes them), since the straight-through wgrad needs the bf16 rows there.
    rows, counts, _ = ep_dispatch(x, ids, ex)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    if dtype == "bf16":
        a = grouped_gemm_act(rows, w_up, offs, activation)
        y = grouped_gemm(a, w2, offs)
    else:
        h = fp8_experts(rows, w_up, offs)
        y = fp8_experts(BY_NAME[activation][0](h), w2, offs)
    return combine(ep_return(y, ids, ex), weights, routed_scale, shared)
