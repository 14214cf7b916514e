"""The sm_90a grouped GEMMs' epilogue: fp32 accumulator -> bf16 (and act(h)) staged in shared subtiles ->
TMA or masked stores, stored at once (store_tile, store_tile_at_once) or held in registers and sent under
later MMAs (Pending). Import only after runtime.import_cutlass("sm_90a")."""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int16, Int32
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.nvgpu import cpasync

from nmoe.fast.kernels.activation import relu2_bits
from nmoe.fast.kernels.prims import out_bits, pinned
from nmoe.fast.kernels.sm90.tiles import (
    ACT_VALUES,
    CONSUMER_THREADS,
    EPI_BARRIER_ID,
    EPI_BUFS,
    EPI_N,
    EPILOGUES,
    STORE_WARP,
    VEC,
    WG_THREADS,
    act_cols,
    store_copy,
    tile_wgs,
)
from nmoe.fast.kernels.swiglu import swiglu_pairs
from nmoe.fast.limits import GEMM_BM as BM


class Epilogue(NamedTuple):
    """A consumer thread's share of the output path (and of act(h) when fused), built once per kernel."""

    r2s: cute.TiledCopy
    t_rs_d: cute.Tensor
    t_rs_acc: cute.Tensor
    r_f: cute.Tensor
    r_d: cute.Tensor
    s2g_atom: cute.CopyAtom
    thr_s2g: Any
    t_s_sd: cute.Tensor
    t_s_cd: cute.Tensor
    bar: pipeline.NamedBarrier
    s_d: cute.Tensor
    tma_atom: cute.CopyAtom
    t_rs_c: cute.Tensor
    s_act: Any
    act_atom: cute.CopyAtom
    t_s_sa: Any
    thr_act: Any
    act_tma_atom: Any
    buf0: Int32
    store_warp: Int32
    order: tuple[int, ...]


