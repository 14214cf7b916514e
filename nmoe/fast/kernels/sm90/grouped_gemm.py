"""sm_90a grouped GEMM over expert row segments (fwd, optionally writing act(h) too; dgrad via an N-major B):
persistent warp-specialised TMA/wgmma CTAs whose tile list comes from the device `offs`, so routing never
syncs the host. Import only after nmoe.fast.runtime.import_cutlass("sm_90a")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int16, Int32, Int64
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer
from cutlass.cutlass_dsl.cutlass import max as dsl_max
from cutlass.cutlass_dsl.cutlass import min as dsl_min
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from nmoe.fast.kernels.prims import PDL, await_upstream
from nmoe.fast.kernels.sm90.epilogue import (
    act_by_tma,
    drain_stores,
    emit_held,
    epilogue_copies,
    hold,
    make_pending,
    store_tile,
)
from nmoe.fast.kernels.sm90.tilequeue import (
    QUEUE_DEPTH,
    cluster_queue,
    drain_filler,
    next_unit,
    take_next,
    tile_queue,
)
from nmoe.fast.kernels.sm90.tiles import (
    CONSUMER_REGS,
    CONSUMER_WGS,
    EPI_N,
    EPILOGUES,
    K_BLOCKS,
    ORDER_BARRIER_ID,
    PRODUCER_REGS,
    THREADS,
    WG_THREADS,
    act_smem_layout,
    check_pairing,
    epi_sets,
    epi_smem_layout,
    epi_tma,
    stages_for,
    tile_wgs,
)
from nmoe.fast.limits import GEMM_A_EVICT_FIRST as A_EVICT_FIRST
from nmoe.fast.limits import GEMM_B_EVICT_LAST as B_EVICT_LAST
from nmoe.fast.limits import GEMM_BK as BK
from nmoe.fast.limits import GEMM_BM as BM
from nmoe.fast.limits import GEMM_CLUSTER_M as CLUSTER_M
from nmoe.fast.limits import GEMM_MAX_GROUPS as MAX_GROUPS
from nmoe.fast.limits import pingpong_bn

EVICT_FIRST, EVICT_LAST = 0x12F0000000000000, 0x14F0000000000000
"""The L2 cache policies a TMA load takes for evict-first and evict-last (fractional, the whole box)."""
A_POLICY = EVICT_FIRST if A_EVICT_FIRST else 0
B_POLICY = EVICT_LAST if B_EVICT_LAST else 0


@cute.jit
def _group_end(s_offs: cute.Tensor, e: Int32, n_groups: Int32, m_rows: Int32) -> Int32:
    """Row end of work group e: offs[e] for experts, m_rows for the zero-filled tail group e == n_groups."""
    end = m_rows
    if e < n_groups:
        end = dsl_min(dsl_max(s_offs[e], Int32(0)), m_rows)
    return end


@cute.jit
def unit_tile(t: Int32, before: Int32, g_start: Int32, n_tiles_n: Constexpr[int], cm: Constexpr[int] = 1,
              rank: Int32 | int = 0) -> tuple[Int32, Int32]:
    """(n tile, first row) of CTA `rank`'s tile in work unit t inside the group whose units start at linear
    index `before`: a unit is cm M tiles stacked, the CTAs of one cluster, sharing their B tile."""
    local = t - before
    m_unit = local // n_tiles_n
    return local - m_unit * n_tiles_n, g_start + (m_unit * cm + rank) * BM


@cute.jit
def _seek(s_offs: cute.Tensor, n_groups: Int32, m_rows: Int32, t: Int32, e: Int32, g_start: Int32,
          g_end: Int32, before: Int32, here: Int32, n_tiles_n: Constexpr[int], cm: Constexpr[int] = 1
          ) -> tuple[Int32, Int32, Int32, Int32, Int32]:
    """Advance the group cursor until unit t (cm M tiles by one N tile) lies in group e (e > n_groups: no work
    left). Units run group by group (experts, then the rows past offs[-1] as group E, zero-filled), n fastest;
    a CTA's t only grows, so the cursor only moves forward."""
    while t >= before + here and e <= n_groups:
        before = before + here
        e = e + 1
        g_start = g_end
        g_end = g_start
        if e <= n_groups:
            g_end = dsl_max(_group_end(s_offs, e, n_groups, m_rows), g_start)
        here = (g_end - g_start + (cm * BM - 1)) // (cm * BM) * n_tiles_n
    return e, g_start, g_end, before, here


