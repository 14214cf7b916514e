"""CuTeDSL kernels of the fused-linear cross-entropy. ce_fwd, per fp32 logits row: online max/sum, lse, loss;
with grad, (softmax - onehot) * coef as bf16 over the row's own memory (bf16 index i lies in fp32 element
i // 2, read before the tile's barrier). ce_scale: bf16(g * dloss) of the fp32 gradients, vectorised."""

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

from nmoe.fast.kernels.prims import PDL, await_upstream, load_tail, out_bits, store_full, store_tail, trap

FMATH: Any = cute.math  # typed Any: the DSL's math module declares its functions dynamically

WARP = 32
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_BIG = -3.4028234663852886e38  # -FLT_MAX: (it - it) is 0, never the NaN that -inf - -inf gives


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
    await_upstream()
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
        grid=[rows, 1, 1], block=[threads, 1, 1], stream=stream, use_pdl=PDL
    )


SCALE_VEC = 8  # fp32 in (two 16-byte loads), bf16 out (one 16-byte store)


@cute.kernel
def ce_scale_kernel(pg: Pointer, ps: Pointer, pout: Pointer, n: Int64, threads: Constexpr[int]) -> None:
    """out = bf16(g * s), s = ps[0], over flat fp32 g[0:n]: one vector per thread, the last one guarded."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = Int64(bidx) * threads + Int64(tidx)
    nfull = n // SCALE_VEC
    mg = cute.make_tensor(pg, cute.make_layout(n))
    mo = cute.make_tensor(pout, cute.make_layout(n))
    s = cute.make_tensor(ps, cute.make_layout(1))[0]
    if i < nfull:
        g = cute.zipped_divide(mg, (SCALE_VEC,))[(None, i)].load().reshape((SCALE_VEC,))
        store_full(cute.zipped_divide(mo, (SCALE_VEC,)), i, out_bits(g * s, "bfloat16"))
    elif i == nfull:
        g = load_tail(mg, nfull * SCALE_VEC, n, SCALE_VEC)
        store_tail(mo, nfull * SCALE_VEC, n, out_bits(g * s, "bfloat16"), SCALE_VEC)


@cute.jit
def ce_scale_host(pg: Pointer, ps: Pointer, pout: Pointer, n: Int64, stream: cuda.CUstream,
                  threads: Constexpr[int]) -> None:
    ce_scale_kernel(pg, ps, pout, n, threads).launch(
        grid=[(n // SCALE_VEC + threads) // threads, 1, 1], block=[threads, 1, 1], stream=stream, use_pdl=PDL
    )


def compile_args(kernel: str, spec: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """Host function and fake arguments (null pointers, zero sizes) that compile `kernel` without a GPU."""
    gmem = cute.AddressSpace.gmem
    if kernel == "ce_scale":
        return ce_scale_host, (make_ptr(Float32, 0, gmem, assumed_align=16), make_ptr(Float32, 0, gmem,
                               assumed_align=4), make_ptr(BFloat16, 0, gmem, assumed_align=16), Int64(0),
                               cuda.CUstream(0), spec["threads"])
    if kernel != "ce_fwd":
        raise KeyError(f"nmoe.fast.kernels.loss has no kernel {kernel!r}; it holds ce_fwd and ce_scale")
    fake = (make_ptr(Float32, 0, gmem, assumed_align=4), make_ptr(BFloat16, 0, gmem, assumed_align=2),
            make_ptr(Int32, 0, gmem, assumed_align=4), make_ptr(Float32, 0, gmem, assumed_align=4),
            make_ptr(Float32, 0, gmem, assumed_align=4))
    return ce_fwd_host, (*fake, Int32(0), Int32(0), cuda.CUstream(0), spec["grad"], spec["threads"],
                         spec["unroll"])
