"""CuTeDSL permute / unpermute: tile histograms, one-CTA scans, stable warp-sequential ranks, row copies;
embedding_bwd: one CTA per vocab row sums its tokens' rows in token order.

Import only after nmoe.fast.runtime.import_cutlass(arch): the DSL fixes its target arch at first import.
"""

# Slot s = t*K + k. A tile of TILE slots is split into WARPS contiguous runs of ITEMS*32 slots, one run per
# warp, taken 32 at a time in slot order, so a slot's rank counts only earlier slots of its expert: the
# order is stable by construction, never decided by atomics.

from __future__ import annotations

from typing import Any, cast

import cuda.bindings.driver as cuda
import cutlass.base_dsl.ast_helpers as dsl
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int8, Int16, Int32, Int64
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer
from cutlass.cutlass_dsl.cutlass import min as dmin

from nmoe.fast.kernels.prims import PDL, await_upstream, out_bits, store_full, trap

LANES = 32
WARPS = 8
ITEMS = 4
TILE = WARPS * ITEMS * LANES
THREADS = WARPS * LANES
SCAN_THREADS = 1024
ROW_WARPS = 4
COPY_VECS = 4  # vectors a lane loads before it stores any (see _load_vecs)
UNIT_TYPES: dict[str, Any] = {"i32": Int32, "i16": Int16, "i8": Int8}
# (unit type, units per vector): the widest copy the row length and the pointers allow.
COPY_SHAPES: dict[int, tuple[str, int]] = {16: ("i32", 4), 8: ("i32", 2), 4: ("i32", 1), 2: ("i16", 1),
                                           1: ("i8", 1)}


def _smem_i32(n: int) -> cute.Tensor:
    ptr = cute.arch.alloc_smem(Int32, n, alignment=16)
    return cast(cute.Tensor, cute.make_tensor(ptr, cute.make_layout(n)))


@cute.jit
def _load_expert(mids: cute.Tensor, s: Int32, n_slots: Int32, n_experts: Constexpr[int]) -> Int32:
    """Expert of slot s, or -1 past the end; an id outside [0, E) aborts the kernel (the spec raises)."""
    e = Int32(-1)
    if s < n_slots:
        raw = Int64(mids[s])
        if raw < 0 or raw >= n_experts:
            cute.printf("nmoe permute: expert id %lld of slot %d is outside [0, %d); fix the router "
                        "output or n_experts", Int64(raw), s, n_experts)
            trap()
        e = Int32(raw)
    return e


@cute.jit
def _zero_smem(h: cute.Tensor, n: Constexpr[int], tidx: Int32) -> None:
    for i in dsl.range(tidx, n, THREADS):
        h[i] = Int32(0)


@cute.kernel
def fill_slot_kernel(pslot: Pointer, n_rows: Int32) -> None:
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    r = Int32(bidx) * THREADS + Int32(tidx)
    mslot = cute.make_tensor(pslot, cute.make_layout(n_rows))
    if r < n_rows:
        mslot[r] = Int64(-1)


