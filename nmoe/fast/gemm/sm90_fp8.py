"""sm_90a fp8 grouped GEMM fwd: e4m3 experts with DeepSeek-V3 scales (x 1x128, w 128x128, e8m0), each
128-wide K block's wgmma sum promoted to fp32. Offsets stay on the device: no host sync, no recompile."""

from __future__ import annotations

import torch
from torch import Tensor

from nmoe.constants import FP8_WEIGHT_BLOCK, MXFP8_BLOCK_SM90
from nmoe.fast import runtime
from nmoe.fast.gemm.routing import as_bytes, check_offs_on_host, check_routing, fwd_ctas, require
from nmoe.fast.limits import (
    GEMM_FP8_CLUSTER_M,
    GEMM_FP8_CLUSTER_MAX_K,
    GEMM_FP8_OVERLAP,
    GEMM_FP8_STAGED_TILE,
    GEMM_FP8_TILE_AT_ONCE,
)
from nmoe.fast.op import Kernel, fast_op
from nmoe.fast.runtime import KernelSpec, tma_aligned

ARCH = "sm_90a"
BN = FP8_WEIGHT_BLOCK
K_BLOCK = MXFP8_BLOCK_SM90
_CODES = (torch.uint8, torch.float8_e4m3fn)
_SCALES = (torch.uint8, torch.float8_e8m0fnu)
FP8 = Kernel("nmoe.fast.kernels.sm90.grouped_gemm_fp8", "grouped_gemm_fp8_sm90",
             lambda km, n, k, overlap=False, staged=False, cm=1, at_once=False:
             km.compile_args(n, k, overlap, staged, cm, at_once),
             (ARCH,),
             "nmoe.fast.gemm.grouped_gemm_fp8")


