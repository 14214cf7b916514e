"""CuTeDSL kernels for combine fwd/bwd: every product and sum rounded separately, as the spec orders them.

Import only after nmoe.fast.runtime.import_cutlass(arch): the DSL fixes its target arch at first import.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer

from nmoe.constants import ACT_H_COLUMNS
from nmoe.fast.kernels.activation import relu2_bwd_f32, relu2_f32
from nmoe.fast.kernels.prims import PDL, add_rn, await_upstream, mul_rn, out_bits
from nmoe.fast.kernels.swiglu import swiglu_bwd_pairs, swiglu_pairs

THREADS = 128
WARP = 32


@cute.jit
def _load_f32(g: cute.Tensor, i: Int64, vec: Constexpr[int]) -> cute.Tensor:
    src: Any = g[(None, i)]
    frag: cute.Tensor = cute.make_rmem_tensor((vec,), Float32)
    frag.store(src.load().reshape((vec,)).to(Float32))
    return frag


@cute.jit
def _store_bits(g: cute.Tensor, i: Int64, v: cute.TensorSSA) -> None:
    bits = out_bits(v, "bfloat16")
    cute.recast_tensor(g[(None, i)], bits.dtype).store(bits)


@cute.jit
def _combine_token(gy: cute.Tensor, mrow: cute.Tensor, mw: cute.Tensor, pshared: Pointer, pout: Pointer,
                   t: Int64, t_rows: Int64, h: Int64, hv: Int64, scale: Float32, k: Constexpr[int],
                   vec: Constexpr[int], has_shared: Constexpr[bool], gather: Constexpr[bool]) -> None:
    """out[t] = bf16(scale * sum_s w[t,s] * y_s (+ shared[t])) in slot order; y_s is row t*k+s of gy, or row
    mrow[t*k+s] when gathering from the expert-sorted output."""
    nvec = h // vec
    gout = cute.zipped_divide(cute.make_tensor(pout, cute.make_layout(t_rows * h)), (vec,))
    acc = cute.make_rmem_tensor((vec,), Float32)
    for s in range_constexpr(k):
        row = Int64(mrow[t * k + s]) if const_expr(gather) else t * k + s
        ys = _load_f32(gy, row * nvec + hv, vec)
        ws = mw[t * k + s]
        for j in range_constexpr(vec):
            if const_expr(s == 0):
                acc[j] = mul_rn(ws, ys[j])
            else:
                acc[j] = add_rn(acc[j], mul_rn(ws, ys[j]))
    for j in range_constexpr(vec):
        acc[j] = mul_rn(acc[j], scale)
    if const_expr(has_shared):
        gsh = cute.zipped_divide(cute.make_tensor(pshared, cute.make_layout(t_rows * h)), (vec,))
        sh = _load_f32(gsh, t * nvec + hv, vec)
        for j in range_constexpr(vec):
            acc[j] = add_rn(acc[j], sh[j])
    _store_bits(gout, t * nvec + hv, acc.load())


@cute.kernel
def combine_fwd_kernel(py: Pointer, pw: Pointer, pshared: Pointer, pout: Pointer, t_rows: Int64, h: Int64,
                       scale: Float32, k: Constexpr[int], vec: Constexpr[int],
                       has_shared: Constexpr[bool]) -> None:
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    t_blk, chunk, _ = cute.arch.block_idx()
    t = Int64(t_blk)
    nvec = h // vec
    hv = Int64(chunk) * THREADS + Int64(tidx)
    if hv < nvec:
        gy = cute.zipped_divide(cute.make_tensor(py, cute.make_layout(t_rows * k * h)), (vec,))
        mw = cute.make_tensor(pw, cute.make_layout(t_rows * k))
        _combine_token(gy, mw, mw, pshared, pout, t, t_rows, h, hv, scale, k, vec, has_shared, False)


@cute.kernel
def combine_gather_fwd_kernel(pyp: Pointer, prow: Pointer, pw: Pointer, pshared: Pointer, pout: Pointer,
                              t_rows: Int64, n_rows: Int64, h: Int64, scale: Float32, k: Constexpr[int],
                              vec: Constexpr[int], has_shared: Constexpr[bool]) -> None:
    """combine_fwd with slot s's row read from yp[row_of[s]]: the [T, K, H] copy is never written."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    t_blk, chunk, _ = cute.arch.block_idx()
    t = Int64(t_blk)
    nvec = h // vec
    hv = Int64(chunk) * THREADS + Int64(tidx)
    if hv < nvec:
        gyp = cute.zipped_divide(cute.make_tensor(pyp, cute.make_layout(n_rows * h)), (vec,))
        mrow = cute.make_tensor(prow, cute.make_layout(t_rows * k))
        mw = cute.make_tensor(pw, cute.make_layout(t_rows * k))
        _combine_token(gyp, mrow, mw, pshared, pout, t, t_rows, h, hv, scale, k, vec, has_shared, True)


