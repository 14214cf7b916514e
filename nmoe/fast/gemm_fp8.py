"""Fast fp8 grouped GEMM fwd for sm_90a: e4m3 experts with DeepSeek-V3 scales (x 1x128, w 128x128, e8m0),
each 128-wide K block's wgmma sum promoted to fp32. Offsets stay on the device: no host sync, no recompile."""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import Tensor

from nmoe.constants import FP8_WEIGHT_BLOCK, MXFP8_BLOCK_SM90
from nmoe.fast import gemm, runtime
from nmoe.fast.arch import ArchNotImplemented
from nmoe.fast.runtime import KernelSpec, tma_aligned

ARCH = "sm_90a"
_KERNEL_MODULE = "nmoe.fast.kernels.sm90.grouped_gemm_fp8"
# The kernel also compiles the bf16 kernel's cursor/epilogue helpers and the e8m0 decoder from these.
_SOURCES = (_KERNEL_MODULE, "nmoe.fast.kernels.sm90.grouped_gemm", "nmoe.fast.kernels.formats",
            "nmoe.constants")
BN = FP8_WEIGHT_BLOCK
K_BLOCK = MXFP8_BLOCK_SM90
_CODES = (torch.uint8, torch.float8_e4m3fn)
_SCALES = (torch.uint8, torch.float8_e8m0fnu)


def _source_sha256() -> str:
    return runtime.sources_sha256(*_SOURCES)


def _require_sm90(arch: str) -> None:
    if arch != ARCH:
        raise ArchNotImplemented(
            f"grouped_gemm_fp8 (wgmma, 1x128/128x128 scales) is an sm_90a kernel, got {arch}; call "
            "nmoe.fast.gemm.grouped_gemm_fp8, which runs the tcgen05 block-scaled kernel on sm_100a"
        )


def _kernels(arch: str) -> ModuleType:
    _require_sm90(arch)
    return runtime.kernel_module(_KERNEL_MODULE, arch)


def _bytes(op: str, name: str, t: Tensor, allowed: tuple[torch.dtype, ...]) -> Tensor:
    if t.dtype not in allowed:
        raise ValueError(f"{op}: {name} is {t.dtype}; pass its bit patterns as one of "
                         f"{[str(d) for d in allowed]} (quantize with nmoe.fast.formats)")
    return t.contiguous().view(torch.uint8)


