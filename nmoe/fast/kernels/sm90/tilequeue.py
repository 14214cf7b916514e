"""How a dynamic sm_90a GEMM's tile index reaches the warps that run it: one producer warp takes it from a
device counter and hands it over through a shared ring, to its own CTA's other readers (TileQueue) or, in a
cluster, to every CTA's warps by DSMEM stores (ClusterQueue). Import only after runtime.import_cutlass."""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64
from cutlass.base_dsl.ast_helpers import const_expr
from cutlass.base_dsl.typing import Constexpr
from cutlass.memory import SmemAllocator

from nmoe.fast.kernels.sm90.tiles import CONSUMER_THREADS, CONSUMER_WGS

QUEUE_DEPTH = 4
SLOT_BYTES = 4


class TileQueue(NamedTuple):
    """A dynamic kernel's tile hand-off: the producer warp takes the next tile index from a device counter
    and passes it through `slots` (a QUEUE_DEPTH ring under `pipe`) to the consumers (and other producers)."""

    pipe: pipeline.PipelineAsync
    slots: cute.Tensor


def tile_queue(producer_warps: int = 1) -> TileQueue:
    """The ring of tile indices in shared memory: warp 0 of the producers fills it, both consumer
    warpgroups and producer warps 1 .. producer_warps - 1 drain it (every thread arrives)."""
    smem = SmemAllocator()
    barriers = smem.allocate_array(Int64, QUEUE_DEPTH * 2, byte_alignment=8)
    slots = smem.allocate_tensor(Int32, cute.make_layout(QUEUE_DEPTH), 16)
    pipe = pipeline.PipelineAsync.create(
        barrier_storage=barriers, num_stages=QUEUE_DEPTH,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                 CONSUMER_THREADS + 32 * (producer_warps - 1)))
    return TileQueue(pipe, slots)


@cute.jit
def grab_tile(m_count: cute.Tensor, at: Int32, lane: Int32) -> Int32:
    """The next tile of the heaviest-first list for this CTA: one device-scope fetch-and-add by lane 0 of the
    calling warp, shuffled to the others. Which CTA takes a tile never changes its bits."""
    t = Int32(0)
    if lane == 0:
        ptr = (m_count.iterator + at).llvm_ptr
        t = Int32(cute.arch.atomic_add(ptr, Int32(1), sem="acq_rel", scope="gpu"))
    out: Int32 = cute.arch.shuffle_sync(t, 0)
    return out


@cute.jit
def pass_tile(q: TileQueue, state: Any, t: Int32, lane: Int32) -> Any:
    q.pipe.producer_acquire(state)
    if lane == 0:
        q.slots[state.index] = t
    q.pipe.producer_commit(state)
    state.advance()
    return state


@cute.jit
def take_tile(q: TileQueue, state: Any) -> tuple[Int32, Any]:
    q.pipe.consumer_wait(state)
    t = cast(Int32, q.slots[state.index])
    q.pipe.consumer_release(state)
    state.advance()
    return t, state


class ClusterQueue(NamedTuple):
    """The hand-off across a cluster of cm CTAs that share each x box: CTA 0's producer warp takes a tile and
    stores its index into every CTA's slot (st.async, counted by that CTA's `full` mbarrier as tx bytes); one
    lane of each reading warp frees the slot on CTA 0's `empty` mbarrier, so all run the same tiles."""

    full: cute.Tensor
    empty: cute.Tensor
    slots: cute.Tensor


def queue_readers(cm: int, producer_warps: int = 1) -> int:
    """Warps that read each slot: every consumer warp of the cluster and the producer_warps of each CTA
    (CTA 0's filling warp aside)."""
    return cm * (CONSUMER_WGS * 4 + producer_warps) - 1


