"""sm_90a grouped wgrad dw[e] = dy[rows of e]^T @ x[rows of e]: 64-row TMA boxes start at the group's first
row; consumers zero the last box's rows that belong to the next group before the MMA reads them. Tiles go
heaviest group first, dealt to the CTAs in snake order. Import only after runtime.import_cutlass("sm_90a")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer
from cutlass.cutlass_dsl.cutlass import max as dsl_max
from cutlass.cutlass_dsl.cutlass import min as dsl_min
from cutlass.tensor_utils import LayoutEnum

from nmoe.fast.kernels.prims import PDL, await_upstream
from nmoe.fast.kernels.sm90.epilogue import (
    drain_stores,
    emit_held,
    epilogue_copies,
    hold,
    make_pending,
    store_tile,
    store_tile_transposed,
)
from nmoe.fast.kernels.sm90.grouped_gemm import (
    _k_loop,
    b_tma,
    cluster_dims,
    copy_b,
    cta_setup,
    cta_start,
    mma_fragments,
)
from nmoe.fast.kernels.sm90.tilequeue import (
    QUEUE_DEPTH,
    ClusterQueue,
    TileQueue,
    cluster_queue,
    drain_queue,
    grab_tile,
    hand_tile,
    take_next,
    tile_queue,
)
from nmoe.fast.kernels.sm90.tiles import (
    CONSUMER_REGS,
    CONSUMER_THREADS,
    CONSUMER_WGS,
    EPI_N,
    EPI_SMEM_BYTES,
    PRODUCER_REGS,
    THREADS,
    VEC,
    WG_THREADS,
    epi_smem_layout,
    epi_tma,
    pipeline_stages,
)
from nmoe.fast.limits import GEMM_BK as BK
from nmoe.fast.limits import GEMM_BM as BM
from nmoe.fast.limits import GEMM_MAX_GROUPS as MAX_GROUPS

MASK_BARRIER_ID = 2
PACK = 1 << 16
LOG_GROUPS = MAX_GROUPS.bit_length() - 1
assert 1 << LOG_GROUPS == MAX_GROUPS, "the unit search halves a power-of-two table"


def stages_for(bn: int) -> int:
    """Operand stages beside the fwd's output subtiles and the wgrad's two unit tables."""
    return pipeline_stages((BM + bn) * BK * 2, EPI_SMEM_BYTES + (2 * MAX_GROUPS + 8) * 4)


@cute.jit
def _group_rows(s_offs: cute.Tensor, e: Int32, m_rows: Int32) -> tuple[Int32, Int32]:
    """[start, end) of group e, clamped into [0, m_rows] and ordered so bad offs cannot reach memory."""
    start = Int32(0)
    if e > 0:
        start = dsl_min(dsl_max(s_offs[e - 1], Int32(0)), m_rows)
    end = dsl_max(dsl_min(dsl_max(s_offs[e], Int32(0)), m_rows), start)
    return start, end


def _at(table: cute.Tensor, i: Any) -> Int32:
    return cast(Int32, table[i])


class Units(NamedTuple):
    """A CTA's view of the wgrad's work: the offs and the two rank tables in shared memory, the flag a
    split's counter result is broadcast through, the chunk size, the tile grid, the CTAs of a cluster (side
    by side along M, one work item) and the count of work items: a unit's tiles, cm to an item."""

    s_offs: cute.Tensor
    by_rank: cute.Tensor
    starts: cute.Tensor
    flag: cute.Tensor
    n_groups: Int32
    m_rows: Int32
    split_rows: Int32
    tiles_per_group: int
    tiles_n: int
    cm: int
    total: Int32


