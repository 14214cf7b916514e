"""CuTeDSL kernels for interleaved swiglu fwd/bwd: flat over output pairs, 128-bit vectors, guarded tail.

Every fp32 op the reference rounds separately is a separate `.rn` op here (no FMA contraction; the sigmoid's
division is IEEE division's own fast path, unit_quotient), so the only difference from the reference is expf's
last bits. Import only after nmoe.fast.runtime.import_cutlass(arch).
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int64
from cutlass.base_dsl.ast_helpers import range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.typing import Pointer

from nmoe.fast.kernels.activation import elementwise_args
from nmoe.fast.kernels.activation import pointers as pointers
from nmoe.fast.kernels.prims import (
    PDL,
    add_rn,
    await_upstream,
    fma_rn,
    mul_rn,
    out_bits,
    rcp_approx,
    store_full,
    store_tail,
)

THREADS = 256


def _frag(vec: Constexpr[int]) -> cute.Tensor:
    frag: cute.Tensor = cute.make_rmem_tensor((vec,), Float32)
    return frag


@cute.jit
def unit_quotient(num: Float32, den: Float32) -> Float32:
    """The sigmoid's (1 or e) / (1 + e), e in [0, 1]: div.rn.f32's own fast path (refined reciprocal, one
    corrected quotient) without its range check and slow-path branch, which only a tiny num takes; its den is
    then exactly 1, where this path is exact too."""
    r = rcp_approx(den)
    y = fma_rn(r, fma_rn(-den, r, 1.0), r)
    q = mul_rn(num, y)
    return fma_rn(y, fma_rn(-den, q, num), q)


@cute.jit
def _sigmoid(g: cute.Tensor, vec: Constexpr[int]) -> cute.Tensor:
    """s = 1/(1+e) for g >= 0 else e/(1+e), e = exp(-|g|): the reference's subnormal-preserving form."""
    gv = g.load()
    e = cute.math.exp(-cute.math.absf(gv))  # type: ignore[attr-defined]
    ef = _frag(vec)
    ef.store(e)
    num = _frag(vec)
    num.store(cute.where(gv >= cute.full_like(gv, 0.0), cute.full_like(gv, 1.0), e))
    s = _frag(vec)
    for j in range_constexpr(vec):
        s[j] = unit_quotient(num[j], add_rn(1.0, ef[j]))
    return s


@cute.jit
def _split(hf: cute.Tensor, vec: Constexpr[int]) -> tuple[cute.Tensor, cute.Tensor]:
    g, u = _frag(vec), _frag(vec)
    for j in range_constexpr(vec):
        g[j] = hf[2 * j]
        u[j] = hf[2 * j + 1]
    return g, u


@cute.jit
def swiglu_pairs(hf: cute.Tensor, vec: Constexpr[int]) -> cute.Tensor:
    """vec outputs from 2*vec interleaved fp32 inputs; the grouped GEMM's fused epilogue calls it too."""
    g, u = _split(hf, vec)
    s = _sigmoid(g, vec)
    out = _frag(vec)
    for j in range_constexpr(vec):
        out[j] = mul_rn(mul_rn(g[j], s[j]), u[j])
    return out


@cute.jit
def swiglu_bwd_pairs(df: cute.Tensor, hf: cute.Tensor, vec: Constexpr[int]) -> cute.Tensor:
    """dg = (d*u) * (s*(1 + g*(1-s))), du = d*(g*s), interleaved like h, each product and sum rounded."""
    g, u = _split(hf, vec)
    s = _sigmoid(g, vec)
    dh = _frag(2 * vec)
    for j in range_constexpr(vec):
        ds = mul_rn(s[j], add_rn(1.0, mul_rn(g[j], add_rn(1.0, -s[j]))))
        dh[2 * j] = mul_rn(mul_rn(df[j], u[j]), ds)
        dh[2 * j + 1] = mul_rn(df[j], mul_rn(g[j], s[j]))
    return dh


@cute.jit
def _load_full(m: cute.Tensor, i: Int64, width: Constexpr[int]) -> cute.Tensor:
    frag = _frag(width)
    src: Any = cute.zipped_divide(m, (width,))[(None, i)]
    frag.store(src.load().reshape((width,)).to(Float32))
    return frag


