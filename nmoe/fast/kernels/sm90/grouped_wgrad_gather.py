"""sm_90a gathered wgrad: dw[e] = dy[rows of e]^T @ x[rows of e] with one side read from token-major rows
through permute's slot by cp.async (no permuted copy), the other by TMA; the consumers and the tile plan are
grouped_gemm_wgrad's. Import only after runtime.import_cutlass("sm_90a")."""

from __future__ import annotations

from typing import Any, cast

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.typing import Pointer
from cutlass.cutlass_dsl.cutlass import max as dsl_max

from nmoe.fast.kernels.prims import PDL, await_upstream, sel
from nmoe.fast.kernels.sm90.chunkload import (
    arm_stage,
    chunk_at,
    chunk_offsets,
    commit_stage,
    copy_chunk,
    land_all,
    land_pending,
    swizzled,
    swizzled_bases,
    token_at,
)
from nmoe.fast.kernels.sm90.gatherplan import (
    gather_lag,
    gather_lanes,
    own_row,
    queued_lag,
    source_lane,
)
from nmoe.fast.kernels.sm90.grouped_gemm import cta_setup, cta_start
from nmoe.fast.kernels.sm90.grouped_gemm_wgrad import (
    Units,
    consume_wgrad,
    dw_out,
    dw_out_transposed,
    mn_major_setup,
    n_rounds,
    plan_units,
    pointer,
    snake_tile,
    split_tensors,
    stages_for,
    wgrad_tile,
)
from nmoe.fast.kernels.sm90.tilequeue import QUEUE_DEPTH, TileQueue, next_unit, tile_queue
from nmoe.fast.kernels.sm90.tiles import PRODUCER_REGS, THREADS, VEC
from nmoe.fast.limits import GEMM_BK as BK
from nmoe.fast.limits import GEMM_BM as BM
from nmoe.fast.limits import GEMM_WGRAD_GATHER_LEAN


@cute.jit
def _slot_at(m_slot: cute.Tensor, row: Int32, end: Int32) -> Int64:
    s = Int64(-1)
    if row < end:
        s = Int64(m_slot[row])
    return s


@cute.jit
def _gather_tile(u: Units, t: Int32, m_t: cute.Tensor, tma_atom: cute.CopyAtom, s_t_flat: cute.Tensor,
                 c: Int32, bn: Constexpr[int], side: Constexpr[str]) -> tuple[Any, Any, Any, Any, Any]:
    """Tile t's rows [start, end), the first gathered column of the thread at chunk column c, and the TMA
    side's shared and global boxes."""
    _, m_tile, n_tile, start, end, _, _, _ = wgrad_tile(u, t)
    if const_expr(side == "b"):
        g_t = cute.local_tile(cute.domain_offset((0, start), m_t), (BM, BK), (m_tile, None))
        col = n_tile * bn + c
    else:
        g_t = cute.local_tile(cute.domain_offset((0, start), m_t), (bn, BK), (n_tile, None))
        col = m_tile * BM + c
    t_st, t_gt = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), s_t_flat,
                                       cute.group_modes(g_t, 0, 2))
    return start, end, col, t_st, t_gt