@cute.jit
def plan_units(s_offs: cute.Tensor, n_groups: Int32, m_rows: Int32, thresh: Int32, split_rows: Int32,
               tidx: Int32, n: Constexpr[int], k: Constexpr[int], bn: Constexpr[int],
               cm: Constexpr[int] = 1) -> Units:
    """Rank tables of the work units: by_rank[r] = e + PACK * S for the group with the r-th most rows (ties by
    index), cut into S chunks of split_rows rows when it has more than `thresh`; starts[r] = its first unit +
    PACK * its first workspace slice. Heaviest first, so the longest reductions start first."""
    base = cast(Any, s_offs.iterator)
    by_rank = cute.make_tensor(base + MAX_GROUPS, cute.make_layout(MAX_GROUPS))
    starts = cute.make_tensor(base + 2 * MAX_GROUPS, cute.make_layout(MAX_GROUPS + 1))
    flag = cute.make_tensor(base + 3 * MAX_GROUPS + 4, cute.make_layout(1))
    for i in range(tidx, n_groups, THREADS):
        start, end = _group_rows(s_offs, i, m_rows)
        rank = Int32(0)
        for j in range(n_groups):
            s_j, e_j = _group_rows(s_offs, j, m_rows)
            if e_j - s_j > end - start:
                rank += 1
            if e_j - s_j == end - start and j < i:
                rank += 1
        splits = Int32(1)
        if end - start > thresh:
            splits = (end - start + split_rows - 1) // split_rows
        by_rank[rank] = i + PACK * splits
    cute.arch.sync_threads()
    if tidx == 0:
        units = Int32(0)
        slices = Int32(0)
        for r in range(n_groups):
            starts[r] = units + PACK * slices
            splits = _at(by_rank, r) // PACK
            units += splits
            if splits > 1:
                slices += splits
        starts[n_groups] = units + PACK * slices
    cute.arch.sync_threads()
    tiles_n = (k + bn - 1) // bn
    tiles_per_group = ((n + BM - 1) // BM) * tiles_n
    total = (_at(starts, n_groups) % PACK) * (tiles_per_group // cm)
    return Units(s_offs, by_rank, starts, flag, n_groups, m_rows, split_rows, tiles_per_group, tiles_n, cm,
                 cast(Int32, total))


@cute.jit
def n_rounds(total: Int32, n_ctas: Int32) -> Int32:
    """Rounds of the deal: every CTA takes one tile per round, the last round partial."""
    return cast(Int32, (total + n_ctas - 1) // n_ctas)


@cute.jit
def snake_tile(i: Int32, bidx: Int32, n_ctas: Int32) -> Int32:
    """The tile a CTA takes in round i: rounds alternate direction, so the CTA dealt a heavy tile early is
    dealt a light one next."""
    t = i * n_ctas + bidx
    if i % 2 == 1:
        t = i * n_ctas + n_ctas - 1 - bidx
    return cast(Int32, t)


@cute.jit
def dealt_tile(i: Int32, bidx: Int32, n_ctas: Int32, total: Int32) -> Int32:
    """The static deal's tile for round i, or total (none) past the producer's last round, so consumers stop
    where their producer does."""
    t = snake_tile(i, bidx, n_ctas)
    if i >= n_rounds(total, n_ctas):
        t = total
    return cast(Int32, t)


def next_tile(q: TileQueue | ClusterQueue | None, state: Any, rnd: Int32, bidx: Int32, n_ctas: Int32,
              total: Int32, lane: Int32, cm: int = 1) -> tuple[Int32, Any]:
    """The consumers' work item of round rnd: dealt to the clusters in snake order, or the one the producer
    (CTA 0's in a cluster) hands over."""
    if q is None:
        return dealt_tile(rnd, bidx // cm, n_ctas // cm, total), state
    return take_next(q, state, lane)


@cute.jit
def wgrad_tile(u: Units, t: Int32, rank: Int32 | int = 0
                ) -> tuple[Int32, Int32, Int32, Int32, Int32, Int32, Int32, Int32]:
    """CTA `rank`'s tile of work item t: (group, m tile, n tile, first row, end row, the group's chunk count
    S, this chunk's index, the group's first workspace slice); S = 1: the whole group."""
    by_rank, starts = u.by_rank, u.starts
    items = u.tiles_per_group // u.cm
    v = t // items
    local = t - v * items
    r = Int32(0)
    for b in range_constexpr(LOG_GROUPS):
        step = 1 << (LOG_GROUPS - 1 - b)
        if r + step < u.n_groups and _at(starts, r + step) % PACK <= v:
            r += step
    e = _at(by_rank, r) % PACK
    splits = _at(by_rank, r) // PACK
    part = v - _at(starts, r) % PACK
    start, end = _group_rows(u.s_offs, e, u.m_rows)
    if splits > 1:
        start = start + part * u.split_rows
        end = dsl_min(end, start + u.split_rows)
    m_unit = local // u.tiles_n
    m_tile = m_unit
    if const_expr(u.cm > 1):
        m_tile = m_unit * u.cm + rank
    return (cast(Int32, e), m_tile, local - m_unit * u.tiles_n, start, end, cast(Int32, splits),
            cast(Int32, part), cast(Int32, _at(starts, r) // PACK))


@cute.jit
def _split_partial(acc: Any, m_ws: Any, m_count: cute.Tensor, flag: cute.Tensor,
                   counter: Int32, first_slice: Int32, part: Int32, splits: Int32, slice_stride: Int32,
                   local: Int32, ctid: Int32, bar: pipeline.NamedBarrier) -> Int32:
    """A chunk's fp32 partial goes to its workspace slice; the CTA that finishes a tile's last chunk (a
    device-scope counter) sums the slices in chunk order, so the bits never depend on which CTA is last."""
    for v in range_constexpr(cute.size(acc)):
        m_ws[(v, ctid, (first_slice + part) * slice_stride + local)] = acc[v]
    cute.arch.fence_acq_rel_gpu()
    bar.arrive_and_wait()
    if ctid == 0:
        flag[0] = cute.arch.atomic_add((m_count.iterator + counter).llvm_ptr, Int32(1), sem="acq_rel",
                                       scope="gpu")
    bar.arrive_and_wait()
    last = Int32(0)
    if flag[0] == splits - 1:
        last = Int32(1)
        cute.arch.fence_acq_rel_gpu()
        acc.fill(0.0)
        for c in range(splits):
            for v in range_constexpr(cute.size(acc)):
                acc[v] = acc[v] + m_ws[(v, ctid, (first_slice + c) * slice_stride + local)]
    return last


@cute.jit
def _zero_rows(s: cute.Tensor, stage: Int32, valid: Int32, rows: Constexpr[int], ctid: Int32) -> None:
    """Zero s[i, r, stage] for r >= valid by 16-byte stores (scalar ones made the mask the Zipf wgrad's
    largest cost); unswizzled offsets suffice, as the swizzle only permutes the chunks within one row r."""
    base = cast(Pointer, s.iterator).toint()
    per_row = rows // VEC
    zeros = cute.full((VEC,), 0.0, BFloat16)
    for idx in range(ctid, per_row * (BK - valid), CONSUMER_THREADS):
        r = valid + idx // per_row
        c = (idx - (idx // per_row) * per_row) * VEC
        at = base + cast(Int32, s.layout((c, r, stage))) * 2
        cute.make_tensor(cute.make_ptr(BFloat16, at, cute.AddressSpace.smem, assumed_align=16),
                         cute.make_layout(VEC)).store(zeros)


def _tail_mask(s_a: cute.Tensor, s_b: cute.Tensor, rows: Int32, bn: int, ctid: Int32,
               bar: pipeline.NamedBarrier) -> Callable[[Int32, Any], None]:
    """The K loop's step before box kt: _mask_tail of the rows the tile has left."""
    return lambda stage, kt: _mask_tail(s_a, s_b, stage, rows - kt * BK, bn, ctid, bar)


@cute.jit
def _mask_tail(s_a: cute.Tensor, s_b: cute.Tensor, stage: Int32, valid: Int32, bn: Constexpr[int],
               ctid: Int32, bar: pipeline.NamedBarrier) -> None:
    """A box that runs past the group's last row holds the next expert's rows: zero them before the MMA."""
    if valid < BK:
        _zero_rows(s_a, stage, valid, BM, ctid)
        _zero_rows(s_b, stage, valid, bn, ctid)
        cute.arch.fence_proxy("async.shared", space="cta")
        bar.arrive_and_wait()


@cute.jit
def consume_wgrad(mainloop: pipeline.PipelineTmaAsync, tiled_mma: cute.TiledMma, s_a: cute.Tensor,
                  s_b: cute.Tensor, s_d: cute.Tensor, u: Units, m_ws: cute.Tensor, m_count: cute.Tensor,
                  tma_atom_d: cute.CopyAtom, tma_d: cute.Tensor, m_d: cute.Tensor, tidx: Int32,
                  warp_idx: Int32, bidx: Int32, n_ctas: Int32, n: Constexpr[int], k: Constexpr[int],
                  bn: Constexpr[int], stages: Constexpr[int], gs: Constexpr[int], q: Any = None,
                  accumulate: Constexpr[bool] = False, deferred: Constexpr[bool] = False,
                  rank: Int32 | int = 0, transposed: Constexpr[bool] = False) -> None:
    """The two consumer warpgroups of the wgrad: masked K boxes into wgmma, then the fwd's epilogue into dw's
    rows, group e's n from row e * gs (transposed: into dw[e]^T, a [groups, k, n] tensor, by TMA alone)."""
    # A split group's chunk goes first through its workspace slice and counter. deferred: the tile's bf16
    # subtiles leave under the next tile's wgmmas (`Pending`). Work items come in snake rounds or, with a
    # queue q, as the producer hands them over; CTA `rank` of the cluster takes its item's rank-th M tile.
    cute.arch.setmaxregister_increase(CONSUMER_REGS)
    ctid = tidx - WG_THREADS
    t_ra, t_rb, acc_shape = mma_fragments(tiled_mma, s_a, s_b, warp_idx, bn)
    acc = cute.make_rmem_tensor(acc_shape, Float32)

    assert not (deferred and transposed), "a held tile leaves row-major; a transposed one leaves at once"
    epi = epilogue_copies(tiled_mma, acc, s_d, ctid, tma_atom_d, m_major=transposed)
    mask_bar = pipeline.NamedBarrier(barrier_id=MASK_BARRIER_ID, num_threads=CONSUMER_THREADS)

    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    qstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, QUEUE_DEPTH)
    held = None
    if const_expr(deferred):
        held = make_pending(epi, tma_d, m_d, k, bn, accumulate)
    subs = bn // EPI_N
    p_row0, p_tile, p_end, p_on = Int32(0), Int32(0), Int32(0), Int32(0)
    rnd = Int32(0)
    lane = tidx % 32
    t, qstate = next_tile(q, qstate, rnd, bidx, n_ctas, u.total, lane, u.cm)
    while t < u.total:
        e, m_tile, n_tile, start, end, splits, part, first_slice = wgrad_tile(u, t, rank)
        k_tiles = (end - start + BK - 1) // BK
        acc.fill(0.0)
        if k_tiles > 0:
            read, release = _k_loop(mainloop, tiled_mma, acc, t_ra, t_rb, read, release, held, p_row0, p_tile,
                                    p_end, p_on, k_tiles, subs, deferred,
                                    landed=_tail_mask(s_a, s_b, end - start, bn, ctid, mask_bar))
        elif const_expr(deferred):
            emit_held(held, p_row0, p_tile, p_end, p_on, Int32(0), Int32(subs))
        if const_expr(deferred):
            p_on = Int32(0)

        local = m_tile * u.tiles_n + n_tile
        write = Int32(1)
        if splits > 1:
            write = _split_partial(acc, m_ws, m_count, u.flag, e * u.tiles_per_group + local, first_slice,
                                   part, splits, u.tiles_per_group, local, ctid, epi.bar)
        if write == 1:
            if const_expr(deferred):
                hold(held)
                p_row0, p_tile, p_end, p_on = e * gs + m_tile * BM, n_tile, e * gs + n, Int32(1)
            elif const_expr(transposed):
                store_tile_transposed(epi, tma_d, e, m_tile, n_tile, bn)
            else:
                store_tile(epi, tma_d, m_d, m_d, e * gs + m_tile * BM, n_tile, e * gs + n, k, bn, "none",
                           accumulate=accumulate)
        rnd = rnd + 1
        t, qstate = next_tile(q, qstate, rnd, bidx, n_ctas, u.total, lane, u.cm)
    if const_expr(deferred):
        emit_held(held, p_row0, p_tile, p_end, p_on, Int32(0), Int32(subs))
    drain_stores()


@cute.jit
def _load_tile(mainloop: pipeline.PipelineTmaAsync, state: Any, u: Units, t: Int32,
               tma_atom_a: cute.CopyAtom, m_a: cute.Tensor, tma_atom_b: cute.CopyAtom, m_b: cute.Tensor,
               s_a_flat: cute.Tensor, s_b_flat: cute.Tensor, bn: Constexpr[int], rank: Int32 | int = 0
               ) -> Any:
    """The producer warp's TMA loads of every K box of work item t, both operands onto each stage's barrier
    (in a cluster: its own dy box and its 1/cm of the x box, multicast to the cluster); the advanced state is
    returned, as a loop carries only names it assigns or calls methods on."""
    _, m_tile, n_tile, start, end, _, _, _ = wgrad_tile(u, t, rank)
    g_a = cute.local_tile(cute.domain_offset((0, start), m_a), (BM, BK), (m_tile, None))
    g_b = cute.local_tile(cute.domain_offset((0, start), m_b), (bn, BK), (n_tile, None))
    t_sa, t_ga = cpasync.tma_partition(tma_atom_a, 0, cute.make_layout(1), s_a_flat,
                                       cute.group_modes(g_a, 0, 2))
    t_sb, t_gb = cpasync.tma_partition(tma_atom_b, rank, cute.make_layout(u.cm), s_b_flat,
                                       cute.group_modes(g_b, 0, 2))
    for kt in range((end - start + BK - 1) // BK):
        mainloop.producer_acquire(state)
        bar = mainloop.producer_get_barrier(state)
        cute.copy(tma_atom_a, t_ga[(None, kt)], t_sa[(None, state.index)], tma_bar_ptr=bar)
        copy_b(tma_atom_b, t_gb[(None, kt)], t_sb[(None, state.index)], bar, u.cm)
        mainloop.producer_commit(state)
        state.advance()
    return state


@cute.jit
def _produce_dynamic(mainloop: pipeline.PipelineTmaAsync, state: Any, q: TileQueue | ClusterQueue, u: Units,
                     m_count: cute.Tensor, at: Int32, rank: Int32 | int, lane: Int32,
                     tma_atom_a: cute.CopyAtom, m_a: cute.Tensor, tma_atom_b: cute.CopyAtom, m_b: cute.Tensor,
                     s_a_flat: cute.Tensor, s_b_flat: cute.Tensor, bn: Constexpr[int]) -> Any:
    """A dynamic producer warp: alone, or CTA 0's in a cluster, it takes each work item from the counter and
    hands it over (a cluster's ring drained before exit); the other CTAs' read it from their ring. All load
    their share of each item."""
    if rank == 0:
        qstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, QUEUE_DEPTH)
        t = grab_tile(m_count, at, lane)
        qstate = hand_tile(q, qstate, t, lane, u.cm)
        while t < u.total:
            state = _load_tile(mainloop, state, u, t, tma_atom_a, m_a, tma_atom_b, m_b, s_a_flat, s_b_flat,
                               bn, rank)
            t = grab_tile(m_count, at, lane)
            qstate = hand_tile(q, qstate, t, lane, u.cm)
        if const_expr(u.cm > 1):
            drain_queue(q, qstate)
    else:
        rstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, QUEUE_DEPTH)
        t, rstate = take_next(q, rstate, lane)
        while t < u.total:
            state = _load_tile(mainloop, state, u, t, tma_atom_a, m_a, tma_atom_b, m_b, s_a_flat, s_b_flat,
                               bn, rank)
            t, rstate = take_next(q, rstate, lane)
    return state


@cute.kernel
def grouped_wgrad_kernel(
    tma_atom_a: cute.CopyAtom, m_a: cute.Tensor, tma_atom_b: cute.CopyAtom, m_b: cute.Tensor,
    tma_atom_d: cute.CopyAtom, tma_d: cute.Tensor, m_d: cute.Tensor, m_offs: cute.Tensor, m_ws: cute.Tensor,
    m_count: cute.Tensor, m_rows: Int32,
    n_groups: Int32, thresh: Int32, split_rows: Int32,
    tiled_mma: cute.TiledMma, a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout,
    d_layout: cute.ComposedLayout, n: Constexpr[int], k: Constexpr[int], bn: Constexpr[int],
    stages: Constexpr[int], gs: Constexpr[int], dynamic: Constexpr[bool], accumulate: Constexpr[bool],
    deferred: Constexpr[bool], cm: Constexpr[int],
) -> None:
    await_upstream()
    tidx, bidx, n_ctas, warp_idx = cta_start((tma_atom_a, tma_atom_b, tma_atom_d))
    q: Any = None
    rank: Int32 | int = 0
    if const_expr(cm > 1):
        rank = bidx % cm
        if const_expr(dynamic):
            q = cluster_queue(tidx, cm)
    s_offs, s_a, s_b, s_d, mainloop = cta_setup(m_offs, n_groups, BFloat16, a_layout, b_layout, d_layout,
                                                stages, tables=3, cm=cm)
    if const_expr(dynamic and cm == 1):
        q = tile_queue()
    u = plan_units(s_offs, n_groups, m_rows, thresh, split_rows, tidx, n, k, bn, cm)
    s_a_flat = cute.group_modes(s_a, 0, 2)
    s_b_flat = cute.group_modes(s_b, 0, 2)

    if warp_idx < 4:
        cute.arch.setmaxregister_decrease(PRODUCER_REGS)
        if warp_idx == 0:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            if const_expr(dynamic):
                state = _produce_dynamic(mainloop, state, q, u, m_count, n_groups * u.tiles_per_group, rank,
                                         tidx % 32, tma_atom_a, m_a, tma_atom_b, m_b, s_a_flat, s_b_flat, bn)
            else:
                for rnd in range(n_rounds(u.total, n_ctas // cm)):
                    t = snake_tile(rnd, bidx // cm, n_ctas // cm)
                    if t < u.total:
                        state = _load_tile(mainloop, state, u, t, tma_atom_a, m_a, tma_atom_b, m_b,
                                           s_a_flat, s_b_flat, bn, rank)
            mainloop.producer_tail(state)
    else:
        consume_wgrad(mainloop, tiled_mma, s_a, s_b, s_d, u, m_ws, m_count, tma_atom_d, tma_d, m_d, tidx,
                      warp_idx, bidx, n_ctas, n, k, bn, stages, gs, q, accumulate, deferred, rank)


def mn_major_setup(bn: int, stages: int, transposed: bool = False) -> tuple[
        cute.TiledMma, cute.ComposedLayout, cute.ComposedLayout, cute.ComposedLayout]:
    """The wgrad's MMA and shared layouts: both operands MN-major (rows are the reduction), the output
    through the fwd's subtiles (M-contiguous ones when it leaves transposed)."""
    mn_major = LayoutEnum.COL_MAJOR
    tile = (BM, bn, BK)
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        BFloat16, BFloat16, mn_major.sm90_mma_major_mode(), mn_major.sm90_mma_major_mode(), Float32,
        (CONSUMER_WGS, 1, 1), tiler_mn=(64, bn),
    )
    a_layout = sm90_utils.make_smem_layout_a(mn_major, tile, BFloat16, stages)
    b_layout = sm90_utils.make_smem_layout_b(mn_major, tile, BFloat16, stages)
    return tiled_mma, a_layout, b_layout, epi_smem_layout(m_major=transposed)


def dw_out(pdw: Pointer, n_groups: Int32, n: int, k: int, ld: int, gs: int,
            accumulate: bool = False) -> tuple[cute.Tensor, cute.CopyAtom, cute.Tensor]:
    """dw as the rows (ld apart: k columns of a wider dw) the fwd's epilogue stores (accumulate: adds to),
    group e's n rows from row e * gs (gs > n: n rows of a taller dw): a group's tiles never cross into the
    next group's rows, since its row_end is e * gs + n; the rows end at the last group's."""
    m_d = cute.make_tensor(pdw, cute.make_layout(((n_groups - 1) * gs + n, k), stride=(ld, 1)))
    atom, tma_d = epi_tma(m_d, accumulate=accumulate)
    return m_d, atom, tma_d


def dw_out_transposed(pdw: Pointer, n_groups: Int32, n: int, k: int,
                      accumulate: bool = False) -> tuple[cute.Tensor, cute.CopyAtom, cute.Tensor]:
    """dw as a contiguous [groups, k, n] tensor seen as (n, k, group), n contiguous: each group's n x k
    result lands transposed, and TMA bounds every tile by its own group's n and k."""
    m_d = cute.make_tensor(pdw, cute.make_layout((n, k, n_groups), stride=(1, n, n * k)))
    atom, tma_d = epi_tma(m_d, accumulate=accumulate, m_major=True)
    return m_d, atom, tma_d


def split_tensors(pws: Pointer, pcount: Pointer, ws_tiles: Int32, n_groups: Int32, n: int, k: int,
                   bn: int) -> tuple[cute.Tensor, cute.Tensor]:
    """The split's fp32 workspace, [value, consumer thread, slice] (a warp's stores coalesce), and its
    per-tile counters."""
    per = BM * bn // CONSUMER_THREADS
    m_ws = cute.make_tensor(pws, cute.make_layout((per, CONSUMER_THREADS, ws_tiles),
                                                  stride=(CONSUMER_THREADS, 1, per * CONSUMER_THREADS)))
    tiles = ((n + BM - 1) // BM) * ((k + bn - 1) // bn)
    return m_ws, cute.make_tensor(pcount, cute.make_layout(n_groups * tiles + 1))


@cute.jit
def grouped_wgrad_host(
    pdy: Pointer, px: Pointer, pdw: Pointer, poffs: Pointer, pws: Pointer, pcount: Pointer, m_rows: Int32,
    n_groups: Int32, n_ctas: Int32, thresh: Int32, split_rows: Int32, ws_tiles: Int32, stream: cuda.CUstream,
    n: Constexpr[int], k: Constexpr[int], bn: Constexpr[int], ld: Constexpr[int], gs: Constexpr[int],
    dynamic: Constexpr[bool], accumulate: Constexpr[bool], deferred: Constexpr[bool], cm: Constexpr[int],
) -> None:
    """dw[E, n, k] = per group dy[rows, n]^T @ x[rows, k], stored or (accumulate) added to dw, from MN-major
    operand views; dw's rows are ld apart and its groups gs rows apart."""
    # A group of more than thresh rows splits into split_rows chunks: fp32 partials in pws, counters in pcount
    # (zeroed). cm > 1: clusters of cm CTAs on M tiles side by side, each x box multicast to them.
    stages = stages_for(bn)
    m_ws, m_count = split_tensors(pws, pcount, ws_tiles, n_groups, n, k, bn)
    m_dyt = cute.make_tensor(pdy, cute.make_layout((n, m_rows), stride=(1, n)))
    m_xt = cute.make_tensor(px, cute.make_layout((k, m_rows), stride=(1, k)))
    m_dw, tma_atom_d, tma_d = dw_out(pdw, n_groups, n, k, ld, gs, accumulate)
    m_offs = cute.make_tensor(poffs, cute.make_layout(n_groups))

    tiled_mma, a_layout, b_layout, d_layout = mn_major_setup(bn, stages)
    tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), m_dyt, cute.slice_(a_layout, (None, None, 0)), (BM, BK))
    tma_atom_b, tma_b = b_tma(m_xt, b_layout, bn, cm)
    grouped_wgrad_kernel(
        tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_d, tma_d, m_dw, m_offs, m_ws, m_count, m_rows,
        n_groups, thresh, split_rows, tiled_mma, a_layout, b_layout, d_layout, n, k, bn, stages, gs, dynamic,
        accumulate, deferred, cm,
    ).launch(grid=[n_ctas, 1, 1], block=[THREADS, 1, 1], cluster=cluster_dims(cm), min_blocks_per_mp=1,
             stream=stream, use_pdl=PDL)


def check_cluster(n: int, cm: int) -> None:
    """A cluster's CTAs take an item's cm M tiles together, so the M tiles must fill whole items."""
    if cm not in (1, 2, 4) or (n + BM - 1) // BM % cm:
        raise ValueError(f"wgrad cluster of {cm} CTAs over {(n + BM - 1) // BM} M tiles of {BM} rows (dw's "
                         f"{n}): clusters of 1, 2 or 4 whose M tiles fill whole clusters; use cm=1")


def pointer(dtype: Any, address: int, align: int = 16) -> Any:
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def compile_args(n: int, k: int, bn: int, ld: int, gs: int = 0, dynamic: bool = False,
                 accumulate: bool = False, deferred: bool = False,
                 cm: int = 1) -> tuple[Any, tuple[Any, ...]]:
    if gs and gs < n:
        raise ValueError(f"wgrad group row stride {gs} < its rows {n}: groups would overlap")
    check_cluster(n, cm)
    gs = gs or n
    ptrs = (pointer(BFloat16, 0), pointer(BFloat16, 0), pointer(BFloat16, 0), pointer(Int32, 0, 4),
            pointer(Float32, 0), pointer(Int32, 0, 4))
    return grouped_wgrad_host, (*ptrs, *(Int32(0) for _ in range(6)), cuda.CUstream(0), n, k, bn, ld, gs,
                                dynamic, accumulate, deferred, cm)
