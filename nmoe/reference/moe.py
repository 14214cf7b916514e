"""MoE layer spec: router -> permute -> expert up (+act) -> expert down -> unpermute -> combine (+ shared).

Every data-moving or rounding step has an explicit backward built from the reference bwd ops, so the
layer's gradient is a spec too. fp8/nvfp4 experts quantize in the forward; the backward is straight-through
(bf16 dgrad/wgrad of the unquantized tensors), as in fp8 training recipes that keep bf16 master weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from nmoe.config import ModelConfig
from nmoe.layout import FP8_ACT_BLOCK, MoEParams, MoERouting, check_moe_params
from nmoe.reference.activation import relu2, relu2_bwd, swiglu, swiglu_bwd
from nmoe.reference.combine import combine, combine_bwd
from nmoe.reference.dispatch import permute, unpermute
from nmoe.reference.formats import quantize_mxfp8, quantize_mxfp8_weight, quantize_nvfp4
from nmoe.reference.gemm import (
    grouped_gemm,
    grouped_gemm_act,
    grouped_gemm_dgrad,
    grouped_gemm_fp8,
    grouped_gemm_nvfp4,
    grouped_gemm_wgrad,
)
from nmoe.reference.router import expert_counts, router_logits, router_topk

ACTIVATIONS: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]] = {
    "swiglu": (swiglu, swiglu_bwd),
    "relu2": (relu2, relu2_bwd),
}


def expert_gemm(x: Tensor, w: Tensor, offs: Tensor, expert_dtype: str) -> Tensor:
    """grouped_gemm in the expert dtype: bf16 operands directly, fp8/nvfp4 operands quantized first."""
    if expert_dtype == "bf16":
        return grouped_gemm(x, w, offs)
    if expert_dtype == "fp8":
        xq, xs = quantize_mxfp8(x, FP8_ACT_BLOCK)
        wq, ws = quantize_mxfp8_weight(w)
        return grouped_gemm_fp8(xq, xs, wq, ws, offs)
    if expert_dtype == "nvfp4":
        xp, xbs, xts = quantize_nvfp4(x)
        wp, wbs, wts = quantize_nvfp4(w)
        return grouped_gemm_nvfp4(xp, xbs, xts, wp, wbs, wts, offs)
    raise ValueError(f"expert_gemm: expert_dtype {expert_dtype!r} unknown; use bf16, fp8 or nvfp4")


class _ExpertUp(torch.autograd.Function):
    """a = act(x @ w_e^T) per group; the backward recomputes h instead of saving it."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, w: Tensor, offs: Tensor, activation: str, dtype: str) -> Tensor:
        ctx.save_for_backward(x, w, offs)
        ctx.activation, ctx.dtype = activation, dtype  # type: ignore[attr-defined]
        if dtype == "bf16":
            return grouped_gemm_act(x, w, offs, activation)
        return ACTIVATIONS[activation][0](expert_gemm(x, w, offs, dtype))

    @staticmethod
    def backward(ctx: Any, da: Tensor) -> tuple[Tensor, Tensor, None, None, None]:
        x, w, offs = ctx.saved_tensors
        h = expert_gemm(x, w, offs, ctx.dtype)
        dh = ACTIVATIONS[ctx.activation][1](da.contiguous(), h)
        return grouped_gemm_dgrad(dh, w, offs), grouped_gemm_wgrad(dh, x, offs), None, None, None


class _ExpertDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, a: Tensor, w: Tensor, offs: Tensor, dtype: str) -> Tensor:
        ctx.save_for_backward(a, w, offs)
        return expert_gemm(a, w, offs, dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, None, None]:
        a, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        return grouped_gemm_dgrad(dy, w, offs), grouped_gemm_wgrad(dy, a, offs), None, None


class _Permute(torch.autograd.Function):
    """Backward gathers each token's K slot grads and sums them in slot order in fp32, rounded once."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: Tensor, ids: Tensor, n_experts: int, align: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        p = permute(x, ids, n_experts, align)
        ctx.save_for_backward(p.slot)
        ctx.tk = tuple(ids.shape)  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(p.counts, p.offs, p.slot)
        return p.xp, p.counts, p.offs, p.slot

    @staticmethod
    def backward(ctx: Any, dxp: Tensor, *_: Any) -> tuple[Tensor, None, None, None]:
        (slot,) = ctx.saved_tensors
        t, k = ctx.tk
        dslot = unpermute(dxp, slot, t, k).float()
        acc = dslot[:, 0]
        for j in range(1, k):
            acc = acc + dslot[:, j]
        return acc.to(dxp.dtype), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, yp: Tensor, slot: Tensor, t: int, k: int) -> Tensor:
        ctx.save_for_backward(slot)
        return unpermute(yp, slot, t, k)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None, None]:
        (slot,) = ctx.saved_tensors
        real = slot >= 0
        dyp = torch.zeros(slot.shape[0], dy.shape[-1], dtype=dy.dtype)
        dyp[real] = dy.reshape(-1, dy.shape[-1])[slot[real]]
        return dyp, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, y: Tensor, w: Tensor, scale: float, shared: Tensor | None) -> Tensor:
        ctx.save_for_backward(y, w)
        ctx.scale, ctx.has_shared = scale, shared is not None  # type: ignore[attr-defined]
        return combine(y, w, scale, shared)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, None, Tensor | None]:
        y, w = ctx.saved_tensors
        dy, dw, dshared = combine_bwd(dout.contiguous(), y, w, ctx.scale)
        return dy, dw, None, dshared if ctx.has_shared else None


def _apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    return fn.apply(*args)  # type: ignore[no-untyped-call]


def ffn(x: Tensor, w_up: Tensor, w2: Tensor, activation: str, expert_dtype: str) -> Tensor:
    """A dense MLP [T,D] -> [T,D] as a one-group grouped GEMM, so it rounds exactly like an expert."""
    offs = torch.tensor([x.shape[0]], dtype=torch.int32)
    a = _apply(_ExpertUp, x, w_up[None], offs, activation, expert_dtype)
    out: Tensor = _apply(_ExpertDown, a, w2[None], offs, expert_dtype)
    return out


def moe_layer(x: Tensor, p: MoEParams, cfg: ModelConfig) -> tuple[Tensor, MoERouting]:
    """x bf16 [T,D] -> (out bf16 [T,D], routing). Shared experts use cfg.expert_dtype like routed ones."""
    up, shared_up = check_moe_params(x, p, cfg)
    t, k, e = x.shape[0], cfg.n_activated_experts, cfg.n_routed_experts
    logits = router_logits(x, p.router_w)
    weights, ids = router_topk(logits, p.router_bias, k, cfg.score_func, cfg.n_expert_groups,
                               cfg.n_limited_groups)
    xp, _, offs, slot = _apply(_Permute, x, ids, e, cfg.permute_align)
    a = _apply(_ExpertUp, xp, up, offs, cfg.activation, cfg.expert_dtype)
    yp = _apply(_ExpertDown, a, p.w2, offs, cfg.expert_dtype)
    y = _apply(_Unpermute, yp, slot, t, k)
    shared = None
    if shared_up is not None:
        assert p.shared_w2 is not None
        shared = ffn(x, shared_up, p.shared_w2, cfg.activation, cfg.expert_dtype)
    out: Tensor = _apply(_Combine, y, weights, cfg.route_scale, shared)
    return out, MoERouting(weights=weights, ids=ids, counts=expert_counts(ids, e))