@cute.jit
def cta_start(tma_atoms: tuple[cute.CopyAtom, ...]) -> tuple[Int32, Int32, Int32, Int32]:
    """(thread, CTA, CTA count, warp) of a persistent grouped-GEMM CTA; warp 0 prefetches the TMA
    descriptors."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    n_ctas, _, _ = cute.arch.grid_dim()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp_idx == 0:
        for atom in tma_atoms:
            cpasync.prefetch_descriptor(atom)
    return tidx, bidx, n_ctas, warp_idx


@cute.jit
def first_unit(s_offs: cute.Tensor, n_groups: Int32, m_rows: Int32, t: Int32, n_tiles_n: Constexpr[int],
               cm: Constexpr[int] = 1) -> tuple[Int32, Int32, Int32, Int32, Int32]:
    """The group cursor (e, g_start, g_end, before, here) at a CTA's first work unit t, sought from before
    group 0: group e spans rows [g_start, g_end) and linear units [before, before + here)."""
    cursor: tuple[Int32, Int32, Int32, Int32, Int32] = _seek(
        s_offs, n_groups, m_rows, t, Int32(-1), Int32(0), Int32(0), Int32(0), Int32(0), n_tiles_n, cm)
    return cursor


@cute.jit
def cluster_units(bidx: Int32, n_ctas: Int32, cm: Constexpr[int]) -> tuple[Int32, Int32, Int32]:
    """(first work unit, unit stride, rank) of a CTA: the cm consecutive CTAs of a cluster take one unit at a
    time, CTA `rank` its rank-th M tile."""
    return bidx // cm, n_ctas // cm, bidx % cm


@cute.jit
def mma_fragments(tiled_mma: cute.TiledMma, s_a: cute.Tensor, s_b: cute.Tensor, warp_idx: Int32,
                  bn: Constexpr[int], pingpong: Constexpr[bool] = False
                  ) -> tuple[cute.Tensor, cute.Tensor, Any]:
    """A consumer warpgroup's slice of the MMA: its operand fragments over the smem ring and the shape of its
    accumulator (its rows of the BM x bn tile; ping-pong: all of them)."""
    wg = warp_idx // 4 - 1
    thr_mma = tiled_mma.get_slice(wg % tile_wgs(pingpong) * WG_THREADS)
    t_ra = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
    t_rb = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
    return t_ra, t_rb, thr_mma.partition_shape_C((BM, bn))


@cute.jit
def act_staging(s_d: cute.Tensor, act: Constexpr[str], sets: Constexpr[int] = 1) -> cute.Tensor:
    """Shared staging for act(h)'s subtiles (with no fused activation: s_d, never written through it)."""
    if const_expr(act == "none"):
        return s_d
    s_act: cute.Tensor = SmemAllocator().allocate_tensor(BFloat16, act_smem_layout(act, sets), 1024)
    return s_act


@cute.jit
def cta_setup(m_offs: cute.Tensor, n_groups: Int32, ab_dtype: Constexpr[Any], a_layout: cute.ComposedLayout,
              b_layout: cute.ComposedLayout, d_layout: cute.ComposedLayout, stages: Constexpr[int],
              by_tma: Constexpr[str] = "ab", tables: Constexpr[int] = 1, cm: Constexpr[int] = 1,
              wgs: Constexpr[int] = CONSUMER_WGS,
              ) -> tuple[cute.Tensor, cute.Tensor, cute.Tensor, cute.Tensor, pipeline.PipelineTmaAsync]:
    """A CTA's shared memory (mbarriers, offs + tables - 1 tables, operand ring, output staging) and TMA
    pipeline; init publishes offs."""
    # cm > 1: B is multicast over the cluster and a stage is freed by all its consumers, wgs warpgroups in
    # each CTA. by_tma names the TMA-loaded operands; with one of them gathered instead, a stage also waits
    # for one arrival per gathering thread.
    tidx, _, _ = cute.arch.thread_idx()
    smem = SmemAllocator()
    barriers = smem.allocate_array(Int64, stages * 2, byte_alignment=8)
    s_offs = smem.allocate_tensor(Int32, cute.make_layout(MAX_GROUPS * tables + 8 * (tables - 1)), 16)
    s_a = smem.allocate_tensor(ab_dtype, a_layout.outer, 1024, a_layout.inner)
    s_b = smem.allocate_tensor(ab_dtype, b_layout.outer, 1024, b_layout.inner)
    s_d = smem.allocate_tensor(BFloat16, d_layout.outer, 1024, d_layout.inner)
    for i in range(tidx, n_groups, THREADS):
        s_offs[i] = m_offs[i]
    a_bytes = cute.size_in_bytes(ab_dtype, cute.slice_(a_layout, (None, None, 0)))
    b_bytes = cute.size_in_bytes(ab_dtype, cute.slice_(b_layout, (None, None, 0)))
    tx_bytes = (a_bytes if const_expr("a" in by_tma) else 0) + (b_bytes if const_expr("b" in by_tma) else 0)
    mainloop = pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 if const_expr(by_tma == "ab")
                                                 else 1 + WG_THREADS),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, wgs * 4 * cm),
        tx_count=tx_bytes,
        cta_layout_vmnk=cute.make_layout((1, cm, 1, 1)),
        defer_sync=cm > 1,
    )
    if const_expr(cm > 1):
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
    return s_offs, s_a, s_b, s_d, mainloop