@cute.jit
def _load_tail(m: cute.Tensor, base: Int64, n: Int64, width: Constexpr[int]) -> cute.Tensor:
    frag = _frag(width)
    frag.fill(Float32(0.0))
    for j in range_constexpr(width):
        if base + j < n:
            x: Any = m[base + j]
            frag[j] = x.to(Float32)
    return frag


@cute.jit
def _store_full(m: cute.Tensor, i: Int64, v: cute.Tensor, width: Constexpr[int],
                dtype_name: Constexpr[str]) -> None:
    store_full(cute.zipped_divide(m, (width,)), i, out_bits(v.load(), dtype_name))


@cute.jit
def _store_tail(m: cute.Tensor, base: Int64, n: Int64, v: cute.Tensor, width: Constexpr[int],
                dtype_name: Constexpr[str]) -> None:
    store_tail(m, base, n, out_bits(v.load(), dtype_name), width)


@cute.kernel
def swiglu_fwd_kernel(ph: Pointer, py: Pointer, n: Int64, vec: Constexpr[int],
                      dtype_name: Constexpr[str]) -> None:
    """n = number of outputs; thread i owns outputs [i*vec, i*vec+vec) and their 2*vec interleaved inputs."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = Int64(bidx) * THREADS + Int64(tidx)
    nfull = n // vec
    mh = cute.make_tensor(ph, cute.make_layout(2 * n))
    my = cute.make_tensor(py, cute.make_layout(n))
    if i < nfull:
        _store_full(my, i, swiglu_pairs(_load_full(mh, i, 2 * vec), vec), vec, dtype_name)
    elif i == nfull:
        hf = _load_tail(mh, 2 * nfull * vec, 2 * n, 2 * vec)
        _store_tail(my, nfull * vec, n, swiglu_pairs(hf, vec), vec, dtype_name)


@cute.kernel
def swiglu_bwd_kernel(pdy: Pointer, ph: Pointer, pdh: Pointer, n: Int64, vec: Constexpr[int],
                      dtype_name: Constexpr[str]) -> None:
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = Int64(bidx) * THREADS + Int64(tidx)
    nfull = n // vec
    mdy = cute.make_tensor(pdy, cute.make_layout(n))
    mh = cute.make_tensor(ph, cute.make_layout(2 * n))
    mdh = cute.make_tensor(pdh, cute.make_layout(2 * n))
    if i < nfull:
        dh = swiglu_bwd_pairs(_load_full(mdy, i, vec), _load_full(mh, i, 2 * vec), vec)
        _store_full(mdh, i, dh, 2 * vec, dtype_name)
    elif i == nfull:
        df = _load_tail(mdy, nfull * vec, n, vec)
        hf = _load_tail(mh, 2 * nfull * vec, 2 * n, 2 * vec)
        _store_tail(mdh, 2 * nfull * vec, 2 * n, swiglu_bwd_pairs(df, hf, vec), 2 * vec, dtype_name)


def _grid(n: Int64, vec: int) -> list[Any]:
    return [(n // vec + THREADS) // THREADS, 1, 1]


@cute.jit
def swiglu_fwd_host(ph: Pointer, py: Pointer, n: Int64, stream: cuda.CUstream, vec: Constexpr[int],
                    dtype_name: Constexpr[str]) -> None:
    swiglu_fwd_kernel(ph, py, n, vec, dtype_name).launch(
        grid=_grid(n, vec), block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


@cute.jit
def swiglu_bwd_host(pdy: Pointer, ph: Pointer, pdh: Pointer, n: Int64, stream: cuda.CUstream,
                    vec: Constexpr[int], dtype_name: Constexpr[str]) -> None:
    swiglu_bwd_kernel(pdy, ph, pdh, n, vec, dtype_name).launch(
        grid=_grid(n, vec), block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


HOSTS: dict[str, tuple[Any, int]] = {"swiglu_fwd": (swiglu_fwd_host, 2), "swiglu_bwd": (swiglu_bwd_host, 3)}


def compile_args(kernel: str, spec: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    return elementwise_args(HOSTS, kernel, spec)
