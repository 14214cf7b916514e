"""Grouped GEMMs for MoE experts: the public ops, each picking its kernel by arch from one table.

A (op, arch) pair missing from IMPLEMENTATIONS raises ArchNotImplemented naming the gap and the remedy;
there is no fallback. The per-arch modules (sm90, sm90_fp8, sm100) hold the kernels' glue.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.arch import SUPPORTED_ARCHS, ArchNotImplemented
from nmoe.fast.gemm import sm90, sm90_fp8, sm100

IMPLEMENTATIONS: Final[Mapping[tuple[str, str], Callable[..., Tensor]]] = {
    ("grouped_gemm", "sm_90a"): sm90.grouped_gemm,
    ("grouped_gemm", "sm_100a"): sm100.grouped_gemm,
    ("grouped_gemm_dgrad", "sm_90a"): sm90.grouped_gemm_dgrad,
    ("grouped_gemm_wgrad", "sm_90a"): sm90.grouped_gemm_wgrad,
    ("grouped_gemm_act", "sm_90a"): sm90.grouped_gemm_act,
    ("grouped_gemm_fp8", "sm_90a"): sm90_fp8.grouped_gemm_fp8,
    ("grouped_gemm_fp8", "sm_100a"): sm100.grouped_gemm_fp8,
    ("grouped_gemm_nvfp4", "sm_100a"): sm100.grouped_gemm_nvfp4,
}
"""(op, arch) -> the function that runs it there."""

REMEDIES: Final[Mapping[tuple[str, str], str]] = {
    ("grouped_gemm_dgrad", "sm_100a"): "the tcgen05 dgrad kernel is not written yet; detach the inputs, or "
                                       "compute gradients with torch._grouped_mm explicitly",
    ("grouped_gemm_wgrad", "sm_100a"): "the tcgen05 wgrad kernel is not written yet; detach the inputs, or "
                                       "compute gradients with torch._grouped_mm explicitly",
    ("grouped_gemm_act", "sm_100a"): "the fused epilogue is an sm_90a kernel; compose nmoe.fast.activation"
                                     ".<act>(nmoe.fast.gemm.grouped_gemm(x, w, offs)) there",
    ("grouped_gemm_nvfp4", "sm_90a"): "sm_90a has no NVFP4 block-scaled MMA; use expert_dtype = \"bf16\" on "
                                      "H100/H200, or run nvfp4 on a B200 (sm_100a)",
}
"""What to do instead, for each (op, arch) the table leaves out."""


def implementation(op: str, arch: str) -> Callable[..., Tensor]:
    fn = IMPLEMENTATIONS.get((op, arch))
    if fn is None:
        remedy = REMEDIES.get((op, arch), f"it has kernels for {implemented_archs(op)} only")
        raise ArchNotImplemented(f"{op}: no {arch} kernel: {remedy}")
    return fn


def implemented_archs(op: str) -> tuple[str, ...]:
    return tuple(a for a in SUPPORTED_ARCHS if (op, a) in IMPLEMENTATIONS)


def _run(op: str, args: tuple[Any, ...], *on: Tensor) -> Tensor:
    return implementation(op, runtime.require_arch(*on))(*args)


def grouped_gemm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """y[rows of e] = x[rows of e] @ w[e]^T in fp32, rounded once to bf16; rows past offs[-1] are zero."""
    return _run("grouped_gemm", (x, w, offs), x, w, offs)


def grouped_gemm_dgrad(dy: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """dx[rows of e] = dy[rows of e] @ w[e] in fp32, rounded once to bf16; rows past offs[-1] are zero."""
    return _run("grouped_gemm_dgrad", (dy, w, offs), dy, w, offs)


def grouped_gemm_wgrad(dy: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    """dw[e] = dy[rows of e]^T @ x[rows of e] in fp32, rounded once to bf16; empty groups give zeros."""
    return _run("grouped_gemm_wgrad", (dy, x, offs), dy, x, offs)


def grouped_gemm_act(x: Tensor, w: Tensor, offs: Tensor, activation: str) -> Tensor:
    """act(grouped_gemm(x, w, offs)) from one kernel (swiglu [M, N/2], relu2 [M, N]) that also writes h,
    so the activation never re-reads h from memory and the backward keeps h instead of recomputing it."""
    sm90.act_width(w, activation)
    return _run("grouped_gemm_act", (x, w, offs, activation), x, w, offs)


def grouped_gemm_fp8(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor) -> Tensor:
    """e4m3 experts: wgmma with fp32 promotion per 128-K block on sm_90a, tcgen05 block-scaled on sm_100a."""
    return _run("grouped_gemm_fp8", (xq, xs, wq, ws, offs), xq, wq, offs)


def grouped_gemm_nvfp4(x_packed: Tensor, x_bs: Tensor, x_ts: Tensor, w_packed: Tensor, w_bs: Tensor,
                       w_ts: Tensor, offs: Tensor) -> Tensor:
    """e2m1 experts with e4m3 block scales in sm_100a's scaled MMA; fp32 tensor scales in the epilogue."""
    return _run("grouped_gemm_nvfp4", (x_packed, x_bs, x_ts, w_packed, w_bs, w_ts, offs), x_packed, w_packed,
                offs)