@cute.jit
def produce_wgrad_gathered(mainloop: pipeline.PipelineTmaAsync, tma_atom: cute.CopyAtom, m_t: cute.Tensor,
                           m_slot: cute.Tensor, src_addr: Int64, zero_addr: Int64, top_k: Constexpr[int],
                           s_t: cute.Tensor, s_g: cute.Tensor, g_outer: cute.Layout, u: Units, bidx: Int32,
                           n_ctas: Int32, warp_idx: Int32, ptid: Int32, width: Constexpr[int],
                           bn: Constexpr[int], side: Constexpr[str], stages: Constexpr[int]) -> None:
    """One operand from token-major rows (side "b": x, "a": dy), the other by TMA (warp 0): one lane per row
    looks up its source a stage ahead (slot // top_k), shuffled to the lanes that cp.async its 16-byte chunks;
    pad rows and rows past the group land zero-filled, reading nothing; each stage lands gather_lag later."""
    s_t_flat = cute.group_modes(s_t, 0, 2)
    g_base = cast(Pointer, s_g.iterator).toint()
    box = bn if const_expr(side == "b") else BM
    per_row = box // VEC
    q, _, n_chunks = gather_lanes(per_row)
    lane = ptid % 32
    mine = own_row(lane, ptid // 32, q)
    c = (lane % per_row) * VEC
    row_bytes = Int64(width * 2)
    slot = cute.make_rmem_tensor(1, Int64)
    lag = gather_lag(stages)
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    for rnd in range(n_rounds(u.total, n_ctas)):
        t = snake_tile(rnd, bidx, n_ctas)
        if t < u.total:
            start, end, col, t_st, t_gt = _gather_tile(u, t, m_t, tma_atom, s_t_flat, c, bn, side)
            slot[0] = _slot_at(m_slot, start + mine, end)
            for kt in range((end - start + BK - 1) // BK):
                arm_stage(mainloop, state, warp_idx, tma_atom, t_gt[(None, kt)], t_st[(None, state.index)])
                s = slot[0]
                slot[0] = _slot_at(m_slot, start + (kt + 1) * BK + mine, end)
                src = zero_addr
                if s >= Int64(0):
                    src = src_addr + s // Int64(top_k) * row_bytes
                for i in range_constexpr(n_chunks):
                    a = cute.arch.shuffle_sync(src, source_lane(i, lane, per_row, q))
                    g = zero_addr
                    size = Int32(0)
                    if col < width and a != zero_addr:
                        g = a + Int64(col * 2)
                        size = Int32(16)
                    rr = ptid // per_row + 4 * q * i
                    copy_chunk(g, g_base + swizzled(g_outer((c, rr, state.index)) * 2), size)
                commit_stage(mainloop, state, lag, stages)
                state.advance()
    land_all(mainloop, state, lag, stages)
    if warp_idx == 0:
        mainloop.producer_tail(state)


@cute.jit
def _lean_tile(mainloop: pipeline.PipelineTmaAsync, state: Any, u: Units, t: Int32, tma_atom: cute.CopyAtom,
               m_t: cute.Tensor, s_t_flat: cute.Tensor, m_slot: cute.Tensor, src_addr: Int64,
               top_k: Constexpr[int], tok: cute.Tensor, at: Any, steps: Any, stage_bytes: Constexpr[int],
               mine: Int32, c: Int32, lane: Int32, warp_idx: Int32, width: Constexpr[int],
               per_row: Constexpr[int], q: Constexpr[int], n_chunks: Constexpr[int], bn: Constexpr[int],
               side: Constexpr[str], stages: Constexpr[int], lag: Constexpr[int],
               floor: Int32 | int = 0) -> Any:
    """Every K box of tile t (returns the advanced state: a loop carries only the names it assigns)."""
    box = bn if const_expr(side == "b") else BM
    start, end, col, t_st, t_gt = _gather_tile(u, t, m_t, tma_atom, s_t_flat, c, bn, side)
    live = Int32(16)
    if const_expr(width % box):
        live = sel(col < width, 16, 0)
    row0 = src_addr + Int64(col * 2)
    tok[0] = token_at(m_slot, start + mine, end, top_k)
    for kt in range((end - start + BK - 1) // BK):
        arm_stage(mainloop, state, warp_idx, tma_atom, t_gt[(None, kt)], t_st[(None, state.index)])
        here = tok[0]
        tok[0] = token_at(m_slot, start + (kt + 1) * BK + mine, end, top_k)
        s_stage = state.index * stage_bytes
        for i in range_constexpr(n_chunks):
            r = cute.arch.shuffle_sync(here, source_lane(i, lane, per_row, q))
            size = Int32(0)
            if r >= 0:
                size = live
            g = row0 + Int64(Uint32(dsl_max(r, Int32(0)))) * Int64(width * 2)
            copy_chunk(g, chunk_at(at, steps[i], s_stage), size)
        commit_stage(mainloop, state, lag, stages, floor)
        state.advance()
    return state


@cute.jit
def produce_wgrad_lean(mainloop: pipeline.PipelineTmaAsync, tma_atom: cute.CopyAtom, m_t: cute.Tensor,
                       m_slot: cute.Tensor, src_addr: Int64, top_k: Constexpr[int], s_t: cute.Tensor,
                       s_g: cute.Tensor, g_outer: cute.Layout, u: Units, bidx: Int32, n_ctas: Int32,
                       warp_idx: Int32, ptid: Int32, width: Constexpr[int], bn: Constexpr[int],
                       side: Constexpr[str], stages: Constexpr[int], tq: TileQueue | None = None,
                       m_count: cute.Tensor | None = None) -> None:
    """produce_wgrad_gathered's copies in fewer instructions: a 32-bit token shuffled per chunk, its row's
    address one wide multiply-add, its shared offset a constant plus one of a thread's few swizzled bases.
    With a queue tq, tiles come from the device counter (warp 0 fills the ring) instead of snake rounds."""
    # The gathered wgrad's producer is issue-bound: under ncu its time tracked its instruction count.
    s_t_flat = cute.group_modes(s_t, 0, 2)
    box = bn if const_expr(side == "b") else BM
    per_row = box // VEC
    q, _, n_chunks = gather_lanes(per_row)
    lane = ptid % 32
    mine = own_row(lane, ptid // 32, q)
    c = (lane % per_row) * VEC
    steps, stage_bytes = chunk_offsets(g_outer, per_row, q, n_chunks, stages)
    first = g_outer((c, ptid // per_row, 0)) * 2
    s_base = cast(Pointer, s_g.iterator).toint()
    at = swizzled_bases(s_base, first, steps)
    tok = cute.make_rmem_tensor(1, Int32)
    lag = gather_lag(stages) if const_expr(tq is None) else queued_lag(stages, QUEUE_DEPTH)
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    if const_expr(tq is None):
        for rnd in range(n_rounds(u.total, n_ctas)):
            t = snake_tile(rnd, bidx, n_ctas)
            if t < u.total:
                state = _lean_tile(mainloop, state, u, t, tma_atom, m_t, s_t_flat, m_slot, src_addr, top_k,
                                   tok, at, steps, stage_bytes, mine, c, lane, warp_idx, width, per_row, q,
                                   n_chunks, bn, side, stages, lag)
        land_all(mainloop, state, lag, stages)
    else:
        fills = warp_idx == 0
        counter = u.n_groups * u.tiles_per_group
        qstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, QUEUE_DEPTH)
        rstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, QUEUE_DEPTH)
        floor = Int32(0)
        t, qstate, rstate = next_unit(tq, m_count, fills, qstate, rstate, lane, 1, counter)
        while t < u.total:
            issued = state.count
            state = _lean_tile(mainloop, state, u, t, tma_atom, m_t, s_t_flat, m_slot, src_addr, top_k,
                               tok, at, steps, stage_bytes, mine, c, lane, warp_idx, width, per_row, q,
                               n_chunks, bn, side, stages, lag, floor)
            if state.count == issued:
                floor = land_pending(mainloop, state, lag, stages, floor)
            t, qstate, rstate = next_unit(tq, m_count, fills, qstate, rstate, lane, 1, counter)
        land_all(mainloop, state, lag, stages, floor)
    if warp_idx == 0:
        mainloop.producer_tail(state)


@cute.jit
def _produce(mainloop: pipeline.PipelineTmaAsync, tma_atom: cute.CopyAtom, m_t: cute.Tensor,
             m_slot: cute.Tensor, src_addr: Int64, zero_addr: Int64, top_k: Constexpr[int], s_t: cute.Tensor,
             s_g: cute.Tensor, g_outer: cute.Layout, u: Units, bidx: Int32, n_ctas: Int32, warp_idx: Int32,
             ptid: Int32, width: Constexpr[int], bn: Constexpr[int], side: Constexpr[str],
             stages: Constexpr[int], tq: TileQueue | None, m_count: cute.Tensor) -> None:
    if const_expr(GEMM_WGRAD_GATHER_LEAN):
        produce_wgrad_lean(mainloop, tma_atom, m_t, m_slot, src_addr, top_k, s_t, s_g, g_outer, u, bidx,
                           n_ctas, warp_idx, ptid, width, bn, side, stages, tq, m_count)
    else:
        assert tq is None, "the gathered wgrad's old producer deals its tiles in snake rounds only"
        produce_wgrad_gathered(mainloop, tma_atom, m_t, m_slot, src_addr, zero_addr, top_k, s_t, s_g,
                               g_outer, u, bidx, n_ctas, warp_idx, ptid, width, bn, side, stages)


@cute.kernel
def grouped_wgrad_gather_kernel(
    tma_atom: cute.CopyAtom, m_t: cute.Tensor, m_slot: cute.Tensor, src_addr: Int64, zero_addr: Int64,
    tma_atom_d: cute.CopyAtom, tma_d: cute.Tensor, m_d: cute.Tensor, m_offs: cute.Tensor,
    m_ws: cute.Tensor, m_count: cute.Tensor,
    m_rows: Int32, n_groups: Int32, thresh: Int32, split_rows: Int32, tiled_mma: cute.TiledMma,
    a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout, d_layout: cute.ComposedLayout,
    n: Constexpr[int], k: Constexpr[int], bn: Constexpr[int], top_k: Constexpr[int],
    side: Constexpr[str], stages: Constexpr[int], accumulate: Constexpr[bool], transposed: Constexpr[bool],
    dynamic: Constexpr[bool],
) -> None:
    await_upstream()
    tidx, bidx, n_ctas, warp_idx = cta_start((tma_atom, tma_atom_d))
    s_offs, s_a, s_b, s_d, mainloop = cta_setup(m_offs, n_groups, BFloat16, a_layout, b_layout, d_layout,
                                                stages, "a" if const_expr(side == "b") else "b", 3)
    tq = tile_queue(4) if const_expr(dynamic) else None
    u = plan_units(s_offs, n_groups, m_rows, thresh, split_rows, tidx, n, k, bn)
    if warp_idx < 4:
        cute.arch.setmaxregister_decrease(PRODUCER_REGS)
        if const_expr(side == "b"):
            _produce(mainloop, tma_atom, m_t, m_slot, src_addr, zero_addr, top_k, s_a, s_b, b_layout.outer, u,
                     bidx, n_ctas, warp_idx, tidx, k, bn, side, stages, tq, m_count)
        else:
            _produce(mainloop, tma_atom, m_t, m_slot, src_addr, zero_addr, top_k, s_b, s_a, a_layout.outer, u,
                     bidx, n_ctas, warp_idx, tidx, n, bn, side, stages, tq, m_count)
    else:
        consume_wgrad(mainloop, tiled_mma, s_a, s_b, s_d, u, m_ws, m_count, tma_atom_d, tma_d, m_d, tidx,
                      warp_idx, bidx, n_ctas, n, k, bn, stages, n, tq, accumulate=accumulate,
                      transposed=transposed)


@cute.jit
def grouped_wgrad_gather_host(
    pt: Pointer, psrc: Pointer, pzero: Pointer, pslot: Pointer, pdw: Pointer, poffs: Pointer, pws: Pointer,
    pcount: Pointer, m_rows: Int32, n_groups: Int32, n_ctas: Int32, thresh: Int32,
    split_rows: Int32, ws_tiles: Int32, stream: cuda.CUstream, n: Constexpr[int], k: Constexpr[int],
    bn: Constexpr[int], side: Constexpr[str], top_k: Constexpr[int], accumulate: Constexpr[bool],
    transposed: Constexpr[bool], dynamic: Constexpr[bool],
) -> None:
    """dw[E, n, k] (transposed: dw[E, k, n]) = (accumulate: dw +=) per group dy[rows, n]^T @ x[rows, k], one
    side read from token-major rows through slot (zero rows where slot = -1): side "b", x[slot // top_k]
    (pt = dy [R, n]); side "a", dy[slot // top_k] (pt = x [R, k]). Neither side is permuted into a copy."""
    stages = stages_for(bn)
    if const_expr(transposed):
        m_dw, tma_atom_d, tma_d = dw_out_transposed(pdw, n_groups, n, k, accumulate)
    else:
        m_dw, tma_atom_d, tma_d = dw_out(pdw, n_groups, n, k, k, n, accumulate)
    m_offs = cute.make_tensor(poffs, cute.make_layout(n_groups))
    m_slot = cute.make_tensor(cute.recast_ptr(pslot, dtype=Int32), cute.make_layout(m_rows, stride=2))
    m_ws, m_count = split_tensors(pws, pcount, ws_tiles, n_groups, n, k, bn)
    tiled_mma, a_layout, b_layout, d_layout = mn_major_setup(bn, stages, transposed)
    if const_expr(side == "b"):
        m_t = cute.make_tensor(pt, cute.make_layout((n, m_rows), stride=(1, n)))
        tma_atom, tma_t = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), m_t, cute.slice_(a_layout, (None, None, 0)), (BM, BK))
    else:
        m_t = cute.make_tensor(pt, cute.make_layout((k, m_rows), stride=(1, k)))
        tma_atom, tma_t = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), m_t, cute.slice_(b_layout, (None, None, 0)), (bn, BK))
    grouped_wgrad_gather_kernel(
        tma_atom, tma_t, m_slot, Int64(psrc.toint()), Int64(pzero.toint()), tma_atom_d, tma_d, m_dw,
        m_offs, m_ws,
        m_count, m_rows, n_groups, thresh, split_rows, tiled_mma, a_layout, b_layout, d_layout, n, k, bn,
        top_k, side, stages, accumulate, transposed, dynamic,
    ).launch(grid=[n_ctas, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=1, stream=stream, use_pdl=PDL)


def compile_args_gather(n: int, k: int, bn: int, side: str, top_k: int, accumulate: bool = False,
                        transposed: bool = False, dynamic: bool = False) -> tuple[Any, tuple[Any, ...]]:
    if side not in ("a", "b"):
        raise ValueError(f"gathered wgrad side {side!r}: 'a' (dy token-major) or 'b' (x token-major)")
    ptrs = (*(pointer(BFloat16, 0) for _ in range(3)), pointer(Int64, 0, 8), pointer(BFloat16, 0),
            pointer(Int32, 0, 4), pointer(Float32, 0), pointer(Int32, 0, 4))
    return grouped_wgrad_gather_host, (*ptrs, *(Int32(0) for _ in range(6)), cuda.CUstream(0), n, k, bn,
                                       side, top_k, accumulate, transposed, dynamic)
