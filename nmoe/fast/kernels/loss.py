"""CuTeDSL row kernels of the fused-linear cross-entropy: per fp32 logits row, online max/sum, lse, loss; with
grad, (softmax - onehot) * coef as bf16: over the row's own memory (ce_fwd: bf16 index i lies in fp32 element
i // 2, read before the tile's barrier) or into a buffer (ce_cluster). Import after runtime.import_cutlass."""

from __future__ import annotations

import math
from typing import Any, cast

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer
from cutlass.cutlass_dsl import select_
from cutlass.cutlass_dsl.cutlass import min as dmin

from nmoe.fast.kernels.prims import trap

FMATH: Any = cute.math  # typed Any: the DSL's math module declares its functions dynamically

WARP = 32
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_BIG = -3.4028234663852886e38  # -FLT_MAX: (it - it) is 0, never the NaN that -inf - -inf gives
VEC = 4  # fp32 logits per 16-byte load of the cluster kernel (bf16 dlogits per 8-byte store)


@cute.jit
def _merge(m: Float32, s: Float32, mo: Float32, so: Float32) -> tuple[Float32, Float32]:
    """Online-softmax merge of (max, sum of exp(x - max)) pairs."""
    mn = cute.arch.fmax(m, mo)
    sn = s * FMATH.exp2((m - mn) * LOG2E) + so * FMATH.exp2((mo - mn) * LOG2E)
    return mn, sn


