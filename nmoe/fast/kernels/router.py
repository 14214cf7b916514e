"""CuTeDSL router top-k: one warp per token (lane l holds experts l, l+32, ...), exact warp argmax.

Import only after nmoe.fast.runtime.import_cutlass(arch): the DSL fixes its target arch at first import.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass.base_dsl.ast_helpers as dsl
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64
from cutlass.base_dsl.ast_helpers import range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer
from cutlass.cutlass_dsl.cutlass import min as dmin
from cutlass.cutlass_dsl.cutlass import select_

from nmoe.fast.kernels.prims import (
    PDL,
    add_rn,
    await_upstream,
    canonical_nan,
    div_rn,
    f2i,
    i2f,
    mul_rn,
    sel,
    sub_rn,
    trap,
)

WARPS = 4
LANES = 32
INVALID_ID = 1 << 30

# Pinned exp (see nmoe.fast.router): Cody-Waite split of ln2, degree-7 Taylor, 2^n in two exact steps.
EXP_LO = -104.0
EXP_HI = 89.0
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068203094172e-06
ROUND_SHIFTER = 12582912.0
TAYLOR = (1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5)


def _sel_f(c: Boolean, a: Float32 | float, b: Float32 | float) -> Float32:
    return Float32(select_(c, Float32(a), Float32(b)))


def _isnan(x: Float32) -> Boolean:
    return Boolean(x != x)


def pinned_exp(x: Float32) -> Float32:
    """exp(x) from round-to-nearest fp32 add/sub/mul only, so any IEEE machine reproduces its bits."""
    xc = _sel_f(x < EXP_LO, EXP_LO, _sel_f(x > EXP_HI, EXP_HI, x))
    nf = sub_rn(add_rn(mul_rn(xc, Float32(LOG2E)), Float32(ROUND_SHIFTER)), Float32(ROUND_SHIFTER))
    n = Int32(nf)
    r = sub_rn(sub_rn(xc, mul_rn(nf, Float32(LN2_HI))), mul_rn(nf, Float32(LN2_LO)))
    q = Float32(TAYLOR[0])
    for c in TAYLOR[1:]:
        q = add_rn(mul_rn(q, r), Float32(c))
    p = add_rn(Float32(1.0), add_rn(r, mul_rn(mul_rn(r, r), q)))
    a = n >> 1
    b = n - a
    res = mul_rn(mul_rn(p, i2f((a + 127) << 23)), i2f((b + 127) << 23))
    res = _sel_f(x < EXP_LO, 0.0, _sel_f(x > EXP_HI, float("inf"), res))
    return _sel_f(_isnan(x), x, res)


def _gt(a: Float32, b: Float32) -> Boolean:
    """a ranks above b in torch.sort's descending order: NaN above every number."""
    return Boolean((_isnan(a) & ~_isnan(b)) | (a > b))


def _ties(a: Float32, b: Float32) -> Boolean:
    return Boolean((a == b) | (_isnan(a) & _isnan(b)))


def _beats(av: Float32, ai: Int32, bv: Float32, bi: Int32) -> Boolean:
    """Candidate (av, ai) is selected before (bv, bi): higher value, then lower id; INVALID_ID never wins."""
    better = _gt(av, bv) | (_ties(av, bv) & (ai < bi))
    return Boolean((ai < INVALID_ID) & ((bi >= INVALID_ID) | better))


def _gmax(a: Float32, b: Float32) -> Float32:
    return _sel_f(_gt(b, a), b, a)


def _gmin(a: Float32, b: Float32) -> Float32:
    return _sel_f(_gt(b, a), a, b)


def _bfly(v: Any, off: int) -> Any:
    return cute.arch.shuffle_sync_bfly(v, offset=off)


def _top2_merge(t1: Float32, t2: Float32) -> tuple[Float32, Float32]:
    """Warp-wide top-2 values (with multiplicity) of per-lane sorted pairs; any merge order gives the same."""
    off = LANES // 2
    while off > 0:
        o1 = _bfly(t1, off)
        o2 = _bfly(t2, off)
        t1, t2 = _gmax(t1, o1), _gmax(_gmin(t1, o1), _gmax(t2, o2))
        off //= 2
    return t1, t2


