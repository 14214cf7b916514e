"""sm_100a grouped GEMM over expert row segments (bf16, MXFP8, NVFP4): TMA -> tcgen05.mma -> masked stores.

Persistent CTAs derive tiles from the device `offs` (no host sync, no recompile per routing); import only
after nmoe.fast.runtime.import_cutlass("sm_100a").
"""

# Warp roles per CTA (192 threads): warps 0-3 epilogue (one TMEM lane = one output row per thread), warp 4
# issues tcgen05.mma (and, for scaled formats, tcgen05.cp of the scale factors smem -> TMEM), warp 5 issues
# TMA loads. Two rings: operands in smem (TMA -> MMA) and two fp32 accumulators in TMEM (MMA -> epilogue).
# NVFP4's fp32 tensor scales multiply in the epilogue; e8m0 / e4m3 block scales are applied inside the MMA.

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as sf_layouts
from cutlass import BFloat16, Float4E2M1FN, Float8E4M3FN, Float8E8M0FNU, Float32, Int16, Int32, Int64
from cutlass._mlir.dialects import nvvm
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer
from cutlass.memory import SmemAllocator, TmemAllocator

from nmoe.fast.kernels.prims import PDL, await_upstream
from nmoe.fast.limits import GEMM_BM as BM
from nmoe.fast.limits import SF_ROWS

MMA_PER_TILE_K = 4
EPI_WARPS = 4
MMA_WARP = 4
TMA_WARP = 5
THREADS = 32 * (EPI_WARPS + 2)
EPI_THREADS = 32 * EPI_WARPS
ACC_STAGES = 2
TMEM_COLS = 512
EPI_COLS = 32
VEC = 8
SMEM_BYTES = 232448
SMEM_RESERVE = 4096
MAX_STAGES = 8
EPI_BARRIER_ID = 1
TMEM_BARRIER_ID = 2


@dataclass(frozen=True)
class Format:
    """Operand element type, block-scale type and vector, and the MMA instruction K it implies."""

    name: str
    ab: Any
    sf: Any
    sf_vec: int
    inst_k: int

    @property
    def scaled(self) -> bool:
        return self.sf is not None

    @property
    def tile_k(self) -> int:
        return self.inst_k * MMA_PER_TILE_K

    def bytes_of(self, elements: int) -> int:
        return elements * int(self.ab.width) // 8


FORMATS: dict[str, Format] = {
    "bf16": Format("bf16", BFloat16, None, 0, 16),
    "mxfp8": Format("mxfp8", Float8E4M3FN, Float8E8M0FNU, 32, 32),
    "nvfp4": Format("nvfp4", Float4E2M1FN, Float8E4M3FN, 16, 64),
}


