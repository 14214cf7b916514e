"""Fast combine fwd/bwd: CuTeDSL kernels (nmoe/fast/kernels/combine.py) behind torch custom ops.

Bitwise to the spec: every product and sum is an explicit `.rn` op (no FMA), slot order is kept, and
routed_scale multiplies the sum, never the weights. nmoe::combine carries autograd via nmoe::combine_bwd.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nmoe.constants import ACT_H_COLUMNS
from nmoe.fast import runtime
from nmoe.fast._swiglu import ELEMENTWISE_FORBID, quotient_rules
from nmoe.fast.activation import ACTIVATIONS
from nmoe.fast.limits import VEC_BYTES
from nmoe.fast.op import Kernel, fast_op, save_inputs
from nmoe.fast.runtime import KernelSpec

_VEC = 8


def _kernel(name: str) -> Kernel:
    return Kernel("nmoe.fast.kernels.combine", name,
                  lambda km, k, vec, shared: km.compile_args(name, k, vec, shared))


COMBINE_FWD = _kernel("combine_fwd")
COMBINE_BWD = _kernel("combine_bwd")
COMBINE_GATHER_FWD = _kernel("combine_gather_fwd")
EXPERT_ROWS_BWD = Kernel("nmoe.fast.kernels.combine", "expert_rows_bwd",
                         lambda km, vec, act: km.expert_rows_bwd_args(vec, act))


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


def _launch(kernel: Kernel, tensors: tuple[Tensor, ...], y: Tensor, scale: float, shared: bool) -> None:
    """Launch on contiguous tensors in the kernel's pointer order."""
    device, arch = runtime.device_arch(*tensors)
    t, k, h = y.shape
    if t == 0 or h == 0:
        return
    ptrs = [x.data_ptr() for x in tensors]
    aligned = all(p % VEC_BYTES == 0 for x, p in zip(tensors, ptrs, strict=True) if x.dtype == torch.bfloat16)
    vec = _VEC if h % _VEC == 0 and aligned else 1
    kernel.launcher(arch, k=k, vec=vec, shared=shared)(device, *ptrs, t, h, scale)


def _combine_impl(y: Tensor, w: Tensor, routed_scale: float, shared: Tensor | None) -> Tensor:
    _check("combine", y, w)
    if shared is not None:
        _check_rows("combine", "shared", shared, y)
    out = torch.empty((y.shape[0], y.shape[2]), dtype=y.dtype, device=y.device)
    y, w = y.contiguous(), w.contiguous()
    sh = y if shared is None else shared.contiguous()
    scale = _scale_f32(routed_scale)
    _launch(COMBINE_FWD, (y, w, sh, out), y, scale, shared is not None)
    return out


def _combine_fake(y: Tensor, w: Tensor, routed_scale: float, shared: Tensor | None) -> Tensor:
    _check("combine", y, w)
    return y.new_empty((y.shape[0], y.shape[2]))


def _check_gather(yp: Tensor, row_of: Tensor, w: Tensor) -> None:
    if yp.dim() != 2 or row_of.dim() != 2 or w.shape != row_of.shape:
        raise ValueError(f"combine_gather: need yp [R,H], row_of [T,K] and w [T,K]; got {tuple(yp.shape)}, "
                         f"{tuple(row_of.shape)}, {tuple(w.shape)}")
    if row_of.dtype != torch.int32:
        raise ValueError(f"combine_gather: row_of must be int32 row indices into yp, got {row_of.dtype}")
    _check("combine_gather", yp.new_empty(0, *row_of.shape[1:], yp.shape[1]), w[:0])


def _combine_gather_impl(yp: Tensor, row_of: Tensor, w: Tensor, routed_scale: float,
                         shared: Tensor | None) -> Tensor:
    _check_gather(yp, row_of, w)
    (t, k), h = row_of.shape, yp.shape[1]
    out = torch.empty((t, h), dtype=yp.dtype, device=yp.device)
    if shared is not None and (shared.shape != (t, h) or shared.dtype != yp.dtype):
        raise ValueError(f"combine_gather: shared {tuple(shared.shape)} {shared.dtype} must be [T,H] = "
                         f"{(t, h)} {yp.dtype}")
    yp, row_of, w = yp.contiguous(), row_of.contiguous(), w.contiguous()
    sh = out if shared is None else shared.contiguous()
    tensors = (yp, row_of, w, sh, out)
    device, arch = runtime.device_arch(*tensors)
    if t == 0 or h == 0:
        return out
    ptrs = [x.data_ptr() for x in tensors]
    aligned = all(p % VEC_BYTES == 0 for x, p in zip(tensors, ptrs, strict=True) if x.dtype == torch.bfloat16)
    vec = _VEC if h % _VEC == 0 and aligned else 1
    COMBINE_GATHER_FWD.launcher(arch, k=k, vec=vec, shared=shared is not None)(
        device, *ptrs, t, yp.shape[0], h, _scale_f32(routed_scale))
    return out