@cute.jit
def produce_tiles(mainloop: pipeline.PipelineTmaAsync, tma_atom_a: cute.CopyAtom, m_a: cute.Tensor,
                  tma_atom_b: cute.CopyAtom, m_b: cute.Tensor, s_a: cute.Tensor, s_b: cute.Tensor,
                  s_offs: cute.Tensor, n_groups: Int32, m_rows: Int32, t: Int32, n_ctas: Int32,
                  n_tiles_n: Constexpr[int], k_tiles: Constexpr[int], bn: Constexpr[int], bk: Constexpr[int],
                  stages: Constexpr[int], cm: Constexpr[int] = 1, rank: Int32 | int = 0, q: Any = None,
                  m_count: cute.Tensor | None = None) -> None:
    """The producer warp: TMA loads of every K box of this CTA's tiles (units t, t + n_ctas, ..., or with q
    each next one from the counter at m_count) into the ring; with cm > 1 it loads its 1/cm of the B tile,
    multicast to every CTA of the cluster."""
    s_a_flat = cute.group_modes(s_a, 0, 2)
    s_b_flat = cute.group_modes(s_b, 0, 2)
    lane = cute.arch.lane_idx()
    fills = rank == 0
    qstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, QUEUE_DEPTH)
    rstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, QUEUE_DEPTH)
    if const_expr(q is not None):
        t, qstate, rstate = next_unit(q, m_count, fills, qstate, rstate, lane, cm)
    e, g_start, g_end, before, here = first_unit(s_offs, n_groups, m_rows, t, n_tiles_n, cm)
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    while e <= n_groups:
        if e < n_groups:
            n_tile, row0 = unit_tile(t, before, g_start, n_tiles_n, cm, rank)
            g_a = cute.local_tile(cute.domain_offset((row0, 0), m_a), (BM, bk), (0, None))
            g_b = cute.local_tile(m_b[(None, None, e)], (bn, bk), (n_tile, None))
            t_sa, t_ga = cpasync.tma_partition(tma_atom_a, 0, cute.make_layout(1), s_a_flat,
                                               cute.group_modes(g_a, 0, 2))
            t_sb, t_gb = cpasync.tma_partition(tma_atom_b, rank, cute.make_layout(cm), s_b_flat,
                                               cute.group_modes(g_b, 0, 2))
            for kt in range(k_tiles):
                mainloop.producer_acquire(state)
                bar = mainloop.producer_get_barrier(state)
                cute.copy(tma_atom_a, t_ga[(None, kt)], t_sa[(None, state.index)], tma_bar_ptr=bar,
                          **tma_hints(1, A_POLICY))
                copy_b(tma_atom_b, t_gb[(None, kt)], t_sb[(None, state.index)], bar, cm, B_POLICY)
                mainloop.producer_commit(state)
                state.advance()
        if const_expr(q is not None):
            t, qstate, rstate = next_unit(q, m_count, fills, qstate, rstate, lane, cm)
        else:
            t = t + n_ctas
        e, g_start, g_end, before, here = _seek(s_offs, n_groups, m_rows, t, e, g_start, g_end, before, here,
                                                n_tiles_n, cm)
    if const_expr(q is not None and cm > 1):
        drain_filler(q, qstate, fills)
    mainloop.producer_tail(state)


@cute.jit
def copy_b(atom: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor, bar: Any, cm: Constexpr[int],
           policy: Constexpr[int] = 0) -> None:
    """One TMA load of this CTA's share of a B box, multicast to all cm CTAs of its cluster when cm > 1;
    policy: an L2 cache policy (0: none)."""
    cute.copy(atom, src, dst, tma_bar_ptr=bar, **tma_hints(cm, policy))


