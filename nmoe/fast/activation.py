"""Fast relu2 fwd/bwd: CuTeDSL kernels (nmoe/fast/kernels/activation.py) behind torch custom ops.

nmoe::relu2 carries autograd (bwd = nmoe::relu2_bwd) and a shape-only fake, so torch.compile and
CUDA graphs capture it as one op. Kernels are compiled per (arch, dtype, vector width) on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from nmoe.constants import ACT_H_COLUMNS
from nmoe.fast import _swiglu, runtime
from nmoe.fast.limits import VEC_BYTES
from nmoe.fast.op import Kernel, Launcher, elementwise_pair, fast_op, remember
from nmoe.fast.runtime import KernelSpec

ACTIVATIONS = tuple(ACT_H_COLUMNS)
"""The expert activations with fast kernels, standalone and fused (grouped GEMM epilogue, expert rows)."""
_DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_VEC: dict[str, int] = {"bfloat16": 8, "float32": 4}


RELU2_FWD = Kernel.by_name("nmoe.fast.kernels.activation", "relu2_fwd")
RELU2_BWD = Kernel.by_name("nmoe.fast.kernels.activation", "relu2_bwd")


def _check(op: str, *ts: Tensor) -> str:
    dtypes = {t.dtype for t in ts}
    if len(dtypes) != 1 or ts[0].dtype not in _DTYPE_NAMES:
        raise ValueError(
            f"{op}: fast kernels take bf16 or fp32 inputs of one dtype, got {sorted(map(str, dtypes))}; "
            "cast the inputs, or use nmoe.reference for other dtypes"
        )
    if any(t.shape != ts[0].shape for t in ts):
        raise ValueError(f"{op}: shapes {[tuple(t.shape) for t in ts]} differ; pass tensors of one shape")
    return _DTYPE_NAMES[ts[0].dtype]


def _prepare(kernel: Kernel, ins: tuple[Tensor, ...], out: Tensor) -> tuple[int, int, Launcher | None]:
    """(device, elements, launcher or None when empty): the checks, read from layouts only."""
    device, arch = runtime.device_arch(*ins, out)
    dtype_name = _check(kernel.name, *ins, out)
    n = out.numel()
    if n == 0:
        return device, n, None
    ptrs = [t.data_ptr() for t in (*ins, out)]
    vec = _VEC[dtype_name] if all(p % VEC_BYTES == 0 for p in ptrs) else 1
    return device, n, kernel.launcher(arch, dtype=dtype_name, vec=vec)


_PLANS: dict[tuple[Any, ...], tuple[int, int, Launcher | None]] = {}


def _launch(kernel: Kernel, ins: tuple[Tensor, ...], out: Tensor) -> None:
    """Run `kernel` over the flattened contiguous tensors; 128-bit vectors when every pointer allows. A
    layout (shapes, dtypes, devices, aligned addresses) is checked once, then its plan is reused."""
    tensors = (*ins, out)
    ptrs = [t.data_ptr() for t in tensors]
    bits = 0
    for p in ptrs:
        bits |= p
    key = (kernel.name, bits % VEC_BYTES == 0, *[(t.shape, t.dtype, t.device) for t in tensors])
    plan = _PLANS.get(key)
    if plan is None:
        plan = remember(_PLANS, key, _prepare(kernel, ins, out))
    device, n, launch = plan
    if launch is not None:
        launch(device, *ptrs, n)


def _relu2_impl(x: Tensor) -> Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    _launch(RELU2_FWD, (x,), y)
    return y


def _relu2_fake(x: Tensor) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _relu2_bwd_impl(dy: Tensor, x: Tensor) -> Tensor:
    dy = dy.contiguous()
    dx = torch.empty_like(dy)
    _launch(RELU2_BWD, (dy, x.contiguous()), dx)
    return dx


def _relu2_bwd_fake(dy: Tensor, x: Tensor) -> Tensor:
    return torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)


_relu2_op = fast_op("relu2", _relu2_impl, _relu2_fake)
_relu2_bwd_op = fast_op("relu2_bwd", _relu2_bwd_impl, _relu2_bwd_fake)
elementwise_pair(_relu2_op, _relu2_bwd_op)


def relu2(x: Tensor) -> Tensor:
    """relu(x)^2 in fp32, rounded once to x.dtype; differentiable through relu2_bwd."""
    return _relu2_op(x)


def relu2_bwd(dy: Tensor, x: Tensor) -> Tensor:
    """dy * (2 * relu(x)) in fp32, rounded once to dy.dtype."""
    return _relu2_bwd_op(dy, x)


# ftz would flush fp32 subnormal squares that bf16 keeps; PTX max/min return the non-NaN operand
# (NaN must propagate); a bf16 multiply would skip the fp32 product; local memory means spills.
_FORBID = (r"\.ftz\b", r"\b(max|min)(\.[a-zA-Z0-9]+)*\.(f32|bf16|bf16x2)\b", r"\bmul(\.rn)?\.bf16",
           r"\b(ld|st)\.local\b")
# sm_100a packs fp32 multiplies into mul.f32x2, which Hopper lacks.
_MUL_F32 = {"sm_90a": (r"\bmul(\.rn)?\.f32\s",), "sm_100a": (r"\bmul(\.rn)?\.f32x2\s",)}


def _spec(kernel: Kernel, dtype_name: str) -> KernelSpec:
    suffix = "" if dtype_name == "bfloat16" else "_f32"
    rounding = (r"\bcvt\.rn\.bf16x2\.f32\b",) if dtype_name == "bfloat16" else ()
    op = kernel.name.removesuffix("_fwd")
    compile = kernel.compiler(dtype=dtype_name, vec=_VEC[dtype_name])
    return runtime.portable_spec(op, f"{kernel.name}{suffix}", compile,
                                 (runtime.LD128, runtime.ST128, r"\bsetp\.nan\.f32\b", *rounding), _FORBID,
                                 _MUL_F32)


swiglu = _swiglu.swiglu
swiglu_bwd = _swiglu.swiglu_bwd

BY_NAME: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]] = {
    "swiglu": (swiglu, swiglu_bwd), "relu2": (relu2, relu2_bwd)}
"""(act, act_bwd) of each expert activation, by its config name."""

KERNELS: tuple[KernelSpec, ...] = (
    *(_spec(kernel, dtype_name)
      for dtype_name in ("bfloat16", "float32") for kernel in (RELU2_FWD, RELU2_BWD)),
    *_swiglu.KERNELS,
)
