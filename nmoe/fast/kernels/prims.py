"""Device building blocks the kernels share: explicitly rounded fp32 ops, canonical NaN bits, bit casts, trap.

Import only after nmoe.fast.runtime.import_cutlass(arch): the DSL fixes its target arch at first import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int16, Int32, Int64
from cutlass._mlir.dialects import llvm, nvvm
from cutlass._mlir_helpers.op import dsl_user_op as _untyped_user_op
from cutlass.base_dsl.ast_helpers import range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cutlass_dsl import select_

from nmoe.constants import BF16_CANONICAL_NAN, F32_CANONICAL_NAN
from nmoe.fast.limits import FAST_PDL

_NVVM: Any = nvvm  # the generated dialect module has no stubs

PDL: bool = FAST_PDL
"""limits.FAST_PDL as the kernels read it at import: every launch's use_pdl and await_upstream's switch."""

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def dsl_user_op(fn: _Fn) -> _Fn:
    """CuTeDSL's op decorator (it threads loc/ip), typed for mypy."""
    return cast(_Fn, _untyped_user_op(fn))


def await_upstream() -> None:
    """Every kernel's first step: under PDL, wait for the grid before it to end and flush (nothing is read or
    written earlier), then let the next grid launch into this one's tail."""
    if PDL:
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()


@dsl_user_op
def _nvvm_f32(name: str, *operands: Any, loc: Any = None, ip: Any = None) -> Float32:
    """The fp32 NVVM intrinsic `name` of fp32 operands."""
    args = [Float32(x).ir_value(loc=loc, ip=ip) for x in operands]
    return Float32(llvm.call_intrinsic(Float32.mlir_type, name, args, [], [], loc=loc, ip=ip))


def _rn(op: str, *operands: Any) -> Float32:
    """One fp32 op rounded to nearest even; the explicit rounding keeps ptxas from fusing it into an FMA."""
    return _nvvm_f32(f"llvm.nvvm.{op}.rn.f", *operands)


def add_rn(a: Any, b: Any) -> Float32:
    """`add.rn.f32`; also the reduction op of warp sums that must round like the spec's sequential adds."""
    return _rn("add", a, b)


@dsl_user_op
def sub_rn(a: Any, b: Any, *, loc: Any = None, ip: Any = None) -> Float32:
    """`sub.rn.f32`: LLVM has no sub.rn intrinsic, the NVVM dialect op lowers to one."""
    x, y = Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)
    return Float32(_NVVM.subf(x, y, rnd=_NVVM.FPRoundingMode.RN, loc=loc, ip=ip))


def mul_rn(a: Any, b: Any) -> Float32:
    return _rn("mul", a, b)


def div_rn(a: Any, b: Any) -> Float32:
    """IEEE-correct fp32 division (`div.rn.f32`, subnormals kept), like torch's CPU division."""
    return _rn("div", a, b)


def fma_rn(a: Any, b: Any, c: Any) -> Float32:
    return _rn("fma", a, b, c)


def rcp_approx(a: Any) -> Float32:
    """`rcp.approx.ftz.f32` (MUFU.RCP): the seed that IEEE division refines; not correctly rounded alone."""
    return _nvvm_f32("llvm.nvvm.rcp.approx.ftz.f", a)


def sqrt_rn(a: Any) -> Float32:
    return _rn("sqrt", a)


@dsl_user_op
def f2i(x: Any, *, loc: Any = None, ip: Any = None) -> Int32:
    return Int32(llvm.bitcast(Int32.mlir_type, Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def i2f(x: Any, *, loc: Any = None, ip: Any = None) -> Float32:
    return Float32(llvm.bitcast(Float32.mlir_type, Int32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def pinned(x: Any, *, loc: Any = None, ip: Any = None) -> Int32:
    """x through an empty volatile asm: work computed from the result stays after this point (the compiler
    cannot hoist it out of a loop, as it would a pure function of loop-invariant registers)."""
    return Int32(llvm.inline_asm(Int32.mlir_type, [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;",
                                 "=r,r", has_side_effects=True, loc=loc, ip=ip))


def sel(c: Any, a: Any, b: Any) -> Int32:
    return Int32(select_(c, Int32(a), Int32(b)))


@dsl_user_op
def trap(*, loc: Any = None, ip: Any = None) -> None:
    """Abort the kernel: the CUDA error surfaces at the next sync, as torch's device asserts do."""
    llvm.intr_trap(loc=loc, ip=ip)


def canonical_nan() -> Float32:
    """The spec's one fp32 NaN; GPU arithmetic alone writes 0x7FFFFFFF."""
    return i2f(Int32(F32_CANONICAL_NAN))


def out_bits(v: cute.TensorSSA, dtype_name: str) -> cute.TensorSSA:
    """fp32 rounded once (RNE) to the output dtype, as integer bits with every NaN canonical.

    cvt.rn.bf16x2.f32 alone would write NaN as 0x7FFF.
    """
    if dtype_name == "bfloat16":
        rounded = v.to(BFloat16).bitcast(Int16)
        nan16: cute.TensorSSA = cute.where(v != v, cute.full_like(rounded, BF16_CANONICAL_NAN), rounded)
        return nan16
    vb = v.bitcast(Int32)
    nan32: cute.TensorSSA = cute.where(v != v, cute.full_like(vb, F32_CANONICAL_NAN), vb)
    return nan32


@cute.jit
def load_tail(m: cute.Tensor, base: Int64, n: Int64, vec: Constexpr[int]) -> cute.TensorSSA:
    """The last, partial `vec`-element vector of flat m[0:n] from `base`, zeros past n."""
    frag = cute.make_rmem_tensor((vec,), m.element_type)
    frag.fill(0.0)
    for j in range_constexpr(vec):
        if base + j < n:
            frag[j] = m[base + j]
    v: cute.TensorSSA = frag.load()
    return v


@cute.jit
def store_tail(m: cute.Tensor, base: Int64, n: Int64, bits: cute.TensorSSA, vec: Constexpr[int]) -> None:
    """Store the elements of `bits` that fall before n into flat m from `base`."""
    frag = cute.make_rmem_tensor((vec,), bits.dtype)
    frag.store(bits)
    mb = cute.recast_tensor(m, bits.dtype)
    for j in range_constexpr(vec):
        if base + j < n:
            mb[base + j] = frag[j]


@cute.jit
def store_full(g: cute.Tensor, i: Int64, bits: cute.TensorSSA) -> None:
    """Store `bits` as vector i of g, a zipped_divide of a flat tensor into vectors."""
    cute.recast_tensor(g[(None, i)], bits.dtype).store(bits)