def tma_hints(cm: int, policy: int) -> dict[str, Any]:
    """A TMA load's optional operands: the multicast mask over a cluster of cm CTAs, the L2 cache policy."""
    hints: dict[str, Any] = {}
    if cm > 1:
        hints["mcast_mask"] = Int16((1 << cm) - 1)
    if policy != 0:
        hints["cache_policy"] = Int64(policy)
    return hints


@cute.jit
def _first_half(t: cute.Tensor) -> cute.Tensor:
    """The first of a (V, 2, ...) tensor's two M modes, as a (V, 1, ...) view of the same storage."""
    shape: Any = t.shape
    layout = cute.make_layout((shape[0], 1, *shape[2:]), stride=t.stride)
    half: cute.Tensor = cute.make_tensor(t.iterator, layout)
    return half


@cute.jit
def _issue_mmas(tiled_mma: cute.TiledMma, acc: cute.Tensor, t_ra: cute.Tensor, t_rb: cute.Tensor,
                stage: Int32, half: Constexpr[bool] = False) -> None:
    """One K box's wgmmas; half: a ping-pong tile's first 64 rows only (its others lie past the group)."""
    warpgroup.fence()
    d = _first_half(acc) if const_expr(half) else acc
    for kb in range_constexpr(K_BLOCKS):
        a = t_ra[(None, None, kb, stage)]
        cute.gemm(tiled_mma, d, _first_half(a) if const_expr(half) else a, t_rb[(None, None, kb, stage)], d)
    warpgroup.commit_group()


@cute.jit
def _k_loop(mainloop: pipeline.PipelineTmaAsync, tiled_mma: cute.TiledMma, acc: cute.Tensor,
            t_ra: cute.Tensor, t_rb: cute.Tensor, read: Any, release: Any, held: Any, p_row0: Int32,
            p_tile: Int32, p_end: Int32, p_on: Int32, k_tiles: Int32 | int, subs: Constexpr[int],
            deferred: Constexpr[bool], half: Constexpr[bool] = False, issue: Constexpr[bool] = True,
            landed: Callable[[Int32, Any], None] = lambda stage, kt: None,
            issued: Callable[[Int32, Any], None] = lambda stage, kt: None) -> tuple[Any, Any]:
    """A tile's mainloop: each K box's wgmmas (none if not issue: dead rows), the box before it freed once
    they retire; returns (read, release) advanced."""
    # deferred: one held subtile leaves under each box, in step with the partner warpgroup's epilogue barrier.
    # landed / issued(stage, kt): steps before / after box kt's wgmmas.
    mainloop.consumer_wait(read)
    landed(read.index, Int32(0))
    if const_expr(issue):
        _issue_mmas(tiled_mma, acc, t_ra, t_rb, read.index, half)
        issued(read.index, Int32(0))
    if const_expr(deferred):
        emit_held(held, p_row0, p_tile, p_end, p_on, Int32(0), Int32(1))
    read.advance()
    for _kt in range(1, k_tiles):
        mainloop.consumer_wait(read)
        landed(read.index, _kt)
        if const_expr(issue):
            _issue_mmas(tiled_mma, acc, t_ra, t_rb, read.index, half)
            issued(read.index, _kt)
        if const_expr(deferred):
            emit_held(held, p_row0, p_tile, p_end, p_on, _kt, _kt + 1)
        if const_expr(issue):
            warpgroup.wait_group(1)
        mainloop.consumer_release(release)
        release.advance()
        read.advance()
    if const_expr(deferred):
        emit_held(held, p_row0, p_tile, p_end, p_on, Int32(k_tiles), Int32(subs))
    if const_expr(issue):
        warpgroup.wait_group(0)
    mainloop.consumer_release(release)
    release.advance()
    return read, release


def no_spill(row0: Int32, n_tile: Int32, g_end: Int32) -> Callable[[Int32, Any], None]:
    """consume_tiles' default per-tile step after a K box's wgmmas: none."""
    return lambda stage, kt: None


