"""sm_90a grouped GEMM fwd on e4m3 experts with 1x128 (x) / 128x128 (w) e8m0 scales: one K tile per scale
block, its wgmma sum promoted to an fp32 accumulator with the block's scales (as in DeepSeek-V3).
Import only after nmoe.fast.runtime.import_cutlass("sm_90a")."""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint8
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.typing import Pointer
from cutlass.cutlass_dsl.cutlass import min as dsl_min
from cutlass.tensor_utils import LayoutEnum

from nmoe.constants import E8M0_NAN, F32_CANONICAL_NAN, FP8_WEIGHT_BLOCK, MXFP8_BLOCK_SM90
from nmoe.fast.kernels.formats import e8m0_value_bits
from nmoe.fast.kernels.prims import PDL, await_upstream, i2f, sel
from nmoe.fast.kernels.sm90.epilogue import (
    drain_stores,
    epilogue_copies,
    store_tile,
    store_tile_at_once,
)
from nmoe.fast.kernels.sm90.grouped_gemm import (
    _seek,
    b_tma,
    cluster_dims,
    cluster_units,
    cta_setup,
    cta_start,
    first_unit,
    mma_fragments,
    pointer,
    produce_tiles,
    unit_tile,
)
from nmoe.fast.kernels.sm90.tiles import (
    CONSUMER_REGS,
    CONSUMER_WGS,
    PRODUCER_REGS,
    THREADS,
    WG_THREADS,
    epi_bufs,
    epi_smem_bytes,
    epi_smem_layout,
    epi_tma,
    pipeline_stages,
)
from nmoe.fast.limits import GEMM_BM as BM

# One K tile per activation scale block and one N tile per weight scale block.
BK = MXFP8_BLOCK_SM90
BN = FP8_WEIGHT_BLOCK
K_BLOCKS = BK // 32


def stages_for(staged: bool = False) -> int:
    return pipeline_stages((BM + BN) * BK, epi_smem_bytes(BN, staged))


def _byte(t: cute.Tensor, coord: Any) -> Int32:
    """A Uint8 element as 0..255: the DSL widens Uint8 with sign extension, hence the mask."""
    v: Any = t[coord]
    return Int32(v.to(Int32) & 0xFF)


def make_tiled_mma() -> cute.TiledMma:
    """e4m3 x e4m3 -> fp32 wgmma, both operands K-major (fp8 wgmma has no other mode), one WG per 64 rows."""
    k_major = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
    return sm90_utils.make_trivial_tiled_mma(Float8E4M3FN, Float8E4M3FN, k_major, k_major, Float32,
                                             (CONSUMER_WGS, 1, 1), tiler_mn=(64, BN))


@cute.jit
def _scale(b: Int32) -> Float32:
    """e8m0 byte -> 2^(b-127) in fp32; 255 is NaN (b << 23 would make it +Inf)."""
    return Float32(i2f(sel(b == E8M0_NAN, F32_CANONICAL_NAN, e8m0_value_bits(b))))


@cute.jit
def _issue_block(tiled_mma: cute.TiledMma, blk: cute.Tensor, t_ra: cute.Tensor, t_rb: cute.Tensor,
                 stage: Int32) -> cute.TiledMma:
    """One scale block's k32 wgmmas into `blk`, the first overwriting it, committed as one group. Returns the
    MMA so the caller rebinds it: its ACCUMULATE field is staged state the loop must carry."""
    warpgroup.fence()
    tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
    for kb in range_constexpr(K_BLOCKS):
        cute.gemm(tiled_mma, blk, t_ra[(None, None, kb, stage)], t_rb[(None, None, kb, stage)], blk)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    return tiled_mma


@cute.jit
def _block_mma(tiled_mma: cute.TiledMma, blk: cute.Tensor, t_ra: cute.Tensor, t_rb: cute.Tensor,
               stage: Int32) -> cute.TiledMma:
    """_issue_block, then wait for it (the serial schedule: promotion follows its block's MMAs)."""
    tiled_mma = _issue_block(tiled_mma, blk, t_ra, t_rb, stage)
    warpgroup.wait_group(0)
    return tiled_mma


