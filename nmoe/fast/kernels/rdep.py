"""CuTeDSL RDEP kernels: counts exchange, row writes into peer receive windows, completion flags.

Import only after nmoe.fast.runtime.import_cutlass(arch): the DSL fixes its target arch at first import.
"""

# Every rank maps every peer's window (CUDA IPC); `peers[d]` is rank d's window base in this process.
# Window of rank d: recv x [C, H] | recv row_id [C] | returned rows [2][T*K, H] | counts [2][W][E] int32 |
# flags [3][W] int64 (counts posted, rows posted, rows returned), each holding its phase's call count.
# Counts and returned rows alternate by call parity: a peer's rows for call n+2 wait on this rank's post
# of call n+1, which its stream makes only after what it queued to read call n's. (A return writes
# without awaiting anyone, so one buffer would let a peer's next return overwrite rows not yet read.)
# The counts' parity is the device's dispatch count; the returned rows' is the host's return count, passed
# in, since the host hands out a view of that buffer: a captured CUDA graph then replays the buffers it
# captured, whatever ran between replays.
# Flags are st.release.sys after a fence and polled with ld.acquire.sys: peers may sit on another GPU or
# in another process on this one. A poll that outlasts limit_ns writes the status word (mapped host
# memory, readable after the trap) and traps.
# Every rank posts before it polls and no kernel waits on another kernel of its own rank, so no two kernels
# need to be resident together: W processes on one GPU without MPS time-slice (a polling kernel is
# preempted at its slice's end), and each poll ends once every peer's slice has run to its post. Where
# preemption never comes, limit_ns turns the stall into the timeout report.
# Rows are written by one kernel and flagged by the next one's thread 0: a kernel's stores (peer stores
# included) are performed before the next kernel of its stream starts, as event-ordered P2P copies rely
# on, and the flag thread's system fence and release store publish them.

from __future__ import annotations

from typing import Any, cast

import cuda.bindings.driver as cuda
import cutlass.base_dsl.ast_helpers as dsl
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.base_dsl.ast_helpers import const_expr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer

from nmoe.fast.kernels.dispatch import LANES, ROW_WARPS, UNIT_TYPES, _copy_row, _row_views
from nmoe.fast.kernels.prims import PDL, await_upstream, trap
from nmoe.fast.limits import MAX_EXPERTS, MAX_RANKS

THREADS = 256
FLAG_COUNTS, FLAG_ROWS, FLAG_RETURN = 0, 1, 2
ST_CODE, ST_A, ST_B, ST_C = 0, 1, 2, 3
OVERFLOW, TIMEOUT, BAD_ROW = 1, 2, 3
# local int32 state: [0] rows may move (no overflow anywhere), [1] rows this rank receives
L_OK, L_NRECV = 0, 1
# local int64 epoch: [0] dispatch calls, [1] return calls (each phase's flags carry its own count), [2] lock
E_DISPATCH, E_RETURN, E_LOCK, EPOCH_WORDS = 0, 1, 2, 3


def _smem_i32(n: int) -> cute.Tensor:
    ptr = cute.arch.alloc_smem(Int32, n, alignment=16)
    return cast(cute.Tensor, cute.make_tensor(ptr, cute.make_layout(n)))


def _i32s(addr: Any, n: Any) -> cute.Tensor:
    return cast(cute.Tensor, cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.gmem,
                                                            assumed_align=4), cute.make_layout(n)))


def _flag_addr(base: Int64, off_flag: Int64, kind: int, world: Int32, src: Int32) -> Int64:
    return cast(Int64, base + off_flag + Int64((kind * world + src) * 8))


def _store_sys(addr: Any, v: Any) -> None:
    cute.arch.store(cute.make_ptr(Int64, addr, cute.AddressSpace.gmem, assumed_align=8), Int64(v),
                    sem="relaxed", scope="sys")


