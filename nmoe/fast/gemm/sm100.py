"""sm_100a (B200) grouped GEMM: bf16, MXFP8 and NVFP4 expert GEMMs on tcgen05 tensor cores.

Same signatures as the reference grouped_gemm / _fp8 / _nvfp4; group sizes stay on the device (no host sync).
Reached through nmoe.fast.gemm, which picks the kernel by arch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.gemm.routing import (
    as_bytes,
    check_aligned,
    check_bf16,
    check_routing,
    require,
    tile_upper_bound,
)
from nmoe.fast.kernels.sm100 import scale_layout
from nmoe.fast.limits import GEMM_ALIGN, SF_COLS
from nmoe.fast.op import Kernel, fast_op
from nmoe.fast.runtime import KernelSpec, tma_aligned

ARCH = "sm_100a"
SF_VEC = {"mxfp8": 32, "nvfp4": 16}
GEMM = Kernel("nmoe.fast.kernels.sm100.grouped_gemm", "grouped_gemm_sm100",
              lambda km, fmt, n, k, bn: km.compile_args(fmt, n, k, bn), (ARCH,), "nmoe.fast.gemm")


def pick_bn(fmt: str, n: int) -> int:
    """bf16 takes 256-wide N tiles when N fills them (two TMEM accumulator stages still fit); scaled: 128."""
    return 256 if fmt == "bf16" and n % 256 == 0 and n >= 2048 else 128


def _check(op: str, m: int, n: int, k: int, offs: Tensor, e: int, k_mult: int) -> None:
    check_routing(op, offs, e, m, max_groups=None)
    check_aligned(op, "sizes", ("N", n, GEMM_ALIGN), ("K", k, k_mult))


def _launch(fmt: str, a: Tensor, b: Tensor, sfa: Tensor, sfb: Tensor, offs: Tensor,
            scales: tuple[Tensor, Tensor], out: Tensor, k: int, sf_blocks: int) -> None:
    """out[M, N] = per-group A @ B_e^T with A/B given as raw bytes of `fmt` (k = elements per row)."""
    device, arch = runtime.device_arch(a, b, offs, out)
    m, n = out.shape
    n_groups = offs.numel()
    if m == 0 or n == 0:
        return
    if k == 0 or n_groups == 0:
        out.zero_()
        return
    bn = pick_bn(fmt, n)
    n_ctas = min(runtime.sm_count(device), tile_upper_bound(m, n, n_groups, bn))
    GEMM.launcher(arch, fmt=fmt, n=n, k=k, bn=bn)(
        device, a.data_ptr(), b.data_ptr(), sfa.data_ptr(), sfb.data_ptr(), out.data_ptr(), offs.data_ptr(),
        scales[0].data_ptr(), scales[1].data_ptr(), m, n_groups, sf_blocks, n_ctas)


def _bf16_impl(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    op = "grouped_gemm"
    require(op, runtime.require_arch(x, w, offs), ARCH)
    check_bf16(op, x=x, w=w)
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"{op}: need x [M, K] and w [E, N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    (m, k), (e, n, _) = x.shape, w.shape
    _check(op, m, n, k, offs, e, GEMM_ALIGN)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    dummy = offs.new_zeros(4, dtype=torch.float32)
    _launch("bf16", tma_aligned(op, "x", x), tma_aligned(op, "w", w), dummy, dummy, offs.contiguous(),
            (dummy, dummy), y, k, 0)
    return y


def _fp8_scales(op: str, xs: Tensor, ws: Tensor, m: int, n: int, k: int, e: int) -> tuple[Tensor, Tensor]:
    """Take 1x32 MX scales ([M, K/32], [E, N, K/32]) or DeepSeek 1x128 / 128x128 ones, expanded exactly."""
    xs = as_bytes(op, "xs", xs, (torch.uint8, torch.float8_e8m0fnu))
    ws = as_bytes(op, "ws", ws, (torch.uint8, torch.float8_e8m0fnu))
    if xs.shape == (m, k // 128) and k % 128 == 0:
        xs = scale_layout.expand_fp8_act_scales(xs)
    if ws.shape == (e, n // 128, k // 128) and n % 128 == 0 and k % 128 == 0:
        ws = scale_layout.expand_fp8_weight_scales(ws)
    if xs.shape != (m, k // 32) or ws.shape != (e, n, k // 32):
        raise ValueError(f"{op}: scales {tuple(xs.shape)} / {tuple(ws.shape)} fit neither 1x32 MX blocks "
                         f"([{m}, {k // 32}] / [{e}, {n}, {k // 32}]) nor 1x128 / 128x128 blocks; quantize "
                         "with quantize_mxfp8(x, 32) or the DeepSeek-V3 1x128 / 128x128 layout")
    return xs, ws


def _fp8_impl(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor) -> Tensor:
    op = "grouped_gemm_fp8"
    require(op, runtime.require_arch(xq, xs, wq, ws, offs), ARCH)
    if xq.dim() != 2 or wq.dim() != 3 or xq.shape[1] != wq.shape[2]:
        raise ValueError(f"{op}: need xq [M, K] and wq [E, N, K], got {tuple(xq.shape)} and "
                         f"{tuple(wq.shape)}")
    (m, k), (e, n, _) = xq.shape, wq.shape
    _check(op, m, n, k, offs, e, SF_VEC["mxfp8"] * SF_COLS)
    codes = (torch.uint8, torch.float8_e4m3fn)
    a, b = as_bytes(op, "xq", xq, codes), as_bytes(op, "wq", wq, codes)
    xs32, ws32 = _fp8_scales(op, xs, ws, m, n, k, e)
    cols = scale_layout.COLS_MULTIPLE["mxfp8"]
    sfa = scale_layout.pack_grouped_rows(xs32, offs, cols)
    sfb = scale_layout.pack_atoms(ws32, cols)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=xq.device)
    one = offs.new_ones(1, dtype=torch.float32)
    _launch("mxfp8", tma_aligned(op, "xq", a), tma_aligned(op, "wq", b), sfa, sfb, offs.contiguous(),
            (one, one), y, k, scale_layout.grouped_row_blocks(m, e))
    return y


def _nvfp4_impl(x_packed: Tensor, x_bs: Tensor, x_ts: Tensor, w_packed: Tensor, w_bs: Tensor, w_ts: Tensor,
                offs: Tensor) -> Tensor:
    op = "grouped_gemm_nvfp4"
    require(op, runtime.require_arch(x_packed, x_bs, x_ts, w_packed, w_bs, w_ts, offs), ARCH)
    if x_packed.dim() != 2 or w_packed.dim() != 3 or x_packed.shape[1] != w_packed.shape[2]:
        raise ValueError(f"{op}: need x_packed [M, K/2] and w_packed [E, N, K/2], got "
                         f"{tuple(x_packed.shape)} and {tuple(w_packed.shape)}")
    (m, half_k), (e, n, _) = x_packed.shape, w_packed.shape
    k = 2 * half_k
    _check(op, m, n, k, offs, e, SF_VEC["nvfp4"] * SF_COLS)
    packed = (torch.uint8, torch.float4_e2m1fn_x2)
    a, b = as_bytes(op, "x_packed", x_packed, packed), as_bytes(op, "w_packed", w_packed, packed)
    bs = (torch.uint8, torch.float8_e4m3fn)
    xbs, wbs = as_bytes(op, "x_bs", x_bs, bs), as_bytes(op, "w_bs", w_bs, bs)
    if xbs.shape != (m, k // 16) or wbs.shape != (e, n, k // 16):
        raise ValueError(f"{op}: block scales {tuple(xbs.shape)} / {tuple(wbs.shape)} must be "
                         f"[{m}, {k // 16}] / [{e}, {n}, {k // 16}] (one e4m3 per 16 values); pass "
                         "quantize_nvfp4's outputs")
    for name, t in (("x_ts", x_ts), ("w_ts", w_ts)):
        if t.dtype != torch.float32 or t.numel() != 1:
            raise ValueError(f"{op}: {name} must be one fp32 tensor scale (quantize_nvfp4's third output)")
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x_packed.device)
    cols = scale_layout.COLS_MULTIPLE["nvfp4"]
    _launch("nvfp4", tma_aligned(op, "x_packed", a), tma_aligned(op, "w_packed", b),
            scale_layout.pack_grouped_rows(xbs, offs, cols), scale_layout.pack_atoms(wbs, cols),
            offs.contiguous(),
            (x_ts.contiguous(), w_ts.contiguous()), y, k, scale_layout.grouped_row_blocks(m, e))
    return y


def _fake_rows(rows: Tensor, w: Tensor) -> Tensor:
    return rows.new_empty(rows.shape[0], w.shape[1], dtype=torch.bfloat16)


def _fake_bf16(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return _fake_rows(x, w)


def _fake_fp8(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor) -> Tensor:
    return _fake_rows(xq, wq)


def _fake_nvfp4(x_packed: Tensor, x_bs: Tensor, x_ts: Tensor, w_packed: Tensor, w_bs: Tensor, w_ts: Tensor,
                offs: Tensor) -> Tensor:
    return _fake_rows(x_packed, w_packed)


_bf16_op = fast_op("grouped_gemm_sm100", _bf16_impl, _fake_bf16)
_fp8_op = fast_op("grouped_gemm_fp8_sm100", _fp8_impl, _fake_fp8)
_nvfp4_op = fast_op("grouped_gemm_nvfp4_sm100", _nvfp4_impl, _fake_nvfp4)


def _no_backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:
    raise NotImplementedError(
        "grouped_gemm (sm_100a): dgrad/wgrad kernels are not written for tcgen05 yet; detach the inputs, or "
        "compute gradients with torch._grouped_mm explicitly"
    )


def _no_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    return None


_bf16_op.autograd(_no_backward, _no_context)


def grouped_gemm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """y[rows of e] = x[rows of e] @ w[e]^T in fp32 (TMEM), rounded once to bf16; rows past offs[-1]: 0."""
    return _bf16_op(x, w, offs)


def grouped_gemm_fp8(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor) -> Tensor:
    """e4m3 x e4m3 with e8m0 scales applied inside tcgen05.mma (1x32 blocks; 1x128/128x128 scales expand)."""
    return _fp8_op(xq, xs, wq, ws, offs)


def grouped_gemm_nvfp4(x_packed: Tensor, x_bs: Tensor, x_ts: Tensor, w_packed: Tensor, w_bs: Tensor,
                       w_ts: Tensor, offs: Tensor) -> Tensor:
    """e2m1 x e2m1 with e4m3 block scales in tcgen05.mma; the fp32 tensor scales multiply in the epilogue."""
    return _nvfp4_op(x_packed, x_bs, x_ts, w_packed, w_bs, w_ts, offs)


# ---------------------------------------------------------------------------------------------------------
# Compile-time checks without a GPU: python -m nmoe.fast.compilecheck --arch sm_100a
# ---------------------------------------------------------------------------------------------------------


# Tensor-core MMA of the right kind (the block-scaled kinds carry .block_scale and the scale block size),
# TMEM alloc + tcgen05.ld with its wait, TMA loads, scale factors copied smem -> TMEM, 128-bit masked stores.
_COMMON = (r"\.target sm_100a\b", r"tcgen05\.mma", r"tcgen05\.(ld|alloc)", r"tcgen05\.alloc\.cta_group::1",
           r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32\.b32", r"tcgen05\.wait::ld", r"cp\.async\.bulk\.tensor",
           r"tcgen05\.commit", r"\bst\.global\.v4\.b32\b")
_KIND = {
    "bf16": (r"tcgen05\.mma\.cta_group::1\.kind::f16",),
    "mxfp8": (r"block_scale", r"tcgen05\.mma\.cta_group::1\.kind::mxf8f6f4\.block_scale\.block32",
              r"tcgen05\.cp\.cta_group::1\.32x128b\.warpx4"),
    "nvfp4": (r"block_scale", r"tcgen05\.mma\.cta_group::1\.kind::mxf4nvf4\.block_scale\.block16",
              r"tcgen05\.cp\.cta_group::1\.32x128b\.warpx4"),
}
# Local memory means spilled registers; wgmma/mma.sync would mean a Hopper/Ampere path slipped in.
_FORBID = (r"\b(ld|st)\.local\b", r"\bwgmma\b", r"\bmma\.sync\b")


_CONTRACT = {"bf16": "grouped_gemm", "mxfp8": "grouped_gemm_fp8", "nvfp4": "grouped_gemm_nvfp4"}


def _spec(fmt: str, n: int, k: int, bn: int) -> KernelSpec:
    forbid = (*_FORBID, r"block_scale") if fmt == "bf16" else _FORBID
    return KernelSpec(
        op=_CONTRACT[fmt],
        name=f"grouped_gemm_sm100_{fmt}_n{bn}",
        compile=GEMM.compiler(fmt=fmt, n=n, k=k, bn=bn),
        expect={ARCH: (*_COMMON, *_KIND[fmt])},
        forbid={ARCH: forbid},
    )


# Representative classes: up projection (N = 2I, K = H) in bf16, and the quantized expert GEMMs.
KERNELS: tuple[KernelSpec, ...] = (
    _spec("bf16", 4096, 2048, 256),
    _spec("mxfp8", 2048, 1408, 128),
    _spec("nvfp4", 2048, 1408, 128),
)