@cute.jit
def _promote(acc: cute.Tensor, blk: cute.Tensor, s_lo: Float32, s_hi: Float32) -> None:
    """acc += blk * s, s by row: wgmma's fragment value (j, i, c) sits at row 8i of the thread's row pair."""
    a: Any = acc
    p: Any = blk
    for c in range_constexpr(cute.size(acc, mode=[0, 2])):
        for j in range_constexpr(2):
            lo = ((j, 0, c), 0, 0)
            hi = ((j, 1, c), 0, 0)
            a[lo] = p[lo] * s_lo + a[lo]
            a[hi] = p[hi] * s_hi + a[hi]


@cute.jit
def _block_bytes(m_xs: cute.Tensor, m_ws: cute.Tensor, row_lo: Int32, row_hi: Int32, n_tile: Int32, kt: Int32,
                 e: Int32) -> tuple[Int32, Int32, Int32]:
    """K block kt's 3 scale bytes for this thread (its two rows', the weight block's), read straight from
    global (L1 after first touch): xs's 1-byte columns are too narrow for a TMA box without a transposed
    copy. Loaded before the stage wait, so the latency hides under the TMA and the wgmmas."""
    return _byte(m_xs, (row_lo, kt)), _byte(m_xs, (row_hi, kt)), _byte(m_ws, (n_tile, kt, e))


@cute.jit
def _block_scales(b_lo: Int32, b_hi: Int32, b_w: Int32) -> tuple[Float32, Float32]:
    s_w = _scale(b_w)
    return _scale(b_lo) * s_w, _scale(b_hi) * s_w


@cute.jit
def _overlap_step(mainloop: pipeline.PipelineTmaAsync, read: Any, release: Any, tiled_mma: cute.TiledMma,
                  acc: cute.Tensor, into: cute.Tensor, prev: cute.Tensor, s_lo: Float32, s_hi: Float32,
                  t_ra: cute.Tensor, t_rb: cute.Tensor, m_xs: cute.Tensor, m_ws: cute.Tensor, row_lo: Int32,
                  row_hi: Int32, n_tile: Int32, kt: Int32,
                  e: Int32) -> tuple[Any, Any, cute.TiledMma, Any, Any]:
    """Issue block kt into `into`, then promote `prev` (block kt - 1, scales s) while those wgmmas run and
    free its stage. Returns the states it advanced and block kt's scales."""
    b_lo, b_hi, b_w = _block_bytes(m_xs, m_ws, row_lo, row_hi, n_tile, kt, e)
    mainloop.consumer_wait(read)
    tiled_mma = _issue_block(tiled_mma, into, t_ra, t_rb, read.index)
    read.advance()
    warpgroup.wait_group(1)
    _promote(acc, prev, s_lo, s_hi)
    mainloop.consumer_release(release)
    release.advance()
    n_lo, n_hi = _block_scales(b_lo, b_hi, b_w)
    return read, release, tiled_mma, n_lo, n_hi


@cute.jit
def _k_overlapped(mainloop: pipeline.PipelineTmaAsync, read: Any, release: Any, tiled_mma: cute.TiledMma,
                  acc: cute.Tensor, bufs: tuple[cute.Tensor, cute.Tensor], t_ra: cute.Tensor,
                  t_rb: cute.Tensor, m_xs: cute.Tensor, m_ws: cute.Tensor, row_lo: Int32, row_hi: Int32,
                  n_tile: Int32, e: Int32, k_tiles: Constexpr[int]) -> tuple[Any, Any, cute.TiledMma]:
    """A tile's K blocks with each promotion under the next block's MMAs, block kt in bufs[kt % 2]; the loop
    is unrolled (rolled, ptxas serializes the wgmmas). Promotions keep K order, so every bit equals the
    serial schedule's. Returns the states it advanced."""
    b_lo, b_hi, b_w = _block_bytes(m_xs, m_ws, row_lo, row_hi, n_tile, Int32(0), e)
    mainloop.consumer_wait(read)
    tiled_mma = _issue_block(tiled_mma, bufs[0], t_ra, t_rb, read.index)
    read.advance()
    s_lo, s_hi = _block_scales(b_lo, b_hi, b_w)
    for kt in range_constexpr(1, k_tiles):
        read, release, tiled_mma, s_lo, s_hi = _overlap_step(
            mainloop, read, release, tiled_mma, acc, bufs[kt % 2], bufs[(kt - 1) % 2], s_lo, s_hi, t_ra, t_rb,
            m_xs, m_ws, row_lo, row_hi, n_tile, Int32(kt), e)
    warpgroup.wait_group(0)
    _promote(acc, bufs[(k_tiles - 1) % 2], s_lo, s_hi)
    mainloop.consumer_release(release)
    release.advance()
    return read, release, tiled_mma


