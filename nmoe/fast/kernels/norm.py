"""CuTeDSL kernels for rmsnorm fwd/bwd: one CTA per row, the row held in registers, fp32 math.

r = 1/sqrt.rn(mean + eps) with IEEE sqrt and division (each <= 1/2 fp32 ulp) instead of rsqrt.approx.
dw is reduced deterministically: per-CTA fp32 partials, then a fixed-order column sum.
Import only after nmoe.fast.runtime.import_cutlass(arch).
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer
from cutlass.cutlass_dsl import select_

from nmoe.fast.kernels.prims import PDL, add_rn, await_upstream, div_rn, mul_rn, sqrt_rn

WARP = 32
DTYPES: dict[str, Any] = {"bfloat16": BFloat16, "float16": Float16, "float32": Float32}
DW_THREADS = 64  # small CTAs spread the few dw columns over more SMs
DW_UNROLL = 16  # partial-sum loads in flight per thread; the adds stay in index order


def inv_rms(sum_sq: Float32, d: int, eps: Float32) -> Float32:
    """1/sqrt(sum/d + eps), every step correctly rounded: |rel err| <= ~2 fp32 ulp past the sum."""
    ms = add_rn(div_rn(sum_sq, Float32(float(d))), eps)
    return div_rn(1.0, sqrt_rn(ms))


@cute.jit
def _load_row(m: Any, row: Int64, out: cute.Tensor, tidx: Int32, d: Constexpr[int],
              vec: Constexpr[int], nper: Constexpr[int], threads: Constexpr[int]) -> None:
    """out[p*vec + j] = m[row, (tidx + p*threads)*vec + j] in fp32; zero past the row's end."""
    nv = d // vec
    g = cute.zipped_divide(m, (vec,))
    for p in range_constexpr(nper):
        v = Int64(tidx) + p * threads
        if const_expr(threads * nper == nv):
            xv = g[(None, row * nv + v)].load().reshape((vec,)).to(Float32)
            for j in range_constexpr(vec):
                out[p * vec + j] = xv[j]
        else:
            for j in range_constexpr(vec):
                out[p * vec + j] = Float32(0.0)
            if v < nv:
                xv = g[(None, row * nv + v)].load().reshape((vec,)).to(Float32)
                for j in range_constexpr(vec):
                    out[p * vec + j] = xv[j]


@cute.jit
def _load_raw(m: Any, row: Int64, out: cute.Tensor, tidx: Int32, d: Constexpr[int],
              vec: Constexpr[int], nper: Constexpr[int], threads: Constexpr[int]) -> None:
    """_load_row without the widening: the registers stay loads in flight until first read."""
    nv = d // vec
    g = cute.zipped_divide(m, (vec,))
    outv: Any = cute.zipped_divide(out, (vec,))
    for p in range_constexpr(nper):
        v = Int64(tidx) + p * threads
        dst = outv[(None, p)]
        if const_expr(threads * nper == nv):
            dst.store(g[(None, row * nv + v)].load())
        else:
            dst.fill(0.0)
            if v < nv:
                dst.store(g[(None, row * nv + v)].load())


@cute.jit
def _store_row(m: Any, row: Int64, vals: cute.Tensor, tidx: Int32, d: Constexpr[int],
               vec: Constexpr[int], nper: Constexpr[int], threads: Constexpr[int],
               write_back: Constexpr[bool] = False, plus: Any = None) -> None:
    """One rounding of each fp32 value to m's dtype (RNE), vector stores; write_back: vals then hold the
    values stored (add_rmsnorm norms the stream as stored); plus: m's row of it is added to the rounded
    values and the sum rounded again, what a separate add stores (add_rmsnorm's stream gradient)."""
    nv = d // vec
    g = cute.zipped_divide(m, (vec,))
    for p in range_constexpr(nper):
        v = Int64(tidx) + p * threads
        frag = cute.make_rmem_tensor((vec,), Float32)
        for j in range_constexpr(vec):
            frag[j] = vals[p * vec + j]
        if const_expr(write_back and m.element_type != Float32):
            low = frag.load().to(m.element_type)
            if const_expr(threads * nper == nv) or v < nv:
                g[(None, row * nv + v)].store(low)
            back = low.to(Float32)
            for j in range_constexpr(vec):
                vals[p * vec + j] = back[j]
        elif const_expr(threads * nper == nv) or v < nv:
            out = frag.load()
            if const_expr(plus is not None):
                added = cute.zipped_divide(plus, (vec,))[(None, row * nv + v)].load().reshape((vec,))
                out = out.to(m.element_type).to(Float32) + added.to(Float32)
            g[(None, row * nv + v)].store(out.to(m.element_type))


