"""Grouped GEMM over expert segments: forward, dgrad, wgrad, and the fp8 / nvfp4 / fused-activation variants.

Operands are widened to fp32 and reduced tile by tile (128 along the reduction dim) into an fp32 accumulator,
then rounded once to bf16; quantized variants dequantize exactly and then run the same GEMM.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmoe.reference.activation import relu2, swiglu
from nmoe.reference.formats import (
    dequantize_mxfp8,
    dequantize_mxfp8_weight,
    dequantize_nvfp4,
    to_bf16,
)

K_TILE = 128
FP8_ACT_BLOCK = 128


def _require_bf16(who: str, **ts: Tensor) -> None:
    for name, t in ts.items():
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{who}: {name} is {t.dtype}, expected bfloat16; cast with .to(torch.bfloat16)")


def _segments(offs: Tensor, m: int, n_groups: int, who: str) -> list[tuple[int, int]]:
    """[start, end) row range of each group from cumulative int32 ends."""
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() != n_groups:
        raise ValueError(f"{who}: offs must be int32 [{n_groups}] cumulative group ends, got {offs.dtype} "
                         f"{tuple(offs.shape)}; build it with torch.cumsum(counts, 0).to(torch.int32)")
    ends = [int(v) for v in offs.tolist()]
    starts = [0, *ends[:-1]]
    if any(e < s for s, e in zip(starts, ends, strict=True)) or (ends and ends[-1] > m):
        raise ValueError(f"{who}: offs {ends} must be non-decreasing, >= 0 and <= {m} rows; fix the counts")
    return list(zip(starts, ends, strict=True))


def _matmul_f32(a: Tensor, b: Tensor) -> Tensor:
    """a [m, R] @ b [R, n] with an fp32 accumulator updated once per 128-wide tile of R."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for r0 in range(0, a.shape[1], K_TILE):
        acc = acc + a[:, r0:r0 + K_TILE].float() @ b[r0:r0 + K_TILE].float()
    return acc


def _grouped_fwd_f32(x: Tensor, w: Tensor, offs: Tensor, who: str) -> Tensor:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"{who}: need x [M, K] and w [E, N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32)
    for e, (s, t) in enumerate(_segments(offs, x.shape[0], w.shape[0], who)):
        out[s:t] = _matmul_f32(x[s:t], w[e].t())
    return out


def grouped_gemm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """y[rows of e] = x[rows of e] @ w[e]^T; rows past offs[-1] are zero."""
    _require_bf16("grouped_gemm", x=x, w=w)
    return to_bf16(_grouped_fwd_f32(x, w, offs, "grouped_gemm"))


def grouped_gemm_dgrad(dy: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """dx[rows of e] = dy[rows of e] @ w[e], reduced over N; rows past offs[-1] are zero."""
    _require_bf16("grouped_gemm_dgrad", dy=dy, w=w)
    if dy.dim() != 2 or w.dim() != 3 or dy.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_gemm_dgrad: need dy [M, N] and w [E, N, K], got {tuple(dy.shape)} and "
                         f"{tuple(w.shape)}")
    out = torch.zeros(dy.shape[0], w.shape[2], dtype=torch.float32)
    for e, (s, t) in enumerate(_segments(offs, dy.shape[0], w.shape[0], "grouped_gemm_dgrad")):
        out[s:t] = _matmul_f32(dy[s:t], w[e])
    return to_bf16(out)


def grouped_gemm_wgrad(dy: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    """dw[e] = dy[rows of e]^T @ x[rows of e], reduced over the group's rows; empty groups give zero."""
    _require_bf16("grouped_gemm_wgrad", dy=dy, x=x)
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0]:
        raise ValueError(f"grouped_gemm_wgrad: need dy [M, N] and x [M, K], got {tuple(dy.shape)} and "
                         f"{tuple(x.shape)}")
    segs = _segments(offs, x.shape[0], offs.numel(), "grouped_gemm_wgrad")
    out = torch.zeros(len(segs), dy.shape[1], x.shape[1], dtype=torch.float32)
    for e, (s, t) in enumerate(segs):
        out[e] = _matmul_f32(dy[s:t].t(), x[s:t])
    return to_bf16(out)


def grouped_gemm_fp8(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor) -> Tensor:
    """MX-FP8 operands (x: 1x128 blocks along K, w: 128x128 blocks) dequantized exactly, then the GEMM."""
    x = dequantize_mxfp8(xq, xs, FP8_ACT_BLOCK)
    w = dequantize_mxfp8_weight(wq, ws)
    return to_bf16(_grouped_fwd_f32(x, w, offs, "grouped_gemm_fp8"))


def grouped_gemm_nvfp4(x_packed: Tensor, x_bs: Tensor, x_ts: Tensor, w_packed: Tensor, w_bs: Tensor,
                       w_ts: Tensor, offs: Tensor) -> Tensor:
    """NVFP4 operands dequantized (code * s_b) * g, then the same fp32-accumulated GEMM."""
    x = dequantize_nvfp4(x_packed, x_bs, x_ts)
    w = dequantize_nvfp4(w_packed, w_bs, w_ts)
    return to_bf16(_grouped_fwd_f32(x, w, offs, "grouped_gemm_nvfp4"))


def grouped_gemm_act(x: Tensor, w: Tensor, offs: Tensor, activation: str) -> Tensor:
    """act(grouped_gemm(x, w, offs)): the unfused composition a fused epilogue must reproduce."""
    if activation == "swiglu":
        return swiglu(grouped_gemm(x, w, offs))
    if activation == "relu2":
        return relu2(grouped_gemm(x, w, offs))
    raise ValueError(f"grouped_gemm_act: activation {activation!r} unknown; use 'swiglu' or 'relu2'")
