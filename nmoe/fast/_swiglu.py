"""Fast interleaved swiglu fwd/bwd: CuTeDSL kernels (nmoe/fast/kernels/swiglu.py) behind torch custom ops.

Re-exported by nmoe.fast.activation. nmoe::swiglu carries autograd (bwd = nmoe::swiglu_bwd) and a
shape-only fake, so torch.compile and CUDA graphs capture each as one op.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.runtime import KernelSpec

_KERNEL_MODULE = "nmoe.fast.kernels.swiglu"
# the swiglu kernels import the .rn helpers from the combine kernels and the launch convention from the
# activation kernels: all three key the cache
_SOURCE_MODULES = (_KERNEL_MODULE, "nmoe.fast.kernels.combine", "nmoe.fast.kernels.activation")
_DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_VEC: dict[str, int] = {"bfloat16": 8, "float32": 4}
_VEC_BYTES = 16


def _source_sha256() -> str:
    return runtime.sources_sha256(*_SOURCE_MODULES)


def _kernels(arch: str) -> ModuleType:
    return runtime.kernel_module(_KERNEL_MODULE, arch)


def _check_h(op: str, h: Tensor) -> str:
    if h.dtype not in _DTYPE_NAMES:
        raise ValueError(f"{op}: fast kernels take bf16 or fp32, got {h.dtype}; cast h or use nmoe.reference")
    if h.dim() == 0 or h.shape[-1] % 2 != 0:
        raise ValueError(f"{op}: h {tuple(h.shape)} needs an even last dim [..., 2I] (gate/up interleaved)")
    return _DTYPE_NAMES[h.dtype]


def _launch(kernel: str, ins: tuple[Tensor, ...], out: Tensor, n: int) -> None:
    """Run `kernel` over n output pairs of contiguous tensors; 128-bit vectors when every pointer allows."""
    runtime.require_arch(*ins, out)
    dtype_name = _DTYPE_NAMES[out.dtype]
    if n == 0:
        return
    aligned = all(t.data_ptr() % _VEC_BYTES == 0 for t in (*ins, out))
    spec = {"dtype": dtype_name, "vec": _VEC[dtype_name] if aligned else 1}
    runtime.launch(_KERNEL_MODULE, _source_sha256(), kernel, spec, (*ins, out), (n,))


def _out_shape(h: Tensor) -> list[int]:
    return [*h.shape[:-1], h.shape[-1] // 2]


def _swiglu_impl(h: Tensor) -> Tensor:
    _check_h("swiglu", h)
    y = torch.empty(_out_shape(h), dtype=h.dtype, device=h.device)
    _launch("swiglu_fwd", (h.contiguous(),), y, y.numel())
    return y


def _swiglu_fake(h: Tensor) -> Tensor:
    _check_h("swiglu", h)
    return h.new_empty(_out_shape(h))


def _check_bwd(dy: Tensor, h: Tensor) -> None:
    _check_h("swiglu_bwd", h)
    if dy.dtype != h.dtype:
        raise ValueError(f"swiglu_bwd: dy is {dy.dtype} but h is {h.dtype}; pass one dtype (cast dy)")
    if list(dy.shape) != _out_shape(h):
        raise ValueError(f"swiglu_bwd: dy {tuple(dy.shape)} must be h with last dim halved {_out_shape(h)}")


def _swiglu_bwd_impl(dy: Tensor, h: Tensor) -> Tensor:
    _check_bwd(dy, h)
    dh = torch.empty(h.shape, dtype=dy.dtype, device=dy.device)
    _launch("swiglu_bwd", (dy.contiguous(), h.contiguous()), dh, dy.numel())
    return dh


def _swiglu_bwd_fake(dy: Tensor, h: Tensor) -> Tensor:
    _check_bwd(dy, h)
    return h.new_empty(h.shape)


_swiglu_op, _swiglu_bwd_op = runtime.register_activation_ops(
    "swiglu", (_swiglu_impl, _swiglu_fake), (_swiglu_bwd_impl, _swiglu_bwd_fake)
)


def swiglu(h: Tensor) -> Tensor:
    """silu(gate)*up in fp32 from h[..., 2I] (h[..., 0::2] = gate, h[..., 1::2] = up), rounded once."""
    out: Tensor = _swiglu_op(h)
    return out


def swiglu_bwd(dy: Tensor, h: Tensor) -> Tensor:
    """dh [..., 2I] interleaved like h: dgate = dy*up*s*(1+g*(1-s)), dup = dy*silu(g), rounded once."""
    out: Tensor = _swiglu_bwd_op(dy, h)
    return out


def _ptx(kernel: str, dtype_name: str, arch: str) -> str:
    k = _kernels(arch)
    host, args = k.compile_args(kernel, {"dtype": dtype_name, "vec": _VEC[dtype_name]})
    return runtime.compile_ptx(host, args)


# ftz on an op of ours would flush subnormal products (libdevice expf's ex2.approx.ftz acts on a
# range-reduced argument and is exempt); approximate division is not IEEE; local memory means spills.
_FORBID = (r"\b(mul|add|sub|div|fma)(\.r[nzmp])?\.ftz\.f32\b", r"\bdiv\.(approx|full)(\.ftz)?\.f32\b",
           r"\b(ld|st)\.local\b")
_LD128 = r"\bld\.global(\.nc)?\.(v4\.(b|f|u)32|v2\.(b|u)64|v8\.(b|f|u)32)\b"
_ST128 = r"\bst\.global\.(v4\.(b|f|u)32|v2\.(b|u)64|v8\.(b|f|u)32)\b"


def _spec(kernel: str, dtype_name: str) -> KernelSpec:
    suffix = "" if dtype_name == "bfloat16" else "_f32"
    rounding = (r"\bcvt\.rn\.bf16x2\.f32\b",) if dtype_name == "bfloat16" else ()
    return runtime.portable_spec(
        "swiglu", f"{kernel}{suffix}", functools.partial(_ptx, kernel, dtype_name),
        (_LD128, _ST128, r"\bmul\.rn\.f32\b", r"\badd\.rn\.f32\b", r"\bdiv\.rn\.f32\b", *rounding), _FORBID)


KERNELS: tuple[KernelSpec, ...] = tuple(
    _spec(kernel, dtype_name) for dtype_name in ("bfloat16", "float32")
    for kernel in ("swiglu_fwd", "swiglu_bwd")
)