@cute.jit
def consume_tiles(mainloop: pipeline.PipelineTmaAsync, tiled_mma: cute.TiledMma, s_a: cute.Tensor,
                  s_b: cute.Tensor, s_d: cute.Tensor, s_offs: cute.Tensor, tma_atom_d: cute.CopyAtom,
                  tma_d: cute.Tensor, m_d: cute.Tensor, m_act: cute.Tensor, s_act: Any,
                  tma_atom_act: cute.CopyAtom, tma_act: cute.Tensor, n_groups: Int32, m_rows: Int32,
                  tidx: Int32, warp_idx: Int32, n_ctas: Int32, t: Int32, n: Constexpr[int],
                  bn: Constexpr[int],
                  k_tiles: Constexpr[int], stages: Constexpr[int], act: Constexpr[str],
                  cm: Constexpr[int] = 1, rank: Int32 | int = 0, pingpong: Constexpr[bool] = False,
                  keep_h: Constexpr[bool] = True,
                  deferred: Constexpr[bool] = False, q: Any = None,
                  spill: Callable[[Int32, Int32, Int32], Callable[[Int32, Any], None]] = no_spill) -> None:
    """The two consumer warpgroups: wgmma over each tile's K boxes, then the epilogue (none for a cluster's
    tile past its group's end, which only keeps the shared B stages flowing); spill(row0, n_tile, g_end):
    a cooperative tile's step after each K box's wgmmas."""
    # Ping-pong: warpgroup wg takes the CTA's units wg, wg + 2, ... and steps its ring cursor over the other's
    # stages; the mainloops take turns unit by unit (ORDER_BARRIER_ID). deferred (cooperative): a tile's bf16
    # subtiles (and act(h) of them) leave under the next tile's wgmmas (`Pending`). q: units arrive through a
    # tile queue instead of t, t + n_ctas, ...; every warpgroup reads every slot, a ping-pong one the next as
    # soon as its MMAs are issued (whether to hand the mainloop over), so that read waits only on the
    # producer's loads of the unit just issued.
    check_deferred(deferred, pingpong)
    cute.arch.setmaxregister_increase(CONSUMER_REGS)
    ctid = tidx - WG_THREADS
    wg = warp_idx // 4 - 1
    t_ra, t_rb, acc_shape = mma_fragments(tiled_mma, s_a, s_b, warp_idx, bn, pingpong)
    acc = cute.make_rmem_tensor(acc_shape, Float32)

    epi = epilogue_copies(tiled_mma, acc, s_d, ctid, tma_atom_d, act, s_act, tma_atom_act, pingpong)

    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    n_tiles_n = n_tiles_n_of(n, bn)
    dynamic = q is not None
    lane = tidx % 32
    qstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, QUEUE_DEPTH)
    if const_expr(dynamic):
        t, qstate = take_next(q, qstate, lane)
    e, g_start, g_end, before, here = first_unit(s_offs, n_groups, m_rows, t, n_tiles_n, cm)
    ordered = 2 * WG_THREADS
    mine_done = pipeline.NamedBarrier(barrier_id=ORDER_BARRIER_ID + wg, num_threads=ordered)
    other_done = pipeline.NamedBarrier(barrier_id=ORDER_BARRIER_ID + 1 - wg, num_threads=ordered)
    held = None
    if const_expr(deferred):
        held = make_pending(epi, tma_d, m_d, n, bn, act=act, keep_h=keep_h, m_act=m_act, tma_act=tma_act)
    subs = bn // EPI_N
    p_row0, p_tile, p_end, p_on = Int32(0), Int32(0), Int32(0), Int32(0)
    turn = Int32(0)
    wg_row = wg % tile_wgs(pingpong) * (BM // tile_wgs(pingpong))
    while e <= n_groups:
        mine = True
        if const_expr(pingpong):
            mine = turn % 2 == wg
        if mine:
            n_tile, row0 = unit_tile(t, before, g_start, n_tiles_n, cm, rank)
            if turn > 0 and const_expr(pingpong):
                other_done.arrive_and_wait()
            acc.fill(0.0)
            if e < n_groups and row0 + wg_row < g_end and const_expr(k_tiles > 0):
                if const_expr(pingpong) and g_end - row0 <= BM // 2:
                    read, release = _k_loop(mainloop, tiled_mma, acc, t_ra, t_rb, read, release, held,
                                            p_row0, p_tile, p_end, p_on, k_tiles, subs, deferred, True)
                else:
                    read, release = _k_loop(mainloop, tiled_mma, acc, t_ra, t_rb, read, release, held,
                                            p_row0, p_tile, p_end, p_on, k_tiles, subs, deferred,
                                            issued=spill(row0, n_tile, g_end))
            elif e < n_groups and const_expr(k_tiles > 0):
                read, release = _k_loop(mainloop, tiled_mma, acc, t_ra, t_rb, read, release, held,
                                        p_row0, p_tile, p_end, p_on, k_tiles, subs, deferred, issue=False)
            elif const_expr(deferred):
                emit_held(held, p_row0, p_tile, p_end, p_on, Int32(0), Int32(subs))
            if const_expr(pingpong):
                t_next = t + n_ctas
                if const_expr(dynamic):
                    t, qstate = take_next(q, qstate, lane)
                    t_next = t
                nxt = _seek(s_offs, n_groups, m_rows, t_next, e, g_start, g_end, before, here, n_tiles_n,
                            cm)[0]
                if nxt <= n_groups:
                    mine_done.arrive()

            if const_expr(deferred):
                hold(held)
                p_row0, p_tile, p_end, p_on = row0, n_tile, g_end, Int32(1)
            else:
                store_tile(epi, tma_d, m_d, m_act, row0, n_tile, g_end, n, bn, act, tma_act, keep_h=keep_h)
        elif e < n_groups and const_expr(k_tiles > 0):
            read.advance(k_tiles)
            release.advance(k_tiles)

        if const_expr(dynamic and pingpong):
            if turn % 2 != wg:
                t, qstate = take_next(q, qstate, lane)
        elif const_expr(dynamic):
            t, qstate = take_next(q, qstate, lane)
        else:
            t = t + n_ctas
        turn = turn + 1
        e, g_start, g_end, before, here = _seek(s_offs, n_groups, m_rows, t, e, g_start, g_end,
                                                before, here, n_tiles_n, cm)
    if const_expr(deferred):
        emit_held(held, p_row0, p_tile, p_end, p_on, Int32(0), Int32(subs))
    drain_stores(epi.store_warp)


def n_tiles_n_of(n: int, bn: int) -> int:
    return (n + bn - 1) // bn


def n_k_tiles(k: int) -> int:
    """K boxes of a row, the last one partial where BK does not divide k."""
    return (k + BK - 1) // BK


@cute.jit
def fwd_cta_begin(tma_atoms: tuple[cute.CopyAtom, ...], m_offs: cute.Tensor, n_groups: Int32,
                  a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout, d_layout: cute.ComposedLayout,
                  stages: Constexpr[int], by_tma: Constexpr[str], cm: Constexpr[int], act: Constexpr[str],
                  pingpong: Constexpr[bool] = False, queue_warps: Constexpr[int] = 0) -> tuple[Any, ...]:
    """What a fwd/dgrad CTA sets up before its warps split: (thread, warp, first unit, unit stride, cluster
    rank, offs table, A / B / output / act(h) shared tensors, operand pipeline, tile queue or None)."""
    # queue_warps > 0: a dynamic schedule whose queue that many producer warps of each CTA also read; a
    # cluster's queue is initialised before the operand pipeline's cluster sync publishes it.
    q: Any = None
    if const_expr(queue_warps > 0 and cm > 1):
        q = cluster_queue(cute.arch.thread_idx()[0], cm, queue_warps)
    tidx, bidx, n_ctas, warp_idx = cta_start(tma_atoms)
    s_offs, s_a, s_b, s_d, mainloop = cta_setup(m_offs, n_groups, BFloat16, a_layout, b_layout, d_layout,
                                                stages, by_tma, cm=cm, wgs=tile_wgs(pingpong))
    unit, n_units, rank = cluster_units(bidx, n_ctas, cm)
    s_act = act_staging(s_d, act, epi_sets(pingpong))
    if const_expr(queue_warps > 0 and cm == 1):
        q = tile_queue(queue_warps)
    return tidx, warp_idx, unit, n_units, rank, s_offs, s_a, s_b, s_d, s_act, mainloop, q


@cute.kernel
def grouped_gemm_kernel(
    tma_atom_a: cute.CopyAtom, m_a: cute.Tensor, tma_atom_b: cute.CopyAtom, m_b: cute.Tensor,
    tma_atom_d: cute.CopyAtom, tma_d: cute.Tensor, m_d: cute.Tensor, m_act: cute.Tensor,
    tma_atom_act: cute.CopyAtom, tma_act: cute.Tensor, m_offs: cute.Tensor,
    m_rows: Int32, n_groups: Int32, tiled_mma: cute.TiledMma, a_layout: cute.ComposedLayout,
    b_layout: cute.ComposedLayout, d_layout: cute.ComposedLayout, n: Constexpr[int], k: Constexpr[int],
    bn: Constexpr[int], stages: Constexpr[int], act: Constexpr[str], pingpong: Constexpr[bool],
    deferred: Constexpr[bool], m_count: cute.Tensor, dynamic: Constexpr[bool],
) -> None:
    await_upstream()
    tidx, warp_idx, unit, n_units, rank, s_offs, s_a, s_b, s_d, s_act, mainloop, q = fwd_cta_begin(
        (tma_atom_a, tma_atom_b, tma_atom_d, tma_atom_act), m_offs, n_groups, a_layout, b_layout, d_layout,
        stages, "ab", CLUSTER_M, act, pingpong, 1 if dynamic else 0)
    n_tiles_n = n_tiles_n_of(n, bn)
    k_tiles = n_k_tiles(k)
    if warp_idx < 4:
        cute.arch.setmaxregister_decrease(PRODUCER_REGS)
        if warp_idx == 0:
            produce_tiles(mainloop, tma_atom_a, m_a, tma_atom_b, m_b, s_a, s_b, s_offs, n_groups, m_rows,
                          unit, n_units, n_tiles_n, k_tiles, bn, BK, stages, CLUSTER_M, rank, q, m_count)
    else:
        consume_tiles(mainloop, tiled_mma, s_a, s_b, s_d, s_offs, tma_atom_d, tma_d, m_d, m_act, s_act,
                      tma_atom_act, tma_act, n_groups,
                      m_rows, tidx, warp_idx, n_units, unit, n, bn, k_tiles,
                      stages, act, CLUSTER_M, rank, pingpong, deferred=deferred, q=q)


def _gemm_setup(pw: Pointer, py: Pointer, pa: Pointer, poffs: Pointer, m_rows: Int32, n_groups: Int32, n: int,
                k: int, bn: int, stages: int, w_k_major: bool, act: str, cm: int,
                pingpong: bool) -> tuple[Any, ...]:
    """What the TMA and the gathering fwd/dgrad hosts share: B (w, K-major or not) by TMA, y by TMA, the
    activation output, offs, the MMA (one warpgroup per tile with ping-pong) and the A / B shared layouts."""
    check_schedule(bn, pingpong, act)
    if const_expr(act != "none"):
        check_pairing(EPI_N, act, tile_wgs(pingpong) * WG_THREADS)
    if const_expr(w_k_major):
        m_w = cute.make_tensor(pw, cute.make_layout((n, k, n_groups), stride=(k, 1, n * k)))
    else:
        m_w = cute.make_tensor(pw, cute.make_layout((n, k, n_groups), stride=(1, n, n * k)))
    m_y = cute.make_tensor(py, cute.make_layout((m_rows, n), stride=(n, 1)))
    n_act = n // EPILOGUES[act]
    m_a = cute.make_tensor(pa, cute.make_layout((m_rows, n_act), stride=(n_act, 1)))
    m_offs = cute.make_tensor(poffs, cute.make_layout(n_groups))
    a_enum = LayoutEnum.ROW_MAJOR
    b_enum = LayoutEnum.ROW_MAJOR if const_expr(w_k_major) else LayoutEnum.COL_MAJOR
    tile = (BM, bn, BK)
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        BFloat16, BFloat16, a_enum.sm90_mma_major_mode(), b_enum.sm90_mma_major_mode(), Float32,
        (tile_wgs(pingpong), 1, 1), tiler_mn=(64, bn),
    )
    a_layout = sm90_utils.make_smem_layout_a(a_enum, tile, BFloat16, stages)
    b_layout = sm90_utils.make_smem_layout_b(b_enum, tile, BFloat16, stages)
    tma_atom_b, tma_b = b_tma(m_w, b_layout, bn, cm)
    tma_atom_d, tma_d = epi_tma(m_y)
    tma_atom_act, tma_act = epi_tma(m_a, act) if const_expr(act_by_tma(n, act)) else (tma_atom_d, tma_d)
    return (m_y, m_a, m_offs, tiled_mma, a_layout, b_layout, tma_atom_b, tma_b, tma_atom_d, tma_d,
            tma_atom_act, tma_act)