@cute.kernel
def tile_count_kernel(pids: Pointer, ptile: Pointer, n_slots: Int32, n_tiles: Int32,
                      n_experts: Constexpr[int]) -> None:
    """tile_counts[e, tile] = slots of expert e in the tile (expert-major, so the scan reads rows)."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    hist = _smem_i32(n_experts)
    _zero_smem(hist, n_experts, Int32(tidx))
    cute.arch.sync_threads()
    mids = cute.make_tensor(pids, cute.make_layout(n_slots))
    for it in range_constexpr(ITEMS):
        s = Int32(bidx) * TILE + Int32(tidx) // LANES * (ITEMS * LANES) + it * LANES + Int32(tidx) % LANES
        e = _load_expert(mids, s, n_slots, n_experts)
        _count(hist, e)
    cute.arch.sync_threads()
    mtile = cute.make_tensor(ptile, cute.make_layout(n_experts * n_tiles))
    for i in dsl.range(Int32(tidx), n_experts, THREADS):
        mtile[i * n_tiles + Int32(bidx)] = hist[i]


@cute.jit
def _count(hist: cute.Tensor, e: Int32) -> None:
    if e >= 0:
        cute.arch.atomic_add((hist.iterator + e).llvm_ptr, Int32(1))


@cute.jit
def _warp_inclusive_scan(v: Int32, lane: Int32) -> Int32:
    for d in range_constexpr(5):
        o = cute.arch.shuffle_sync_up(v, 1 << d)
        if lane >= (1 << d):
            v = v + o
    return v


@cute.kernel
def scan_kernel(ptile: Pointer, pcounts: Pointer, poffs: Pointer, pstart: Pointer, n_tiles: Int32,
                align: Int32, n_experts: Constexpr[int]) -> None:
    """One CTA: exclusive tile prefix per expert (in place), real counts, padded segment starts/ends."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    lane = Int32(tidx) % LANES
    warp = Int32(tidx) // LANES
    totals = _smem_i32(n_experts)
    warp_sums = _smem_i32(LANES)
    mtile = cute.make_tensor(ptile, cute.make_layout(n_experts * n_tiles))
    for e in dsl.range(warp, n_experts, SCAN_THREADS // LANES):
        carry = Int32(0)
        for c0 in dsl.range(0, n_tiles, LANES):
            c = c0 + lane
            v = Int32(0)
            if c < n_tiles:
                v = Int32(mtile[e * n_tiles + c])
            inc = _warp_inclusive_scan(v, lane)
            if c < n_tiles:
                mtile[e * n_tiles + c] = carry + inc - v
            carry = carry + cute.arch.shuffle_sync(inc, LANES - 1)
        if lane == 0:
            totals[e] = carry
    cute.arch.sync_threads()
    count = Int32(0)
    if Int32(tidx) < n_experts:
        count = Int32(totals[Int32(tidx)])
    padded = (count + align - 1) // align * align
    inc = _warp_inclusive_scan(padded, lane)
    if lane == LANES - 1:
        warp_sums[warp] = inc
    cute.arch.sync_threads()
    if warp == 0:
        warp_sums[lane] = _warp_inclusive_scan(Int32(warp_sums[lane]), lane)
    cute.arch.sync_threads()
    before = Int32(0)
    if warp > 0:
        before = Int32(warp_sums[warp - 1])
    end = before + inc
    if Int32(tidx) < n_experts:
        mcounts = cute.make_tensor(pcounts, cute.make_layout(n_experts))
        moffs = cute.make_tensor(poffs, cute.make_layout(n_experts))
        mstart = cute.make_tensor(pstart, cute.make_layout(n_experts))
        mcounts[Int32(tidx)] = count
        moffs[Int32(tidx)] = end
        mstart[Int32(tidx)] = end - padded


@cute.jit
def _rank_step(cnt: cute.Tensor, e: Int32, lane_lt: Int32) -> Int32:
    """Rank of this lane among the warp's earlier slots of expert e; the lowest peer advances the count."""
    peers = Int32(cute.arch.match_sync(-1, e))
    before = peers & lane_lt
    base = Int32(0)
    if e >= 0:
        base = Int32(cnt[e])
    cute.arch.sync_warp()
    if e >= 0 and before == 0:
        cnt[e] = base + cute.arch.popc(peers)
    cute.arch.sync_warp()
    return Int32(base + cute.arch.popc(before))


@cute.jit
def _write_slot(mslot: cute.Tensor, mrow: cute.Tensor, mtile: cute.Tensor, mstart: cute.Tensor,
                cnt: cute.Tensor, e: Int32, s: Int32, rank: Int32, tile: Int32, n_tiles: Int32) -> None:
    if e >= 0:
        dest = Int32(mstart[e]) + Int32(mtile[e * n_tiles + tile]) + Int32(cnt[e]) + rank
        mslot[dest] = Int64(s)
        mrow[s] = dest


@cute.kernel
def rank_kernel(pids: Pointer, ptile: Pointer, pstart: Pointer, pslot: Pointer, prow: Pointer,
                n_slots: Int32, n_tiles: Int32, n_rows: Int32, n_experts: Constexpr[int]) -> None:
    """slot[row] = s and row_of[s] = row for every real slot, row = segment start + slots of the same
    expert before s."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = Int32(tidx) % LANES
    warp = Int32(tidx) // LANES
    cnt_all = _smem_i32(WARPS * n_experts)
    _zero_smem(cnt_all, WARPS * n_experts, Int32(tidx))
    cute.arch.sync_threads()
    cnt = cute.make_tensor(cnt_all.iterator + warp * n_experts, cute.make_layout(n_experts))
    mids = cute.make_tensor(pids, cute.make_layout(n_slots))
    lane_lt = Int32(cute.arch.lanemask_lt())
    es: list[Int32] = []
    ranks: list[Int32] = []
    slots: list[Int32] = []
    for it in range_constexpr(ITEMS):
        s = Int32(bidx) * TILE + warp * (ITEMS * LANES) + it * LANES + lane
        e = _load_expert(mids, s, n_slots, n_experts)
        ranks.append(_rank_step(cnt, e, lane_lt))
        es.append(e)
        slots.append(s)
    cute.arch.sync_threads()
    for e in dsl.range(Int32(tidx), n_experts, THREADS):
        run = Int32(0)
        for w in range_constexpr(WARPS):
            v = Int32(cnt_all[w * n_experts + e])
            cnt_all[w * n_experts + e] = run
            run = run + v
    cute.arch.sync_threads()
    mtile = cute.make_tensor(ptile, cute.make_layout(n_experts * n_tiles))
    mstart = cute.make_tensor(pstart, cute.make_layout(n_experts))
    mslot = cute.make_tensor(pslot, cute.make_layout(n_rows))
    mrow = cute.make_tensor(prow, cute.make_layout(n_slots))
    for it in range_constexpr(ITEMS):
        _write_slot(mslot, mrow, mtile, mstart, cnt, es[it], slots[it], ranks[it], Int32(bidx), n_tiles)


def _row_views(p: Pointer, n_rows: Int64, row_units: Int32, vec: int) -> cute.Tensor:
    """[rows * row_units] units grouped into vectors of `vec` units: index (None, vector)."""
    m = cute.make_tensor(p, cute.make_layout(n_rows * Int64(row_units)))
    return cast(cute.Tensor, cute.zipped_divide(m, (vec,)))


@cute.jit
def _load_vecs(src: cute.Tensor, row: Int64, v0: Int32, row_vecs: Int32, pitch: Int32) -> list[Any]:
    """Vectors v0 + c*LANES of one row (rows `pitch` vectors apart), all loaded before any store (index
    clamped to the row): a load cannot pass a store that may alias it; interleaving would serialise them."""
    vals = []
    for c in range_constexpr(COPY_VECS):
        v = dmin(v0 + c * LANES, row_vecs - 1)
        vals.append(cast(cute.Tensor, src[(None, row * Int64(pitch) + Int64(v))]).load())
    return vals


@cute.jit
def _store_vecs(dst: cute.Tensor, row: Int64, v0: Int32, row_vecs: Int32, vals: list[Any]) -> None:
    for c in range_constexpr(COPY_VECS):
        if v0 + c * LANES < row_vecs:
            cast(cute.Tensor, dst[(None, row * Int64(row_vecs) + Int64(v0 + c * LANES))]).store(vals[c])


@cute.jit
def _copy_row(src: cute.Tensor, dst: cute.Tensor, src_row: Int64, dst_row: Int64, row_vecs: Int32,
              lane: Int32) -> None:
    for v0 in dsl.range(lane, row_vecs, LANES * COPY_VECS):
        _store_vecs(dst, dst_row, v0, row_vecs, _load_vecs(src, src_row, v0, row_vecs, row_vecs))


@cute.jit
def _zero_row(dst: cute.Tensor, row: Int64, row_vecs: Int32, lane: Int32) -> None:
    for v in dsl.range(lane, row_vecs, LANES, unroll=4):
        d = cast(cute.Tensor, dst[(None, row * Int64(row_vecs) + Int64(v))])
        d.fill(Int32(0))


@cute.kernel
def spread_rows_kernel(px: Pointer, pslot: Pointer, prow: Pointer, pxp: Pointer, n_src: Int32,
                       n_rows: Int32, top_k: Int32, row_vecs: Int32, src_vecs: Int32, vec: Constexpr[int]
                       ) -> None:
    """Warp w stores x[w] (x's rows src_vecs vectors apart) to its K rows row_of[w*K + k], each vector loaded
    once: x is read in one pass, where a gather in row order reads each token K times, far apart. Pad rows
    (slot -1) get zeros."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = Int32(tidx) % LANES
    w = Int32(bidx) * ROW_WARPS + Int32(tidx) // LANES
    src = _row_views(px, Int64(n_src), src_vecs * vec, vec)
    dst = _row_views(pxp, Int64(n_rows), row_vecs * vec, vec)
    if w < n_src:
        mrow = cute.make_tensor(prow, cute.make_layout(n_src * top_k))
        for v0 in dsl.range(lane, row_vecs, LANES * COPY_VECS):
            vals = _load_vecs(src, Int64(w), v0, row_vecs, src_vecs)
            for kk in dsl.range(top_k):
                _store_vecs(dst, Int64(mrow[w * top_k + kk]), v0, row_vecs, vals)
    if w < n_rows:
        mslot = cute.make_tensor(pslot, cute.make_layout(n_rows))
        if Int64(mslot[w]) < 0:
            _zero_row(dst, Int64(w), row_vecs, lane)


@cute.kernel
def scatter_rows_kernel(pyp: Pointer, pslot: Pointer, py: Pointer, pseen: Pointer, n_rows: Int32,
                        n_slots: Int32, row_vecs: Int32, vec: Constexpr[int]) -> None:
    """y[slot[r]] = yp[r] for real rows; seen[s] counts arrivals so a bad slot map aborts loudly."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = Int32(tidx) % LANES
    r = Int32(bidx) * ROW_WARPS + Int32(tidx) // LANES
    rc = dmin(r, n_rows - 1)
    mslot = cute.make_tensor(pslot, cute.make_layout(n_rows))
    s = Int64(mslot[rc])
    src = _row_views(pyp, Int64(n_rows), row_vecs * vec, vec)
    dst = _row_views(py, Int64(n_slots), row_vecs * vec, vec)
    mseen = cute.make_tensor(pseen, cute.make_layout(n_slots))
    if r < n_rows:
        _scatter_one(src, dst, mseen, s, Int64(r), Int64(n_slots), row_vecs, lane)


@cute.jit
def _scatter_one(src: cute.Tensor, dst: cute.Tensor, mseen: cute.Tensor, s: Int64, r: Int64,
                 n_slots: Int64, row_vecs: Int32, lane: Int32) -> None:
    if s < -1 or s >= n_slots:
        if lane == 0:
            cute.printf("nmoe unpermute: slot[%lld] = %lld is outside [-1, %lld); pass permute's slot",
                        r, s, n_slots)
        trap()
    if s >= 0:
        if lane == 0:
            cute.arch.atomic_add((mseen.iterator + s).llvm_ptr, Int32(1))
        _copy_row(src, dst, r, s, row_vecs, lane)


@cute.kernel
def check_seen_kernel(pseen: Pointer, n_slots: Int32) -> None:
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    s = Int32(bidx) * THREADS + Int32(tidx)
    mseen = cute.make_tensor(pseen, cute.make_layout(n_slots))
    if s < n_slots:
        n = Int32(mseen[s])
        if n != 1:
            cute.printf("nmoe unpermute: slot %d arrived %d times, not once; pass permute's slot", s, n)
            trap()


def _blocks(n: Int32, per: int) -> Int32:
    return Int32((n + per - 1) // per)


@cute.jit
def permute_host(pids: Pointer, px: Pointer, ptile: Pointer, pcounts: Pointer, poffs: Pointer,
                 pstart: Pointer, pslot: Pointer, prow: Pointer, pxp: Pointer, n_slots: Int32, n_tiles: Int32,
                 n_tokens: Int32, n_rows: Int32, top_k: Int32, align: Int32, row_vecs: Int32,
                 stream: cuda.CUstream, n_experts: Constexpr[int], vec: Constexpr[int],
                 has_slots: Constexpr[bool], has_rows: Constexpr[bool], copies: Constexpr[bool]) -> None:
    """copies False (x has no columns): the routing alone, no row-copy launch over every row."""
    if const_expr(has_rows):
        fill_slot_kernel(pslot, n_rows).launch(
            grid=[_blocks(n_rows, THREADS), 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL)
    if const_expr(has_slots):
        tile_count_kernel(pids, ptile, n_slots, n_tiles, n_experts).launch(
            grid=[n_tiles, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL)
    scan_kernel(ptile, pcounts, poffs, pstart, n_tiles, align, n_experts).launch(
        grid=[1, 1, 1], block=[SCAN_THREADS, 1, 1], stream=stream, use_pdl=PDL)
    if const_expr(has_slots):
        rank_kernel(pids, ptile, pstart, pslot, prow, n_slots, n_tiles, n_rows, n_experts).launch(
            grid=[n_tiles, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL)
    if const_expr(has_rows and copies):
        spread_rows_kernel(px, pslot, prow, pxp, n_tokens, n_rows, top_k, row_vecs, row_vecs, vec).launch(
            grid=[_blocks(n_rows, ROW_WARPS), 1, 1], block=[ROW_WARPS * LANES, 1, 1], stream=stream,
            use_pdl=PDL)


@cute.jit
def spread_host(px: Pointer, pslot: Pointer, prow: Pointer, pxp: Pointer, n_tokens: Int32, n_rows: Int32,
                top_k: Int32, row_vecs: Int32, src_vecs: Int32, stream: cuda.CUstream,
                vec: Constexpr[int]) -> None:
    spread_rows_kernel(px, pslot, prow, pxp, n_tokens, n_rows, top_k, row_vecs, src_vecs, vec).launch(
        grid=[_blocks(n_rows, ROW_WARPS), 1, 1], block=[ROW_WARPS * LANES, 1, 1], stream=stream, use_pdl=PDL)


@cute.jit
def unpermute_host(pyp: Pointer, pslot: Pointer, py: Pointer, pseen: Pointer, n_rows: Int32,
                   n_slots: Int32, row_vecs: Int32, stream: cuda.CUstream, vec: Constexpr[int],
                   has_rows: Constexpr[bool], has_slots: Constexpr[bool]) -> None:
    if const_expr(has_rows):
        scatter_rows_kernel(pyp, pslot, py, pseen, n_rows, n_slots, row_vecs, vec).launch(
            grid=[_blocks(n_rows, ROW_WARPS), 1, 1], block=[ROW_WARPS * LANES, 1, 1], stream=stream,
            use_pdl=PDL)
    if const_expr(has_slots):
        check_seen_kernel(pseen, n_slots).launch(
            grid=[_blocks(n_slots, THREADS), 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL)


EMBED_DTYPES: dict[str, Any] = {"bfloat16": BFloat16, "float32": Float32}


@cute.kernel
def embed_bwd_kernel(pdy: Pointer, porder: Pointer, pstarts: Pointer, pout: Pointer, n_tok: Int32,
                     vocab: Int32, h: Constexpr[int], threads: Constexpr[int], dtype: Constexpr[str]) -> None:
    """Row `bidx` of the table's gradient: the fp32 sum of dy's rows order[starts[row]:starts[row + 1]]
    (int64 positions, ascending), rounded once; CTA 0 traps unless starts spans exactly [0, n_tok] (an id
    outside [0, vocab) would otherwise be dropped)."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    row = Int64(bidx)
    vec = 16 * 8 // EMBED_DTYPES[dtype].width
    nvec = h // vec
    mst = cute.make_tensor(pstarts, cute.make_layout(Int64(vocab) + 1))
    mord = cute.make_tensor(porder, cute.make_layout(Int64(n_tok) + 1))  # + 1: never empty; reads < n_tok
    vdy = cute.zipped_divide(cute.make_tensor(pdy, cute.make_layout(Int64(n_tok) * h)), (vec,))
    vout = cute.zipped_divide(cute.make_tensor(pout, cute.make_layout(Int64(vocab) * h)), (vec,))
    if bidx == 0 and tidx == 0 and (mst[0] != 0 or mst[Int64(vocab)] != n_tok):
        trap()
    first = mst[row]
    count = mst[row + 1] - first
    acc = cute.make_rmem_tensor((vec,), Float32)
    for c in range_constexpr((nvec + threads - 1) // threads):
        col = c * threads + tidx
        if col < nvec:
            acc.fill(0.0)
            for j in dsl.range(0, count, 1):
                tok = mord[Int64(first + j)]
                acc.store(acc.load() + vdy[(None, tok * nvec + col)].load().reshape((vec,)).to(Float32))
            store_full(vout, row * nvec + col, out_bits(acc.load(), dtype))


@cute.jit
def embed_bwd_host(pdy: Pointer, porder: Pointer, pstarts: Pointer, pout: Pointer, n_tok: Int32,
                   vocab: Int32, stream: cuda.CUstream, h: Constexpr[int], threads: Constexpr[int],
                   dtype: Constexpr[str]) -> None:
    embed_bwd_kernel(pdy, porder, pstarts, pout, n_tok, vocab, h, threads, dtype).launch(
        grid=[vocab, 1, 1], block=[threads, 1, 1], stream=stream, use_pdl=PDL)


def pointer(dtype: Any, address: int, align: int) -> Any:
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def ids_type(ids_bits: int) -> Any:
    return Int64 if ids_bits == 64 else Int32


def permute_args(n_experts: int, ids_bits: int, unit: str, vec: int, has_slots: bool,
                 has_rows: bool, copies: bool = True) -> tuple[Any, tuple[Any, ...]]:
    ut = UNIT_TYPES[unit]
    align = vec * ut.width // 8
    ptrs = (pointer(ids_type(ids_bits), 0, ids_bits // 8), pointer(ut, 0, align), pointer(Int32, 0, 4),
            pointer(Int32, 0, 4), pointer(Int32, 0, 4), pointer(Int32, 0, 4), pointer(Int64, 0, 8),
            pointer(Int32, 0, 4), pointer(ut, 0, align))
    ints = tuple(Int32(0) for _ in range(7))
    return permute_host, (*ptrs, *ints, cuda.CUstream(0), n_experts, vec, has_slots, has_rows, copies)


def spread_args(unit: str, vec: int) -> tuple[Any, tuple[Any, ...]]:
    ut = UNIT_TYPES[unit]
    align = vec * ut.width // 8
    ptrs = (pointer(ut, 0, align), pointer(Int64, 0, 8), pointer(Int32, 0, 4), pointer(ut, 0, align))
    return spread_host, (*ptrs, *(Int32(0) for _ in range(5)), cuda.CUstream(0), vec)


def unpermute_args(unit: str, vec: int, has_rows: bool, has_slots: bool) -> tuple[Any, tuple[Any, ...]]:
    ut = UNIT_TYPES[unit]
    align = vec * ut.width // 8
    ptrs = (pointer(ut, 0, align), pointer(Int64, 0, 8), pointer(ut, 0, align), pointer(Int32, 0, 4))
    return unpermute_host, (*ptrs, Int32(0), Int32(0), Int32(0), cuda.CUstream(0), vec, has_rows,
                            has_slots)


def embed_bwd_args(h: int, threads: int, dtype: str) -> tuple[Any, tuple[Any, ...]]:
    et = EMBED_DTYPES[dtype]
    ptrs = (pointer(et, 0, 16), pointer(Int64, 0, 8), pointer(Int32, 0, 4), pointer(et, 0, 16))
    return embed_bwd_host, (*ptrs, Int32(0), Int32(0), cuda.CUstream(0), h, threads, dtype)
