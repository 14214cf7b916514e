"""Fast combine fwd/bwd: CuTeDSL kernels (nmoe/fast/kernels/combine.py) behind torch custom ops.

Bitwise to the spec: every product and sum is an explicit `.rn` op (no FMA), slot order is kept, and
routed_scale multiplies the sum, never the weights. nmoe::combine carries autograd via nmoe::combine_bwd.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.runtime import KernelSpec

_KERNEL_MODULE = "nmoe.fast.kernels.combine"
_VEC = 8
_VEC_BYTES = 16


def _source_sha256() -> str:
    return runtime.sources_sha256(_KERNEL_MODULE)


def _kernels(arch: str) -> ModuleType:
    return runtime.kernel_module(_KERNEL_MODULE, arch)


def _check(op: str, y: Tensor, w: Tensor) -> None:
    if y.dim() != 3 or w.shape != y.shape[:2]:
        raise ValueError(f"{op}: need y [T,K,H] and w [T,K]; got y {tuple(y.shape)}, w {tuple(w.shape)}")
    if y.shape[1] < 1:
        raise ValueError(f"{op}: K must be >= 1; every token needs at least one routed slot")
    if y.dtype != torch.bfloat16:
        raise ValueError(f"{op}: the fast kernel takes bf16 expert outputs, got {y.dtype}; cast y to bf16 "
                         "or use nmoe.reference.combine")
    if w.dtype != torch.float32:
        raise ValueError(f"{op}: w must be fp32 router weights, got {w.dtype}; pass w.float()")


def _check_rows(op: str, name: str, x: Tensor, y: Tensor) -> None:
    want = (y.shape[0], y.shape[2])
    if x.shape != want or x.dtype != y.dtype:
        raise ValueError(f"{op}: {name} {tuple(x.shape)} {x.dtype} must be [T,H] = {want} {y.dtype}")


def _scale_f32(routed_scale: float) -> float:
    """routed_scale rounded to fp32 exactly as the spec's torch.tensor(routed_scale, dtype=float32)."""
    return float(torch.tensor(float(routed_scale), dtype=torch.float32).item())


def _launch(kernel: str, tensors: tuple[Tensor, ...], y: Tensor, scale: float) -> None:
    """Launch on contiguous tensors in the kernel's pointer order (bf16 and fp32 pointers by dtype)."""
    arch = runtime.require_arch(*tensors)
    t, k, h = y.shape
    if t == 0 or h == 0:
        return
    bf16 = [x for x in tensors if x.dtype == torch.bfloat16]
    vec = _VEC if h % _VEC == 0 and all(x.data_ptr() % _VEC_BYTES == 0 for x in bf16) else 1
    has_shared = kernel == "combine_fwd_shared"
    name = "combine_fwd" if has_shared else kernel
    kc = _kernels(arch)
    key = runtime.cache_key(name, _source_sha256(), arch, {"k": k, "vec": vec, "shared": has_shared})

    def build() -> Any:
        import cutlass.cute as cute

        host, args = kc.compile_args(name, k, vec, has_shared)
        return cute.compile(host, *args)

    device = y.device
    ex = runtime.kernel_cache().executor(key, build)
    ptrs = [kc.bf16_pointer(x.data_ptr(), vec) if x.dtype == torch.bfloat16 else kc.f32_pointer(x.data_ptr())
            for x in tensors]
    with torch.cuda.device(device):
        ex(*ptrs, t, h, scale, runtime.current_stream(device))


def _combine_impl(y: Tensor, w: Tensor, routed_scale: float, shared: Tensor | None) -> Tensor:
    _check("combine", y, w)
    if shared is not None:
        _check_rows("combine", "shared", shared, y)
    out = torch.empty((y.shape[0], y.shape[2]), dtype=y.dtype, device=y.device)
    y, w = y.contiguous(), w.contiguous()
    sh = y if shared is None else shared.contiguous()
    scale = _scale_f32(routed_scale)
    _launch("combine_fwd" if shared is None else "combine_fwd_shared", (y, w, sh, out), y, scale)
    return out


