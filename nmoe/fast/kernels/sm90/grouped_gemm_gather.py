"""sm_90a grouped GEMM whose A rows are gathered by index as they load (the up projection from token rows,
the dgrad from dy rows) by 16-byte cp.async beside the B TMA, with the consumers and epilogue of
grouped_gemm. Import after nmoe.fast.runtime.import_cutlass("sm_90a")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Int32, Int64, Uint32
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.typing import Pointer
from cutlass.cutlass_dsl.cutlass import max as dsl_max

from nmoe.fast.kernels.prims import PDL, await_upstream, sel
from nmoe.fast.kernels.sm90.chunkload import (
    SWIZZLE_PERIOD,
    arm_stage,
    chunk_at,
    chunk_offsets,
    commit_stage,
    copy_chunk,
    land_all,
    land_pending,
    spill_chunk,
    swizzled_bases,
    token_at,
)
from nmoe.fast.kernels.sm90.gatherplan import (
    PRODUCER_THREADS,
    ROW_CHUNKS,
    ROWS_PER_THREAD,
    copied_lane,
    copied_lookup,
    copied_row,
    gather_lag,
    queued_lag,
)
from nmoe.fast.kernels.sm90.grouped_gemm import (
    EVICT_LAST,
    _gemm_setup,
    _seek,
    check_deferred,
    check_schedule,
    cluster_dims,
    consume_tiles,
    first_unit,
    fwd_cta_begin,
    n_k_tiles,
    n_tiles_n_of,
    no_spill,
    pointer,
    unit_tile,
)
from nmoe.fast.kernels.sm90.tilequeue import QUEUE_DEPTH, next_unit
from nmoe.fast.kernels.sm90.tiles import (
    CONSUMER_WGS,
    EPILOGUES,
    PRODUCER_REGS,
    THREADS,
    VEC,
    WG_THREADS,
    epi_sets,
    epi_smem_layout,
    stages_for,
)
from nmoe.fast.limits import GEMM_BK as BK
from nmoe.fast.limits import GEMM_BM as BM
from nmoe.fast.limits import GEMM_GATHER_B_EVICT_LAST as GATHER_B_EVICT_LAST

GATHER_B_POLICY = EVICT_LAST if GATHER_B_EVICT_LAST else 0


@cute.jit
def _tile_tokens(m_slot: cute.Tensor, row0: Int32, g_end: Int32, top_k: Int32, ptid: Int32,
                 toks: cute.Tensor, sizes: cute.Tensor) -> None:
    """Tokens (slot // top_k, 0 where none) and source bytes (16, or 0 for pad rows and rows past the group)
    of a copying thread's rows copied_row(ptid, i), each looked up by one of the row's threads."""
    lane = ptid % 32
    tok = token_at(m_slot, row0 + copied_lookup(ptid), g_end, top_k)
    for i in range_constexpr(ROWS_PER_THREAD):
        t = cute.arch.shuffle_sync(tok, copied_lane(lane, i))
        toks[i] = dsl_max(t, Int32(0))
        sizes[i] = sel(t >= 0, 16, 0)


@cute.jit
def produce_rows(mainloop: pipeline.PipelineTmaAsync, tma_atom_b: cute.CopyAtom, m_b: cute.Tensor,
                 x_addr: Int64, m_slot: cute.Tensor, top_k: Int32, s_a: cute.Tensor, a_outer: cute.Layout,
                 s_b: cute.Tensor, s_offs: cute.Tensor, n_groups: Int32, m_rows: Int32, t: Int32,
                 n_ctas: Int32, warp_idx: Int32, ptid: Int32, n_tiles_n: Constexpr[int],
                 k_tiles: Constexpr[int], k: Constexpr[int], bn: Constexpr[int], stages: Constexpr[int],
                 q: Any = None, m_count: cute.Tensor | None = None) -> None:
    """The producer warpgroup: thread p copies chunk p % 8 of tile rows p // 8 + 16 i by 16-byte cp.async,
    their tokens looked up once per tile, so a chunk costs one wide multiply-add and the copy and the TMA
    unit carries only B (one TMA per 128-byte row had set the pace at H = 4096: 0.84-0.93x its time)."""
    s_b_flat = cute.group_modes(s_b, 0, 2)
    lane = ptid % 32
    steps, stage_bytes = chunk_offsets(lambda crd: a_outer((crd[1], crd[0], crd[2])), ROW_CHUNKS,
                                       32 // ROW_CHUNKS, ROWS_PER_THREAD, stages)
    c = ptid % ROW_CHUNKS * VEC
    at = swizzled_bases(cast(Pointer, s_a.iterator).toint(), a_outer((copied_row(ptid, 0), c, 0)) * 2, steps)
    x_col = x_addr + Int64(c * 2)
    toks = cute.make_rmem_tensor(ROWS_PER_THREAD, Int32)
    sizes = cute.make_rmem_tensor(ROWS_PER_THREAD, Int32)
    dynamic = q is not None
    lag = queued_lag(stages, QUEUE_DEPTH) if const_expr(dynamic) else gather_lag(stages)
    fills = warp_idx == 0
    qstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, QUEUE_DEPTH)
    rstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, QUEUE_DEPTH)
    if const_expr(dynamic):
        t, qstate, rstate = next_unit(q, m_count, fills, qstate, rstate, lane, 1)
    e, g_start, g_end, before, here = first_unit(s_offs, n_groups, m_rows, t, n_tiles_n)
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    floor = Int32(0)
    while e <= n_groups:
        if e < n_groups:
            n_tile, row0 = unit_tile(t, before, g_start, n_tiles_n)
            _tile_tokens(m_slot, row0, g_end, top_k, ptid, toks, sizes)
            g_b = cute.local_tile(m_b[(None, None, e)], (bn, BK), (n_tile, None))
            t_sb, t_gb = cpasync.tma_partition(tma_atom_b, 0, cute.make_layout(1), s_b_flat,
                                               cute.group_modes(g_b, 0, 2))
            for kt in range(k_tiles):
                arm_stage(mainloop, state, warp_idx, tma_atom_b, t_gb[(None, kt)], t_sb[(None, state.index)],
                          1, GATHER_B_POLICY)
                g_kt = x_col + Int64(kt * BK * 2)
                s_stage = state.index * stage_bytes
                live = Int32(16)
                if const_expr(k % BK):
                    live = sel(kt * BK + c < k, 16, 0)
                for i in range_constexpr(ROWS_PER_THREAD):
                    size = sizes[i]
                    if const_expr(k % BK):
                        size = size & live
                    copy_chunk(g_kt + Int64(Uint32(toks[i])) * Int64(k * 2), chunk_at(at, steps[i], s_stage),
                               size)
                commit_stage(mainloop, state, lag, stages, floor)
                state.advance()
        elif const_expr(dynamic):
            floor = land_pending(mainloop, state, lag, stages, floor)
        if const_expr(dynamic):
            t, qstate, rstate = next_unit(q, m_count, fills, qstate, rstate, lane, 1)
        else:
            t = t + n_ctas
        e, g_start, g_end, before, here = _seek(s_offs, n_groups, m_rows, t, e, g_start, g_end, before, here,
                                                n_tiles_n)
    land_all(mainloop, state, lag, stages, floor)
    if warp_idx == 0:
        mainloop.producer_tail(state)


SPILL_ROWS = ROWS_PER_THREAD // CONSUMER_WGS
"""Rows of a K box each consumer thread spills one chunk of: its warpgroup's half, as a producer thread's."""

TileStep = Callable[[Int32, Any], None]


def spill_rows(s_a: cute.Tensor, a_outer: cute.Layout, xp_addr: Int64, k: int, stages: int,
               ctid: Int32, n_tiles: int) -> Callable[[Int32, Int32, Int32], TileStep]:
    """consume_tiles' spill: after box kt's wgmmas, N tile kt % n_tiles's consumer threads copy their chunks
    of its landed rows (before the group's end) to xp [R, k] in permuted order: no pass copies them."""
    steps, stage_bytes = chunk_offsets(lambda crd: a_outer((crd[1], crd[0], crd[2])), ROW_CHUNKS,
                                       32 // ROW_CHUNKS, SPILL_ROWS, stages)
    half_bytes = a_outer((BM // CONSUMER_WGS, 0, 0)) * 2
    if half_bytes % SWIZZLE_PERIOD:
        raise ValueError(f"gathered spill: a warpgroup's half stage starts {half_bytes} bytes in, not at a "
                         "whole swizzle period")
    wtid, wg = ctid % WG_THREADS, ctid // WG_THREADS
    c = wtid % ROW_CHUNKS * VEC
    at = swizzled_bases(cast(Pointer, s_a.iterator).toint(), a_outer((copied_row(wtid, 0), c, 0)) * 2, steps)
    half = wg * half_bytes
    first = wg * (BM // CONSUMER_WGS) + copied_row(wtid, 0)
    pitch = PRODUCER_THREADS // ROW_CHUNKS

    def tile(row0: Int32, n_tile: Int32, g_end: Int32) -> TileStep:
        rows = [row0 + first + pitch * i for i in range(SPILL_ROWS)]
        on = [sel(r < g_end, 1, 0) for r in rows]
        dst = [xp_addr + Int64(r) * Int64(k * 2) + Int64(c * 2) for r in rows]

        def box(stage: Int32, kt: Any) -> None:
            s_stage = stage * stage_bytes + half
            tail = sel(kt * BK + c < k, 1, 0) if k % BK else 1
            owner = sel(kt % n_tiles == n_tile, 1, 0) if n_tiles > 1 else 1
            for i in range(SPILL_ROWS):
                spill_chunk(chunk_at(at, steps[i], s_stage), dst[i] + Int64(kt * BK * 2),
                            on[i] & tail & owner)

        return box

    return tile


@cute.kernel
def grouped_gemm_gather_kernel(
    tma_atom_b: cute.CopyAtom, m_b: cute.Tensor, tma_atom_d: cute.CopyAtom, tma_d: cute.Tensor,
    m_d: cute.Tensor, m_act: cute.Tensor, tma_atom_act: cute.CopyAtom, tma_act: cute.Tensor,
    m_offs: cute.Tensor, m_slot: cute.Tensor, top_k: Int32, m_rows: Int32, n_groups: Int32,
    tiled_mma: cute.TiledMma, a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout,
    d_layout: cute.ComposedLayout, n: Constexpr[int], k: Constexpr[int], bn: Constexpr[int],
    stages: Constexpr[int], act: Constexpr[str], pingpong: Constexpr[bool], keep_h: Constexpr[bool],
    deferred: Constexpr[bool], m_count: cute.Tensor, dynamic: Constexpr[bool], x_addr: Int64, xp_addr: Int64,
    spill: Constexpr[bool],
) -> None:
    await_upstream()
    tidx, warp_idx, unit, n_units, rank, s_offs, s_a, s_b, s_d, s_act, mainloop, q = fwd_cta_begin(
        (tma_atom_b, tma_atom_d, tma_atom_act), m_offs, n_groups, a_layout, b_layout, d_layout, stages, "b",
        1, act, pingpong, 4 if dynamic else 0)
    n_tiles_n = n_tiles_n_of(n, bn)
    k_tiles = n_k_tiles(k)
    if warp_idx < 4:
        cute.arch.setmaxregister_decrease(PRODUCER_REGS)
        produce_rows(mainloop, tma_atom_b, m_b, x_addr, m_slot, top_k, s_a, a_layout.outer, s_b, s_offs,
                     n_groups, m_rows, unit, n_units, warp_idx, tidx, n_tiles_n, k_tiles, k, bn, stages, q,
                     m_count)
    else:
        spiller: Callable[[Int32, Int32, Int32], TileStep] = no_spill
        if const_expr(spill):
            spiller = spill_rows(s_a, a_layout.outer, xp_addr, k, stages, tidx - WG_THREADS, n_tiles_n)
        consume_tiles(mainloop, tiled_mma, s_a, s_b, s_d, s_offs, tma_atom_d, tma_d, m_d, m_act, s_act,
                      tma_atom_act, tma_act, n_groups, m_rows, tidx, warp_idx, n_units, unit, n, bn, k_tiles,
                      stages, act, 1, rank, pingpong, keep_h, deferred, q, spiller)


@cute.jit
def grouped_gemm_gather_host(
    px: Pointer, pslot: Pointer, pw: Pointer, py: Pointer, pa: Pointer, poffs: Pointer, pcount: Pointer,
    pxp: Pointer, top_k: Int32, m_rows: Int32, n_groups: Int32, n_ctas: Int32, stream: cuda.CUstream,
    n: Constexpr[int], k: Constexpr[int], bn: Constexpr[int], w_k_major: Constexpr[bool], act: Constexpr[str],
    pingpong: Constexpr[bool], keep_h: Constexpr[bool], deferred: Constexpr[bool], dynamic: Constexpr[bool],
    spill: Constexpr[bool],
) -> None:
    """y[p, n] = x[slot[p] // top_k] @ B_e^T for permuted row p of group e, zero rows where slot[p] = -1; x's
    rows are gathered as they load, so the permuted copy of x is never written (spill: written to xp [R, k]
    beside the MMAs, every group's rows, where the wgrad wants it)."""
    # x is [*, k]; B_e = w[e] for K-major w [E, n, k], else w[e]^T of w [E, k, n] (the dgrad). With act !=
    # "none" it also writes a = act(y), and y is not stored unless keep_h. deferred: each tile's epilogue
    # leaves under the next tile's wgmmas (grouped_gemm's Pending). dynamic: units taken from the zeroed
    # counter at pcount, in order, as CTAs free up, instead of every n_ctas-th.
    stages = stages_for(bn, act, pingpong)
    (m_y, m_a, m_offs, tiled_mma, a_layout, b_layout, tma_atom_b, tma_b, tma_atom_d, tma_d, tma_atom_act,
     tma_act) = _gemm_setup(pw, py, pa, poffs, m_rows, n_groups, n, k, bn, stages, w_k_major, act, 1,
                            pingpong)
    m_slot = cute.make_tensor(pslot, cute.make_layout(m_rows))
    m_count = cute.make_tensor(pcount, cute.make_layout(1))
    grouped_gemm_gather_kernel(
        tma_atom_b, tma_b, tma_atom_d, tma_d, m_y, m_a, tma_atom_act, tma_act, m_offs, m_slot, top_k, m_rows,
        n_groups, tiled_mma, a_layout, b_layout, epi_smem_layout(epi_sets(pingpong)), n, k, bn, stages, act,
        pingpong, keep_h, deferred, m_count, dynamic, Int64(px.toint()), Int64(pxp.toint()), spill,
    ).launch(grid=[n_ctas, 1, 1], block=[THREADS, 1, 1], cluster=cluster_dims(1), min_blocks_per_mp=1,
             stream=stream, use_pdl=PDL)


def compile_args_gather(n: int, k: int, bn: int, act: str = "none", w_k_major: bool = True,
                        pingpong: bool = False, keep_h: bool = True, deferred: bool = False,
                        dynamic: bool = False, spill: bool = False) -> tuple[Any, tuple[Any, ...]]:
    if act not in EPILOGUES or (act != "none" and not w_k_major):
        raise ValueError(f"gathered grouped GEMM epilogue {act!r} (w_k_major={w_k_major}) unsupported; the "
                         f"fwd takes one of {sorted(EPILOGUES)}, the dgrad only 'none'")
    if not keep_h and act == "none":
        raise ValueError("gathered grouped GEMM without h (keep_h=False) needs an activation epilogue: with "
                         "act 'none' it would store nothing")
    if spill and (w_k_major or pingpong):
        raise ValueError("gathered grouped GEMM spill writes the dgrad's dy rows (w_k_major=False) from the "
                         f"cooperative consumers; got w_k_major={w_k_major}, pingpong={pingpong}")
    ptrs = (pointer(BFloat16, 0), pointer(Int64, 0, 8), *(pointer(BFloat16, 0) for _ in range(3)),
            pointer(Int32, 0, 4), pointer(Int32, 0, 4), pointer(BFloat16, 0))
    check_schedule(bn, pingpong, act)
    check_deferred(deferred, pingpong)
    return grouped_gemm_gather_host, (*ptrs, *(Int32(0) for _ in range(4)), cuda.CUstream(0), n, k, bn,
                                      w_k_major, act, pingpong, keep_h, deferred, dynamic, spill)
