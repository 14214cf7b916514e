"""CuTeDSL AdamW step: flat elementwise over fp32 masters, one 128-bit vector per thread, guarded tail; every
step of the spec's formula is one correctly rounded fp32 op (.rn), in its order, so the per-step error budget
holds; bf16 moments widen exactly and are stored rounded once. Import after runtime.import_cutlass(arch)."""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int16, Int64
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer

from nmoe.fast.kernels.prims import PDL, add_rn, await_upstream, div_rn, mul_rn, out_bits, sqrt_rn, sub_rn

THREADS = 256
DTYPES: dict[str, Any] = {"bfloat16": BFloat16, "float32": Float32}


@cute.jit
def _update(fp: cute.Tensor, fg: cute.Tensor, fm: cute.Tensor, fv: cute.Tensor, scale: Float32,
            decay: Float32, b1: Float32, omb1: Float32, b2: Float32, omb2: Float32, bc1: Float32,
            bc2: Float32, lr: Float32, eps: Float32, vec: Constexpr[int], scaled: Constexpr[bool]) -> None:
    """g = g*scale (scaled); p = p*decay; m = m*b1 + g*(1-b1); v = v*b2 + (g*g)*(1-b2);
    p -= (lr*(m/bc1)) / (sqrt(v/bc2) + eps)."""
    for j in range_constexpr(vec):
        gj: Any = fg[j]
        g = gj.to(Float32) if const_expr(fg.element_type != Float32) else gj
        if const_expr(scaled):
            g = mul_rn(g, scale)
        p1 = mul_rn(fp[j], decay)
        m1 = add_rn(mul_rn(fm[j], b1), mul_rn(g, omb1))
        v1 = add_rn(mul_rn(fv[j], b2), mul_rn(mul_rn(g, g), omb2))
        den = add_rn(sqrt_rn(div_rn(v1, bc2)), eps)
        fp[j] = sub_rn(p1, div_rn(mul_rn(lr, div_rn(m1, bc1)), den))
        fm[j] = m1
        fv[j] = v1


@cute.jit
def _load_tail(m: cute.Tensor, f: Any, base: Int64, n: Int64, vec: Constexpr[int]) -> None:
    """f[j] = m[base + j] in f's type (a bf16 moment widens exactly) where inside n, else 0."""
    f.fill(0.0)
    for j in range_constexpr(vec):
        if base + j < n:
            x: Any = m[base + j]
            f[j] = x.to(Float32) if const_expr(m.element_type != f.element_type) else x


@cute.jit
def _store_tail(m: cute.Tensor, f: cute.Tensor, base: Int64, n: Int64, vec: Constexpr[int]) -> None:
    for j in range_constexpr(vec):
        if base + j < n:
            m[base + j] = f[j]


@cute.jit
def _store_rounded(m: cute.Tensor, f: cute.Tensor, i: Int64, base: Int64, n: Int64, vec: Constexpr[int],
                   full: Constexpr[bool]) -> None:
    bits = cute.make_rmem_tensor((vec,), Int16)
    bits.store(out_bits(f.load(), "bfloat16"))
    words = cute.recast_tensor(m, Int16)
    if const_expr(full):
        cute.zipped_divide(words, (vec,))[(None, i)].store(bits.load())
    else:
        _store_tail(words, bits, base, n, vec)


@cute.jit
def _store_moments(mm: cute.Tensor, mv: cute.Tensor, fm: cute.Tensor, fv: cute.Tensor, i: Int64, base: Int64,
                   n: Int64, vec: Constexpr[int], full: Constexpr[bool]) -> None:
    """fm, fv into the moments: as they are (fp32), or rounded once to nearest even (bf16 moments)."""
    if const_expr(mm.element_type == Float32):
        if const_expr(full):
            gm: Any = cute.zipped_divide(mm, (vec,))
            gv: Any = cute.zipped_divide(mv, (vec,))
            gm[(None, i)].store(fm.load())
            gv[(None, i)].store(fv.load())
        else:
            _store_tail(mm, fm, base, n, vec)
            _store_tail(mv, fv, base, n, vec)
    else:
        _store_rounded(mm, fm, i, base, n, vec, full)
        _store_rounded(mv, fv, i, base, n, vec, full)


