"""CuTeDSL kernels for relu2 fwd/bwd: flat elementwise, one 128-bit vector per thread, guarded tail.

Import only after nmoe.fast.runtime.import_cutlass(arch): the DSL fixes its target arch at first import.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer

from nmoe.fast.kernels.prims import PDL, await_upstream, load_tail, out_bits, store_full, store_tail

THREADS = 256
DTYPES: dict[str, Any] = {"bfloat16": BFloat16, "float32": Float32}


# Pure dataflow helpers are plain functions traced inline; only code with dynamic `if`/loops needs
# @cute.jit (its AST is rewritten into scf control flow).
def _relu(x: cute.TensorSSA) -> cute.TensorSSA:
    zero = cute.full_like(x, 0.0)
    r: cute.TensorSSA = cute.where(x <= zero, zero, x)
    return r


def relu2_f32(x: cute.TensorSSA) -> cute.TensorSSA:
    """relu(x)^2 of one vector in fp32, unrounded."""
    r = _relu(x.to(Float32))
    sq: cute.TensorSSA = r * r
    return sq


def relu2_bits(x: cute.TensorSSA, dtype_name: str) -> cute.TensorSSA:
    """relu2 of one vector as output bits; the grouped GEMM's fused epilogue calls it too."""
    return out_bits(relu2_f32(x), dtype_name)


def relu2_bwd_f32(dy: cute.TensorSSA, x: cute.TensorSSA) -> cute.TensorSSA:
    """dy * (2 relu(x)) of one vector in fp32, unrounded."""
    two_r = 2.0 * _relu(x.to(Float32))
    p: cute.TensorSSA = dy.to(Float32) * two_r
    return p


def _bwd_bits(dy: cute.TensorSSA, x: cute.TensorSSA, dtype_name: str) -> cute.TensorSSA:
    return out_bits(relu2_bwd_f32(dy, x), dtype_name)


@cute.kernel
def relu2_fwd_kernel(px: Pointer, py: Pointer, n: Int64,
                     vec: Constexpr[int], dtype_name: Constexpr[str]) -> None:
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = Int64(bidx) * THREADS + Int64(tidx)
    nfull = n // vec
    mx = cute.make_tensor(px, cute.make_layout(n))
    my = cute.make_tensor(py, cute.make_layout(n))
    if i < nfull:
        gx = cute.zipped_divide(mx, (vec,))
        x = gx[(None, i)].load().reshape((vec,))
        store_full(cute.zipped_divide(my, (vec,)), i, relu2_bits(x, dtype_name))
    elif i == nfull:
        x = load_tail(mx, nfull * vec, n, vec)
        store_tail(my, nfull * vec, n, relu2_bits(x, dtype_name), vec)


@cute.kernel
def relu2_bwd_kernel(pdy: Pointer, px: Pointer, pdx: Pointer, n: Int64,
                     vec: Constexpr[int], dtype_name: Constexpr[str]) -> None:
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = Int64(bidx) * THREADS + Int64(tidx)
    nfull = n // vec
    mdy = cute.make_tensor(pdy, cute.make_layout(n))
    mx = cute.make_tensor(px, cute.make_layout(n))
    mdx = cute.make_tensor(pdx, cute.make_layout(n))
    if i < nfull:
        dy = cute.zipped_divide(mdy, (vec,))[(None, i)].load().reshape((vec,))
        x = cute.zipped_divide(mx, (vec,))[(None, i)].load().reshape((vec,))
        store_full(cute.zipped_divide(mdx, (vec,)), i, _bwd_bits(dy, x, dtype_name))
    elif i == nfull:
        dy = load_tail(mdy, nfull * vec, n, vec)
        x = load_tail(mx, nfull * vec, n, vec)
        store_tail(mdx, nfull * vec, n, _bwd_bits(dy, x, dtype_name), vec)


def _grid(n: Int64, vec: int) -> list[Any]:
    return [(n // vec + THREADS) // THREADS, 1, 1]


@cute.jit
def relu2_fwd_host(px: Pointer, py: Pointer, n: Int64, stream: cuda.CUstream,
                   vec: Constexpr[int], dtype_name: Constexpr[str]) -> None:
    relu2_fwd_kernel(px, py, n, vec, dtype_name).launch(
        grid=_grid(n, vec), block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


@cute.jit
def relu2_bwd_host(pdy: Pointer, px: Pointer, pdx: Pointer, n: Int64, stream: cuda.CUstream,
                   vec: Constexpr[int], dtype_name: Constexpr[str]) -> None:
    relu2_bwd_kernel(pdy, px, pdx, n, vec, dtype_name).launch(
        grid=_grid(n, vec), block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


def pointer(dtype_name: str, address: int, vec: int) -> Any:
    dtype = DTYPES[dtype_name]
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=vec * dtype.width // 8)


HOSTS: dict[str, tuple[Any, int]] = {"relu2_fwd": (relu2_fwd_host, 2), "relu2_bwd": (relu2_bwd_host, 3)}


def pointers(kernel: str, addresses: tuple[int, ...], spec: dict[str, Any]) -> list[Any]:
    """The elementwise kernels (relu2, swiglu) take every operand in the spec's dtype, `vec`-aligned."""
    return [pointer(spec["dtype"], a, spec["vec"]) for a in addresses]


def elementwise_args(hosts: dict[str, tuple[Any, int]], kernel: str,
                     spec: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """Host function and placeholder arguments (null pointers, n = 0) of an elementwise kernel."""
    if kernel not in hosts:
        raise ValueError(f"unknown elementwise kernel {kernel!r}; choose one of {sorted(hosts)}")
    host, n_ptrs = hosts[kernel]
    ptrs = pointers(kernel, (0,) * n_ptrs, spec)
    return host, (*ptrs, Int64(0), cuda.CUstream(0), spec["vec"], spec["dtype"])


def compile_args(kernel: str, spec: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    return elementwise_args(HOSTS, kernel, spec)
