"""sm_90a grouped GEMM whose A rows are gathered by index as they load (the up projection from token rows,
the dgrad from dy rows): a producer warpgroup of cp.async copies beside the B TMA, the consumers and
epilogue of grouped_gemm. Import only after nmoe.fast.runtime.import_cutlass("sm_90a")."""

from __future__ import annotations

from typing import Any, cast

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Int32, Int64
from cutlass.base_dsl.ast_helpers import range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.typing import Pointer
from cutlass.cutlass_dsl.cutlass import min as dsl_min

from nmoe.fast.kernels.sm90.gatherplan import gather_lag
from nmoe.fast.kernels.sm90.grouped_gemm import (
    EPILOGUES,
    PRODUCER_REGS,
    THREADS,
    VEC,
    WG_THREADS,
    _gemm_setup,
    _seek,
    _tile_at,
    cluster_dims,
    consume_tiles,
    copy_b,
    epi_smem_layout,
    first_unit,
    fwd_cta_begin,
    n_k_tiles,
    n_tiles_n_of,
    pointer,
    stages_for,
)
from nmoe.fast.limits import GEMM_BK as BK
from nmoe.fast.limits import GEMM_BM as BM
from nmoe.fast.limits import GEMM_GATHER_CLUSTER_M as GATHER_CLUSTER_M

# Gathered A: the producer warpgroup's WG_THREADS threads load each BM x BK box of A with 16-byte cp.async
# straight from the token rows, thread i taking chunk i % CHUNKS of rows i // CHUNKS + GATHER_ROW_STEP * j.
CHUNKS = BK // VEC
GATHER_ROW_STEP = WG_THREADS // CHUNKS
GATHER_ROWS = BM // GATHER_ROW_STEP


@cute.jit
def swizzled(byte: Int32) -> Int32:
    """128-byte swizzle of a byte offset from a 1024-byte aligned base: 16-byte chunk ^= 128-byte row % 8
    (what TMA writes and wgmma reads for these layouts)."""
    out: Int32 = byte ^ (((byte >> 7) & 7) << 4)
    return out


@cute.jit
def arm_stage(mainloop: pipeline.PipelineTmaAsync, state: Any, warp_idx: Int32, tma_atom: cute.CopyAtom,
              src: cute.Tensor, dst: cute.Tensor, cm: Constexpr[int] = 1) -> None:
    """A gathering producer's stage: every thread waits for it to be free; warp 0 arms its barrier and
    TMA-loads the operand that is not gathered (its 1/cm share, multicast over the cluster)."""
    if warp_idx == 0:
        mainloop.producer_acquire(state)
        copy_b(tma_atom, src, dst, mainloop.producer_get_barrier(state), cm)
    else:
        mainloop.sync_object_empty.wait(state.index, state.phase)


@cute.jit
def copy_chunk(atom: cute.CopyAtom, g: Int64, s_addr: Int32) -> None:
    """One 16-byte cp.async from global byte address g to shared byte address s_addr."""
    cute.copy(atom, cute.make_tensor(cute.make_ptr(BFloat16, g, cute.AddressSpace.gmem, assumed_align=16),
                                     cute.make_layout(VEC)),
              cute.make_tensor(cute.make_ptr(BFloat16, s_addr, cute.AddressSpace.smem, assumed_align=16),
                               cute.make_layout(VEC)))


def chunk_atom() -> cute.CopyAtom:
    atom: cute.CopyAtom = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                              num_bits_per_copy=128)
    return atom


@cute.jit
def _land(mainloop: pipeline.PipelineTmaAsync, index: Int32) -> None:
    cute.arch.mbarrier_arrive(cast(pipeline.MbarrierArray, mainloop.sync_object_full).get_barrier(index))


@cute.jit
def commit_stage(mainloop: pipeline.PipelineTmaAsync, state: Any, lag: Constexpr[int],
                 stages: Constexpr[int]) -> None:
    """Commit this thread's copies of the stage `state` names; from stage `lag` on, land the stage issued
    `lag` before it: wait for its copies, fence them into the async proxy wgmma reads through, arrive."""
    cute.arch.cp_async_commit_group()
    if state.count >= lag:
        cute.arch.cp_async_wait_group(lag)
        cute.arch.fence_proxy("async.shared", space="cta")
        _land(mainloop, (state.index + (stages - lag)) % stages)


