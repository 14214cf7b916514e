"""Fast relu2 fwd/bwd: CuTeDSL kernels (nmoe/fast/kernels/activation.py) behind torch custom ops.

nmoe::relu2 carries autograd (bwd = nmoe::relu2_bwd) and a shape-only fake, so torch.compile and
CUDA graphs capture it as one op. Kernels are compiled per (arch, dtype, vector width) on first use.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import Tensor

from nmoe.fast import _swiglu, runtime
from nmoe.fast.runtime import KernelSpec

_KERNEL_MODULE = "nmoe.fast.kernels.activation"
_DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_VEC: dict[str, int] = {"bfloat16": 8, "float32": 4}
_VEC_BYTES = 16


def _source_sha256() -> str:
    return runtime.sources_sha256(_KERNEL_MODULE)


def _kernels(arch: str) -> ModuleType:
    return runtime.kernel_module(_KERNEL_MODULE, arch)


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


def _launch(kernel: str, ins: tuple[Tensor, ...], out: Tensor) -> None:
    """Run `kernel` over the flattened contiguous tensors; 128-bit vectors when every pointer allows."""
    runtime.require_arch(*ins, out)
    dtype_name = _check(kernel, *ins, out)
    if not all(t.is_contiguous() for t in (*ins, out)):
        raise ValueError(f"{kernel}: tensors must be contiguous; call .contiguous() first")
    n = out.numel()
    if n == 0:
        return
    aligned = all(t.data_ptr() % _VEC_BYTES == 0 for t in (*ins, out))
    spec = {"dtype": dtype_name, "vec": _VEC[dtype_name] if aligned else 1}
    runtime.launch(_KERNEL_MODULE, _source_sha256(), kernel, spec, (*ins, out), (n,))


def _relu2_impl(x: Tensor) -> Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch("relu2_fwd", (x.contiguous(),), y)
    return y


def _relu2_fake(x: Tensor) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _relu2_bwd_impl(dy: Tensor, x: Tensor) -> Tensor:
    dx = torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)
    _launch("relu2_bwd", (dy.contiguous(), x.contiguous()), dx)
    return dx


def _relu2_bwd_fake(dy: Tensor, x: Tensor) -> Tensor:
    return torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)


_relu2_op, _relu2_bwd_op = runtime.register_activation_ops(
    "relu2", (_relu2_impl, _relu2_fake), (_relu2_bwd_impl, _relu2_bwd_fake)
)


def relu2(x: Tensor) -> Tensor:
    """relu(x)^2 in fp32, rounded once to x.dtype; differentiable through relu2_bwd."""
    out: Tensor = _relu2_op(x)
    return out


def relu2_bwd(dy: Tensor, x: Tensor) -> Tensor:
    """dy * (2 * relu(x)) in fp32, rounded once to dy.dtype."""
    out: Tensor = _relu2_bwd_op(dy, x)
    return out


def _ptx(kernel: str, dtype_name: str, arch: str) -> str:
    k = _kernels(arch)
    host, args = k.compile_args(kernel, {"dtype": dtype_name, "vec": _VEC[dtype_name]})
    return runtime.compile_ptx(host, args)


# ftz would flush fp32 subnormal squares that bf16 keeps; PTX max/min return the non-NaN operand
# (NaN must propagate); a bf16 multiply would skip the fp32 product; local memory means spills.
_FORBID = (r"\.ftz\b", r"\b(max|min)(\.[a-zA-Z0-9]+)*\.(f32|bf16|bf16x2)\b", r"\bmul(\.rn)?\.bf16",
           r"\b(ld|st)\.local\b")
# sm_100a packs fp32 multiplies into mul.f32x2, which Hopper lacks.
_MUL_F32 = {"sm_90a": (r"\bmul(\.rn)?\.f32\s",), "sm_100a": (r"\bmul(\.rn)?\.f32x2\s",)}


def _spec(kernel: str, dtype_name: str) -> KernelSpec:
    suffix = "" if dtype_name == "bfloat16" else "_f32"
    rounding = (r"\bcvt\.rn\.bf16x2\.f32\b",) if dtype_name == "bfloat16" else ()
    return runtime.portable_spec("relu2", f"{kernel}{suffix}", functools.partial(_ptx, kernel, dtype_name),
                                 (runtime.LD128, runtime.ST128, r"\bsetp\.nan\.f32\b", *rounding), _FORBID,
                                 _MUL_F32)


swiglu = _swiglu.swiglu
swiglu_bwd = _swiglu.swiglu_bwd

KERNELS: tuple[KernelSpec, ...] = (
    *(_spec(kernel, dtype_name)
      for dtype_name in ("bfloat16", "float32") for kernel in ("relu2_fwd", "relu2_bwd")),
    *_swiglu.KERNELS,
)