def _combine_gather_fake(yp: Tensor, row_of: Tensor, w: Tensor, routed_scale: float,
                         shared: Tensor | None) -> Tensor:
    _check_gather(yp, row_of, w)
    return yp.new_empty((row_of.shape[0], yp.shape[1]))


def _combine_bwd_impl(dout: Tensor, y: Tensor, w: Tensor, routed_scale: float) -> tuple[Tensor, Tensor]:
    _check("combine_bwd", y, w)
    _check_rows("combine_bwd", "dout", dout, y)
    dy = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    dw = torch.zeros(w.shape, dtype=w.dtype, device=w.device)
    dout, y, w = dout.contiguous(), y.contiguous(), w.contiguous()
    _launch(COMBINE_BWD, (dout, y, w, dy, dw), y, _scale_f32(routed_scale), False)
    return dy, dw


def _combine_bwd_fake(dout: Tensor, y: Tensor, w: Tensor, routed_scale: float) -> tuple[Tensor, Tensor]:
    _check("combine_bwd", y, w)
    return y.new_empty(y.shape), w.new_empty(w.shape)


def _check_rows_bwd(dz: Tensor, h: Tensor, w: Tensor, activation: str) -> None:
    op = "expert_rows_bwd"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation {activation!r}; choose one of {ACTIVATIONS}")
    width = ACT_H_COLUMNS[activation]
    if dz.dim() != 2 or h.shape != (dz.shape[0], width * dz.shape[1]) or w.shape != dz.shape[:1]:
        raise ValueError(f"{op}: need dz [R,I], h [R,{width}I] ({activation}) and w [R]; got "
                         f"{tuple(dz.shape)}, {tuple(h.shape)}, {tuple(w.shape)}")
    if dz.dtype != torch.bfloat16 or h.dtype != torch.bfloat16 or w.dtype != torch.float32:
        raise ValueError(f"{op}: dz and h bf16, w fp32; got {dz.dtype}, {h.dtype}, {w.dtype}")
    if not h.is_contiguous():
        raise ValueError(f"{op}: h is overwritten with dh in place and must be contiguous")