@cute.jit
def _block_sum(vals: tuple[Float32, ...], red: Any, tidx: Int32,
               threads: Constexpr[int]) -> tuple[Float32, ...]:
    """CTA-wide sums of a few fp32 values: warp butterflies, then warp partials in a fixed order."""
    nw = (threads + WARP - 1) // WARP
    k = len(vals)
    out = list(vals)
    for i in range_constexpr(k):
        off = WARP // 2
        while const_expr(off > 0):
            out[i] = out[i] + cute.arch.shuffle_sync_bfly(out[i], offset=off)
            off = off // 2
    if tidx % WARP == 0:
        for i in range_constexpr(k):
            red[i * nw + tidx // WARP] = out[i]
    cute.arch.sync_threads()
    for i in range_constexpr(k):
        acc = red[i * nw]
        for w in range_constexpr(1, nw):
            acc = acc + red[i * nw + w]
        out[i] = acc
    cute.arch.sync_threads()
    return tuple(out)


def _rows(px: Pointer, rows: Int64, d: int, pitch: int) -> Any:
    """rows x d elements, row r at px + r * pitch: flat when pitch == d, else a (d, rows) layout whose flat
    index row * (d / vec) + v still names a row's vector v after zipped_divide by vec."""
    if const_expr(pitch == d):
        return cute.make_tensor(px, cute.make_layout(rows * d))
    return cute.make_tensor(px, cute.make_layout((d, rows), stride=(1, pitch)))


@cute.jit
def _fwd_row(mx: Any, ma: Any, ms: Any, mw: Any, my: Any, row: Int64, eps: Float32, tidx: Int32,
             d: Constexpr[int], vec: Constexpr[int], nper: Constexpr[int], threads: Constexpr[int]) -> None:
    """y = rmsnorm(x) of one row; with ma (not None), x = round(x + a) first, stored to ms."""
    red = cute.make_tensor(cute.arch.alloc_smem(Float32, (threads + WARP - 1) // WARP),
                           cute.make_layout((threads + WARP - 1) // WARP))
    xf = cute.make_rmem_tensor((nper * vec,), Float32)
    wf = cute.make_rmem_tensor((nper * vec,), Float32)
    _load_row(mx, row, xf, tidx, d, vec, nper, threads)
    if const_expr(ma is not None):
        af = cute.make_rmem_tensor((nper * vec,), Float32)
        _load_row(ma, row, af, tidx, d, vec, nper, threads)
        for j in range_constexpr(nper * vec):
            xf[j] = add_rn(xf[j], af[j])
        _store_row(ms, row, xf, tidx, d, vec, nper, threads, True)
    _load_row(mw, Int64(0), wf, tidx, d, vec, nper, threads)
    ss = Float32(0.0)
    for j in range_constexpr(nper * vec):
        ss = ss + xf[j] * xf[j]
    (ss,) = _block_sum((ss,), red, tidx, threads)
    r = inv_rms(ss, d, eps)
    y = cute.make_rmem_tensor((nper * vec,), Float32)
    for j in range_constexpr(nper * vec):
        y[j] = mul_rn(mul_rn(xf[j], r), wf[j])
    _store_row(my, row, y, tidx, d, vec, nper, threads)


@cute.kernel
def rmsnorm_fwd_kernel(px: Pointer, pw: Pointer, py: Pointer, rows: Int64, eps: Float32, d: Constexpr[int],
                       vec: Constexpr[int], nper: Constexpr[int], threads: Constexpr[int],
                       pitch: Constexpr[int]) -> None:
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    mx = _rows(px, rows, d, pitch)
    mw = cute.make_tensor(pw, cute.make_layout(d))
    my = cute.make_tensor(py, cute.make_layout(rows * d))
    _fwd_row(mx, None, None, mw, my, Int64(bidx), eps, tidx, d, vec, nper, threads)


@cute.kernel
def add_rmsnorm_fwd_kernel(px: Pointer, pa: Pointer, pw: Pointer, ps: Pointer, py: Pointer, rows: Int64,
                           eps: Float32, d: Constexpr[int], vec: Constexpr[int], nper: Constexpr[int],
                           threads: Constexpr[int]) -> None:
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    mx = cute.make_tensor(px, cute.make_layout(rows * d))
    ma = cute.make_tensor(pa, cute.make_layout(rows * d))
    ms = cute.make_tensor(ps, cute.make_layout(rows * d))
    mw = cute.make_tensor(pw, cute.make_layout(d))
    my = cute.make_tensor(py, cute.make_layout(rows * d))
    _fwd_row(mx, ma, ms, mw, my, Int64(bidx), eps, tidx, d, vec, nper, threads)


@cute.jit
def rmsnorm_fwd_host(px: Pointer, pw: Pointer, py: Pointer, rows: Int64, eps: Float32, stream: cuda.CUstream,
                     d: Constexpr[int], vec: Constexpr[int], nper: Constexpr[int], threads: Constexpr[int],
                     x_dtype: Constexpr[str], w_dtype: Constexpr[str], pitch: Constexpr[int]) -> None:
    rmsnorm_fwd_kernel(px, pw, py, rows, eps, d, vec, nper, threads, pitch).launch(
        grid=[rows, 1, 1], block=[threads, 1, 1], stream=stream, use_pdl=PDL
    )


@cute.jit
def add_rmsnorm_fwd_host(px: Pointer, pa: Pointer, pw: Pointer, ps: Pointer, py: Pointer, rows: Int64,
                         eps: Float32, stream: cuda.CUstream, d: Constexpr[int], vec: Constexpr[int],
                         nper: Constexpr[int], threads: Constexpr[int], x_dtype: Constexpr[str],
                         w_dtype: Constexpr[str]) -> None:
    add_rmsnorm_fwd_kernel(px, pa, pw, ps, py, rows, eps, d, vec, nper, threads).launch(
        grid=[rows, 1, 1], block=[threads, 1, 1], stream=stream, use_pdl=PDL
    )


@cute.jit
def _bwd_rows(pdy: Pointer, px: Pointer, pw: Pointer, pdx: Pointer, pdw: Pointer, pds: Pointer | None,
              rows: Int64, eps: Float32, d: Constexpr[int], vec: Constexpr[int], nper: Constexpr[int],
              threads: Constexpr[int], pitch: Constexpr[int]) -> None:
    """RMSNorm backward over rows bidx, bidx + grid, ...: each row's dx, and this CTA's dw partials written to
    row bidx of pdw."""
    # dx = r*(g - x*(r*r)*mean(g*x)) with g = dy*w, plus mds's row where given (add_rmsnorm's stream
    # gradient). The dw partials of dy*(x*r) sit in shared memory, freeing registers for the resident-CTA
    # target. The next row's x and dy load before this row's reductions, hiding their latency behind
    # barriers and math.
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    gdim, _, _ = cute.arch.grid_dim()
    mdy = cute.make_tensor(pdy, cute.make_layout(rows * d))
    mx = _rows(px, rows, d, pitch)
    mw = cute.make_tensor(pw, cute.make_layout(d))
    mdx = cute.make_tensor(pdx, cute.make_layout(rows * d))
    mdw = cute.make_tensor(pdw, cute.make_layout(Int64(gdim) * d))
    mds = None if const_expr(pds is None) else cute.make_tensor(pds, cute.make_layout(rows * d))
    red = cute.make_tensor(cute.arch.alloc_smem(Float32, 2 * ((threads + WARP - 1) // WARP)),
                           cute.make_layout(2 * ((threads + WARP - 1) // WARP)))
    wf = cute.make_rmem_tensor((nper * vec,), Float32)
    _load_row(mw, Int64(0), wf, tidx, d, vec, nper, threads)
    nk = nper * vec
    ck = 4 if nk % 4 == 0 else 1
    dws = cute.zipped_divide(cute.make_tensor(cute.arch.alloc_smem(Float32, threads * nk, 4 * ck),
                                              cute.make_layout(threads * nk)), (ck,))
    for c in range_constexpr(nk // ck):
        dws[(None, c * threads + Int32(tidx))].fill(0.0)
    xn = cute.make_rmem_tensor((nper * vec,), mx.element_type)
    gn = cute.make_rmem_tensor((nper * vec,), mx.element_type)
    _load_raw(mx, Int64(bidx), xn, tidx, d, vec, nper, threads)
    _load_raw(mdy, Int64(bidx), gn, tidx, d, vec, nper, threads)
    xf = cute.make_rmem_tensor((nper * vec,), Float32)
    gf = cute.make_rmem_tensor((nper * vec,), Float32)
    stride = Int64(gdim)
    for it in cutlass.range((rows - Int64(bidx) + stride - 1) // stride):  # type: ignore[attr-defined]
        row = Int64(bidx) + it * stride
        xf.store(xn.load().to(Float32))
        gf.store(gn.load().to(Float32))
        if row + stride < rows:
            _load_raw(mx, row + stride, xn, tidx, d, vec, nper, threads)
            _load_raw(mdy, row + stride, gn, tidx, d, vec, nper, threads)
        ss = Float32(0.0)
        gx = Float32(0.0)
        for j in range_constexpr(nper * vec):
            ss = ss + xf[j] * xf[j]
            gx = gx + mul_rn(gf[j], wf[j]) * xf[j]
        ss, gx = _block_sum((ss, gx), red, tidx, threads)
        r = inv_rms(ss, d, eps)
        s = div_rn(gx, Float32(float(d)))
        rr = mul_rn(r, r)
        for c in range_constexpr(nk // ck):
            acc = dws[(None, c * threads + Int32(tidx))]
            part = cute.make_rmem_tensor((ck,), Float32)
            part.store(acc.load())
            for k in range_constexpr(ck):
                j = c * ck + k
                part[k] = add_rn(part[k], mul_rn(gf[j], mul_rn(xf[j], r)))
            acc.store(part.load())
        for j in range_constexpr(nk):
            gf[j] = mul_rn(r, add_rn(mul_rn(gf[j], wf[j]), -mul_rn(mul_rn(xf[j], rr), s)))
        _store_row(mdx, row, gf, tidx, d, vec, nper, threads, plus=mds)
    for c in range_constexpr(nk // ck):
        part = dws[(None, c * threads + Int32(tidx))].load()
        for k in range_constexpr(ck):
            gf[c * ck + k] = part[k]
    _store_row(mdw, Int64(bidx), gf, tidx, d, vec, nper, threads)


@cute.kernel
def rmsnorm_bwd_kernel(pdy: Pointer, px: Pointer, pw: Pointer, pdx: Pointer, pdw: Pointer, rows: Int64,
                       eps: Float32, d: Constexpr[int], vec: Constexpr[int], nper: Constexpr[int],
                       threads: Constexpr[int], pitch: Constexpr[int]) -> None:
    await_upstream()
    _bwd_rows(pdy, px, pw, pdx, pdw, None, rows, eps, d, vec, nper, threads, pitch)


@cute.kernel
def add_rmsnorm_bwd_kernel(pdy: Pointer, pds: Pointer, px: Pointer, pw: Pointer, pdx: Pointer, pdw: Pointer,
                           rows: Int64, eps: Float32, d: Constexpr[int], vec: Constexpr[int],
                           nper: Constexpr[int], threads: Constexpr[int]) -> None:
    await_upstream()
    _bwd_rows(pdy, px, pw, pdx, pdw, pds, rows, eps, d, vec, nper, threads, d)


@cute.jit
def rmsnorm_bwd_host(pdy: Pointer, px: Pointer, pw: Pointer, pdx: Pointer, pdw: Pointer, rows: Int64,
                     eps: Float32, ctas: Int32, stream: cuda.CUstream, d: Constexpr[int], vec: Constexpr[int],
                     nper: Constexpr[int], threads: Constexpr[int], x_dtype: Constexpr[str],
                     w_dtype: Constexpr[str], ctas_per_sm: Constexpr[int], pitch: Constexpr[int]) -> None:
    """The grid is sized for ctas_per_sm resident CTAs: .minnctapersm makes ptxas fit the registers to it
    (a CTA that does not fit would run in a second wave). The carveout stays the driver's default."""
    rmsnorm_bwd_kernel(pdy, px, pw, pdx, pdw, rows, eps, d, vec, nper, threads, pitch).launch(
        grid=[ctas, 1, 1], block=[threads, 1, 1], stream=stream, min_blocks_per_mp=ctas_per_sm,
        preferred_smem_carveout=-1, use_pdl=PDL
    )


@cute.jit
def add_rmsnorm_bwd_host(pdy: Pointer, pds: Pointer, px: Pointer, pw: Pointer, pdx: Pointer, pdw: Pointer,
                         rows: Int64, eps: Float32, ctas: Int32, stream: cuda.CUstream, d: Constexpr[int],
                         vec: Constexpr[int], nper: Constexpr[int], threads: Constexpr[int],
                         x_dtype: Constexpr[str], w_dtype: Constexpr[str],
                         ctas_per_sm: Constexpr[int]) -> None:
    """rmsnorm_bwd_host's grid for add_rmsnorm's backward: dx written as ds + dx."""
    add_rmsnorm_bwd_kernel(pdy, pds, px, pw, pdx, pdw, rows, eps, d, vec, nper, threads).launch(
        grid=[ctas, 1, 1], block=[threads, 1, 1], stream=stream, min_blocks_per_mp=ctas_per_sm,
        preferred_smem_carveout=-1, use_pdl=PDL
    )


@cute.kernel
def rmsnorm_dw_kernel(pparts: Pointer, pdw: Pointer, nparts: Int32, d: Int64, vec: Constexpr[int]) -> None:
    """dw[c] = sum over the CTA partials in index order (deterministic), one rounding to w's dtype.
    DW_UNROLL partials load at once (indices clamped in range) before their in-order adds: the chain of
    nparts dependent adds waits on one load latency per chunk instead of per partial."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    cv = Int64(bidx) * DW_THREADS + Int64(tidx)
    nv = d // vec
    if cv < nv:
        gp = cute.zipped_divide(cute.make_tensor(pparts, cute.make_layout(Int64(nparts) * d)), (vec,))
        gdw = cute.zipped_divide(cute.make_tensor(pdw, cute.make_layout(d)), (vec,))
        acc = cute.make_rmem_tensor((vec,), Float32)
        acc.fill(0.0)
        for c in cutlass.range((nparts + DW_UNROLL - 1) // DW_UNROLL):  # type: ignore[attr-defined]
            base = c * DW_UNROLL
            parts = []
            for u in range_constexpr(DW_UNROLL):
                last = Int32(select_(base + u < nparts, base + u, nparts - 1))
                parts.append(gp[(None, Int64(last) * nv + cv)].load().reshape((vec,)))
            for u in range_constexpr(DW_UNROLL):
                if base + u < nparts:
                    for j in range_constexpr(vec):
                        acc[j] = add_rn(acc[j], parts[u][j])
        gdw[(None, cv)].store(acc.load().to(gdw.element_type))


@cute.jit
def rmsnorm_dw_host(pparts: Pointer, pdw: Pointer, nparts: Int32, d: Int64, stream: cuda.CUstream,
                    vec: Constexpr[int], w_dtype: Constexpr[str]) -> None:
    rmsnorm_dw_kernel(pparts, pdw, nparts, d, vec).launch(
        grid=[(d // vec + DW_THREADS - 1) // DW_THREADS, 1, 1], block=[DW_THREADS, 1, 1], stream=stream,
        use_pdl=PDL
    )


def pointer(dtype_name: str, address: int, align: int) -> Any:
    return make_ptr(DTYPES[dtype_name], address, cute.AddressSpace.gmem, assumed_align=align)


def _align(dtype_name: str, vec: int) -> int:
    return min(16, vec * int(DTYPES[dtype_name].width) // 8)


def pointers(kernel: str, addresses: tuple[int, ...], spec: dict[str, Any]) -> list[Any]:
    """Typed pointers of `kernel`'s tensors in argument order; alignment = one vector (<= 16 bytes)."""
    x, w, vec = spec.get("x_dtype", ""), spec["w_dtype"], spec["vec"]
    names = {"rmsnorm_fwd": (x, w, x), "rmsnorm_bwd": (x, x, w, x, "float32"), "rmsnorm_dw": ("float32", w),
             "add_rmsnorm_fwd": (x, x, w, x, x), "add_rmsnorm_bwd": (x, x, x, w, x, "float32")}[kernel]
    return [pointer(n, a, _align(n, vec)) for n, a in zip(names, addresses, strict=True)]


def compile_args(kernel: str, spec: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """Host function and fake arguments (null pointers, zero sizes) that compile `kernel` without a GPU."""
    counts = {"rmsnorm_fwd": 3, "rmsnorm_bwd": 5, "rmsnorm_dw": 2, "add_rmsnorm_fwd": 5, "add_rmsnorm_bwd": 6}
    fake = pointers(kernel, (0,) * counts[kernel], spec)
    s = cuda.CUstream(0)
    if kernel == "rmsnorm_dw":
        return rmsnorm_dw_host, (*fake, Int32(1), Int64(0), s, spec["vec"], spec["w_dtype"])
    row = (spec["d"], spec["vec"], spec["nper"], spec["threads"], spec["x_dtype"], spec["w_dtype"])
    pitch = (spec.get("pitch", spec["d"]),) if kernel in ("rmsnorm_fwd", "rmsnorm_bwd") else ()
    if kernel in ("rmsnorm_fwd", "add_rmsnorm_fwd"):
        fwd = rmsnorm_fwd_host if kernel == "rmsnorm_fwd" else add_rmsnorm_fwd_host
        return fwd, (*fake, Int64(0), Float32(0.0), s, *row, *pitch)
    bwd = rmsnorm_bwd_host if kernel == "rmsnorm_bwd" else add_rmsnorm_bwd_host
    return bwd, (*fake, Int64(0), Float32(0.0), Int32(1), s, *row, spec["ctas_per_sm"], *pitch)