@cute.jit
def _block_lse(m: Float32, s: Float32, red: Any, tidx: Int32, threads: Constexpr[int]) -> Float32:
    """CTA-wide lse = m + log(s): warp butterflies, then the warp partials merged in warp order."""
    nw = threads // WARP
    off = WARP // 2
    while const_expr(off > 0):
        m, s = _merge(m, s, cute.arch.shuffle_sync_bfly(m, offset=off),
                      cute.arch.shuffle_sync_bfly(s, offset=off))
        off = off // 2
    if tidx % WARP == 0:
        red[tidx // WARP] = m
        red[nw + tidx // WARP] = s
    cute.arch.sync_threads()
    mt = red[0]
    st = red[nw]
    for w in range_constexpr(1, nw):
        mt, st = _merge(mt, st, red[w], red[nw + w])
    return Float32(mt + FMATH.log2(st) * LN2)


@cute.jit
def _row_target(ptgt: Pointer, n: Any, row: Any, v: Int32) -> Int32:
    """The row's target id (negative: ignored); an id >= V traps: the loader's range check was skipped."""
    tgt = cute.make_tensor(ptgt, cute.make_layout(n))[row]
    if tgt >= v:
        trap()
    return cast(Int32, tgt)


@cute.jit
def _lse_scratch(threads: Constexpr[int]) -> cute.Tensor:
    return cast(cute.Tensor, cute.make_tensor(cute.arch.alloc_smem(Float32, 2 * (threads // WARP)),
                                              cute.make_layout(2 * (threads // WARP))))


@cute.kernel
def ce_fwd_kernel(plog: Pointer, pgrad: Pointer, ptgt: Pointer, pcoef: Pointer, ploss: Pointer, v: Int32,
                  grad: Constexpr[bool], threads: Constexpr[int], unroll: Constexpr[int]) -> None:
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    row = Int64(bidx)
    vv = Int64(v)
    mlog = cute.make_tensor(plog, cute.make_layout((row + 1) * vv))
    mgrad = cute.make_tensor(pgrad, cute.make_layout((row + 1) * vv * 2))
    mloss = cute.make_tensor(ploss, cute.make_layout(row + 1))
    mcoef = cute.make_tensor(pcoef, cute.make_layout(1))
    red = _lse_scratch(threads)
    tgt = _row_target(ptgt, row + 1, row, v)
    kept = tgt >= 0
    base_row = row * vv
    tile = threads * unroll
    ntiles = (v + tile - 1) // tile
    frag = cute.make_rmem_tensor((unroll,), Float32)
    m = Float32(NEG_BIG)
    s = Float32(0.0)
    for t in cutlass.range(ntiles):  # type: ignore[attr-defined]
        for u in range_constexpr(unroll):
            i = t * tile + u * threads + tidx
            frag[u] = Float32(NEG_BIG)
            if i < v:
                frag[u] = mlog[base_row + Int64(i)]
        mu = frag[0]
        for u in range_constexpr(1, unroll):
            mu = cute.arch.fmax(mu, frag[u])
        mn = cute.arch.fmax(m, mu)
        acc = s * FMATH.exp2((m - mn) * LOG2E)
        for u in range_constexpr(unroll):
            e = FMATH.exp2((frag[u] - mn) * LOG2E)
            acc = acc + select_(t * tile + u * threads + tidx < v, e, Float32(0.0))
        m = mn
        s = acc
    picked = mlog[base_row + Int64(select_(kept, tgt, Int32(0)))]
    lse = _block_lse(m, s, red, tidx, threads)
    if tidx == 0:
        mloss[row] = select_(kept, lse - picked, Float32(0.0))
    if const_expr(grad):
        coef = mcoef[0]
        for t in cutlass.range(ntiles):  # type: ignore[attr-defined]
            for u in range_constexpr(unroll):
                i = t * tile + u * threads + tidx
                frag[u] = Float32(0.0)
                if i < v:
                    frag[u] = mlog[base_row + Int64(i)]
            cute.arch.sync_threads()
            for u in range_constexpr(unroll):
                i = t * tile + u * threads + tidx
                if i < v:
                    p = FMATH.exp2((frag[u] - lse) * LOG2E)
                    p = select_(i == tgt, p - Float32(1.0), p)
                    g = select_(kept, p * coef, Float32(0.0))
                    mgrad[base_row * 2 + Int64(i)] = BFloat16(g)


@cute.jit
def ce_fwd_host(plog: Pointer, pgrad: Pointer, ptgt: Pointer, pcoef: Pointer, ploss: Pointer, rows: Int32,
                v: Int32, stream: cuda.CUstream, grad: Constexpr[bool], threads: Constexpr[int],
                unroll: Constexpr[int]) -> None:
    ce_fwd_kernel(plog, pgrad, ptgt, pcoef, ploss, v, grad, threads, unroll).launch(
        grid=[rows, 1, 1], block=[threads, 1, 1], stream=stream
    )


@cute.jit
def _segment_tile(glog: cute.Tensor, frag: Any, base: Int64, k0: Int32, hi: Int32, threads: Constexpr[int],
                  unroll: Constexpr[int], fill: Float32) -> None:
    """Load `unroll` 4-wide vectors per thread from vector k0 + u * threads + tidx (fill past hi)."""
    tidx, _, _ = cute.arch.thread_idx()
    for u in range_constexpr(unroll):
        k = k0 + u * threads + Int32(tidx)
        for j in range_constexpr(VEC):
            frag[u * VEC + j] = fill
        if k < hi:
            xv = cast(cute.Tensor, glog[(None, base + Int64(k))]).load().reshape((VEC,))
            for j in range_constexpr(VEC):
                frag[u * VEC + j] = xv[j]


@cute.kernel
def ce_cluster_kernel(plog: Pointer, pgrad: Pointer, ptgt: Pointer, pcoef: Pointer, ploss: Pointer,
                      ppart: Pointer, rows: Int32, v: Int32, grad: Constexpr[bool], threads: Constexpr[int],
                      unroll: Constexpr[int], cluster: Constexpr[int]) -> None:
    """Persistent clusters, one row at a time: rank r streams its 1/cluster of the row for (max, sum), posts
    its partial lse to ppart, merges all ranks' in rank order after the cluster barrier, then re-reads its
    slice (from L2: the clusters in flight hold a few tens of MB) and writes dlogits to their own buffer."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    gdim, _, _ = cute.arch.grid_dim()
    rank = Int32(cute.arch.block_idx_in_cluster())
    vv = Int64(v)
    nvec = v // VEC
    seg = (nvec + cluster - 1) // cluster
    lo = rank * seg
    hi = dmin(lo + seg, nvec)
    tile = threads * unroll
    ntiles = (hi - lo + tile - 1) // tile
    glog = cute.zipped_divide(cute.make_tensor(plog, cute.make_layout(Int64(rows) * vv)), (VEC,))
    ggrad = cute.zipped_divide(cute.make_tensor(pgrad, cute.make_layout(Int64(rows) * vv)), (VEC,))
    mlog = cute.make_tensor(plog, cute.make_layout(Int64(rows) * vv))
    mloss = cute.make_tensor(ploss, cute.make_layout(rows))
    mcoef = cute.make_tensor(pcoef, cute.make_layout(1))
    mpart = cute.make_tensor(ppart, cute.make_layout(Int64(rows) * cluster))
    red = _lse_scratch(threads)
    frag = cute.make_rmem_tensor((unroll * VEC,), Float32)
    out = cute.make_rmem_tensor((VEC,), Float32)
    step = Int32(gdim) // cluster
    for row in cutlass.range(Int32(bidx) // cluster, rows, step):  # type: ignore[attr-defined]
        base = Int64(row) * Int64(nvec)
        m = Float32(NEG_BIG)
        s = Float32(0.0)
        for t in cutlass.range(ntiles):  # type: ignore[attr-defined]
            _segment_tile(glog, frag, base, lo + t * tile, hi, threads, unroll, Float32(NEG_BIG))
            mu = frag[0]
            for u in range_constexpr(1, unroll * VEC):
                mu = cute.arch.fmax(mu, frag[u])
            mn = cute.arch.fmax(m, mu)
            acc = s * FMATH.exp2((m - mn) * LOG2E)
            for u in range_constexpr(unroll * VEC):
                acc = acc + FMATH.exp2((frag[u] - mn) * LOG2E)
            m = mn
            s = acc
        lse_part = _block_lse(m, s, red, tidx, threads)
        if tidx == 0:
            mpart[Int64(row) * cluster + rank] = lse_part
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        lm = mpart[Int64(row) * cluster]
        ls = Float32(1.0)
        for r in range_constexpr(1, cluster):
            lm, ls = _merge(lm, ls, mpart[Int64(row) * cluster + r], Float32(1.0))
        lse = Float32(lm + FMATH.log2(ls) * LN2)
        tgt = _row_target(ptgt, rows, row, v)
        kept = tgt >= 0
        if rank == 0 and tidx == 0:
            picked = mlog[Int64(row) * vv + Int64(select_(kept, tgt, Int32(0)))]
            mloss[row] = select_(kept, lse - picked, Float32(0.0))
        if const_expr(grad):
            coef = mcoef[0]
            for t in cutlass.range(ntiles):  # type: ignore[attr-defined]
                k0 = lo + t * tile
                _segment_tile(glog, frag, base, k0, hi, threads, unroll, Float32(0.0))
                for u in range_constexpr(unroll):
                    k = k0 + u * threads + Int32(tidx)
                    if k < hi:
                        for j in range_constexpr(VEC):
                            p = FMATH.exp2((frag[u * VEC + j] - lse) * LOG2E)
                            p = select_(k * VEC + j == tgt, p - Float32(1.0), p)
                            out[j] = select_(kept, p * coef, Float32(0.0))
                        ggrad[(None, base + Int64(k))].store(out.load().to(BFloat16))


@cute.jit
def ce_cluster_host(plog: Pointer, pgrad: Pointer, ptgt: Pointer, pcoef: Pointer, ploss: Pointer,
                    ppart: Pointer, rows: Int32, v: Int32, ctas: Int32, stream: cuda.CUstream,
                    grad: Constexpr[bool], threads: Constexpr[int], unroll: Constexpr[int],
                    cluster: Constexpr[int]) -> None:
    ce_cluster_kernel(plog, pgrad, ptgt, pcoef, ploss, ppart, rows, v, grad, threads, unroll, cluster).launch(
        grid=[ctas, 1, 1], block=[threads, 1, 1], cluster=[cluster, 1, 1], stream=stream
    )


def compile_args(kernel: str, spec: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """Host function and fake arguments (null pointers, zero sizes) that compile `kernel` without a GPU."""
    if kernel not in ("ce_fwd", "ce_cluster"):
        raise KeyError(f"nmoe.fast.kernels.loss has no kernel {kernel!r}; it holds ce_fwd and ce_cluster")
    gmem = cute.AddressSpace.gmem
    wide = 4 * VEC if kernel == "ce_cluster" else 4
    fake = (make_ptr(Float32, 0, gmem, assumed_align=wide),
            make_ptr(BFloat16, 0, gmem, assumed_align=wide // 2), make_ptr(Int32, 0, gmem, assumed_align=4),
            make_ptr(Float32, 0, gmem, assumed_align=4), make_ptr(Float32, 0, gmem, assumed_align=4))
    if kernel == "ce_cluster":
        part = make_ptr(Float32, 0, gmem, assumed_align=4)
        return ce_cluster_host, (*fake, part, Int32(0), Int32(0), Int32(0), cuda.CUstream(0), spec["grad"],
                                 spec["threads"], spec["unroll"], spec["cluster"])
    return ce_fwd_host, (*fake, Int32(0), Int32(0), cuda.CUstream(0), spec["grad"], spec["threads"],
                         spec["unroll"])
