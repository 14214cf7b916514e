"""CuTeDSL kernel for rope fwd/bwd: flat over x's rows of d, one vector of `vec` elements (vec/2 pairs) per
thread; rows sit `ld` elements apart in x and y alike (ld > d: a column slice, rotated where it lies).

Each product and the add/sub are separately rounded fp32 ops (mul.rn/add.rn/sub.rn), as the spec's torch
ops are, so ptxas cannot contract them into an FMA; the result is rounded once to x's dtype.
Import only after nmoe.fast.runtime.import_cutlass(arch): the DSL fixes its target arch at first import.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer

from nmoe.fast.kernels.prims import PDL, add_rn, await_upstream, mul_rn, out_bits, sub_rn

THREADS = 256
DTYPES: dict[str, Any] = {"bfloat16": BFloat16, "float32": Float32}


@cute.jit
def _rotate(xv: cute.TensorSSA, cv: cute.TensorSSA, sv: cute.TensorSSA, vec: Constexpr[int],
            inverse: Constexpr[bool]) -> cute.TensorSSA:
    """fwd: (x0 c - x1 s, x0 s + x1 c); inverse (bwd, angle negated): (x0 c + x1 s, x1 c - x0 s).

    IEEE defines a - b as a + (-b), so the inverse is bitwise the spec's apply_rope(dy, cos, -sin).
    """
    y = cute.make_rmem_tensor((vec,), Float32)
    for k in range_constexpr(vec // 2):
        x0, x1, c, s = xv[2 * k], xv[2 * k + 1], cv[k], sv[k]
        if const_expr(inverse):
            y[2 * k] = add_rn(mul_rn(x0, c), mul_rn(x1, s))
            y[2 * k + 1] = sub_rn(mul_rn(x1, c), mul_rn(x0, s))
        else:
            y[2 * k] = sub_rn(mul_rn(x0, c), mul_rn(x1, s))
            y[2 * k + 1] = add_rn(mul_rn(x0, s), mul_rn(x1, c))
    out: cute.TensorSSA = y.load()
    return out


@cute.kernel
def rope_kernel(px: Pointer, pcos: Pointer, psin: Pointer, py: Pointer, n: Int64, inner: Int64, s_len: Int64,
                d: Constexpr[int], ld: Constexpr[int], vec: Constexpr[int], dtype_name: Constexpr[str],
                inverse: Constexpr[bool]) -> None:
    """x viewed as [outer, S, inner, d] (n elements, rows ld apart); row r's table row is (r // inner) % S."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = Int64(bidx) * THREADS + Int64(tidx)
    half = d // 2
    hv = vec // 2
    if i < n // vec:
        e = i * vec
        row = e // d
        col = e - row * d
        pos = (row // inner) % s_len
        tv = (pos * half + col // 2) // hv
        at = (row * ld + col) // vec
        mx = cute.make_tensor(px, cute.make_layout(n // d * ld))
        my = cute.make_tensor(py, cute.make_layout(n // d * ld))
        mc = cute.make_tensor(pcos, cute.make_layout(s_len * half))
        ms = cute.make_tensor(psin, cute.make_layout(s_len * half))
        xv = cute.zipped_divide(mx, (vec,))[(None, at)].load().reshape((vec,)).to(Float32)
        cv = cute.zipped_divide(mc, (hv,))[(None, tv)].load().reshape((hv,))
        sv = cute.zipped_divide(ms, (hv,))[(None, tv)].load().reshape((hv,))
        bits = out_bits(_rotate(xv, cv, sv, vec, inverse), dtype_name)
        cute.recast_tensor(cute.zipped_divide(my, (vec,))[(None, at)], bits.dtype).store(bits)


@cute.jit
def rope_host(px: Pointer, pcos: Pointer, psin: Pointer, py: Pointer, n: Int64, inner: Int64, s_len: Int64,
              stream: cuda.CUstream, d: Constexpr[int], ld: Constexpr[int], vec: Constexpr[int],
              dtype_name: Constexpr[str], inverse: Constexpr[bool]) -> None:
    rope_kernel(px, pcos, psin, py, n, inner, s_len, d, ld, vec, dtype_name, inverse).launch(
        grid=[(n // vec + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


def compile_args(kernel: str, spec: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """rope_fwd / rope_bwd: x and y `vec`-aligned in the spec's dtype with rows `ld` apart, fp32 tables
    `vec/2`-aligned."""
    if kernel not in ("rope_fwd", "rope_bwd"):
        raise ValueError(f"unknown rope kernel {kernel!r}; choose rope_fwd or rope_bwd")
    dtype = DTYPES[spec["dtype"]]
    vec = spec["vec"]
    xp = make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=vec * dtype.width // 8)
    tp = make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=vec // 2 * 4)
    return rope_host, (xp, tp, tp, xp, Int64(0), Int64(1), Int64(1), cuda.CUstream(0), spec["d"], spec["ld"],
                       vec, spec["dtype"], kernel == "rope_bwd")