def _expert_rows_bwd_impl(dz: Tensor, h: Tensor, w: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    _check_rows_bwd(dz, h, w, activation)
    rows, n = dz.shape
    dz, w = dz.contiguous(), w.contiguous()
    aw = torch.empty_like(dz)
    dot = torch.empty(rows, dtype=torch.float32, device=dz.device)
    tensors = (dz, h, w, aw, dot)
    device, arch = runtime.device_arch(*tensors)
    if rows == 0 or n == 0:
        return aw, dot.zero_()
    ptrs = [x.data_ptr() for x in tensors]
    aligned = all(p % VEC_BYTES == 0 for x, p in zip(tensors, ptrs, strict=True) if x.dtype == torch.bfloat16)
    vec = _VEC if n % _VEC == 0 and aligned else 1
    EXPERT_ROWS_BWD.launcher(arch, vec=vec, act=activation)(device, *ptrs, rows, n)
    return aw, dot


def _expert_rows_bwd_fake(dz: Tensor, h: Tensor, w: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    _check_rows_bwd(dz, h, w, activation)
    return dz.new_empty(dz.shape), w.new_empty(w.shape)


_combine_op = fast_op("combine", _combine_impl, _combine_fake)
_combine_bwd_op = fast_op("combine_bwd", _combine_bwd_impl, _combine_bwd_fake)
_combine_gather_op = fast_op("combine_gather", _combine_gather_impl, _combine_gather_fake)
_expert_rows_bwd_op = fast_op("expert_rows_bwd", _expert_rows_bwd_impl, _expert_rows_bwd_fake, mutates=("h",))


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, Tensor | None]:
    y, w = ctx.saved_tensors
    routed_scale, shared = ctx.inputs[2], ctx.inputs[3]
    dy: Tensor | None = None
    dw: Tensor | None = None
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        dy, dw = _combine_bwd_op(grad, y, w, routed_scale)
    return dy, dw, None, None if shared is None else grad


_combine_op.autograd(_backward, save_inputs(0, 1))


def combine(y: Tensor, w: Tensor, routed_scale: float, shared: Tensor | None = None) -> Tensor:
    """bf16(((sum_k w_k*y_k) * routed_scale) + shared), fp32 slot-order sum, every op rounded (no FMA)."""
    return _combine_op(y, w, routed_scale, shared)


def combine_gather(yp: Tensor, row_of: Tensor, w: Tensor, routed_scale: float,
                   shared: Tensor | None = None) -> Tensor:
    """combine(yp[row_of], w, routed_scale, shared) bit for bit, reading each slot's row in place; forward
    only (the MoE layer owns its backward). row_of int32 [T,K]; an index outside yp is undefined."""
    return _combine_gather_op(yp, row_of, w, routed_scale, shared)


def combine_bwd(dout: Tensor, y: Tensor, w: Tensor, routed_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dy, dw, dshared): g = dout*routed_scale, dy_k = bf16(g*w_k), dw_k = sum_h g*y_k (fp32), and dout
    itself as dshared (equal to the spec's copy; no [T,H] copy is made)."""
    dy, dw = _combine_bwd_op(dout, y, w, routed_scale)
    return dy, dw, dout


def expert_rows_bwd(dz: Tensor, h: Tensor, w: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """(aw, dot) of the MoE layer's expert rows, h overwritten by dh: with a = act(h), exactly
    combine(a, w), combine_bwd(dz, a, w)'s dw, then act_bwd(its dy, h); K = 1, scale 1, one pass."""
    return _expert_rows_bwd_op(dz, h, w, activation)


# The contract pins every product and sum as separately rounded: any fma (scalar or sm_100a's packed
# f32x2), an unrounded mul/add that ptxas may fuse, ftz, or local memory (spills) is a defect.
FORBID_FMA = r"\bfma\.rn\.f32\b|\bfma\.f32\b"
_FORBID = (FORBID_FMA, r"\bfma(\.\w+)*\.f32x2\b", r"\b(mul|add)\.f32\b", r"\.ftz\b", r"\b(ld|st)\.local\b")


def _spec(name: str, kernel: Kernel, k: int, has_shared: bool, *extra: str) -> KernelSpec:
    expect = (runtime.LD128, runtime.ST128, r"mul\.rn\.f32", r"\bcvt\.rn\.bf16x2\.f32\b", *extra)
    return runtime.portable_spec(kernel.name.removesuffix("_fwd"), name,
                                 kernel.compiler(k=k, vec=_VEC, shared=has_shared), expect, _FORBID)


# The expert rows' pass reduces its row dot across the warp and rounds a and bf16(dz*w) to bf16 in registers;
# its activations keep the standalone kernels' forbid list (libdevice expf holds fma and ex2.approx.ftz).
_ROWS_EXPECT = (runtime.LD128, runtime.ST128, r"mul\.rn\.f32", r"\badd\.rn\.f32\b", r"\bcvt\.rn\.bf16\.f32\b",
                r"\bshfl\.sync\.bfly\.b32\b")


def _rows_spec(act: str) -> KernelSpec:
    quotient, no_div = quotient_rules(act)
    return runtime.portable_spec("moe_layer", f"expert_rows_bwd_{act}",
                                 EXPERT_ROWS_BWD.compiler(vec=_VEC, act=act), (*_ROWS_EXPECT, *quotient),
                                 (*ELEMENTWISE_FORBID, *no_div))


# combine_gather also loads each slot's int32 row index sign-extended into a 64-bit row offset.
KERNELS: tuple[KernelSpec, ...] = (
    _spec("combine_fwd", COMBINE_FWD, 8, True, r"\badd\.rn\.f32\b"),
    _spec("combine_fwd_k1", COMBINE_FWD, 1, False),
    _spec("combine_bwd", COMBINE_BWD, 8, False, r"\badd\.rn\.f32\b", r"\bshfl\.sync\.bfly\.b32\b"),
    *(_rows_spec(act) for act in ACTIVATIONS),
    runtime.portable_spec("combine_gather", "combine_gather_fwd",
                          COMBINE_GATHER_FWD.compiler(k=8, vec=_VEC, shared=True),
                          (runtime.LD128, runtime.ST128, r"mul\.rn\.f32", r"\badd\.rn\.f32\b",
                           r"\bcvt\.rn\.bf16x2\.f32\b", r"\bld\.global(\.nc)?\.s32\s+%rd"), _FORBID),
)