def _check(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor,
           offs: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(xq, xs, wq, ws) as contiguous bytes, or a ValueError naming the fix."""
    op = "grouped_gemm_fp8"
    a, b = as_bytes(op, "xq", xq, _CODES), as_bytes(op, "wq", wq, _CODES)
    sa, sb = as_bytes(op, "xs", xs, _SCALES), as_bytes(op, "ws", ws, _SCALES)
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
    check_routing(op, offs, e, m)
    return a, sa, b, sb


def store_schedule() -> tuple[bool, bool]:
    """(staged, at_once) from the limits, or a ValueError: a tile leaves at once only when staged whole."""
    if GEMM_FP8_TILE_AT_ONCE and not GEMM_FP8_STAGED_TILE:
        raise ValueError("grouped_gemm_fp8: GEMM_FP8_TILE_AT_ONCE stores a whole staged tile at once; set "
                         "GEMM_FP8_STAGED_TILE too, or turn GEMM_FP8_TILE_AT_ONCE off")
    return GEMM_FP8_STAGED_TILE, GEMM_FP8_TILE_AT_ONCE


def _launch(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor, y: Tensor) -> None:
    """y[M, N] = per-group dequant(xq) @ dequant(wq[e])^T from byte views of the operands."""
    device, arch = runtime.device_arch(xq, xs, wq, ws, offs, y)
    require("grouped_gemm_fp8", arch, ARCH)
    (m, k), n, n_groups = xq.shape, y.shape[1], offs.numel()
    if m == 0 or n == 0:
        return
    if k == 0 or n_groups == 0:
        y.zero_()
        return
    check_offs_on_host("grouped_gemm_fp8", offs, m)
    cm = GEMM_FP8_CLUSTER_M if k <= GEMM_FP8_CLUSTER_MAX_K else 1
    n_ctas = fwd_ctas(device, m, n, n_groups, BN, cm)
    staged, at_once = store_schedule()
    launch = FP8.launcher(arch, n=n, k=k, overlap=GEMM_FP8_OVERLAP, staged=staged, cm=cm, at_once=at_once)
    launch(device, xq.data_ptr(), wq.data_ptr(), xs.data_ptr(), ws.data_ptr(), y.data_ptr(), offs.data_ptr(),
           m, n_groups, n_ctas)


def _impl(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor) -> Tensor:
    require("grouped_gemm_fp8", runtime.require_arch(xq, xs, wq, ws, offs), ARCH)
    a, sa, b, sb = _check(xq, xs, wq, ws, offs)
    op = "grouped_gemm_fp8"
    y = torch.empty(a.shape[0], b.shape[1], dtype=torch.bfloat16, device=a.device)
    _launch(tma_aligned(op, "xq", a), sa, tma_aligned(op, "wq", b), sb, offs.contiguous(), y)
    return y


def _fake(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor) -> Tensor:
    return xq.new_empty(xq.shape[0], wq.shape[1], dtype=torch.bfloat16)


_op = fast_op("grouped_gemm_fp8_sm90", _impl, _fake)


def grouped_gemm_fp8(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor) -> Tensor:
    """y[rows of e] = dequant(xq)[rows] @ dequant(wq[e])^T, fp32 per 128-K block, one bf16 rounding; rows
    past offs[-1] are zero. Forward only."""
    return _op(xq, xs, wq, ws, offs)


# ---------------------------------------------------------------------------------------------------------
# Compile-time checks without a GPU: python -m nmoe.fast.compilecheck --arch sm_90a --ops grouped_gemm_fp8
# ---------------------------------------------------------------------------------------------------------


# e4m3 wgmma (k32) fed by TMA; one wgmma batch waited per scale block and promoted with fp32 FMAs; setmaxnreg
# for the producer/consumer split; stmatrix + 128-bit stores in the epilogue. Local memory = spilled
# accumulators; a bf16 wgmma or mma.sync would mean the wrong kernel.
_EXPECT = (r"\.target sm_90a\b", r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3",
           r"cp\.async\.bulk\.tensor", r"wgmma\.wait_group\.sync\.aligned\s+0;", r"\bfma\.rn\.f32\b",
           r"\bsetmaxnreg\.inc", r"\bstmatrix\.sync", r"\bst\.global\.v4\.b32\b")
_FORBID = (r"\b(ld|st)\.local\b", r"\bmma\.sync\b", r"wgmma\.mma_async\S*\.bf16")


# Overlapped promotion: a block's wgmmas stay in flight (wait_group 1) while the block before is promoted.
_EXPECT_OVERLAP = (*_EXPECT, r"wgmma\.wait_group\.sync\.aligned\s+1;")


# A staged tile's consumers wait only for the store of the subtile whose buffer comes next: all but 3 of 4.
_STAGED = r"\bcp\.async\.bulk\.wait_group\.read\s+3\b"


# A tile leaving at once: two subtiles' TMA stores with no commit between them (one group per tile).
_AT_ONCE = (r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta[^\n]*\n[^\n]*\n\s*"
            r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta")


# A cluster's CTAs each load 1/cm of a B box for all of them.
_MULTICAST = (r"multicast::cluster", r"\bbarrier\.cluster\.wait\b")


def _spec(name: str, n: int, k: int, overlap: bool = False, staged: bool = False, cm: int = 1,
          at_once: bool = False) -> KernelSpec:
    expect = (*(_EXPECT_OVERLAP if overlap else _EXPECT), *((_STAGED,) if staged and not at_once else ()),
              *(_MULTICAST if cm > 1 else ()), *((_AT_ONCE,) if at_once else ()))
    return KernelSpec(op="grouped_gemm_fp8", name=name,
                      compile=FP8.compiler(n=n, k=k, overlap=overlap, staged=staged, cm=cm, at_once=at_once),
                      expect={ARCH: expect}, forbid={ARCH: (*_FORBID, *(() if at_once else (_AT_ONCE,)))})


# Representative classes: the up projection (N = 2I, K = H) and the down projection (N = H, K = I); the
# overlapped schedule with an even and an odd count of K blocks.
KERNELS: tuple[KernelSpec, ...] = (
    _spec("grouped_gemm_fp8_sm90_up", 2048, 4096),
    _spec("grouped_gemm_fp8_sm90_down", 4096, 1024),
    _spec("grouped_gemm_fp8_sm90_up_overlap", 2048, 4096, True),
    _spec("grouped_gemm_fp8_sm90_down_overlap", 4096, 1024, True),
    _spec("grouped_gemm_fp8_sm90_odd_overlap", 2048, 384, True),
    _spec("grouped_gemm_fp8_sm90_down_overlap_staged", 4096, 1024, True, True),
    _spec("grouped_gemm_fp8_sm90_down_overlap_cluster2", 4096, 1024, True, True, 2),
    _spec("grouped_gemm_fp8_sm90_short_overlap_cluster2_at_once", 4096, 256, True, True, 2, True),
)