@cute.jit
def land_all(mainloop: pipeline.PipelineTmaAsync, state: Any, lag: Constexpr[int],
             stages: Constexpr[int]) -> None:
    """After the producer's last stage (`state` past it): land the up to `lag` stages still in flight."""
    cute.arch.cp_async_wait_group(0)
    cute.arch.fence_proxy("async.shared", space="cta")
    for i in range(dsl_min(state.count, lag)):
        _land(mainloop, (state.index + (stages - 1) - i) % stages)


@cute.jit
def _gather_sources(m_slot: cute.Tensor, row0: Int32, g_end: Int32, top_k: Int32, rb: Int32, x_addr: Int64,
                    k: Constexpr[int], zero_addr: Int64, src: cute.Tensor) -> None:
    """src[j]: byte address of the token row feeding tile row rb + GATHER_ROW_STEP * j (slot // top_k), or
    of the zero chunk for pad rows (slot -1) and rows past the group."""
    for j in range_constexpr(GATHER_ROWS):
        r = row0 + rb + GATHER_ROW_STEP * j
        a = zero_addr
        if r < g_end:
            s = m_slot[r]
            if s >= Int64(0):
                a = x_addr + s // Int64(top_k) * Int64(k * 2)
        src[j] = a


@cute.jit
def produce_gathered(mainloop: pipeline.PipelineTmaAsync, tma_atom_b: cute.CopyAtom, m_b: cute.Tensor,
                     m_slot: cute.Tensor, x_addr: Int64, zero_addr: Int64, top_k: Int32, s_a: cute.Tensor,
                     a_outer: cute.Layout, s_b: cute.Tensor, s_offs: cute.Tensor, n_groups: Int32,
                     m_rows: Int32, t: Int32,
                     n_ctas: Int32, warp_idx: Int32, ptid: Int32, n_tiles_n: Constexpr[int],
                     k: Constexpr[int], k_tiles: Constexpr[int], bn: Constexpr[int],
                     stages: Constexpr[int], cm: Constexpr[int] = 1, rank: Int32 | int = 0) -> None:
    """The producer warpgroup with A gathered: warp 0 arms each stage and TMA-loads B; every thread copies
    its A chunks with cp.async (zero chunks past K), and arrives on a stage once its copies have landed and
    are fenced, gather_lag stages later, so the consumers need no fence of their own."""
    atom = chunk_atom()
    s_b_flat = cute.group_modes(s_b, 0, 2)
    a_base = cast(Pointer, s_a.iterator).toint()
    c8 = ptid % CHUNKS
    rb = ptid // CHUNKS
    src = cute.make_rmem_tensor(GATHER_ROWS, Int64)
    lag = gather_lag(stages)
    e, g_start, g_end, before, here = first_unit(s_offs, n_groups, m_rows, t, n_tiles_n, cm)
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    while e <= n_groups:
        if e < n_groups:
            n_tile, row0 = _tile_at(t, before, g_start, n_tiles_n, cm, rank)
            _gather_sources(m_slot, row0, g_end, top_k, rb, x_addr, k, zero_addr, src)
            g_b = cute.local_tile(m_b[(None, None, e)], (bn, BK), (n_tile, None))
            t_sb, t_gb = cpasync.tma_partition(tma_atom_b, rank, cute.make_layout(cm), s_b_flat,
                                               cute.group_modes(g_b, 0, 2))
            for kt in range(k_tiles):
                arm_stage(mainloop, state, warp_idx, tma_atom_b, t_gb[(None, kt)],
                          t_sb[(None, state.index)], cm)
                col = kt * BK + c8 * VEC
                for j in range_constexpr(GATHER_ROWS):
                    g = zero_addr
                    if col < k and src[j] != zero_addr:
                        g = src[j] + Int64(col * 2)
                    r = rb + GATHER_ROW_STEP * j
                    copy_chunk(atom, g, a_base + swizzled(a_outer((r, c8 * VEC, state.index)) * 2))
                commit_stage(mainloop, state, lag, stages)
                state.advance()
        t = t + n_ctas
        e, g_start, g_end, before, here = _seek(s_offs, n_groups, m_rows, t, e, g_start, g_end, before, here,
                                                n_tiles_n, cm)
    land_all(mainloop, state, lag, stages)
    if warp_idx == 0:
        mainloop.producer_tail(state)