def _check(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor,
           offs: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(xq, xs, wq, ws) as contiguous bytes, or a ValueError naming the fix."""
    op = "grouped_gemm_fp8"
    a, b = _bytes(op, "xq", xq, _CODES), _bytes(op, "wq", wq, _CODES)
    sa, sb = _bytes(op, "xs", xs, _SCALES), _bytes(op, "ws", ws, _SCALES)
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[2]:
        raise ValueError(f"{op}: need xq [M, K] and wq [E, N, K] with the same K, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    (m, k), (e, n, _) = a.shape, b.shape
    if k % K_BLOCK or n % BN:
        raise ValueError(f"{op}: K={k} and N={n} must be multiples of {K_BLOCK} (whole 1x128 / 128x128 scale "
                         "blocks); pad the expert weights and activations")
    if sa.shape != (m, k // K_BLOCK) or sb.shape != (e, n // BN, k // K_BLOCK):
        raise ValueError(f"{op}: scales {tuple(sa.shape)} / {tuple(sb.shape)} must be [{m}, {k // K_BLOCK}] "
                         f"/ [{e}, {n // BN}, {k // K_BLOCK}] (x 1x128, w 128x128 blocks); quantize with "
                         "quantize_mxfp8(x, 128) and quantize_mxfp8_weight(w)")
    gemm.check_routing(op, offs, e, m)
    return a, sa, b, sb


def _launch(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor, y: Tensor) -> None:
    """y[M, N] = per-group dequant(xq) @ dequant(wq[e])^T from byte views of the operands."""
    arch = runtime.require_arch(xq, xs, wq, ws, offs, y)
    kmod = _kernels(arch)
    (m, k), n, n_groups = xq.shape, y.shape[1], offs.numel()
    if m == 0 or n == 0:
        return
    if k == 0 or n_groups == 0:
        y.zero_()
        return
    gemm._check_offs_on_host("grouped_gemm_fp8", offs, m)
    key = runtime.cache_key("grouped_gemm_fp8_sm90", _source_sha256(), arch, {"n": n, "k": k})
    n_ctas = min(runtime.sm_count(y.device), gemm.tile_upper_bound(m, n, n_groups, BN))
    from cutlass import BFloat16, Float8E4M3FN, Int32, Uint8

    ptrs = (kmod.pointer(Float8E4M3FN, xq.data_ptr()), kmod.pointer(Float8E4M3FN, wq.data_ptr()),
            kmod.pointer(Uint8, xs.data_ptr(), 1), kmod.pointer(Uint8, ws.data_ptr(), 1),
            kmod.pointer(BFloat16, y.data_ptr()), kmod.pointer(Int32, offs.data_ptr(), 4))
    runtime.run_compiled(key, lambda: kmod.compile_args(n, k), y.device, (*ptrs, m, n_groups, n_ctas))


def _impl(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor) -> Tensor:
    _require_sm90(runtime.require_arch(xq, xs, wq, ws, offs))
    a, sa, b, sb = _check(xq, xs, wq, ws, offs)
    op = "grouped_gemm_fp8"
    y = torch.empty(a.shape[0], b.shape[1], dtype=torch.bfloat16, device=a.device)
    _launch(tma_aligned(op, "xq", a), sa, tma_aligned(op, "wq", b), sb, offs.contiguous(), y)
    return y


def _fake(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor) -> Tensor:
    return xq.new_empty(xq.shape[0], wq.shape[1], dtype=torch.bfloat16)


_op = runtime.register_custom_op("nmoe::grouped_gemm_fp8_sm90", _impl, _fake)


def grouped_gemm_fp8(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor) -> Tensor:
    """y[rows of e] = dequant(xq)[rows] @ dequant(wq[e])^T, fp32 per 128-K block, one bf16 rounding; rows
    past offs[-1] are zero. Forward only."""
    out: Tensor = _op(xq, xs, wq, ws, offs)
    return out


# ---------------------------------------------------------------------------------------------------------
# Compile-time checks without a GPU: python -m nmoe.fast.compilecheck --arch sm_90a --ops grouped_gemm_fp8
# ---------------------------------------------------------------------------------------------------------


def _ptx(n: int, k: int, arch: str) -> str:
    host, args = _kernels(arch).compile_args(n, k)
    return runtime.compile_ptx(host, args)


# e4m3 wgmma (k32) fed by TMA; one wgmma batch waited per scale block and promoted with fp32 FMAs; setmaxnreg
# for the producer/consumer split; stmatrix + 128-bit stores in the epilogue. Local memory = spilled
# accumulators; a bf16 wgmma or mma.sync would mean the wrong kernel.
_EXPECT = (r"\.target sm_90a\b", r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3",
           r"cp\.async\.bulk\.tensor", r"wgmma\.wait_group\.sync\.aligned\s+0;", r"\bfma\.rn\.f32\b",
           r"\bsetmaxnreg\.inc", r"\bstmatrix\.sync", r"\bst\.global\.v4\.b32\b")
_FORBID = (r"\b(ld|st)\.local\b", r"\bmma\.sync\b", r"wgmma\.mma_async\S*\.bf16")


def _spec(name: str, n: int, k: int) -> KernelSpec:
    return KernelSpec(op="grouped_gemm_fp8", name=name, compile=functools.partial(_ptx, n, k),
                      expect={ARCH: _EXPECT}, forbid={ARCH: _FORBID})


# Representative classes: the up projection (N = 2I, K = H) and the down projection (N = H, K = I).
KERNELS: tuple[KernelSpec, ...] = (
    _spec("grouped_gemm_fp8_sm90_up", 2048, 4096),
    _spec("grouped_gemm_fp8_sm90_down", 4096, 1024),
)