@cute.jit
def cluster_queue(tidx: Int32, cm: Constexpr[int], producer_warps: Constexpr[int] = 1) -> ClusterQueue:
    """The ring's mbarriers, initialised by thread 0; the cluster's barrier sync after the operand pipeline's
    init publishes them before any CTA stores into another's."""
    smem = SmemAllocator()
    full = smem.allocate_tensor(Int64, cute.make_layout(QUEUE_DEPTH), 8)
    empty = smem.allocate_tensor(Int64, cute.make_layout(QUEUE_DEPTH), 8)
    slots = smem.allocate_tensor(Int32, cute.make_layout(QUEUE_DEPTH), 16)
    if tidx == 0:
        for i in range(QUEUE_DEPTH):
            cute.arch.mbarrier_init(full.iterator + i, 1)
            cute.arch.mbarrier_init(empty.iterator + i, queue_readers(cm, producer_warps))
    return ClusterQueue(full, empty, slots)


@cute.jit
def publish_tile(q: ClusterQueue, state: Any, t: Int32, lane: Int32, cm: Constexpr[int]) -> Any:
    """CTA 0's producer warp: once every reader freed the slot, lane r stores t into CTA r's copy of it and
    arrives on CTA r's full mbarrier, expecting the store's bytes."""
    cute.arch.mbarrier_wait(q.empty.iterator + state.index, state.phase)
    if lane < cm:
        full = q.full.iterator + state.index
        cute.arch.mbarrier_arrive_and_expect_tx(full, SLOT_BYTES, lane)
        cute.arch.store_async_dsmem(q.slots.iterator + state.index, t, full, lane)
    state.advance()
    return state


@cute.jit
def read_tile(q: ClusterQueue, state: Any, lane: Int32) -> tuple[Int32, Any]:
    """A reading warp: wait for the slot's store, read it, then one lane frees it on CTA 0."""
    cute.arch.mbarrier_wait(q.full.iterator + state.index, state.phase)
    t = cast(Int32, q.slots[state.index])
    cute.arch.fence_view_async_shared()
    cute.arch.sync_warp()
    if lane == 0:
        cute.arch.mbarrier_arrive(q.empty.iterator + state.index, 0)
    state.advance()
    return t, state


@cute.jit
def drain_queue(q: ClusterQueue, state: Any) -> None:
    """CTA 0's producer warp, after its last store: wait until every reader freed every slot, so no CTA
    arrives on this CTA's barriers after it exits."""
    for _ in range(QUEUE_DEPTH):
        cute.arch.mbarrier_wait(q.empty.iterator + state.index, state.phase)
        state.advance()


def hand_tile(q: TileQueue | ClusterQueue, state: Any, t: Int32, lane: Int32, cm: int) -> Any:
    """The filling producer warp hands item t over: to its CTA's consumers, or to every CTA of its cluster."""
    if const_expr(isinstance(q, ClusterQueue)):
        return publish_tile(q, state, t, lane, cm)
    return pass_tile(q, state, t, lane)


def take_next(q: TileQueue | ClusterQueue, state: Any, lane: Int32) -> tuple[Int32, Any]:
    """A reading warp's next item from its CTA's ring."""
    if const_expr(isinstance(q, ClusterQueue)):
        return cast(tuple[Int32, Any], read_tile(q, state, lane))
    return cast(tuple[Int32, Any], take_tile(q, state))


@cute.jit
def next_unit(q: Any, m_count: cute.Tensor, fills: Any, qstate: Any, rstate: Any, lane: Int32,
              cm: Constexpr[int], at: Int32 | int = 0) -> tuple[Int32, Any, Any]:
    """A producer warp's next unit of a dynamic schedule: the filling warp takes it from counter `at` and
    hands it over, every other warp reads it from its ring."""
    t = Int32(0)
    if fills:
        t = grab_tile(m_count, Int32(at), lane)
        qstate = hand_tile(q, qstate, t, lane, cm)
    else:
        t, rstate = take_next(q, rstate, lane)
    return t, qstate, rstate


@cute.jit
def drain_filler(q: Any, qstate: Any, fills: Any) -> None:
    """A cluster's filling warp waits for every reader to free every slot before it exits."""
    if fills:
        drain_queue(q, qstate)
