"""CuTeDSL kernels for MLA's key (mla_k: k[r] = [kv[r, :dn] | k_pe[r // h]]) and kv gradient (mla_kv_grad:
dk_nope into dkv's rows beside the dv flash-attn wrote there; dk_pe the heads' dk rope parts added in fp32
in head order, rounded once), a 128-bit vector per thread. Import after runtime.import_cutlass(arch)."""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64
from cutlass.base_dsl.ast_helpers import range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import Pointer

from nmoe.fast.kernels.prims import PDL, await_upstream, out_bits
from nmoe.fast.limits import VEC_BYTES

THREADS = 256
VEC = VEC_BYTES // 2


@cute.jit
def _vec_at(p: Pointer, n: Int64, at: Int64) -> cute.Tensor:
    """The `at`-th VEC-element vector of the flat bf16 array p[0:n]."""
    view: cute.Tensor = cute.zipped_divide(cute.make_tensor(p, cute.make_layout(n)), (VEC,))[(None, at)]
    return view


@cute.jit
def _join(pa: Pointer, pb: Pointer, pd: Pointer, rows: Int64, i: Int64, dn: Constexpr[int],
          wa: Constexpr[int], wb: Constexpr[int], share: Constexpr[int]) -> None:
    """Vector i of d[r] = [a[r, :dn] | b[r // share]] over `rows` rows: a's rows wa wide, b's wb wide, one b
    row per `share` rows of d (the shared rope key: one per token's h heads)."""
    per_row = (dn + wb) // VEC
    r = i // per_row
    c = (i - r * per_row) * VEC
    dst = _vec_at(pd, rows * (dn + wb), i)
    if c < dn:
        dst.store(_vec_at(pa, rows * wa, (r * wa + c) // VEC).load())
    else:
        dst.store(_vec_at(pb, rows // share * wb, ((r // share) * wb + c - dn) // VEC).load())


@cute.kernel
def mla_k_kernel(pkv: Pointer, pkpe: Pointer, pk: Pointer, rows: Int64, h: Constexpr[int], dn: Constexpr[int],
                 dr: Constexpr[int], dv: Constexpr[int]) -> None:
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = Int64(bidx) * THREADS + Int64(tidx)
    if i < rows * ((dn + dr) // VEC):
        _join(pkv, pkpe, pk, rows, i, dn, dn + dv, dr, h)


@cute.kernel
def mla_kv_grad_kernel(pdk: Pointer, pdkv: Pointer, pdkpe: Pointer, rows: Int64, h: Constexpr[int],
                       dn: Constexpr[int], dr: Constexpr[int], dv: Constexpr[int]) -> None:
    """Threads [0, rows * dn / VEC) copy dk's nope vectors into dkv's rows (dn + dv apart); the next
    tokens * dr / VEC sum dk_pe's vectors."""
    await_upstream()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = Int64(bidx) * THREADS + Int64(tidx)
    n_kv = rows * (dn // VEC)
    per_tok = dr // VEC
    if i < n_kv:
        r = i // (dn // VEC)
        c = (i - r * (dn // VEC)) * VEC
        dst = _vec_at(pdkv, rows * (dn + dv), (r * (dn + dv) + c) // VEC)
        dst.store(_vec_at(pdk, rows * (dn + dr), (r * (dn + dr) + c) // VEC).load())
    elif i < n_kv + rows // h * per_tok:
        j = i - n_kv
        t = j // per_tok
        c = (j - t * per_tok) * VEC
        first = (t * h * (dn + dr) + dn + c) // VEC
        acc = _vec_at(pdk, rows * (dn + dr), first).load().reshape((VEC,)).to(Float32)
        for head in range_constexpr(1, h):
            at = ((t * h + head) * (dn + dr) + dn + c) // VEC
            acc = acc + _vec_at(pdk, rows * (dn + dr), at).load().reshape((VEC,)).to(Float32)
        bits = out_bits(acc, "bfloat16")
        cute.recast_tensor(_vec_at(pdkpe, rows // h * dr, j), bits.dtype).store(bits)


@cute.jit
def mla_k_host(pkv: Pointer, pkpe: Pointer, pk: Pointer, rows: Int64, stream: cuda.CUstream,
               h: Constexpr[int], dn: Constexpr[int], dr: Constexpr[int], dv: Constexpr[int]) -> None:
    n = rows * ((dn + dr) // VEC)
    mla_k_kernel(pkv, pkpe, pk, rows, h, dn, dr, dv).launch(
        grid=[(n + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


@cute.jit
def mla_kv_grad_host(pdk: Pointer, pdkv: Pointer, pdkpe: Pointer, rows: Int64, stream: cuda.CUstream,
                     h: Constexpr[int], dn: Constexpr[int], dr: Constexpr[int], dv: Constexpr[int]) -> None:
    n = rows * (dn // VEC) + rows // h * (dr // VEC)
    mla_kv_grad_kernel(pdk, pdkv, pdkpe, rows, h, dn, dr, dv).launch(
        grid=[(n + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=PDL
    )


def compile_args(kernel: str, spec: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """mla_k / mla_kv_grad: bf16 arrays on 16-byte boundaries; spec h, dn, dr, dv (multiples of VEC)."""
    p = make_ptr(BFloat16, 0, cute.AddressSpace.gmem, assumed_align=VEC_BYTES)
    dims = (spec["h"], spec["dn"], spec["dr"], spec["dv"])
    if kernel == "mla_k":
        return mla_k_host, (p, p, p, Int64(0), cuda.CUstream(0), *dims)
    if kernel == "mla_kv_grad":
        return mla_kv_grad_host, (p, p, p, Int64(0), cuda.CUstream(0), *dims)
    raise ValueError(f"unknown mla kernel {kernel!r}; choose mla_k or mla_kv_grad")
