"""Fast rope: apply_rope fwd/bwd as CuTeDSL kernels (nmoe/fast/kernels/rope.py) behind torch custom ops, and
the YaRN cos/sin tables the fast model builds once.

nmoe::apply_rope carries autograd (bwd = nmoe::apply_rope_bwd); cos/sin are constant tables (no gradient).
nmoe::rope_inplace rotates a column slice where it lies (MLA's rope part of each head), for glue that owns
the autograd around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.limits import VEC_BYTES
from nmoe.fast.op import Kernel, fast_op, save_inputs
from nmoe.fast.runtime import KernelSpec, vector_aligned

ROPE_FWD = Kernel.by_name("nmoe.fast.kernels.rope", "rope_fwd")
ROPE_BWD = Kernel.by_name("nmoe.fast.kernels.rope", "rope_bwd")
_DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass(frozen=True)
class TablePlan:
    """x viewed as [outer, S, inner, D]: the cos/sin row of an x row is (row // inner) % S."""

    s_len: int
    inner: int


def table_plan(x: Tensor, cos: Tensor, sin: Tensor) -> TablePlan:
    """Checks the spec's broadcast (cos/sin [..., S, D/2] against x[..., S, D/2]) in the form the kernel
    takes: a table indexed by position only, [S, 1, ..., 1, D/2] after leading ones."""
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"apply_rope: last dim of x {tuple(x.shape)} must be even (interleaved pairs)")
    half = x.shape[-1] // 2
    if cos.shape != sin.shape or cos.dim() < 1 or cos.shape[-1] != half:
        raise ValueError(
            f"apply_rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must share a shape ending in "
            f"{half} (= x.shape[-1] // 2); slice the tables to [:S] and match x's layout"
        )
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"apply_rope: fast tables are fp32, got cos {cos.dtype}, sin {sin.dtype}; build "
                         "them with nmoe.yarn.yarn_cos_sin")
    dims = list(cos.shape[:-1])
    while dims and dims[0] == 1:
        dims.pop(0)
    if len(dims) > x.dim() - 1 or any(v != 1 for v in dims[1:]):
        raise ValueError(
            f"apply_rope: fast tables are indexed by position only: cos {tuple(cos.shape)} must be "
            f"[S, 1, ..., 1, {half}] against x {tuple(x.shape)}; expand per-head angles into x's layout"
        )
    if not dims:
        return TablePlan(1, 1)
    axis = x.dim() - 1 - len(dims)
    if x.shape[axis] != dims[0]:
        raise ValueError(f"apply_rope: cos {tuple(cos.shape)} has {dims[0]} positions but x {tuple(x.shape)} "
                         f"has {x.shape[axis]} on that axis; slice the tables to [:S]")
    return TablePlan(dims[0], math.prod(x.shape[axis + 1:-1]))


def _vec(d: int, dtype: torch.dtype) -> int:
    """128-bit vectors of x when D allows them; else one pair per thread."""
    wide = VEC_BYTES // (2 if dtype == torch.bfloat16 else 4)
    return wide if d % wide == 0 else 2


def row_pitch(x: Tensor) -> int:
    """Elements between consecutive rows of x's last dim, when every row sits at one pitch (a contiguous
    tensor, or a column slice of one); anything else is refused, since the kernel walks rows at one pitch."""
    d = x.shape[-1]
    dims = [(n, st) for n, st in zip(x.shape[:-1], x.stride()[:-1], strict=True) if n != 1]
    pitch = dims[-1][1] if dims else d
    expect = pitch
    for n, st in reversed(dims):
        if st != expect:
            break
        expect = st * n
    else:
        if (x.stride(-1) == 1 or d == 1) and pitch >= d:
            return pitch
    raise ValueError(f"rope_inplace: x {tuple(x.shape)} with strides {x.stride()} is not rows of {d} at one "
                     "pitch; pass a contiguous tensor or a last-dim slice of one, or use apply_rope")