@cute.jit
def _report(status: Int64, epoch: cute.Tensor, code: int, a: Int64, b: Int64, c: Int64) -> None:
    """First error of this rank wins the lock (epoch[E_LOCK], device memory: PCIe may lack host atomics)
    and writes (a, b, c), then the code, into mapped host memory at system scope."""
    lock = (cast(Any, epoch.iterator) + E_LOCK).llvm_ptr
    if cute.arch.atomic_cas(lock, cmp=Int64(0), val=Int64(1), sem="relaxed", scope="gpu") == Int64(0):
        _store_sys(status + ST_A * 8, a)
        _store_sys(status + ST_B * 8, b)
        _store_sys(status + ST_C * 8, c)
        cute.arch.fence_acq_rel_sys()
        cute.arch.store(cute.make_ptr(Int64, status + ST_CODE * 8, cute.AddressSpace.gmem, assumed_align=8),
                        Int64(code), sem="release", scope="sys")
    cute.arch.fence_acq_rel_sys()


@cute.jit
def _post(peers: cute.Tensor, off_flag: Int64, kind: Constexpr[int], world: Int32, me: Int32,
          seq: Int64) -> None:
    """Release this rank's sequence number into flag `kind`[me] of every peer (after a system fence)."""
    cute.arch.fence_acq_rel_sys()
    for d in dsl.range(world):
        p = cute.make_ptr(Int64, _flag_addr(Int64(peers[d]), off_flag, kind, world, me),
                          cute.AddressSpace.gmem, assumed_align=8)
        cute.arch.store(p, seq, sem="release", scope="sys")


@cute.jit
def _await(own: Int64, off_flag: Int64, kind: Constexpr[int], world: Int32, me: Int32, src: Int32,
           seq: Int64, limit_ns: Int64, status: Int64, epoch: cute.Tensor) -> None:
    """Acquire-poll flag `kind`[src] of this rank's window until it reaches seq; past limit_ns, trap."""
    p = cute.make_ptr(Int64, _flag_addr(own, off_flag, kind, world, src), cute.AddressSpace.gmem,
                      assumed_align=8)
    t0 = cute.arch.globaltimer()
    v = cute.arch.load(p, Int64, sem="acquire", scope="sys")
    while v < seq:
        if cute.arch.globaltimer() - t0 > limit_ns:
            _report(status, epoch, TIMEOUT, Int64(src), Int64(kind), seq)
            cute.printf("nmoe rdep: rank %d waited %lld ns for rank %d (phase %d, call %lld); that rank "
                        "stopped answering", me, limit_ns, src, kind, seq)
            trap()
        v = cute.arch.load(p, Int64, sem="acquire", scope="sys")