def _combine_fake(y: Tensor, w: Tensor, routed_scale: float, shared: Tensor | None) -> Tensor:
    _check("combine", y, w)
    return y.new_empty((y.shape[0], y.shape[2]))


def _combine_bwd_impl(dout: Tensor, y: Tensor, w: Tensor, routed_scale: float) -> tuple[Tensor, Tensor]:
    _check("combine_bwd", y, w)
    _check_rows("combine_bwd", "dout", dout, y)
    dy = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    dw = torch.zeros(w.shape, dtype=w.dtype, device=w.device)
    dout, y, w = dout.contiguous(), y.contiguous(), w.contiguous()
    _launch("combine_bwd", (dout, y, w, dy, dw), y, _scale_f32(routed_scale))
    return dy, dw


def _combine_bwd_fake(dout: Tensor, y: Tensor, w: Tensor, routed_scale: float) -> tuple[Tensor, Tensor]:
    _check("combine_bwd", y, w)
    return y.new_empty(y.shape), w.new_empty(w.shape)


_combine_op = runtime.register_custom_op("nmoe::combine", _combine_impl, _combine_fake)
_combine_bwd_op = torch.library.custom_op("nmoe::combine_bwd", mutates_args=())(_combine_bwd_impl)
_combine_bwd_op.register_fake(_combine_bwd_fake)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    y, w, routed_scale, shared = inputs
    ctx.save_for_backward(y, w)
    ctx.routed_scale = routed_scale
    ctx.has_shared = shared is not None


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, Tensor | None]:
    y, w = ctx.saved_tensors
    dy: Tensor | None = None
    dw: Tensor | None = None
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        dy, dw = _combine_bwd_op(grad, y, w, ctx.routed_scale)
    return dy, dw, None, grad if ctx.has_shared else None


_combine_op.register_autograd(_backward, setup_context=_setup_context)


def combine(y: Tensor, w: Tensor, routed_scale: float, shared: Tensor | None = None) -> Tensor:
    """bf16(((sum_k w_k*y_k) * routed_scale) + shared), fp32 slot-order sum, every op rounded (no FMA)."""
    out: Tensor = _combine_op(y, w, routed_scale, shared)
    return out


def combine_bwd(dout: Tensor, y: Tensor, w: Tensor, routed_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dy, dw, dshared): g = dout*routed_scale, dy_k = bf16(g*w_k), dw_k = sum_h g*y_k (fp32), dout."""
    dy, dw = _combine_bwd_op(dout, y, w, routed_scale)
    return dy, dw, dout.clone()


def _ptx(kernel: str, k: int, has_shared: bool, arch: str) -> str:
    kc = _kernels(arch)
    host, args = kc.compile_args(kernel, k, _VEC, has_shared)
    return runtime.compile_ptx(host, args)


# The contract pins every product and sum as separately rounded: any fma (scalar or sm_100a's packed
# f32x2), an unrounded mul/add that ptxas may fuse, ftz, or local memory (spills) is a defect.
FORBID_FMA = r"\bfma\.rn\.f32\b|\bfma\.f32\b"
_FORBID = (FORBID_FMA, r"\bfma(\.\w+)*\.f32x2\b", r"\b(mul|add)\.f32\b", r"\.ftz\b", r"\b(ld|st)\.local\b")


def _spec(name: str, kernel: str, k: int, has_shared: bool, *extra: str) -> KernelSpec:
    expect = (runtime.LD128, runtime.ST128, r"mul\.rn\.f32", r"\bcvt\.rn\.bf16x2\.f32\b", *extra)
    return runtime.portable_spec("combine", name, functools.partial(_ptx, kernel, k, has_shared), expect,
                                 _FORBID)


KERNELS: tuple[KernelSpec, ...] = (
    _spec("combine_fwd", "combine_fwd", 8, True, r"\badd\.rn\.f32\b"),
    _spec("combine_fwd_k1", "combine_fwd", 1, False),
    _spec("combine_bwd", "combine_bwd", 8, False, r"\badd\.rn\.f32\b", r"\bshfl\.sync\.bfly\.b32\b"),
)