@cute.jit
def _store(epi: Any, tma_d: cute.Tensor, m_d: cute.Tensor, row0: Int32, n_tile: Int32, g_end: Int32,
           n: Constexpr[int], staged: Constexpr[bool], at_once: Constexpr[bool]) -> None:
    """A finished tile's epilogue, as the kernel's flags choose it."""
    if const_expr(at_once):
        store_tile_at_once(epi, tma_d, m_d, row0, n_tile, g_end, n, BN)
    else:
        store_tile(epi, tma_d, m_d, m_d, row0, n_tile, g_end, n, BN, "none", bufs=epi_bufs(BN, staged))


@cute.kernel
def grouped_gemm_fp8_kernel(
    tma_atom_a: cute.CopyAtom, m_a: cute.Tensor, tma_atom_b: cute.CopyAtom, m_b: cute.Tensor,
    m_xs: cute.Tensor, m_ws: cute.Tensor, tma_atom_d: cute.CopyAtom, tma_d: cute.Tensor, m_d: cute.Tensor,
    m_offs: cute.Tensor, m_rows: Int32,
    n_groups: Int32, tiled_mma: cute.TiledMma, a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout,
    d_layout: cute.ComposedLayout, n: Constexpr[int], k: Constexpr[int], stages: Constexpr[int],
    overlap: Constexpr[bool], staged: Constexpr[bool], cm: Constexpr[int], at_once: Constexpr[bool],
) -> None:
    await_upstream()
    tidx, bidx, n_ctas, warp_idx = cta_start((tma_atom_a, tma_atom_b, tma_atom_d))
    s_offs, s_a, s_b, s_d, mainloop = cta_setup(m_offs, n_groups, Float8E4M3FN, a_layout, b_layout, d_layout,
                                                stages, cm=cm)
    unit, n_units, rank = cluster_units(bidx, n_ctas, cm)

    n_tiles_n = n // BN
    k_tiles = k // BK

    if warp_idx < 4:
        cute.arch.setmaxregister_decrease(PRODUCER_REGS)
        if warp_idx == 0:
            produce_tiles(mainloop, tma_atom_a, m_a, tma_atom_b, m_b, s_a, s_b, s_offs, n_groups, m_rows,
                          unit, n_units, n_tiles_n, k_tiles, BN, BK, stages, cm, rank)
    else:
        cute.arch.setmaxregister_increase(CONSUMER_REGS)
        ctid = tidx - WG_THREADS
        t_ra, t_rb, acc_shape = mma_fragments(tiled_mma, s_a, s_b, warp_idx, BN)
        assert acc_shape == ((2, 2, BN // 8), 1, 1), f"_promote assumes wgmma's m64 fragment, got {acc_shape}"
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        blk = cute.make_rmem_tensor(acc_shape, Float32)
        blk2 = blk
        if const_expr(overlap):
            blk2 = cute.make_rmem_tensor(acc_shape, Float32)
        # Tile coordinates (row, col) of this thread's accumulator values; its rows are those of (j, 0|1, c).
        t_c = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((BM, BN)))
        epi = epilogue_copies(tiled_mma, acc, s_d, ctid, tma_atom_d)

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        t = unit
        e, g_start, g_end, before, here = first_unit(s_offs, n_groups, m_rows, t, n_tiles_n, cm)
        while e <= n_groups:
            n_tile, row0 = unit_tile(t, before, g_start, n_tiles_n, cm, rank)
            acc.fill(0.0)
            if e < n_groups:
                # Rows past the group are computed, then masked at the store; past M they read row M - 1.
                row_lo = dsl_min(row0 + t_c[((0, 0, 0), 0, 0)][0], m_rows - 1)
                row_hi = dsl_min(row0 + t_c[((0, 1, 0), 0, 0)][0], m_rows - 1)
                if const_expr(overlap):
                    read, release, tiled_mma = _k_overlapped(
                        mainloop, read, release, tiled_mma, acc, (blk, blk2), t_ra, t_rb, m_xs, m_ws, row_lo,
                        row_hi, n_tile, e, k_tiles)
                else:
                    for kt in range(k_tiles):
                        b_lo, b_hi, b_w = _block_bytes(m_xs, m_ws, row_lo, row_hi, n_tile, kt, e)
                        mainloop.consumer_wait(read)
                        tiled_mma = _block_mma(tiled_mma, blk, t_ra, t_rb, read.index)
                        mainloop.consumer_release(read)
                        read.advance()
                        s_lo, s_hi = _block_scales(b_lo, b_hi, b_w)
                        _promote(acc, blk, s_lo, s_hi)
            _store(epi, tma_d, m_d, row0, n_tile, g_end, n, staged, at_once)
            t = t + n_units
            e, g_start, g_end, before, here = _seek(s_offs, n_groups, m_rows, t, e, g_start, g_end,
                                                    before, here, n_tiles_n, cm)
        drain_stores()


@cute.jit
def grouped_gemm_fp8_host(
    px: Pointer, pw: Pointer, pxs: Pointer, pws: Pointer, py: Pointer, poffs: Pointer, m_rows: Int32,
    n_groups: Int32, n_ctas: Int32, stream: cuda.CUstream, n: Constexpr[int], k: Constexpr[int],
    overlap: Constexpr[bool], staged: Constexpr[bool], cm: Constexpr[int], at_once: Constexpr[bool],
) -> None:
    """Host launcher of y[M, n] = per-group dequant(xq)[M, k] @ dequant(wq[e])^T; codes K-major, scales
    row-major bytes; the Constexpr flags pick the epilogue's staging and the B-sharing cluster shape."""
    # staged: a whole output tile waits in shared memory (epi_bufs). cm > 1: clusters of cm M tiles share
    # each B box, every CTA loading 1/cm of it for all. at_once (staged only): store_tile_at_once.
    assert staged or not at_once, "a tile leaves at once only from a whole staged tile"
    stages = stages_for(staged)
    kb = k // BK
    m_x = cute.make_tensor(px, cute.make_layout((m_rows, k), stride=(k, 1)))
    m_w = cute.make_tensor(pw, cute.make_layout((n, k, n_groups), stride=(k, 1, n * k)))
    m_xs = cute.make_tensor(pxs, cute.make_layout((m_rows, kb), stride=(kb, 1)))
    nb = n // BN
    m_ws = cute.make_tensor(pws, cute.make_layout((nb, kb, n_groups), stride=(kb, 1, nb * kb)))
    m_y = cute.make_tensor(py, cute.make_layout((m_rows, n), stride=(n, 1)))
    m_offs = cute.make_tensor(poffs, cute.make_layout(n_groups))

    k_major = LayoutEnum.ROW_MAJOR
    tile = (BM, BN, BK)
    tiled_mma = make_tiled_mma()
    a_layout = sm90_utils.make_smem_layout_a(k_major, tile, Float8E4M3FN, stages)
    b_layout = sm90_utils.make_smem_layout_b(k_major, tile, Float8E4M3FN, stages)
    tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), m_x, cute.slice_(a_layout, (None, None, 0)), (BM, BK))
    tma_atom_b, tma_b = b_tma(m_w, b_layout, BN, cm, BK)
    grouped_gemm_fp8_kernel(
        tma_atom_a, tma_a, tma_atom_b, tma_b, m_xs, m_ws, *epi_tma(m_y), m_y, m_offs, m_rows, n_groups,
        tiled_mma, a_layout, b_layout, epi_smem_layout(bufs=epi_bufs(BN, staged)), n, k, stages, overlap,
        staged, cm, at_once,
    ).launch(grid=[n_ctas, 1, 1], block=[THREADS, 1, 1], cluster=cluster_dims(cm), min_blocks_per_mp=1,
             stream=stream, use_pdl=PDL)


def compile_args(n: int, k: int, overlap: bool = False, staged: bool = False, cm: int = 1,
                 at_once: bool = False) -> tuple[Any, tuple[Any, ...]]:
    ptrs = (pointer(Float8E4M3FN, 0), pointer(Float8E4M3FN, 0), pointer(Uint8, 0, 1), pointer(Uint8, 0, 1),
            pointer(BFloat16, 0), pointer(Int32, 0, 4))
    return grouped_gemm_fp8_host, (*ptrs, Int32(0), Int32(0), Int32(0), cuda.CUstream(0), n, k, overlap,
                                   staged, cm, at_once)