@cute.jit
def _warp_row() -> tuple[Int64, Int64]:
    """(lane, row) of a kernel that gives each row one warp, THREADS // WARP rows per CTA."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    return Int64(tidx % WARP), Int64(bidx) * (THREADS // WARP) + Int64(tidx // WARP)


@cute.kernel
def combine_bwd_kernel(pdout: Pointer, py: Pointer, pw: Pointer, pdy: Pointer, pdw: Pointer, t_rows: Int64,
                       h: Int64, scale: Float32, k: Constexpr[int], vec: Constexpr[int]) -> None:
    """One warp per token: dy_k = bf16(g*w_k) with g = dout*scale, dw_k = warp-reduced sum_h g*y_k."""
    await_upstream()
    lane, t = _warp_row()
    if t < t_rows:
        nvec = h // vec
        gdout = cute.zipped_divide(cute.make_tensor(pdout, cute.make_layout(t_rows * h)), (vec,))
        gy = cute.zipped_divide(cute.make_tensor(py, cute.make_layout(t_rows * k * h)), (vec,))
        gdy = cute.zipped_divide(cute.make_tensor(pdy, cute.make_layout(t_rows * k * h)), (vec,))
        mw = cute.make_tensor(pw, cute.make_layout(t_rows * k))
        mdw = cute.make_tensor(pdw, cute.make_layout(t_rows * k))
        part = cute.make_rmem_tensor((k,), Float32)
        part.fill(0.0)
        for hv in range(lane, nvec, WARP):
            g = _load_f32(gdout, t * nvec + hv, vec)
            for j in range_constexpr(vec):
                g[j] = mul_rn(g[j], scale)
            for kk in range_constexpr(k):
                yk = _load_f32(gy, (t * k + kk) * nvec + hv, vec)
                wk = mw[t * k + kk]
                dyk = cute.make_rmem_tensor((vec,), Float32)
                for j in range_constexpr(vec):
                    dyk[j] = mul_rn(g[j], wk)
                    part[kk] = add_rn(part[kk], mul_rn(g[j], yk[j]))
                _store_bits(gdy, (t * k + kk) * nvec + hv, dyk.load())
        for kk in range_constexpr(k):
            total = cute.arch.warp_reduction(part[kk], add_rn)
            if lane == 0:
                mdw[t * k + kk] = total


@cute.jit
def _rounded(v: cute.Tensor, vec: Constexpr[int]) -> cute.Tensor:
    """v rounded to bf16 and widened back: the value a bf16 store then an fp32 load would give."""
    frag: cute.Tensor = cute.make_rmem_tensor((vec,), Float32)
    frag.store(v.load().to(BFloat16).to(Float32))
    return frag


def _act(hf: cute.Tensor, vec: int, act: str) -> cute.Tensor:
    if act == "swiglu":
        pairs: cute.Tensor = swiglu_pairs(hf, vec)
        return pairs
    frag: cute.Tensor = cute.make_rmem_tensor((vec,), Float32)
    frag.store(relu2_f32(hf.load()))
    return frag


def _act_bwd(df: cute.Tensor, hf: cute.Tensor, vec: int, act: str) -> cute.Tensor:
    if act == "swiglu":
        dh: cute.Tensor = swiglu_bwd_pairs(df, hf, vec)
        return dh
    frag: cute.Tensor = cute.make_rmem_tensor((vec,), Float32)
    frag.store(relu2_bwd_f32(df.load(), hf.load()))
    return frag


@cute.kernel
def expert_rows_bwd_kernel(pdz: Pointer, ph: Pointer, pw: Pointer, paw: Pointer, pdot: Pointer, rows: Int64,
                           n: Int64, vec: Constexpr[int], act: Constexpr[str], width: Constexpr[int]) -> None:
    """One warp per row r (w = w[r]): a = bf16(act(h)); aw = bf16(w*a); dot = warp-reduced sum dz*a;
    h <- bf16(act_bwd(bf16(dz*w), h)). As combine_bwd and combine with K = 1 between act and act_bwd."""
    await_upstream()
    lane, r = _warp_row()
    if r < rows:
        nvec = n // vec
        gdz = cute.zipped_divide(cute.make_tensor(pdz, cute.make_layout(rows * n)), (vec,))
        gh = cute.zipped_divide(cute.make_tensor(ph, cute.make_layout(rows * n * width)), (width * vec,))
        gaw = cute.zipped_divide(cute.make_tensor(paw, cute.make_layout(rows * n)), (vec,))
        wr = cute.make_tensor(pw, cute.make_layout(rows))[r]
        part = cute.make_rmem_tensor((1,), Float32)
        part.fill(0.0)
        for hv in range(lane, nvec, WARP):
            g = _load_f32(gdz, r * nvec + hv, vec)
            hf = _load_f32(gh, r * nvec + hv, width * vec)
            a = _rounded(_act(hf, vec, act), vec)
            dzw = cute.make_rmem_tensor((vec,), Float32)
            aw = cute.make_rmem_tensor((vec,), Float32)
            for j in range_constexpr(vec):
                dzw[j] = mul_rn(g[j], wr)
                part[0] = add_rn(part[0], mul_rn(g[j], a[j]))
                aw[j] = mul_rn(wr, a[j])
            _store_bits(gaw, r * nvec + hv, aw.load())
            _store_bits(gh, r * nvec + hv, _act_bwd(_rounded(dzw, vec), hf, vec, act).load())
        total = cute.arch.warp_reduction(part[0], add_rn)
        mdot = cute.make_tensor(pdot, cute.make_layout(rows))
        if lane == 0:
            mdot[r] = total


@cute.jit
def combine_fwd_host(py: Pointer, pw: Pointer, pshared: Pointer, pout: Pointer, t_rows: Int64, h: Int64,
                     scale: Float32, stream: cuda.CUstream, k: Constexpr[int], vec: Constexpr[int],
                     has_shared: Constexpr[bool]) -> None:
    chunks = (h // vec + THREADS - 1) // THREADS
    combine_fwd_kernel(py, pw, pshared, pout, t_rows, h, scale, k, vec, has_shared).launch(
        grid=[t_rows, chunks, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


@cute.jit
def combine_gather_fwd_host(pyp: Pointer, prow: Pointer, pw: Pointer, pshared: Pointer, pout: Pointer,
                            t_rows: Int64, n_rows: Int64, h: Int64, scale: Float32, stream: cuda.CUstream,
                            k: Constexpr[int], vec: Constexpr[int], has_shared: Constexpr[bool]) -> None:
    chunks = (h // vec + THREADS - 1) // THREADS
    kernel = combine_gather_fwd_kernel(pyp, prow, pw, pshared, pout, t_rows, n_rows, h, scale, k, vec,
                                       has_shared)
    kernel.launch(grid=[t_rows, chunks, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL)


@cute.jit
def combine_bwd_host(pdout: Pointer, py: Pointer, pw: Pointer, pdy: Pointer, pdw: Pointer, t_rows: Int64,
                     h: Int64, scale: Float32, stream: cuda.CUstream, k: Constexpr[int],
                     vec: Constexpr[int]) -> None:
    warps = THREADS // WARP
    combine_bwd_kernel(pdout, py, pw, pdy, pdw, t_rows, h, scale, k, vec).launch(
        grid=[(t_rows + warps - 1) // warps, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


@cute.jit
def expert_rows_bwd_host(pdz: Pointer, ph: Pointer, pw: Pointer, paw: Pointer, pdot: Pointer, rows: Int64,
                         n: Int64, stream: cuda.CUstream, vec: Constexpr[int], act: Constexpr[str]) -> None:
    warps = THREADS // WARP
    width = ACT_H_COLUMNS[act]
    expert_rows_bwd_kernel(pdz, ph, pw, paw, pdot, rows, n, vec, act, width).launch(
        grid=[(rows + warps - 1) // warps, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


def bf16_pointer(address: int, vec: int) -> Any:
    return make_ptr(BFloat16, address, cute.AddressSpace.gmem, assumed_align=2 * vec)


def f32_pointer(address: int) -> Any:
    return make_ptr(Float32, address, cute.AddressSpace.gmem, assumed_align=4)


def i32_pointer(address: int) -> Any:
    return make_ptr(Int32, address, cute.AddressSpace.gmem, assumed_align=4)


def expert_rows_bwd_args(vec: int, act: str) -> tuple[Any, tuple[Any, ...]]:
    b, f = bf16_pointer(0, vec), f32_pointer(0)
    return expert_rows_bwd_host, (b, b, f, b, f, Int64(0), Int64(0), cuda.CUstream(0), vec, act)


def compile_args(kernel: str, k: int, vec: int, has_shared: bool) -> tuple[Any, tuple[Any, ...]]:
    """Host function and placeholder arguments that fix one specialisation (k, vec, has_shared)."""
    b, f = bf16_pointer(0, vec), f32_pointer(0)
    scalars = (Int64(0), Int64(0), Float32(1.0), cuda.CUstream(0))
    if kernel == "combine_fwd":
        return combine_fwd_host, (b, f, b, b, *scalars, k, vec, has_shared)
    if kernel == "combine_gather_fwd":
        return combine_gather_fwd_host, (b, i32_pointer(0), f, b, b, Int64(0), *scalars, k, vec, has_shared)
    if kernel == "combine_bwd":
        return combine_bwd_host, (b, b, f, b, f, *scalars, k, vec)
    raise ValueError(f"unknown combine kernel {kernel!r}; choose combine_fwd, combine_gather_fwd or "
                     "combine_bwd")