def _order_key(v: Float32) -> Int32:
    """A signed int ordered as v is (v + 0.0 first, so -0 and +0 tie as their compare does): two warp
    reductions then pick what a pairwise _beats tournament picks."""
    b = f2i(add_rn(v, 0.0))
    return sel(b >= 0, b, b ^ 0x7FFFFFFF)


def _warp_argmax(v: Float32, i: Int32, s: Float32) -> tuple[Int32, Float32]:
    """(id, score) of the warp's best (value, id): highest value (redux max of its key), then lowest id
    (redux min), the score from the lane that holds that id."""
    key = _order_key(v)
    top = cute.arch.warp_redux_sync(key, "max")
    best = cute.arch.warp_redux_sync(sel(key == top, i, INVALID_ID), "min")
    score = cute.arch.shuffle_sync(s, best % LANES)
    return best, _sel_f(best < INVALID_ID, score, 0.0)


def _warp_max(v: Float32) -> Float32:
    off = LANES // 2
    while off > 0:
        v = _gmax(v, _bfly(v, off))
        off //= 2
    return v


def _route_token(mlog: cute.Tensor, mbias: cute.Tensor, row: Int64, lane: Int32, t: Int32,
                 n_experts: int, k: int, softmax: bool, n_groups: int,
                 topk_groups: int) -> tuple[Float32, Int32]:
    """Trace-time unrolled body (plain Python, so its `if`/`for` run while tracing): this lane's output."""
    cols = (n_experts + LANES - 1) // LANES
    gsize = n_experts // n_groups
    xs: list[Float32] = []
    bs: list[Float32] = []
    valid: list[Boolean] = []
    bad = Boolean(False)
    for j in range(cols):
        e = lane + j * LANES
        full = (j + 1) * LANES <= n_experts
        ok = Boolean(True) if full else Boolean(e < n_experts)
        ec = e if full else sel(ok, e, n_experts - 1)
        x = Float32(mlog[row + Int64(ec)])
        b = Float32(mbias[ec])
        bad = bad | (ok & (_isnan(x) | _isnan(b)))
        xs.append(x)
        bs.append(b)
        valid.append(ok)
    _check_finite_inputs(bad, lane, t)

    if softmax:
        m = Float32(float("-inf"))
        for j in range(cols):
            m = _sel_f(valid[j] & _gt(xs[j], m), xs[j], m)
        m = _warp_max(m)
        ex = [pinned_exp(sub_rn(xs[j], m)) for j in range(cols)]
        total = Float32(0.0)
        for j in range(cols):
            for src in range(LANES):
                if j * LANES + src < n_experts:
                    total = add_rn(total, cute.arch.shuffle_sync(ex[j], src))
        scores = [div_rn(ex[j], total) for j in range(cols)]
    else:
        scores = [div_rn(1.0, add_rn(1.0, pinned_exp(Float32(-xs[j])))) for j in range(cols)]
    biased = [add_rn(scores[j], bs[j]) for j in range(cols)]

    if n_groups > 1:
        group_score: list[Float32] = []
        for g in range(n_groups):
            t1 = Float32(float("-inf"))
            t2 = Float32(float("-inf"))
            for j in range(cols):
                inside = valid[j] & ((lane + j * LANES) // gsize == g)
                b1 = inside & _gt(biased[j], t1)
                b2 = inside & ~b1 & _gt(biased[j], t2)
                t2 = _sel_f(b1, t1, _sel_f(b2, biased[j], t2))
                t1 = _sel_f(b1, biased[j], t1)
            t1, t2 = _top2_merge(t1, t2)
            group_score.append(add_rn(t1, t2))
        keep = Int32(0)
        for _ in range(topk_groups):
            best_v = Float32(float("-inf"))
            best_g = Int32(-1)
            for g in range(n_groups):
                free = ((keep >> g) & 1) == 0
                take = free & ((best_g < 0) | _gt(group_score[g], best_v))
                best_v = _sel_f(take, group_score[g], best_v)
                best_g = sel(take, g, best_g)
            keep = keep | (Int32(1) << best_g)
        for j in range(cols):
            kept = ((keep >> ((lane + j * LANES) // gsize)) & 1) == 1
            biased[j] = _sel_f(valid[j] & kept, biased[j], float("-inf"))

    taken = Int32(0)
    picked_ids: list[Int32] = []
    picked: list[Float32] = []
    for _ in range(k):
        bv = Float32(float("-inf"))
        bi = Int32(INVALID_ID)
        bsc = Float32(0.0)
        for j in range(cols):
            e = lane + j * LANES
            cand = valid[j] & (((taken >> j) & 1) == 0)
            take = cand & _beats(biased[j], e, bv, bi)
            bv = _sel_f(take, biased[j], bv)
            bi = sel(take, e, bi)
            bsc = _sel_f(take, scores[j], bsc)
        bi, bsc = _warp_argmax(bv, bi, bsc)
        mine = (bi % LANES) == lane
        taken = taken | sel(mine, Int32(1) << (bi // LANES), 0)
        picked_ids.append(bi)
        picked.append(bsc)

    denom = picked[0]
    for kk in range(1, k):
        denom = add_rn(denom, picked[kk])
    mine_w = Float32(0.0)
    my_i = Int32(0)
    for kk in range(k):
        mine_w = _sel_f(lane == kk, picked[kk], mine_w)
        my_i = sel(lane == kk, picked_ids[kk], my_i)
    my_w = div_rn(mine_w, denom)
    return _sel_f(_isnan(my_w), canonical_nan(), my_w), my_i


@cute.jit
def _check_finite_inputs(bad: Boolean, lane: Int32, t: Int32) -> None:
    if cute.arch.vote_any_sync(bad):
        if lane == 0:
            cute.printf("nmoe router_topk: NaN in logits row %d or in bias; the ranking is undefined, "
                        "fix the upstream op", t)
        trap()


@cute.jit
def _store_outputs(mw: cute.Tensor, mids: cute.Tensor, t: Int32, n_tokens: Int32, lane: Int32,
                   w: Float32, i: Int32, k: Constexpr[int]) -> None:
    if t < n_tokens and lane < k:
        mw[Int64(t) * k + Int64(lane)] = w
        mids[Int64(t) * k + Int64(lane)] = Int64(i)


@cute.kernel
def router_topk_kernel(plog: Pointer, pbias: Pointer, pw: Pointer, pids: Pointer, n_tokens: Int32,
                       n_experts: Constexpr[int], k: Constexpr[int], softmax: Constexpr[bool],
                       n_groups: Constexpr[int], topk_groups: Constexpr[int]) -> None:
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = Int32(tidx) % LANES
    t = Int32(bidx) * WARPS + Int32(tidx) // LANES
    row_t = dmin(t, n_tokens - 1)
    mlog = cute.make_tensor(plog, cute.make_layout(Int64(n_tokens) * n_experts))
    mbias = cute.make_tensor(pbias, cute.make_layout(n_experts))
    w, i = _route_token(mlog, mbias, Int64(row_t) * n_experts, lane, row_t, n_experts, k, softmax,
                        n_groups, topk_groups)
    mw = cute.make_tensor(pw, cute.make_layout(Int64(n_tokens) * k))
    mids = cute.make_tensor(pids, cute.make_layout(Int64(n_tokens) * k))
    _store_outputs(mw, mids, t, n_tokens, lane, w, i, k)


@cute.jit
def router_topk_host(plog: Pointer, pbias: Pointer, pw: Pointer, pids: Pointer, n_tokens: Int32,
                     stream: cuda.CUstream, n_experts: Constexpr[int], k: Constexpr[int],
                     softmax: Constexpr[bool], n_groups: Constexpr[int], topk_groups: Constexpr[int]) -> None:
    router_topk_kernel(plog, pbias, pw, pids, n_tokens, n_experts, k, softmax, n_groups, topk_groups).launch(
        grid=[(n_tokens + WARPS - 1) // WARPS, 1, 1], block=[WARPS * LANES, 1, 1], stream=stream, use_pdl=PDL
    )


def f32_pointer(address: int) -> Any:
    return make_ptr(Float32, address, cute.AddressSpace.gmem, assumed_align=4)


def i64_pointer(address: int) -> Any:
    return make_ptr(Int64, address, cute.AddressSpace.gmem, assumed_align=8)


def compile_args(n_experts: int, k: int, softmax: bool, n_groups: int,
                 topk_groups: int) -> tuple[Any, tuple[Any, ...]]:
    ptrs = (f32_pointer(0), f32_pointer(0), f32_pointer(0), i64_pointer(0))
    return router_topk_host, (*ptrs, Int32(0), cuda.CUstream(0), n_experts, k, softmax, n_groups,
                              topk_groups)


COUNT_THREADS = 256
COUNT_ITEMS = 8


@cute.jit
def _count_slot(mids: cute.Tensor, hist: cute.Tensor, s: Int32, n_slots: Int32,
                n_experts: Constexpr[int]) -> None:
    if s < n_slots:
        raw = Int64(mids[s])
        if raw < 0 or raw >= n_experts:
            cute.printf("nmoe expert_counts: expert id %lld of slot %d is outside [0, %d); fix the router",
                        Int64(raw), s, n_experts)
            trap()
        cute.arch.atomic_add((hist.iterator + Int32(raw)).llvm_ptr, Int32(1))


@cute.kernel
def expert_counts_kernel(pids: Pointer, pcounts: Pointer, n_slots: Int32, n_experts: Constexpr[int]) -> None:
    """Per-CTA shared histogram, then one global add per expert; integer adds commute, so exact."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    hist = cute.make_tensor(cute.arch.alloc_smem(Int32, n_experts, alignment=16),
                            cute.make_layout(n_experts))
    for i in dsl.range(Int32(tidx), n_experts, COUNT_THREADS):
        hist[i] = Int32(0)
    cute.arch.sync_threads()
    mids = cute.make_tensor(pids, cute.make_layout(n_slots))
    for it in range_constexpr(COUNT_ITEMS):
        s = (Int32(bidx) * COUNT_ITEMS + it) * COUNT_THREADS + Int32(tidx)
        _count_slot(mids, hist, s, n_slots, n_experts)
    cute.arch.sync_threads()
    mcounts = cute.make_tensor(pcounts, cute.make_layout(n_experts))
    for i in dsl.range(Int32(tidx), n_experts, COUNT_THREADS):
        _add_count(mcounts, hist, i)


@cute.jit
def _add_count(mcounts: cute.Tensor, hist: cute.Tensor, i: Int32) -> None:
    c = Int32(hist[i])
    if c != 0:
        cute.arch.atomic_add((mcounts.iterator + i).llvm_ptr, Int64(c))


@cute.jit
def expert_counts_host(pids: Pointer, pcounts: Pointer, n_slots: Int32, stream: cuda.CUstream,
                       n_experts: Constexpr[int]) -> None:
    per = COUNT_THREADS * COUNT_ITEMS
    expert_counts_kernel(pids, pcounts, n_slots, n_experts).launch(
        grid=[(n_slots + per - 1) // per, 1, 1], block=[COUNT_THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


def ids_pointer(address: int, ids_bits: int) -> Any:
    ids_t = Int64 if ids_bits == 64 else Int32
    return make_ptr(ids_t, address, cute.AddressSpace.gmem, assumed_align=ids_bits // 8)


def counts_args(n_experts: int, ids_bits: int) -> tuple[Any, tuple[Any, ...]]:
    return expert_counts_host, (ids_pointer(0, ids_bits), i64_pointer(0), Int32(0), cuda.CUstream(0),
                                n_experts)