@cute.kernel
def counts_kernel(pcounts: Pointer, ppeers: Pointer, pepoch: Pointer, pdoff: Pointer, plocal: Pointer,
                  precv_counts: Pointer, world: Int32, me: Int32, n_experts: Int32, n_local: Int32,
                  capacity: Int32, off_cnt: Int64, off_flag: Int64, limit_ns: Int64, status: Int64) -> None:
    """One CTA: post this rank's expert histogram to every peer, await all, then the write offsets this
    rank uses at each owner, its receive counts, and the capacity check (every rank sees every count)."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    tid = Int32(tidx)
    peers = cute.make_tensor(ppeers, cute.make_layout(world))
    epoch = cute.make_tensor(pepoch, cute.make_layout(EPOCH_WORDS))
    seq = Int64(epoch[E_DISPATCH]) + 1
    cute.arch.sync_threads()
    if tid == 0:
        epoch[E_DISPATCH] = seq
    par = Int32(seq % 2)
    cnt_stride = world * n_experts
    counts = cute.make_tensor(pcounts, cute.make_layout(n_experts))
    for d in dsl.range(world):
        dst = _i32s(Int64(peers[d]) + off_cnt + Int64((par * cnt_stride + me * n_experts) * 4), n_experts)
        for e in dsl.range(tid, n_experts, THREADS):
            dst[e] = Int32(counts[e])
    cute.arch.fence_acq_rel_sys()  # every writer fences its own peer stores before thread 0 releases
    cute.arch.sync_threads()
    own = Int64(peers[me])
    if tid == 0:
        _post(peers, off_flag, FLAG_COUNTS, world, me, seq)
    if tid < world:
        _await(own, off_flag, FLAG_COUNTS, world, me, tid, seq, limit_ns, status, epoch)
    cute.arch.sync_threads()
    cute.arch.fence_acq_rel_sys()  # every reader orders its count loads after the acquiring threads' polls
    allc = _i32s(own + off_cnt + Int64(par * cnt_stride * 4), cnt_stride)
    colsum = _smem_i32(MAX_EXPERTS)
    totals = _smem_i32(MAX_RANKS)
    for e in dsl.range(tid, n_experts, THREADS):
        c = Int32(0)
        for s in dsl.range(world):
            c = c + Int32(allc[s * n_experts + e])
        colsum[e] = c
    cute.arch.sync_threads()
    doff = cute.make_tensor(pdoff, cute.make_layout(n_experts))
    for e in dsl.range(tid, n_experts, THREADS):
        off = Int32(0)
        for e2 in dsl.range(e // n_local * n_local, e):
            off = off + Int32(colsum[e2])
        for s in dsl.range(me):
            off = off + Int32(allc[s * n_experts + e])
        doff[e] = off
    rc = cute.make_tensor(precv_counts, cute.make_layout(n_local))
    for le in dsl.range(tid, n_local, THREADS):
        rc[le] = Int64(colsum[me * n_local + le])
    if tid < world:
        tot = Int32(0)
        for le in dsl.range(n_local):
            tot = tot + Int32(colsum[tid * n_local + le])
        totals[tid] = tot
    cute.arch.sync_threads()
    local = cute.make_tensor(plocal, cute.make_layout(2))
    if tid == 0:
        worst = Int32(0)
        need = Int32(-1)
        for d in dsl.range(world):
            if Int32(totals[d]) > need:
                need = Int32(totals[d])
                worst = Int32(d)
        mine = Int32(totals[me])
        ok = Int32(1)
        if need > capacity:
            ok = Int32(0)
            mine = Int32(0)
            _report(status, epoch, OVERFLOW, Int64(worst), Int64(need), Int64(capacity))
        local[L_OK] = ok
        local[L_NRECV] = mine


@cute.kernel
def label_kernel(precv_counts: Pointer, plocal: Pointer, prow: Pointer, peid: Pointer, n_local: Int32,
                 capacity: Int32) -> None:
    """CTA le < n_local labels its received segment with le; CTA n_local marks the tail rows -1."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    le = Int32(bidx)
    rc = cute.make_tensor(precv_counts, cute.make_layout(n_local))
    local = cute.make_tensor(plocal, cute.make_layout(2))
    meid = cute.make_tensor(peid, cute.make_layout(capacity))
    mrow = cute.make_tensor(prow, cute.make_layout(capacity))
    start = Int32(0)
    for j in dsl.range(le):
        start = start + Int32(rc[j])
    if le < n_local:
        if Int32(local[L_OK]) == 1:
            for p in dsl.range(start + Int32(tidx), start + Int32(rc[le]), THREADS):
                meid[p] = Int64(le)
    else:
        for p in dsl.range(Int32(local[L_NRECV]) + Int32(tidx), capacity, THREADS):
            meid[p] = Int64(-1)
            mrow[p] = Int64(-1)