def check_schedule(bn: int, pingpong: bool, act: str) -> None:
    """A ping-pong warpgroup holds a whole BM x bn fp32 accumulator beside its epilogue's registers: only
    pingpong_bn(act) is compiled and measured."""
    if pingpong and bn != pingpong_bn(act):
        raise ValueError(f"ping-pong grouped GEMM tiles with epilogue {act!r} are {BM} x {pingpong_bn(act)}, "
                         f"not {BM} x {bn}: use bn={pingpong_bn(act)} or the cooperative schedule")


def check_deferred(deferred: bool, pingpong: bool) -> None:
    """The deferred epilogue holds a cooperative tile; a ping-pong warpgroup already overlaps its own."""
    if deferred and pingpong:
        raise ValueError("grouped GEMM deferred epilogue: the cooperative schedule only, not ping-pong "
                         "(whose epilogue already runs under the other warpgroup's MMAs); launch it with "
                         "deferred=False")


def cluster_dims(cm: int) -> list[int] | None:
    """A launch's cluster shape: none at all for CTAs that run alone."""
    return [cm, 1, 1] if cm > 1 else None


def b_tma(m_w: cute.Tensor, b_layout: cute.ComposedLayout, bn: int, cm: int,
          bk: int = BK) -> tuple[cute.CopyAtom, Any]:
    """TMA of the B tile (bn x bk), each of the cm CTAs of a cluster loading 1/cm of it for all of them."""
    op = cpasync.CopyBulkTensorTileG2SMulticastOp() if cm > 1 else cpasync.CopyBulkTensorTileG2SOp()
    atom, tensor = cpasync.make_tiled_tma_atom(op, m_w, cute.slice_(b_layout, (None, None, 0)), (bn, bk),
                                               num_multicast=cm)
    return atom, tensor


