"""Fast interleaved swiglu fwd/bwd: CuTeDSL kernels (nmoe/fast/kernels/swiglu.py) behind torch custom ops.

Re-exported by nmoe.fast.activation. nmoe::swiglu carries autograd (bwd = nmoe::swiglu_bwd) and a
shape-only fake, so torch.compile and CUDA graphs capture each as one op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.limits import VEC_BYTES
from nmoe.fast.op import Kernel, elementwise_pair, fast_op
from nmoe.fast.runtime import KernelSpec

_DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_VEC: dict[str, int] = {"bfloat16": 8, "float32": 4}


SWIGLU_FWD = Kernel.by_name("nmoe.fast.kernels.swiglu", "swiglu_fwd")
SWIGLU_BWD = Kernel.by_name("nmoe.fast.kernels.swiglu", "swiglu_bwd")


def _check_h(op: str, h: Tensor) -> str:
    if h.dtype not in _DTYPE_NAMES:
        raise ValueError(f"{op}: fast kernels take bf16 or fp32, got {h.dtype}; cast h or use nmoe.reference")
    if h.dim() == 0 or h.shape[-1] % 2 != 0:
        raise ValueError(f"{op}: h {tuple(h.shape)} needs an even last dim [..., 2I] (gate/up interleaved)")
    return _DTYPE_NAMES[h.dtype]


def _launch(kernel: Kernel, ins: tuple[Tensor, ...], out: Tensor, n: int) -> None:
    """Run `kernel` over n output pairs of contiguous tensors; 128-bit vectors when every pointer allows."""
    device, arch = runtime.device_arch(*ins, out)
    if n == 0:
        return
    ptrs = [t.data_ptr() for t in (*ins, out)]
    dtype_name = _DTYPE_NAMES[out.dtype]
    vec = _VEC[dtype_name] if all(p % VEC_BYTES == 0 for p in ptrs) else 1
    kernel.launcher(arch, dtype=dtype_name, vec=vec)(device, *ptrs, n)


def _out_shape(h: Tensor) -> list[int]:
    return [*h.shape[:-1], h.shape[-1] // 2]


def _swiglu_impl(h: Tensor) -> Tensor:
    _check_h("swiglu", h)
    y = torch.empty(_out_shape(h), dtype=h.dtype, device=h.device)
    _launch(SWIGLU_FWD, (h.contiguous(),), y, y.numel())
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
    _launch(SWIGLU_BWD, (dy.contiguous(), h.contiguous()), dh, dy.numel())
    return dh


def _swiglu_bwd_fake(dy: Tensor, h: Tensor) -> Tensor:
    _check_bwd(dy, h)
    return h.new_empty(h.shape)


_swiglu_op = fast_op("swiglu", _swiglu_impl, _swiglu_fake)
_swiglu_bwd_op = fast_op("swiglu_bwd", _swiglu_bwd_impl, _swiglu_bwd_fake)
elementwise_pair(_swiglu_op, _swiglu_bwd_op)


def swiglu(h: Tensor) -> Tensor:
    """silu(gate)*up in fp32 from h[..., 2I] (h[..., 0::2] = gate, h[..., 1::2] = up), rounded once."""
    return _swiglu_op(h)


def swiglu_bwd(dy: Tensor, h: Tensor) -> Tensor:
    """dh [..., 2I] interleaved like h: dgate = dy*up*s*(1+g*(1-s)), dup = dy*silu(g), rounded once."""
    return _swiglu_bwd_op(dy, h)


# ftz on an op of ours would flush subnormal products (libdevice expf's ex2.approx.ftz acts on a
# range-reduced argument and is exempt); approximate division is not IEEE; local memory means spills.
ELEMENTWISE_FORBID = (r"\b(mul|add|sub|div|fma)(\.r[nzmp])?\.ftz\.f32\b",
                      r"\bdiv\.(approx|full)(\.ftz)?\.f32\b", r"\b(ld|st)\.local\b")


def quotient_rules(act: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(expected, forbidden) PTX wherever a swiglu computes its sigmoid: the quotient as div.rn's fast path
    (swiglu.unit_quotient), no div.rn.f32, whose range check and slow-path call split the code around it."""
    return ((r"\brcp\.approx\.ftz\.f32\b",), (r"\bdiv\.rn\.f32\b",)) if act == "swiglu" else ((), ())


_LD128 = r"\bld\.global(\.nc)?\.(v4\.(b|f|u)32|v2\.(b|u)64|v8\.(b|f|u)32)\b"
_ST128 = r"\bst\.global\.(v4\.(b|f|u)32|v2\.(b|u)64|v8\.(b|f|u)32)\b"


def _spec(kernel: Kernel, dtype_name: str) -> KernelSpec:
    suffix = "" if dtype_name == "bfloat16" else "_f32"
    rounding = (r"\bcvt\.rn\.bf16x2\.f32\b",) if dtype_name == "bfloat16" else ()
    quotient = quotient_rules("swiglu")
    return runtime.portable_spec(
        kernel.name.removesuffix("_fwd"), f"{kernel.name}{suffix}",
        kernel.compiler(dtype=dtype_name, vec=_VEC[dtype_name]),
        (_LD128, _ST128, r"\bmul\.rn\.f32\b", r"\badd\.rn\.f32\b", *quotient[0], *rounding),
        (*ELEMENTWISE_FORBID, *quotient[1]))


KERNELS: tuple[KernelSpec, ...] = tuple(
    _spec(kernel, dtype_name) for dtype_name in ("bfloat16", "float32")
    for kernel in (SWIGLU_FWD, SWIGLU_BWD)
)