@cute.kernel
def send_rows_kernel(px: Pointer, pids: Pointer, pslot: Pointer, pcounts: Pointer, poffs: Pointer,
                     pdoff: Pointer, plocal: Pointer, ppeers: Pointer, n_slots: Int32, top_k: Int32,
                     world: Int32, me: Int32, n_experts: Int32, n_local: Int32, capacity: Int32,
                     row_vecs: Int32, off_x: Int64, off_row: Int64, vec: Constexpr[int], unit: Constexpr[str],
                     ids64: Constexpr[bool]) -> None:
    """Warp j moves expert-sorted slot j: x[t] to row doff[e] + (j - segment start) of owner e // n_local,
    with row_id = me*T*K + t*K + k, so every owner holds (local expert, src, t, k) order."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = Int32(tidx) % LANES
    j = Int32(bidx) * ROW_WARPS + Int32(tidx) // LANES
    local = cute.make_tensor(plocal, cute.make_layout(2))
    if j < n_slots and Int32(local[L_OK]) == 1:
        mslot = cute.make_tensor(pslot, cute.make_layout(n_slots))
        s = Int64(mslot[j])
        mids = cute.make_tensor(pids, cute.make_layout(n_slots))
        e = Int32(mids[s])
        counts = cute.make_tensor(pcounts, cute.make_layout(n_experts))
        offs = cute.make_tensor(poffs, cute.make_layout(n_experts))
        doff = cute.make_tensor(pdoff, cute.make_layout(n_experts))
        pos = Int64(doff[e]) + Int64(j - (Int32(offs[e]) - Int32(counts[e])))
        dest = e // n_local
        peers = cute.make_tensor(ppeers, cute.make_layout(world))
        base = Int64(peers[dest])
        ut = UNIT_TYPES[unit]
        row_units = row_vecs * vec
        src = _row_views(px, Int64(n_slots // top_k), row_units, vec)
        dptr = cute.make_ptr(ut, base + off_x, cute.AddressSpace.gmem, assumed_align=vec * ut.width // 8)
        dst = _row_views(dptr, Int64(capacity), row_units, vec)
        _copy_row(src, dst, s // Int64(top_k), pos, row_vecs, lane)
        if lane == 0:
            rows = cute.make_tensor(cute.make_ptr(Int64, base + off_row, cute.AddressSpace.gmem,
                                                  assumed_align=8), cute.make_layout(capacity))
            rows[pos] = Int64(me) * Int64(n_slots) + s


@cute.kernel
def sync_kernel(ppeers: Pointer, pepoch: Pointer, world: Int32, me: Int32, off_flag: Int64, limit_ns: Int64,
                status: Int64, kind: Constexpr[int]) -> None:
    """After the row kernel: post flag `kind` to every peer, then await every peer's. Rows carry the
    dispatch count; a return counts its own calls (a backward returns again after the forward's)."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    tid = Int32(tidx)
    peers = cute.make_tensor(ppeers, cute.make_layout(world))
    epoch = cute.make_tensor(pepoch, cute.make_layout(EPOCH_WORDS))
    seq = Int64(epoch[E_DISPATCH])
    if const_expr(kind == FLAG_RETURN):
        seq = Int64(epoch[E_RETURN]) + 1
        cute.arch.sync_threads()
        if tid == 0:
            epoch[E_RETURN] = seq
    if tid == 0:
        _post(peers, off_flag, kind, world, me, seq)
    if tid < world:
        _await(Int64(peers[me]), off_flag, kind, world, me, tid, seq, limit_ns, status, epoch)


@cute.kernel
def return_rows_kernel(py: Pointer, pnrecv: Pointer, prow: Pointer, ppeers: Pointer, pepoch: Pointer,
                       n_slots: Int32, world: Int32, capacity: Int32, row_vecs: Int32, off_out: Int64,
                       status: Int64, buf: Int32, vec: Constexpr[int], unit: Constexpr[str]) -> None:
    """Warp p sends received row p's output to its source's slot row_id % (T*K) (source row_id // (T*K)),
    in the source's return buffer `buf` (the call's parity, every rank's alike). row_id and n_recv come from
    the dispatch being answered: the window's own, or a copy kept while other dispatches reused the window."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = Int32(tidx) % LANES
    p = Int32(bidx) * ROW_WARPS + Int32(tidx) // LANES
    n_recv = cute.make_tensor(pnrecv, cute.make_layout(1))
    epoch = cute.make_tensor(pepoch, cute.make_layout(EPOCH_WORDS))
    if p < Int32(n_recv[0]):
        peers = cute.make_tensor(ppeers, cute.make_layout(world))
        rows = cute.make_tensor(prow, cute.make_layout(capacity))
        rid = Int64(rows[p])
        if rid < 0 or rid >= Int64(world) * Int64(n_slots):
            if lane == 0:
                _report(status, epoch, BAD_ROW, Int64(p), rid, Int64(world) * Int64(n_slots))
                cute.printf("nmoe rdep_return: received row %d holds row_id %lld outside [0, %d); pass "
                            "the recv of this group's last dispatch", p, rid, world * n_slots)
            trap()
        src_rank = Int32(rid // Int64(n_slots))
        slot = rid % Int64(n_slots)
        ut = UNIT_TYPES[unit]
        row_units = row_vecs * vec
        src = _row_views(py, Int64(capacity), row_units, vec)
        dptr = cute.make_ptr(ut, Int64(peers[src_rank]) + off_out, cute.AddressSpace.gmem,
                             assumed_align=vec * ut.width // 8)
        dst = _row_views(dptr, Int64(2) * Int64(n_slots), row_units, vec)
        _copy_row(src, dst, Int64(p), Int64(buf) * Int64(n_slots) + slot, row_vecs, lane)


def _blocks(n: Int32, per: int) -> Int32:
    return Int32((n + per - 1) // per)


@cute.jit
def dispatch_host(px: Pointer, pids: Pointer, pslot: Pointer, pcounts: Pointer, poffs: Pointer,
                  ppeers: Pointer, pepoch: Pointer, pdoff: Pointer, plocal: Pointer, precv_counts: Pointer,
                  peid: Pointer, prow: Pointer, n_slots: Int32, top_k: Int32, world: Int32, me: Int32,
                  n_experts: Int32, n_local: Int32, capacity: Int32, row_vecs: Int32, off_x: Int64,
                  off_row: Int64, off_cnt: Int64, off_flag: Int64, limit_ns: Int64, status: Int64,
                  stream: cuda.CUstream, vec: Constexpr[int], unit: Constexpr[str],
                  ids64: Constexpr[bool]) -> None:
    counts_kernel(pcounts, ppeers, pepoch, pdoff, plocal, precv_counts, world, me, n_experts, n_local,
                  capacity, off_cnt, off_flag, limit_ns, status).launch(
        grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL)
    label_kernel(precv_counts, plocal, prow, peid, n_local, capacity).launch(
        grid=[n_local + 1, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL)
    send_rows_kernel(px, pids, pslot, pcounts, poffs, pdoff, plocal, ppeers, n_slots, top_k, world, me,
                     n_experts, n_local, capacity, row_vecs, off_x, off_row, vec, unit, ids64).launch(
        grid=[_blocks(n_slots, ROW_WARPS), 1, 1], block=[ROW_WARPS * LANES, 1, 1], stream=stream, use_pdl=PDL)
    sync_kernel(ppeers, pepoch, world, me, off_flag, limit_ns, status, FLAG_ROWS).launch(
        grid=[1, 1, 1], block=[LANES, 1, 1], stream=stream, use_pdl=PDL)


@cute.jit
def return_host(py: Pointer, pnrecv: Pointer, prow: Pointer, ppeers: Pointer, pepoch: Pointer, n_slots: Int32,
                world: Int32, me: Int32, capacity: Int32, row_vecs: Int32, off_out: Int64, off_flag: Int64,
                limit_ns: Int64, status: Int64, buf: Int32, stream: cuda.CUstream, vec: Constexpr[int],
                unit: Constexpr[str]) -> None:
    return_rows_kernel(py, pnrecv, prow, ppeers, pepoch, n_slots, world, capacity, row_vecs, off_out, status,
                       buf, vec, unit).launch(
        grid=[_blocks(capacity, ROW_WARPS), 1, 1], block=[ROW_WARPS * LANES, 1, 1], stream=stream,
        use_pdl=PDL)
    sync_kernel(ppeers, pepoch, world, me, off_flag, limit_ns, status, FLAG_RETURN).launch(
        grid=[1, 1, 1], block=[LANES, 1, 1], stream=stream, use_pdl=PDL)


def pointer(dtype: Any, address: int, align: int) -> Any:
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def dispatch_args(unit: str, vec: int, ids64: bool) -> tuple[Any, tuple[Any, ...]]:
    ut = UNIT_TYPES[unit]
    align = vec * ut.width // 8
    ptrs = (pointer(ut, 0, align), pointer(Int64 if ids64 else Int32, 0, 8 if ids64 else 4),
            pointer(Int64, 0, 8), pointer(Int32, 0, 4), pointer(Int32, 0, 4), pointer(Int64, 0, 8),
            pointer(Int64, 0, 8), pointer(Int32, 0, 4), pointer(Int32, 0, 4), pointer(Int64, 0, 8),
            pointer(Int64, 0, 8), pointer(Int64, 0, 8))
    ints = tuple(Int32(0) for _ in range(8))
    longs = tuple(Int64(0) for _ in range(6))
    return dispatch_host, (*ptrs, *ints, *longs, cuda.CUstream(0), vec, unit, ids64)


def return_args(unit: str, vec: int) -> tuple[Any, tuple[Any, ...]]:
    ut = UNIT_TYPES[unit]
    align = vec * ut.width // 8
    ptrs = (pointer(ut, 0, align), pointer(Int32, 0, 4), pointer(Int64, 0, 8), pointer(Int64, 0, 8),
            pointer(Int64, 0, 8))
    ints = tuple(Int32(0) for _ in range(5))
    longs = tuple(Int64(0) for _ in range(4))
    return return_host, (*ptrs, *ints, *longs, Int32(0), cuda.CUstream(0), vec, unit)