def stages_for(fmt: Format, bn: int) -> int:
    """Operand pipeline depth that fits the A/B (and scale-factor) stages into shared memory."""
    stage = fmt.bytes_of((BM + bn) * fmt.tile_k)
    if fmt.scaled:
        stage += (BM + max(bn, SF_ROWS)) * (fmt.tile_k // fmt.sf_vec)
    return min(MAX_STAGES, (SMEM_BYTES - SMEM_RESERVE) // stage)


def _tcgen05_fence(after: bool) -> None:
    """Order async tcgen05 work (MMA writes, TMEM loads) against an mbarrier/named-barrier handshake."""
    kind = nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC if after else nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC
    nvvm.tcgen05_fence(kind)


@cute.jit
def _tensor_scale(m_xs: cute.Tensor, m_ws: cute.Tensor, fmt_name: Constexpr[str]) -> Float32:
    """NVFP4's two fp32 tensor scales, multiplied once (one rounding); 1 for the other formats."""
    alpha = Float32(1.0)
    if const_expr(fmt_name == "nvfp4"):
        xs: Any = m_xs[0]
        ws: Any = m_ws[0]
        alpha = Float32(xs * ws)
    return alpha


@cute.jit
def _group_end(m_offs: cute.Tensor, e: Int32, n_groups: Int32, lo: Int32, m_rows: Int32) -> Int32:
    """Row end of work group e, forced into [lo, m_rows]; e == n_groups is the zero-filled tail."""
    end: Any = m_rows
    if e < n_groups:
        end = m_offs[e]
        if end < lo:
            end = lo
        if end > m_rows:
            end = m_rows
    out: Int32 = end
    return out


@cute.jit
def _walk(m_offs: cute.Tensor, n_groups: Int32, m_rows: Int32, t: Int32, e: Int32, lo: Int32, hi: Int32,
          first: Int32, blk: Int32, n_tiles_n: Constexpr[int]
          ) -> tuple[Int32, Int32, Int32, Int32, Int32]:
    """Move the group cursor until linear tile t lies in group e (e > n_groups: nothing left).

    A CTA's t only grows, so the cursor only moves forward: O(groups + tiles) per CTA, no offs table in smem.
    """
    # Tiles are numbered group after group (experts, then the rows past offs[-1] as group n_groups), each
    # group m-tile-major with n fastest. `first` is group e's first tile, `blk` its first 128-row block in
    # the group-padded scale-factor layout (scale_layout.pack_grouped_rows).
    m_tiles = (hi - lo + (BM - 1)) // BM
    while t >= first + m_tiles * n_tiles_n and e <= n_groups:
        first = first + m_tiles * n_tiles_n
        blk = blk + m_tiles
        e = e + 1
        lo = hi
        if e <= n_groups:
            hi = _group_end(m_offs, e, n_groups, lo, m_rows)
        m_tiles = (hi - lo + (BM - 1)) // BM
    return e, lo, hi, first, blk


@cute.jit
def _store_row_chunk(vals: cute.Tensor, g_row: cute.Tensor, row_ok: cutlass.Boolean, col0: Int32,
                     cols_valid: Int32) -> None:
    """Store EPI_COLS bf16 values of one row as 16-byte vectors, each only where its columns exist."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=VEC * 16)
    src = cute.zipped_divide(vals, (VEC,))
    dst = cute.zipped_divide(g_row, (VEC,))
    for v in range_constexpr(EPI_COLS // VEC):
        if row_ok and col0 + v * VEC < cols_valid:
            cute.copy(atom, src[(None, v)], dst[(None, v)])


@cute.kernel
def grouped_gemm_sm100_kernel(
    tiled_mma: cute.TiledMma,
    tma_atom_a: cute.CopyAtom, m_a: cute.Tensor,
    tma_atom_b: cute.CopyAtom, m_b: cute.Tensor,
    tma_atom_sfa: cute.CopyAtom, m_sfa: cute.Tensor,
    tma_atom_sfb: cute.CopyAtom, m_sfb: cute.Tensor,
    m_d: cute.Tensor, m_offs: cute.Tensor, m_xs: cute.Tensor, m_ws: cute.Tensor,
    m_rows: Int32, n_groups: Int32,
    a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout,
    sfa_layout: cute.Layout, sfb_layout: cute.Layout,
    tx_bytes: Constexpr[int], fmt_name: Constexpr[str], n: Constexpr[int], k: Constexpr[int],
    bn: Constexpr[int], stages: Constexpr[int],
) -> None:
    await_upstream()
    fmt = FORMATS[fmt_name]
    scaled = fmt.scaled
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    n_ctas, _, _ = cute.arch.grid_dim()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    n_tiles_n = (n + bn - 1) // bn
    k_tiles = (k + fmt.tile_k - 1) // fmt.tile_k

    if warp == TMA_WARP:
        cpasync.prefetch_descriptor(tma_atom_a)
        cpasync.prefetch_descriptor(tma_atom_b)
        if const_expr(scaled):
            cpasync.prefetch_descriptor(tma_atom_sfa)
            cpasync.prefetch_descriptor(tma_atom_sfb)

    smem = SmemAllocator()
    ab_bars = smem.allocate_array(Int64, stages * 2, byte_alignment=8)
    acc_bars = smem.allocate_array(Int64, ACC_STAGES * 2, byte_alignment=8)
    s_a = smem.allocate_tensor(fmt.ab, a_layout.outer, 1024, a_layout.inner)
    s_b = smem.allocate_tensor(fmt.ab, b_layout.outer, 1024, b_layout.inner)
    s_sfa = s_a
    s_sfb = s_b
    if const_expr(scaled):
        s_sfa = smem.allocate_tensor(fmt.sf, sfa_layout, 128)
        s_sfb = smem.allocate_tensor(fmt.sf, sfb_layout, 128)

    # Operand ring: the TMA warp fills a stage (transaction bytes), the MMA warp frees it by tcgen05.commit.
    ab_pipe = pipeline.PipelineTmaUmma.create(
        barrier_storage=ab_bars, num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        tx_count=tx_bytes,
    )
    # Accumulator ring in TMEM: the MMA warp fills a stage, the 128 epilogue threads drain it.
    acc_pipe = pipeline.PipelineUmmaAsync.create(
        barrier_storage=acc_bars, num_stages=ACC_STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, EPI_THREADS),
    )
    tmem_bar = pipeline.NamedBarrier(barrier_id=TMEM_BARRIER_ID, num_threads=32 * (EPI_WARPS + 1))
    tmem = TmemAllocator(barrier_for_retrieve=tmem_bar, allocator_warp_id=0)

    thr_mma = tiled_mma.get_slice(0)
    acc_shape = tiled_mma.partition_shape_C((BM, bn))
    acc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, ACC_STAGES))

    e = Int32(-1)
    lo = Int32(0)
    hi = Int32(0)
    first = Int32(0)
    blk = Int32(0)
    t = Int32(bidx)

    if warp == TMA_WARP:
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
        e, lo, hi, first, blk = _walk(m_offs, n_groups, m_rows, t, e, lo, hi, first, blk, n_tiles_n)
        while e <= n_groups:
            if e < n_groups:
                local = t - first
                m_tile = local // n_tiles_n
                n_tile = local - m_tile * n_tiles_n
                row0 = lo + m_tile * BM
                g_a = cute.local_tile(cute.domain_offset((row0, 0, 0), m_a), (BM, fmt.tile_k),
                                      (0, None, 0))
                g_b = cute.local_tile(m_b, (bn, fmt.tile_k), (n_tile, None, e))
                t_sa, t_ga = cpasync.tma_partition(
                    tma_atom_a, 0, cute.make_layout(1), cute.group_modes(s_a, 0, 3),
                    cute.group_modes(thr_mma.partition_A(g_a), 0, 3))
                t_sb, t_gb = cpasync.tma_partition(
                    tma_atom_b, 0, cute.make_layout(1), cute.group_modes(s_b, 0, 3),
                    cute.group_modes(thr_mma.partition_B(g_b), 0, 3))
                t_ssfa, t_gsfa = t_sa, t_ga
                t_ssfb, t_gsfb = t_sb, t_gb
                if const_expr(scaled):
                    g_sfa = cute.local_tile(m_sfa, (BM, fmt.tile_k), (blk + m_tile, None, 0))
                    g_sfb = cute.local_tile(m_sfb, (bn, fmt.tile_k), (n_tile, None, e))
                    t_ssfa, t_gsfa = cpasync.tma_partition(
                        tma_atom_sfa, 0, cute.make_layout(1), cute.group_modes(s_sfa, 0, 3),
                        cute.group_modes(thr_mma.partition_A(g_sfa), 0, 3))
                    t_ssfb, t_gsfb = cpasync.tma_partition(
                        tma_atom_sfb, 0, cute.make_layout(1), cute.group_modes(s_sfb, 0, 3),
                        cute.group_modes(thr_mma.partition_B(g_sfb), 0, 3))
                    t_ssfa = cute.filter_zeros(t_ssfa)
                    t_gsfa = cute.filter_zeros(t_gsfa)
                    t_ssfb = cute.filter_zeros(t_ssfb)
                    t_gsfb = cute.filter_zeros(t_gsfb)
                for kt in cutlass.range(k_tiles, unroll=1):  # type: ignore[attr-defined]
                    ab_pipe.producer_acquire(state)
                    bar = ab_pipe.producer_get_barrier(state)
                    cute.copy(tma_atom_a, t_ga[(None, kt)], t_sa[(None, state.index)], tma_bar_ptr=bar)
                    cute.copy(tma_atom_b, t_gb[(None, kt)], t_sb[(None, state.index)], tma_bar_ptr=bar)
                    if const_expr(scaled):
                        cute.copy(tma_atom_sfa, t_gsfa[(None, kt)], t_ssfa[(None, state.index)],
                                  tma_bar_ptr=bar)
                        cute.copy(tma_atom_sfb, t_gsfb[(None, kt)], t_ssfb[(None, state.index)],
                                  tma_bar_ptr=bar)
                    ab_pipe.producer_commit(state)
                    state.advance()
            t = t + n_ctas
            e, lo, hi, first, blk = _walk(m_offs, n_groups, m_rows, t, e, lo, hi, first, blk, n_tiles_n)
        ab_pipe.producer_tail(state)

    if warp == MMA_WARP:
        tmem.wait_for_alloc()
        _tcgen05_fence(True)
        acc_ptr = tmem.retrieve_ptr(Float32)
        t_acc_all = cute.make_tensor(acc_ptr, acc_fake.layout)
        t_ra = tiled_mma.make_fragment_A(s_a)
        t_rb = tiled_mma.make_fragment_B(s_b)
        t_sfa = t_acc_all
        t_sfb = t_acc_all
        s2t_sfa = None
        s2t_sfb = None
        src_sfa = t_acc_all
        dst_sfa = t_acc_all
        src_sfb = t_acc_all
        dst_sfb = t_acc_all
        if const_expr(scaled):
            acc_cols = tcgen05.find_tmem_tensor_col_offset(t_acc_all)
            sfa_tmem_layout = sf_layouts.make_tmem_layout_sfa(
                tiled_mma, (BM, bn, fmt.tile_k), fmt.sf_vec, cute.slice_(sfa_layout, (None, None, None, 0)))
            t_sfa = cute.make_tensor(cute.recast_ptr(acc_ptr + acc_cols, dtype=fmt.sf), sfa_tmem_layout)
            sfa_cols = tcgen05.find_tmem_tensor_col_offset(t_sfa)
            sfb_tmem_layout = sf_layouts.make_tmem_layout_sfb(
                tiled_mma, (BM, bn, fmt.tile_k), fmt.sf_vec, cute.slice_(sfb_layout, (None, None, None, 0)))
            t_sfb = cute.make_tensor(cute.recast_ptr(acc_ptr + acc_cols + sfa_cols, dtype=fmt.sf),
                                     sfb_tmem_layout)
            s2t_atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), fmt.sf)
            s2t_sfa = tcgen05.make_s2t_copy(s2t_atom, cute.filter_zeros(t_sfa))
            s2t_sfb = tcgen05.make_s2t_copy(s2t_atom, cute.filter_zeros(t_sfb))
            thr_sfa = s2t_sfa.get_slice(0)
            thr_sfb = s2t_sfb.get_slice(0)
            src_sfa = tcgen05.get_s2t_smem_desc_tensor(s2t_sfa, thr_sfa.partition_S(cute.filter_zeros(s_sfa)))
            dst_sfa = thr_sfa.partition_D(cute.filter_zeros(t_sfa))
            src_sfb = tcgen05.get_s2t_smem_desc_tensor(s2t_sfb, thr_sfb.partition_S(cute.filter_zeros(s_sfb)))
            dst_sfb = thr_sfb.partition_D(cute.filter_zeros(t_sfb))

        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ACC_STAGES)
        e, lo, hi, first, blk = _walk(m_offs, n_groups, m_rows, t, e, lo, hi, first, blk, n_tiles_n)
        while e <= n_groups:
            if e < n_groups:
                acc_pipe.producer_acquire(acc_state)
                _tcgen05_fence(True)
                t_acc = t_acc_all[(None, None, None, acc_state.index)]
                for kt in cutlass.range(k_tiles, unroll=1):  # type: ignore[attr-defined]
                    ab_pipe.consumer_wait(ab_state)
                    if const_expr(scaled):
                        cute.copy(s2t_sfa, src_sfa[(None, None, None, None, ab_state.index)], dst_sfa)
                        cute.copy(s2t_sfb, src_sfb[(None, None, None, None, ab_state.index)], dst_sfb)
                    for kb in range_constexpr(MMA_PER_TILE_K):
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, (kt != 0) | (kb != 0))
                        a_kb = t_ra[(None, None, kb, ab_state.index)]
                        b_kb = t_rb[(None, None, kb, ab_state.index)]
                        if const_expr(scaled):
                            cute.gemm(tiled_mma, t_acc, [a_kb, t_sfa[(None, None, kb)]],
                                      [b_kb, t_sfb[(None, None, kb)]], t_acc)
                        else:
                            cute.gemm(tiled_mma, t_acc, a_kb, b_kb, t_acc)
                    ab_pipe.consumer_release(ab_state)
                    ab_state.advance()
                acc_pipe.producer_commit(acc_state)
                acc_state.advance()
            t = t + n_ctas
            e, lo, hi, first, blk = _walk(m_offs, n_groups, m_rows, t, e, lo, hi, first, blk, n_tiles_n)
        acc_pipe.producer_tail(acc_state)

    if warp < EPI_WARPS:
        tmem.allocate(TMEM_COLS)
        tmem.wait_for_alloc()
        _tcgen05_fence(True)
        acc_ptr = tmem.retrieve_ptr(Float32)
        t_acc_all = cute.make_tensor(acc_ptr, acc_fake.layout)
        epi_bar = pipeline.NamedBarrier(barrier_id=EPI_BARRIER_ID, num_threads=EPI_THREADS)
        alpha = _tensor_scale(m_xs, m_ws, fmt_name)

        # Each thread owns one accumulator row (TMEM lane) and reads EPI_COLS columns per tcgen05.ld.
        acc_tile = t_acc_all[((None, None), 0, 0, None)]
        acc_sub = cute.flat_divide(acc_tile, (BM, EPI_COLS))
        t2r = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), Float32),
            acc_sub[(None, None, 0, 0, 0)])
        thr_t2r = t2r.get_slice(tidx)
        t_acc_sub = thr_t2r.partition_S(acc_sub)
        coords = thr_t2r.partition_D(cute.make_identity_tensor((BM, EPI_COLS)))
        my_row = coords[0][0]
        frag = cute.make_rmem_tensor(coords.shape, Float32)
        r_out = cute.make_rmem_tensor((EPI_COLS,), BFloat16)

        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ACC_STAGES)
        e, lo, hi, first, blk = _walk(m_offs, n_groups, m_rows, t, e, lo, hi, first, blk, n_tiles_n)
        while e <= n_groups:
            local = t - first
            m_tile = local // n_tiles_n
            n_tile = local - m_tile * n_tiles_n
            row0 = lo + m_tile * BM
            row_ok = my_row < hi - row0
            cols_valid = n - n_tile * bn
            g_rows = cute.local_tile(cute.domain_offset((row0, 0), m_d), (BM, bn), (0, n_tile))
            if e < n_groups:
                acc_pipe.consumer_wait(acc_state)
                _tcgen05_fence(True)
                for sub in range_constexpr(bn // EPI_COLS):
                    cute.copy(t2r, t_acc_sub[(None, None, None, 0, sub, acc_state.index)], frag)
                    # tcgen05.ld is asynchronous: its registers are defined only after tcgen05.wait::ld.
                    cute.arch.fence_view_async_tmem_load()
                    acc = frag.load().reshape((EPI_COLS,))
                    if const_expr(fmt_name == "nvfp4"):
                        acc = acc * alpha
                    r_out.store(acc.to(BFloat16))
                    g_row = cute.local_tile(g_rows[(my_row, None)], (EPI_COLS,), (sub,))
                    _store_row_chunk(r_out, g_row, row_ok, Int32(sub * EPI_COLS), cols_valid)
                _tcgen05_fence(False)
                acc_pipe.consumer_release(acc_state)
                acc_state.advance()
            else:
                r_out.fill(0.0)
                for sub in range_constexpr(bn // EPI_COLS):
                    g_row = cute.local_tile(g_rows[(my_row, None)], (EPI_COLS,), (sub,))
                    _store_row_chunk(r_out, g_row, row_ok, Int32(sub * EPI_COLS), cols_valid)
            t = t + n_ctas
            e, lo, hi, first, blk = _walk(m_offs, n_groups, m_rows, t, e, lo, hi, first, blk, n_tiles_n)

        tmem.relinquish_alloc_permit()
        _tcgen05_fence(False)
        epi_bar.arrive_and_wait()
        _tcgen05_fence(True)
        tmem.free(acc_ptr)


@cute.jit
def grouped_gemm_sm100_host(
    pa: Pointer, pb: Pointer, psfa: Pointer, psfb: Pointer, pd: Pointer, poffs: Pointer, pxs: Pointer,
    pws: Pointer, m_rows: Int32, n_groups: Int32, sf_blocks: Int32, n_ctas: Int32, stream: cuda.CUstream,
    fmt_name: Constexpr[str], n: Constexpr[int], k: Constexpr[int], bn: Constexpr[int],
) -> None:
    """d[M, n] = per-group a[M, k] @ b[e]^T, b [E, n, k] K-major; scaled formats also take SFA / SFB."""
    fmt = FORMATS[fmt_name]
    stages = stages_for(fmt, bn)
    tiler = (BM, bn, fmt.tile_k)
    m_a = cute.make_tensor(pa, cute.make_layout((m_rows, k, 1), stride=(k, 1, 0)))
    m_b = cute.make_tensor(pb, cute.make_layout((n, k, n_groups), stride=(k, 1, n * k)))
    m_d = cute.make_tensor(pd, cute.make_layout((m_rows, n), stride=(n, 1)))
    m_offs = cute.make_tensor(poffs, cute.make_layout(n_groups))
    m_xs = cute.make_tensor(pxs, cute.make_layout(1))
    m_ws = cute.make_tensor(pws, cute.make_layout(1))

    if const_expr(fmt.scaled):
        tiled_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
            fmt.ab, fmt.ab, OperandMajorMode.K, OperandMajorMode.K, fmt.sf, fmt.sf_vec,
            tcgen05.CtaGroup.ONE, (BM, bn))
    else:
        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            fmt.ab, fmt.ab, OperandMajorMode.K, OperandMajorMode.K, Float32, tcgen05.CtaGroup.ONE, (BM, bn))
    cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))
    a_layout = sm100_utils.make_smem_layout_a(tiled_mma, tiler, fmt.ab, stages)
    b_layout = sm100_utils.make_smem_layout_b(tiled_mma, tiler, fmt.ab, stages)
    a_one = cute.slice_(a_layout, (None, None, None, 0))
    b_one = cute.slice_(b_layout, (None, None, None, 0))
    load = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
    cluster = cluster_vmnk.shape
    tma_atom_a, tma_a = cute.nvgpu.make_tiled_tma_atom_A(load, m_a, a_one, tiler, tiled_mma, cluster)
    tma_atom_b, tma_b = cute.nvgpu.make_tiled_tma_atom_B(load, m_b, b_one, tiler, tiled_mma, cluster)
    tx_bytes = cute.size_in_bytes(fmt.ab, a_one) + cute.size_in_bytes(fmt.ab, b_one)

    sfa_layout = cute.make_layout(1)
    sfb_layout = cute.make_layout(1)
    tma_atom_sfa, tma_sfa = tma_atom_a, tma_a
    tma_atom_sfb, tma_sfb = tma_atom_b, tma_b
    if const_expr(fmt.scaled):
        # Scale factors in the tcgen05 atom layout, K padded to whole k-tiles (so tiles split atoms evenly);
        # A's rows are each group padded to 128-row blocks.
        sfa_rows = sf_blocks * SF_ROWS
        k_sf = fmt.tile_k * ((k + fmt.tile_k - 1) // fmt.tile_k)
        m_sfa = cute.make_tensor(psfa, sf_layouts.tile_atom_to_shape_SF((sfa_rows, k_sf, 1), fmt.sf_vec))
        m_sfb = cute.make_tensor(psfb, sf_layouts.tile_atom_to_shape_SF((n, k_sf, n_groups), fmt.sf_vec))
        sfa_layout = sf_layouts.make_smem_layout_sfa(tiled_mma, tiler, fmt.sf_vec, stages)
        sfb_layout = sf_layouts.make_smem_layout_sfb(tiled_mma, tiler, fmt.sf_vec, stages)
        sfa_one = cute.slice_(sfa_layout, (None, None, None, 0))
        sfb_one = cute.slice_(sfb_layout, (None, None, None, 0))
        tma_atom_sfa, tma_sfa = cute.nvgpu.make_tiled_tma_atom_A(
            load, m_sfa, sfa_one, tiler, tiled_mma, cluster, internal_type=Int16)
        tma_atom_sfb, tma_sfb = cute.nvgpu.make_tiled_tma_atom_B(
            load, m_sfb, sfb_one, tiler, tiled_mma, cluster, internal_type=Int16)
        tx_bytes += cute.size_in_bytes(fmt.sf, sfa_one) + cute.size_in_bytes(fmt.sf, sfb_one)

    grouped_gemm_sm100_kernel(
        tiled_mma, tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_sfa, tma_sfa, tma_atom_sfb, tma_sfb,
        m_d, m_offs, m_xs, m_ws, m_rows, n_groups, a_layout, b_layout, sfa_layout, sfb_layout,
        tx_bytes, fmt_name, n, k, bn, stages,
    ).launch(grid=[n_ctas, 1, 1], block=[THREADS, 1, 1], cluster=[1, 1, 1], min_blocks_per_mp=1,
             stream=stream, use_pdl=PDL)


_PTR_TYPES: dict[str, tuple[Any, Any]] = {
    "bf16": (BFloat16, Float8E8M0FNU),
    "mxfp8": (Float8E4M3FN, Float8E8M0FNU),
    "nvfp4": (Float4E2M1FN, Float8E4M3FN),
}


def pointers(fmt_name: str, a: int, b: int, sfa: int, sfb: int, d: int, offs: int, xs: int,
             ws: int) -> tuple[Any, ...]:
    """Typed device pointers: TMA sources 16-byte aligned; the offs table and tensor scales are scalars."""
    ab, sf = _PTR_TYPES[fmt_name]
    g = cute.AddressSpace.gmem
    return (make_ptr(ab, a, g, assumed_align=16), make_ptr(ab, b, g, assumed_align=16),
            make_ptr(sf, sfa, g, assumed_align=16), make_ptr(sf, sfb, g, assumed_align=16),
            make_ptr(BFloat16, d, g, assumed_align=16), make_ptr(Int32, offs, g, assumed_align=4),
            make_ptr(Float32, xs, g, assumed_align=4), make_ptr(Float32, ws, g, assumed_align=4))


def compile_args(fmt_name: str, n: int, k: int, bn: int) -> tuple[Any, tuple[Any, ...]]:
    ptrs = pointers(fmt_name, 0, 0, 0, 0, 0, 0, 0, 0)
    scalars = (Int32(0), Int32(0), Int32(0), Int32(0))
    return grouped_gemm_sm100_host, (*ptrs, *scalars, cuda.CUstream(0), fmt_name, n, k, bn)