@cute.kernel
def adamw_kernel(pp: Pointer, pg: Pointer, pm: Pointer, pv: Pointer, ps: Pointer, pl: Pointer, n: Int64,
                 decay: Float32, b1: Float32, omb1: Float32, b2: Float32, omb2: Float32, bc1: Float32,
                 bc2: Float32, lr: Float32, eps: Float32, vec: Constexpr[int], scaled: Constexpr[bool],
                 low: Constexpr[bool]) -> None:
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = Int64(bidx) * THREADS + Int64(tidx)
    nfull = n // vec
    mp = cute.make_tensor(pp, cute.make_layout(n))
    mg = cute.make_tensor(pg, cute.make_layout(n))
    mm = cute.make_tensor(pm, cute.make_layout(n))
    mv = cute.make_tensor(pv, cute.make_layout(n))
    fp = cute.make_rmem_tensor((vec,), Float32)
    fg = cute.make_rmem_tensor((vec,), mg.element_type)
    fm = cute.make_rmem_tensor((vec,), Float32)
    fv = cute.make_rmem_tensor((vec,), Float32)
    ml = cute.recast_tensor(cute.make_tensor(pl, cute.make_layout(n)), Int16)
    fl = cute.make_rmem_tensor((vec,), Int16)
    scale = Float32(1.0)
    if const_expr(scaled):
        scale = cute.make_tensor(ps, cute.make_layout(1))[0]
    if i < nfull:
        gp = cute.zipped_divide(mp, (vec,))
        gm = cute.zipped_divide(mm, (vec,))
        gv = cute.zipped_divide(mv, (vec,))
        fp.store(gp[(None, i)].load().reshape((vec,)))
        fg.store(cute.zipped_divide(mg, (vec,))[(None, i)].load().reshape((vec,)))
        fm.store(gm[(None, i)].load().reshape((vec,)).to(Float32))
        fv.store(gv[(None, i)].load().reshape((vec,)).to(Float32))
        _update(fp, fg, fm, fv, scale, decay, b1, omb1, b2, omb2, bc1, bc2, lr, eps, vec, scaled)
        gp[(None, i)].store(fp.load())
        _store_moments(mm, mv, fm, fv, i, Int64(0), n, vec, True)
        if const_expr(low):
            fl.store(out_bits(fp.load(), "bfloat16"))
            cute.zipped_divide(ml, (vec,))[(None, i)].store(fl.load())
    elif i == nfull:
        base = nfull * vec
        _load_tail(mp, fp, base, n, vec)
        _load_tail(mg, fg, base, n, vec)
        _load_tail(mm, fm, base, n, vec)
        _load_tail(mv, fv, base, n, vec)
        _update(fp, fg, fm, fv, scale, decay, b1, omb1, b2, omb2, bc1, bc2, lr, eps, vec, scaled)
        _store_tail(mp, fp, base, n, vec)
        _store_moments(mm, mv, fm, fv, i, base, n, vec, False)
        if const_expr(low):
            fl.store(out_bits(fp.load(), "bfloat16"))
            _store_tail(ml, fl, base, n, vec)


@cute.jit
def adamw_host(pp: Pointer, pg: Pointer, pm: Pointer, pv: Pointer, ps: Pointer, pl: Pointer, n: Int64,
               decay: Float32, b1: Float32, omb1: Float32, b2: Float32, omb2: Float32, bc1: Float32,
               bc2: Float32, lr: Float32, eps: Float32, stream: cuda.CUstream, vec: Constexpr[int],
               grad_dtype: Constexpr[str], scaled: Constexpr[bool], low: Constexpr[bool]) -> None:
    """The step over n masters; scaled: g times the fp32 factor at ps; low: the new p also rounded once into
    the bf16 param at pl (the model's copy of a bf16-param master). The moments' pointer type (fp32 or
    bf16) picks how they are read and stored."""
    adamw_kernel(pp, pg, pm, pv, ps, pl, n, decay, b1, omb1, b2, omb2, bc1, bc2, lr, eps, vec, scaled,
                 low).launch(
        grid=[(n // vec + THREADS) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


def compile_args(kernel: str, spec: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """Host function and fake arguments (null pointers, n = 0) that compile `kernel` without a GPU."""
    if kernel != "adamw":
        raise KeyError(f"nmoe.fast.kernels.optim has no kernel {kernel!r}; it holds adamw")
    vec, gd, sd = spec["vec"], DTYPES[spec["grad_dtype"]], DTYPES[spec["state_dtype"]]
    gmem = cute.AddressSpace.gmem
    ptrs = [make_ptr(t, 0, gmem, assumed_align=vec * t.width // 8) for t in (Float32, gd, sd, sd)]
    scale = make_ptr(Float32, 0, gmem, assumed_align=4)
    low = make_ptr(BFloat16, 0, gmem, assumed_align=vec * 2)
    scalars = [Float32(0.0)] * 9
    return adamw_host, (*ptrs, scale, low, Int64(0), *scalars, cuda.CUstream(0), vec, spec["grad_dtype"],
                        spec["scaled"], spec["low"])