def epilogue_copies(tiled_mma: cute.TiledMma, acc: cute.Tensor, s_d: cute.Tensor, ctid: Int32,
                    tma_atom: cute.CopyAtom, act: str = "none", s_act: Any = None,
                    act_tma_atom: Any = None, pingpong: bool = False, m_major: bool = False) -> Epilogue:
    """stmatrix from the fp32 accumulator into bf16 smem subtiles (s_d: BM x EPI_N, store_tile's bufs a set;
    m_major: transposing into M-contiguous ones), act(h) by scalar stores into s_act (BM x EPI_N / ratio x
    EPI_BUFS per set), then TMA stores or masked smem -> global chunks; ping-pong: each wg its own set."""
    threads = tile_wgs(pingpong) * WG_THREADS
    wg = ctid // WG_THREADS if pingpong else Int32(0)
    tid = ctid - wg * WG_THREADS
    stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(m_major, 4), BFloat16)
    r2s = cute.make_tiled_copy_S(stmatrix, cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
    if act == "swiglu":
        check_fragment_pairs(r2s, threads)
    thr_r2s = r2s.get_slice(tid)
    d_shape = thr_r2s.partition_S(s_d).shape[:3]
    s2g_atom, s2g = store_copy(EPI_N, VEC, threads)
    thr_s2g = s2g.get_slice(tid)
    act_atom, act_copy = store_copy(EPI_N, VEC // EPILOGUES[act], threads)
    thr_act = act_copy.get_slice(tid)
    t_s_sd = thr_s2g.partition_S(s_d)
    return Epilogue(
        r2s, thr_r2s.partition_D(s_d), r2s.retile(acc), cute.make_rmem_tensor(d_shape, Float32),
        cute.make_rmem_tensor(d_shape, BFloat16), s2g_atom, thr_s2g, t_s_sd,
        thr_s2g.partition_D(cute.make_identity_tensor((BM, EPI_N))),
        epi_barrier(wg, threads), s_d, tma_atom,
        thr_r2s.partition_S(cute.make_identity_tensor((BM, EPI_N))), s_act, act_atom,
        None if act == "none" else thr_act.partition_S(s_act), thr_act, act_tma_atom,
        wg * EPI_BUFS, store_warp_of(wg), acc_order(tiled_mma, r2s, acc.shape, threads),
    )


def epi_barrier(wg: Int32, threads: int) -> pipeline.NamedBarrier:
    """Warpgroup wg's epilogue barrier (all consumers' when shared: wg 0, CONSUMER_THREADS)."""
    return pipeline.NamedBarrier(barrier_id=EPI_BARRIER_ID + wg, num_threads=threads)


def store_warp_of(wg: Int32) -> Int32:
    """The warp that issues warpgroup wg's TMA stores: its first."""
    warp: Int32 = STORE_WARP + wg * (WG_THREADS // 32)
    return warp


def acc_order(tiled_mma: cute.TiledMma, r2s: cute.TiledCopy, acc_shape: Any, threads: int) -> tuple[int, ...]:
    """Staged value i of an epilogue thread (subtile i // per, value i % per of its smem partition) is its
    retiled accumulator value order[i]: found from thread 0's coordinates; every thread's partitions are
    thread 0's layouts at one shared base coordinate, so the order holds for all."""
    tile = cute.make_identity_tensor((BM, cute.size(acc_shape) * threads // BM))
    sub_id = cute.make_identity_tensor((BM, EPI_N))

    def parts(t: int) -> tuple[cute.Tensor, cute.Tensor]:
        return r2s.retile(tiled_mma.get_slice(t).partition_C(tile)), r2s.get_slice(t).partition_S(sub_id)

    acc0, part0 = parts(0)
    per = cute.size(part0)
    held = {tuple(cast(Any, acc0[j])): j for j in range(cute.size(acc0))}
    at: list[Any] = [part0[v] for v in range(per)]
    staged = [(at[i % per][0], i // per * EPI_N + at[i % per][1]) for i in range(cute.size(acc0))]
    if sorted(held) != sorted(staged):
        raise RuntimeError("epilogue subtiles do not cover the accumulator; rebuild r2s from tiled_mma")
    for t in range(1, threads):
        acc, part = parts(t)
        if (str(acc.layout), str(part.layout)) != (str(acc0.layout), str(part0.layout)) or (
                acc.iterator != part.iterator):
            raise RuntimeError(f"epilogue thread {t}'s accumulator and staging partitions are not thread 0's "
                               "at one base coordinate; the staging order would not hold for it")
    return tuple(held[c] for c in staged)


def check_fragment_pairs(r2s: cute.TiledCopy, threads: int = CONSUMER_THREADS) -> None:
    """Trace-time proof over every epilogue thread that its subtile values 2p and 2p + 1 hold h columns
    c and c + 1 of one row, c even: the (gate, up) pair swiglu takes from registers."""
    ident = cute.make_identity_tensor((BM, EPI_N))
    for t in range(threads):
        part = r2s.get_slice(t).partition_S(ident)
        base_r, base_c = part.iterator
        for v in range(0, cute.size(part), 2):
            (r0, c0), (r1, c1) = part.layout(v), part.layout(v + 1)
            if base_c % 2 or c0 % 2 or (r0, c0 + 1) != (r1, c1):
                raise RuntimeError(f"swiglu epilogue pairing broken: thread {t} values {v}, {v + 1} sit at "
                                   f"{(base_r + r0, base_c + c0)} and {(base_r + r1, base_c + c1)}; the "
                                   "stmatrix partition no longer keeps column pairs in adjacent values")


@cute.jit
def _act_tile(epi: Epilogue, first: Constexpr[int], total: Constexpr[int], act: Constexpr[str]
              ) -> tuple[cute.Tensor, cute.Tensor]:
    """bf16 h and act(h) bits (the standalone activation kernels' own math) of ACT_VALUES staged values from
    value `first`, computed before they are staged so the activation's chains overlap instead of queuing."""
    r_fa = cute.make_rmem_tensor((total,), Float32)
    for v in range_constexpr(total):
        r_fa[v] = epi.t_rs_acc[epi.order[first + v]]
    r_ha = cute.make_rmem_tensor((total,), BFloat16)
    r_ha.store(r_fa.load().to(BFloat16))
    return r_ha, _act_bits(r_ha, total, act)


@cute.jit
def _act_bits(r_ha: cute.Tensor, total: Constexpr[int], act: Constexpr[str]) -> cute.Tensor:
    """act(h) bits of `total` bf16 h values in staging order (swiglu: adjacent (gate, up) pairs)."""
    h = r_ha.load()
    if const_expr(act == "relu2"):
        bits = relu2_bits(h, "bfloat16")
    else:
        hf = cute.make_rmem_tensor((total,), Float32)
        hf.store(h.to(Float32))
        bits = out_bits(swiglu_pairs(hf, total // 2).load(), "bfloat16")
    r_bits: cute.Tensor = cute.make_rmem_tensor((total // EPILOGUES[act],), Int16)
    r_bits.store(bits)
    return r_bits


@cute.jit
def _stage_act(epi: Epilogue, r_bits: cute.Tensor, at: Constexpr[int], buf: Any, act: Constexpr[str],
               lo: Constexpr[int] = 0, count: Constexpr[int] = 0) -> None:
    """A subtile's act(h) bits, outputs lo .. lo + count (count 0: all of them) from r_bits[at:], to the act
    staging buffer at (row, col // ratio)."""
    ratio = EPILOGUES[act]
    per = count or cute.size(epi.r_d) // ratio
    s_bits = cute.recast_tensor(epi.s_act, Int16)
    for p in range_constexpr(per):
        coord: Any = epi.t_rs_c[ratio * (lo + p)]
        s_bits[(coord[0], coord[1] // ratio, buf)] = r_bits[at + p]


def act_batch(size_sub: int) -> int:
    """Subtiles whose activation is computed together: ACT_VALUES of a thread's staged values."""
    return max(1, ACT_VALUES // size_sub)


def act_by_tma(n: int, act: str) -> bool:
    """act(h) rows of n / ratio bf16 leave by TMA only when their stride is whole 16-byte units."""
    return act != "none" and (n // EPILOGUES[act]) * 2 % 16 == 0


@cute.jit
def _add_chunk(src: cute.Tensor, dst: cute.Tensor) -> None:
    """dst = bf16(dst + src) for one 16-byte chunk (fp32 sum, rounded once, as torch's bf16 add)."""
    dst.store((dst.load().to(Float32) + src.load().to(Float32)).to(BFloat16))


class TileViews(NamedTuple):
    """Where one output tile goes: its subtile buffers and global boxes for TMA (h's, then act(h)'s), how
    many of its rows and columns are real, whether it leaves by TMA, and whether this warp issues it."""

    b_sd: cute.Tensor
    b_gd: cute.Tensor
    b_sa: Any
    b_ga: Any
    rows_valid: Int32
    cols_valid: Int32
    tma_ok: Any
    store_warp: Any


@cute.jit
def tile_views(epi: Epilogue, tma_d: cute.Tensor, row0: Int32, n_tile: Int32, row_end: Int32,
               n: Constexpr[int], bn: Constexpr[int], act: Constexpr[str], tma_act: Any = None) -> TileViews:
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    rows_valid = row_end - row0
    cols_valid = n - n_tile * bn
    g_tile = cute.local_tile(cute.domain_offset((row0, 0), tma_d), (BM, bn), (0, n_tile))
    b_sd, b_gd = cpasync.tma_partition(epi.tma_atom, 0, cute.make_layout(1), cute.group_modes(epi.s_d, 0, 2),
                                       cute.zipped_divide(g_tile, (BM, EPI_N)))
    b_sa, b_ga = None, None
    if const_expr(act_by_tma(n, act)):
        g_act = cute.local_tile(cute.domain_offset((row0, 0), tma_act), (BM, bn // EPILOGUES[act]),
                                (0, n_tile))
        b_sa, b_ga = cpasync.tma_partition(epi.act_tma_atom, 0, cute.make_layout(1),
                                           cute.group_modes(epi.s_act, 0, 2),
                                           cute.zipped_divide(g_act, (BM, act_cols(act))))
    tma_ok = rows_valid >= BM and cols_valid >= bn
    store_warp = warp_idx == epi.store_warp
    return TileViews(b_sd, b_gd, b_sa, b_ga, rows_valid, cols_valid, tma_ok, store_warp)


@cute.jit
def _subtile_bf16(epi: Epilogue, sub: Constexpr[int]) -> None:
    """Subtile sub's accumulator values, in staging order, rounded once to bf16 into epi.r_d."""
    size_sub = cute.size(epi.r_f)
    for v in range_constexpr(size_sub):
        epi.r_f[v] = epi.t_rs_acc[epi.order[sub * size_sub + v]]
    epi.r_d.store(epi.r_f.load().to(BFloat16))


@cute.jit
def store_tile(epi: Epilogue, tma_d: cute.Tensor, m_d: cute.Tensor, m_act: cute.Tensor, row0: Int32,
               n_tile: Int32, row_end: Int32, n: Constexpr[int], bn: Constexpr[int],
               act: Constexpr[str], tma_act: Any = None, accumulate: Constexpr[bool] = False,
               bufs: Constexpr[int] = EPI_BUFS, keep_h: Constexpr[bool] = True) -> None:
    """The tile's rows below row_end and columns below n, one EPI_N subtile at a time: registers -> bf16
    smem subtile (and act(h) from the same bf16 registers -> its own subtile) -> TMA stores (full tiles) or
    masked 16-byte stores; accumulate: added to what m_d holds; keep_h False: act(h) alone leaves."""
    assert act == "none" or bufs == EPI_BUFS, f"act(h) is staged in {EPI_BUFS} subtiles, not {bufs}"
    assert keep_h or act != "none", "an epilogue without act(h) must store h"
    views = tile_views(epi, tma_d, row0, n_tile, row_end, n, bn, act, tma_act)
    size_sub = cute.size(epi.r_f)
    batch = act_batch(size_sub)
    for sub in range_constexpr(bn // EPI_N):
        buf = epi.buf0 + sub % bufs
        if const_expr(act != "none" and sub % batch == 0):
            r_ha, r_bits = _act_tile(epi, sub * size_sub, batch * size_sub, act)
        if const_expr(act == "none"):
            _subtile_bf16(epi, sub)
        else:
            if const_expr(keep_h):
                for v in range_constexpr(size_sub):
                    epi.r_d[v] = r_ha[sub % batch * size_sub + v]
            _stage_act(epi, r_bits, sub % batch * (size_sub // EPILOGUES[act]), buf, act)
        emit_subtile(epi, views, epi.r_d, m_d, m_act, row0, n_tile, sub, buf, n, bn, act, accumulate, bufs,
                     keep_h)


@cute.jit
def store_tile_transposed(epi: Epilogue, tma_t: cute.Tensor, e: Int32, m_tile: Int32, n_tile: Int32,
                          bn: Constexpr[int]) -> None:
    """The tile into group e of a [groups, N, M] output (each group's y^T): subtiles staged M-contiguous by
    epilogue_copies(m_major=True), every one sent by TMA, which drops what lies past the group's M or N."""
    g_tile = cute.local_tile(tma_t[(None, None, e)], (BM, bn), (m_tile, n_tile))
    b_sd, b_gd = cpasync.tma_partition(epi.tma_atom, 0, cute.make_layout(1), cute.group_modes(epi.s_d, 0, 2),
                                       cute.zipped_divide(g_tile, (BM, EPI_N)))
    storing = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == epi.store_warp
    for sub in range_constexpr(bn // EPI_N):
        buf = epi.buf0 + sub % EPI_BUFS
        _subtile_bf16(epi, sub)
        cute.copy(epi.r2s, epi.r_d, epi.t_rs_d[(None, None, None, buf)])
        cute.arch.fence_proxy("async.shared", space="cta")
        epi.bar.arrive_and_wait()
        if storing:
            cute.copy(epi.tma_atom, b_sd[(None, buf)], b_gd[(None, (0, sub))])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(EPI_BUFS - 1, read=True)
        epi.bar.arrive_and_wait()


@cute.jit
def _send_whole(epi: Epilogue, bar: pipeline.NamedBarrier, storing: Any, tma_atom: cute.CopyAtom,
                b_sd: cute.Tensor, b_gd: cute.Tensor, bn: Constexpr[int]) -> None:
    """Every subtile of a whole staged tile (the rows of bar's threads) into its own buffer, one barrier, then
    the storing warp's TMA stores as one bulk group."""
    for sub in range_constexpr(bn // EPI_N):
        _subtile_bf16(epi, sub)
        cute.copy(epi.r2s, epi.r_d, epi.t_rs_d[(None, None, None, epi.buf0 + sub)])
    cute.arch.fence_proxy("async.shared", space="cta")
    bar.arrive_and_wait()
    if storing:
        for whole in range_constexpr(bn // EPI_N):
            cute.copy(tma_atom, b_sd[(None, epi.buf0 + whole)], b_gd[(None, (0, whole))])
        cute.arch.cp_async_bulk_commit_group()


@cute.jit
def store_tile_at_once(epi: Epilogue, tma_d: cute.Tensor, m_d: cute.Tensor, row0: Int32, n_tile: Int32,
                       row_end: Int32, n: Constexpr[int], bn: Constexpr[int]) -> None:
    """A tile staged whole (a buffer per subtile): all subtiles staged, one barrier, then their TMA stores,
    two consumer barriers a tile instead of two a subtile; cut tiles leave by store_tile's masked stores."""
    views = tile_views(epi, tma_d, row0, n_tile, row_end, n, bn, "none")
    if views.store_warp:
        cute.arch.cp_async_bulk_wait_group(0, read=True)
    epi.bar.arrive_and_wait()
    if views.tma_ok:
        _send_whole(epi, epi.bar, views.store_warp, epi.tma_atom, views.b_sd, views.b_gd, bn)
    else:
        store_tile(epi, tma_d, m_d, m_d, row0, n_tile, row_end, n, bn, "none", bufs=bn // EPI_N)


@cute.jit
def emit_subtile(epi: Epilogue, views: TileViews, r_d: cute.Tensor, m_d: cute.Tensor, m_act: cute.Tensor,
                 row0: Int32, n_tile: Int32, sub: Constexpr[int], buf: Any, n: Constexpr[int],
                 bn: Constexpr[int], act: Constexpr[str], accumulate: Constexpr[bool] = False,
                 bufs: Constexpr[int] = EPI_BUFS, keep_h: Constexpr[bool] = True) -> None:
    """Subtile sub of a tile, its bf16 values in r_d (act(h) already staged): into smem buffer buf, then out
    by TMA (full tiles) or by masked 16-byte stores."""
    if const_expr(keep_h):
        cute.copy(epi.r2s, r_d, epi.t_rs_d[(None, None, None, buf)])
    cute.arch.fence_proxy("async.shared", space="cta")
    epi.bar.arrive_and_wait()
    sub_n = n_tile * (bn // EPI_N) + sub
    if const_expr(act != "none"):
        t_s_ga = epi.thr_act.partition_D(
            cute.local_tile(cute.domain_offset((row0, 0), m_act), (BM, act_cols(act)), (0, sub_n)))
    if views.tma_ok:
        if views.store_warp:
            if const_expr(keep_h):
                cute.copy(epi.tma_atom, views.b_sd[(None, buf)], views.b_gd[(None, (0, sub))])
            if const_expr(act_by_tma(n, act)):
                cute.copy(epi.act_tma_atom, views.b_sa[(None, buf)], views.b_ga[(None, (0, sub))])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(bufs - 1, read=True)
        if const_expr(act != "none" and not act_by_tma(n, act)):
            cute.copy(epi.act_atom, epi.t_s_sa[(None, None, None, buf)], t_s_ga)
    else:
        g_d = cute.local_tile(cute.domain_offset((row0, 0), m_d), (BM, EPI_N), (0, sub_n))
        t_s_gd = epi.thr_s2g.partition_D(g_d)
        for i in range_constexpr(cute.size(epi.t_s_sd, mode=[1])):
            for j in range_constexpr(cute.size(epi.t_s_sd, mode=[2])):
                coord: Any = epi.t_s_cd[(0, i, j)]
                if coord[0] < views.rows_valid and coord[1] < views.cols_valid - sub * EPI_N:
                    if const_expr(accumulate):
                        _add_chunk(epi.t_s_sd[(None, i, j, buf)], t_s_gd[(None, i, j)])
                    elif const_expr(keep_h):
                        cute.copy(epi.s2g_atom, epi.t_s_sd[(None, i, j, buf)], t_s_gd[(None, i, j)])
                    if const_expr(act != "none"):
                        cute.copy(epi.act_atom, epi.t_s_sa[(None, i, j, buf)], t_s_ga[(None, i, j)])
        if views.store_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
    epi.bar.arrive_and_wait()


@cute.jit
def drain_stores(store_warp: Int32 | int = STORE_WARP) -> None:
    """Outstanding TMA stores complete before the CTA exits."""
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp_idx == store_warp:
        cute.arch.cp_async_bulk_wait_group(0)


# h values of a held subtile whose activation is computed at once: few, since a held tile's registers sit
# beside the next tile's accumulator.
HELD_ACT_VALUES = 8


class Pending(NamedTuple):
    """A deferred epilogue: the finished tile's bf16 subtiles in registers (`regs`, one per EPI_N columns; h
    where an activation is fused, act(h) computed from them as each leaves) and where they go; the tile's rows
    and the held flag travel beside it as loop scalars."""

    epi: Any
    regs: list[cute.Tensor]
    tma_d: cute.Tensor
    m_d: cute.Tensor
    cols: int
    bn: int
    accumulate: bool
    act: str
    keep_h: bool
    m_act: Any
    tma_act: Any


def make_pending(epi: Epilogue, tma_d: cute.Tensor, m_d: cute.Tensor, cols: int, bn: int,
                 accumulate: bool = False, act: str = "none", keep_h: bool = True, m_act: Any = None,
                 tma_act: Any = None) -> Pending:
    """Register subtiles for one held tile of an output cols wide (a fwd's n, a wgrad's k)."""
    return Pending(epi, [cute.make_rmem_tensor(epi.r_f.shape, BFloat16) for _ in range(bn // EPI_N)], tma_d,
                   m_d, cols, bn, accumulate, act, keep_h, m_d if m_act is None else m_act, tma_act)


@cute.jit
def hold(p: Pending) -> None:
    """The accumulator, rounded once to bf16, into the held subtiles (as store_tile would stage them)."""
    size_sub = cute.size(p.epi.r_f)
    for sub in range_constexpr(p.bn // EPI_N):
        for v in range_constexpr(size_sub):
            p.epi.r_f[v] = p.epi.t_rs_acc[p.epi.order[sub * size_sub + v]]
        p.regs[sub].store(p.epi.r_f.load().to(BFloat16))


@cute.jit
def _pinned(h: cute.Tensor) -> cute.Tensor:
    """A copy of bf16 registers through `pinned`: act(h) of a held subtile is computed where it leaves, under
    that K box's wgmmas, not hoisted out of the K loop into one serial batch before it."""
    words = cute.recast_tensor(h, Int32)
    out = cute.make_rmem_tensor(cute.size(words), Int32)
    for w in range_constexpr(cute.size(words)):
        out[w] = pinned(words[w])
    h_out: cute.Tensor = cute.recast_tensor(out, BFloat16)
    return h_out


@cute.jit
def emit_held(p: Pending, row0: Int32, n_tile: Int32, row_end: Int32, on: Int32, lo: Int32,
              hi: Int32) -> None:
    """The held subtiles lo <= sub < hi leave (when a tile is held), each with act(h) of its h when fused:
    each by a static branch, since a register subtile is chosen at compile time."""
    if on == 1 and lo < hi and lo < p.bn // EPI_N:
        views = tile_views(p.epi, p.tma_d, row0, n_tile, row_end, p.cols, p.bn, p.act, p.tma_act)
        for sub in range_constexpr(p.bn // EPI_N):
            if sub >= lo and sub < hi:
                buf = p.epi.buf0 + sub % EPI_BUFS
                if const_expr(p.act != "none"):
                    ratio = EPILOGUES[p.act]
                    for c in range_constexpr(0, cute.size(p.epi.r_f), HELD_ACT_VALUES):
                        at = cast(Any, p.regs[sub].iterator) + c
                        part = cute.make_tensor(at, cute.make_layout(HELD_ACT_VALUES))
                        _stage_act(p.epi, _act_bits(_pinned(part), HELD_ACT_VALUES, p.act), 0, buf, p.act,
                                   c // ratio, HELD_ACT_VALUES // ratio)
                emit_subtile(p.epi, views, p.regs[sub], p.m_d, p.m_act, row0, n_tile, sub, buf, p.cols, p.bn,
                             p.act, p.accumulate, EPI_BUFS, p.keep_h)