@cute.jit
def grouped_gemm_host(
    px: Pointer, pw: Pointer, py: Pointer, pa: Pointer, poffs: Pointer, pcount: Pointer, m_rows: Int32,
    n_groups: Int32, n_ctas: Int32, stream: cuda.CUstream, n: Constexpr[int], k: Constexpr[int],
    bn: Constexpr[int], w_k_major: Constexpr[bool], act: Constexpr[str], pingpong: Constexpr[bool],
    deferred: Constexpr[bool], dynamic: Constexpr[bool],
) -> None:
    """y[M, n] = per-group x[M, k] @ B_e^T, B_e [n, k] read from w (K-major w [E, n, k], else w [E, k, n]);
    with act != "none" also a[M, n / ratio] = act(y) (pa is ignored for "none"); dynamic: units taken from
    the zeroed counter at pcount."""
    stages = stages_for(bn, act, pingpong)
    (m_y, m_a, m_offs, tiled_mma, a_layout, b_layout, tma_atom_b, tma_b, tma_atom_d, tma_d, tma_atom_act,
     tma_act) = _gemm_setup(
        pw, py, pa, poffs, m_rows, n_groups, n, k, bn, stages, w_k_major, act, CLUSTER_M, pingpong)
    m_x = cute.make_tensor(px, cute.make_layout((m_rows, k), stride=(k, 1)))
    tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), m_x, cute.slice_(a_layout, (None, None, 0)), (BM, BK))
    grouped_gemm_kernel(
        tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_d, tma_d, m_y, m_a, tma_atom_act, tma_act, m_offs,
        m_rows, n_groups,
        tiled_mma, a_layout, b_layout, epi_smem_layout(epi_sets(pingpong)), n, k, bn, stages, act, pingpong,
        deferred, cute.make_tensor(pcount, cute.make_layout(1)), dynamic,
    ).launch(grid=[n_ctas, 1, 1], block=[THREADS, 1, 1], cluster=cluster_dims(CLUSTER_M), min_blocks_per_mp=1,
             stream=stream, use_pdl=PDL)


def pointer(dtype: Any, address: int, align: int = 16) -> Any:
    """TMA needs 16-byte aligned operand bases; the offs table is read as scalars."""
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def compile_args(n: int, k: int, bn: int, w_k_major: bool, act: str = "none", pingpong: bool = False,
                 deferred: bool = False, dynamic: bool = False) -> tuple[Any, tuple[Any, ...]]:
    if act not in EPILOGUES or (act != "none" and not w_k_major):
        raise ValueError(f"grouped GEMM epilogue {act!r} (w_k_major={w_k_major}) unsupported; the fwd takes "
                         f"one of {sorted(EPILOGUES)}, dgrad only 'none'")
    check_deferred(deferred, pingpong)
    ptrs = (*(pointer(BFloat16, 0) for _ in range(4)), pointer(Int32, 0, 4), pointer(Int32, 0, 4))
    check_schedule(bn, pingpong, act)
    return grouped_gemm_host, (*ptrs, Int32(0), Int32(0), Int32(0), cuda.CUstream(0), n, k, bn, w_k_major,
                               act, pingpong, deferred, dynamic)
