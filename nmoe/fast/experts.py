"""The expert GEMM by expert_dtype, one home for the fast MoE layer and its expert-parallel half: bf16 as is,
fp8 quantized here (1x128 activation rows, 128x128 weight blocks, the spec's fp8 expert format) into the
block-scaled grouped GEMM, with the spec's straight-through gradient where autograd needs one."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nmoe.fast.formats import quantize_mxfp8, quantize_mxfp8_weight
from nmoe.fast.gemm import grouped_gemm, grouped_gemm_dgrad, grouped_gemm_fp8, grouped_gemm_wgrad
from nmoe.layout import FP8_ACT_BLOCK


def expert_gemm(x: Tensor, w: Tensor, offs: Tensor, dtype: str) -> Tensor:
    """y[rows of e] = x[rows of e] @ w[e]^T, bf16 or fp8 (quantized per row block) experts; no autograd."""
    if dtype == "bf16":
        return grouped_gemm(x, w, offs)
    xq, xs = quantize_mxfp8(x, FP8_ACT_BLOCK)
    wq, ws = quantize_mxfp8_weight(w)
    return grouped_gemm_fp8(xq, xs, wq, ws, offs)


class _Fp8StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        ctx.save_for_backward(x, w, offs)
        return expert_gemm(x, w, offs, "fp8")

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_gemm_dgrad(dy, w, offs) if ctx.needs_input_grad[0] else None
        dw = grouped_gemm_wgrad(dy, x, offs) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def fp8_experts(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """expert_gemm(x, w, offs, "fp8"), differentiable as the spec defines it: the bf16 dgrad and wgrad of the
    unquantized x and w (bf16 master weights; no fp8 dgrad/wgrad kernels are written)."""
    y: Tensor = _Fp8StraightThrough.apply(x, w, offs)  # type: ignore[no-untyped-call]
    return y