def _launch(kernel: Kernel, x: Tensor, cos: Tensor, sin: Tensor, inplace: bool = False) -> Tensor:
    plan = table_plan(x, cos, sin)
    if x.dtype not in _DTYPE_NAMES:
        raise ValueError(f"{kernel.name}: fast rope takes bf16 or fp32 x, got {x.dtype}; cast it, or use "
                         "nmoe.reference.rope for other dtypes")
    device, arch = runtime.device_arch(x, cos, sin)
    d = x.shape[-1]
    vec = _vec(d, x.dtype)
    if x.numel() == 0:
        return x if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if inplace:
        ld, xc = row_pitch(x), x
        if x.data_ptr() % (vec * x.element_size()) or ld % vec:
            raise ValueError(f"rope_inplace: x's rows must start on {vec * x.element_size()}-byte vectors "
                             f"(pitch {ld}, offset {x.data_ptr() % 16} B); use apply_rope")
        y = x
    else:
        ld, xc = d, vector_aligned(x, vec * x.element_size())
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cc, sc = vector_aligned(cos, vec * 2), vector_aligned(sin, vec * 2)
    launcher = kernel.launcher(arch, dtype=_DTYPE_NAMES[x.dtype], vec=vec, d=d, ld=ld)
    launcher(device, xc.data_ptr(), cc.data_ptr(), sc.data_ptr(), y.data_ptr(), x.numel(), plan.inner,
             plan.s_len)
    return y


def _rope_impl(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _launch(ROPE_FWD, x, cos, sin)


def _rope_bwd_impl(dy: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _launch(ROPE_BWD, dy, cos, sin)


def _rope_fake(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _inplace_impl(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> None:
    _launch(ROPE_BWD if inverse else ROPE_FWD, x, cos, sin, inplace=True)


def _inplace_fake(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> None:
    return None


_rope_op = fast_op("apply_rope", _rope_impl, _rope_fake)
_rope_bwd_op = fast_op("apply_rope_bwd", _rope_bwd_impl, _rope_fake)
_inplace_op = fast_op("rope_inplace", _inplace_impl, _inplace_fake, mutates=("x",))


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
    cos, sin = ctx.saved_tensors
    return _rope_bwd_op(grad.contiguous(), cos, sin), None, None


_rope_op.autograd(_backward, save_inputs(1, 2))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[2i], x[2i+1]): y0 = x0*c - x1*s, y1 = x0*s + x1*c in fp32, rounded once to x.dtype;
    cos/sin fp32 [S, 1.., D/2] broadcast against x[..., S, .., D/2]; differentiable in x."""
    return _rope_op(x, cos, sin)


def apply_rope_bwd(dy: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """dy rotated by the negated angle (the rotation is orthogonal), bitwise apply_rope(dy, cos, -sin)."""
    return _rope_bwd_op(dy, cos, sin)


def rope_inplace(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> None:
    """apply_rope(x) (inverse: apply_rope_bwd) written over x, bitwise the same values; x may be a last-dim
    slice of a wider tensor (rows at one pitch), rotated where it lies. Not differentiable: glue owns that."""
    _inplace_op(x, cos, sin, inverse)


# ftz would flush subnormal products the spec keeps; fma (or mul/add without .rn, which ptxas may contract)
# would skip the spec's rounding of each product; local memory means spills.
_FORBID = (r"\.ftz\b", r"\bfma(\.rn)?\.f32", r"\b(ld|st)\.local\b", r"\bmul\.f32\b", r"\badd\.f32\b",
           r"\bsub\.f32\b")
_ROUNDED = (r"\bmul\.rn\.f32\b", r"\bsub\.rn\.f32\b", r"\badd\.rn\.f32\b", r"\bsetp\.nan\.f32\b")
# (d, dtype, row pitch): MLA's rope part of a 192-wide head (128 nope + 64 rope) is the strided case.
_CHECKED = ((64, "bfloat16", 64), (64, "float32", 64), (6, "bfloat16", 6), (6, "float32", 6),
            (64, "bfloat16", 192))


def _spec(kernel: Kernel, d: int, dtype_name: str, ld: int) -> KernelSpec:
    vec = _vec(d, torch.bfloat16 if dtype_name == "bfloat16" else torch.float32)
    wide = vec * (2 if dtype_name == "bfloat16" else 4) == VEC_BYTES
    loads = (runtime.LD128, runtime.ST128) if wide else ()
    cvt = (r"\bcvt\.rn\.bf16(x2)?\.f32\b",) if dtype_name == "bfloat16" else ()
    name = f"{kernel.name}_d{d}_{dtype_name}" + (f"_ld{ld}" if ld != d else "")
    return runtime.portable_spec(kernel.name.removesuffix("_fwd"), name,
                                 kernel.compiler(dtype=dtype_name, vec=vec, d=d, ld=ld),
                                 (*loads, *_ROUNDED, *cvt), _FORBID)


KERNELS: tuple[KernelSpec, ...] = tuple(
    _spec(kernel, d, dtype_name, ld) for d, dtype_name, ld in _CHECKED for kernel in (ROPE_FWD, ROPE_BWD)
)