@cute.kernel
def grouped_gemm_gather_kernel(
    tma_atom_b: cute.CopyAtom, m_b: cute.Tensor, tma_atom_d: cute.CopyAtom, tma_d: cute.Tensor,
    m_d: cute.Tensor, m_act: cute.Tensor, tma_atom_act: cute.CopyAtom, tma_act: cute.Tensor,
    m_offs: cute.Tensor, m_slot: cute.Tensor, x_addr: Int64,
    zero_addr: Int64, top_k: Int32, m_rows: Int32, n_groups: Int32, tiled_mma: cute.TiledMma,
    a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout, d_layout: cute.ComposedLayout,
    n: Constexpr[int], k: Constexpr[int], bn: Constexpr[int], stages: Constexpr[int], act: Constexpr[str],
) -> None:
    tidx, warp_idx, unit, n_units, rank, s_offs, s_a, s_b, s_d, s_act, mainloop = fwd_cta_begin(
        (tma_atom_b, tma_atom_d, tma_atom_act), m_offs, n_groups, a_layout, b_layout, d_layout, stages, "b",
        GATHER_CLUSTER_M, act)
    n_tiles_n = n_tiles_n_of(n, bn)
    k_tiles = n_k_tiles(k)
    if warp_idx < 4:
        cute.arch.setmaxregister_decrease(PRODUCER_REGS)
        produce_gathered(mainloop, tma_atom_b, m_b, m_slot, x_addr, zero_addr, top_k, s_a, a_layout.outer,
                         s_b, s_offs, n_groups, m_rows, unit, n_units, warp_idx, tidx, n_tiles_n, k, k_tiles,
                         bn, stages, GATHER_CLUSTER_M, rank)
    else:
        consume_tiles(mainloop, tiled_mma, s_a, s_b, s_d, s_offs, tma_atom_d, tma_d, m_d, m_act, s_act,
                      tma_atom_act, tma_act, n_groups,
                      m_rows, tidx, warp_idx, n_units, unit, n, bn, k_tiles,
                      stages, act, GATHER_CLUSTER_M, rank)


@cute.jit
def grouped_gemm_gather_host(
    px: Pointer, pzero: Pointer, pslot: Pointer, pw: Pointer, py: Pointer, pa: Pointer, poffs: Pointer,
    top_k: Int32, m_rows: Int32, n_groups: Int32, n_ctas: Int32, stream: cuda.CUstream, n: Constexpr[int],
    k: Constexpr[int], bn: Constexpr[int], w_k_major: Constexpr[bool], act: Constexpr[str],
) -> None:
    """y[p, n] = x[slot[p] // top_k] @ B_e^T for permuted row p of group e (B_e = w[e] K-major [E, n, k],
    else w[e]^T of w [E, k, n]: the dgrad), zero rows where slot[p] = -1; with act != "none" also
    a = act(y). The permuted copy of x is never written."""
    stages = stages_for(bn, act)
    (m_y, m_a, m_offs, tiled_mma, a_layout, b_layout, tma_atom_b, tma_b, tma_atom_d, tma_d, tma_atom_act,
     tma_act) = _gemm_setup(
        pw, py, pa, poffs, m_rows, n_groups, n, k, bn, stages, w_k_major, act, GATHER_CLUSTER_M)
    m_slot = cute.make_tensor(pslot, cute.make_layout(m_rows))
    grouped_gemm_gather_kernel(
        tma_atom_b, tma_b, tma_atom_d, tma_d, m_y, m_a, tma_atom_act, tma_act, m_offs, m_slot,
        Int64(px.toint()),
        Int64(pzero.toint()), top_k, m_rows,
        n_groups, tiled_mma, a_layout, b_layout, epi_smem_layout(), n, k, bn, stages, act,
    ).launch(grid=[n_ctas, 1, 1], block=[THREADS, 1, 1], cluster=cluster_dims(GATHER_CLUSTER_M),
             min_blocks_per_mp=1, stream=stream)


def compile_args_gather(n: int, k: int, bn: int, act: str = "none",
                        w_k_major: bool = True) -> tuple[Any, tuple[Any, ...]]:
    if act not in EPILOGUES or (act != "none" and not w_k_major):
        raise ValueError(f"gathered grouped GEMM epilogue {act!r} (w_k_major={w_k_major}) unsupported; the "
                         f"fwd takes one of {sorted(EPILOGUES)}, the dgrad only 'none'")
    ptrs = (pointer(BFloat16, 0), pointer(BFloat16, 0), pointer(Int64, 0, 8),
            *(pointer(BFloat16, 0) for _ in range(3)), pointer(Int32, 0, 4))
    return grouped_gemm_gather_host, (*ptrs, Int32(0), Int32(0), Int32(0), Int32(0), cuda.CUstream(0), n, k,
                                      bn, w_k_major, act)

