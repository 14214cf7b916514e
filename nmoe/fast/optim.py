"""Fast optimizer steps with the spec's signatures: AdamW as one CuTeDSL elementwise kernel (kernels/optim.py,
fp32 coefficients from float64 on the host), Muon with Newton-Schulz 5 on bf16 tensor cores and an fp32
iterate. Nothing syncs the host."""

from __future__ import annotations

import math
from typing import Final

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.limits import VEC_BYTES
from nmoe.fast.op import Kernel
from nmoe.fast.runtime import KernelSpec

ADAMW = Kernel.by_name("nmoe.fast.kernels.optim", "adamw")
NS5_COEFFS: Final[tuple[float, float, float]] = (3.4445, -4.7750, 2.0315)
NS5_EPS: Final[float] = 1e-7
MUON_RMS_MATCH: Final[float] = 0.2
_DTYPES: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _check_master(name: str, p: Tensor, *state: Tensor, low_ok: bool = False) -> None:
    """Contiguous state matching the fp32 master; with low_ok (AdamW's moments) all of it may be bf16."""
    if p.dtype != torch.float32:
        raise ValueError(f"{name}: param dtype {p.dtype} must be fp32; step the fp32 master copy (fp64 "
                         "runs on nmoe.reference.optim)")
    want = torch.bfloat16 if low_ok and state and state[0].dtype == torch.bfloat16 else p.dtype
    for t in (p, *state):
        if t.shape != p.shape or t.dtype != (p.dtype if t is p else want) or not t.is_contiguous():
            raise ValueError(f"{name}: state {t.dtype} {tuple(t.shape)} must be a contiguous tensor matching "
                             f"the param {p.dtype} {tuple(p.shape)}"
                             + (" (the moments: both fp32 or both bf16)" if low_ok else ""))


def _check_scale(name: str, p: Tensor, grad_scale: Tensor | None) -> None:
    if grad_scale is not None and (grad_scale.dim() != 0 or grad_scale.dtype != torch.float32
                                   or grad_scale.device != p.device):
        raise ValueError(f"{name}: grad_scale must be a 0-dim fp32 tensor on {p.device}, got "
                         f"{grad_scale.dtype} {tuple(grad_scale.shape)} on {grad_scale.device}")


def adamw_step(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: int, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, grad_scale: Tensor | None = None,
               p_low: Tensor | None = None) -> None:
    """The spec's AdamW step in place on fp32 p and fp32 or bf16 m, v in one kernel pass (grad fp32 or bf16,
    times the device scalar grad_scale when given; step from 1); p_low, the bf16 param over this master (bf16
    grad), gets the new p rounded once in the same pass, so no separate cast runs."""
    _check_master("adamw_step", p, m, v, low_ok=True)
    if g.shape != p.shape or g.dtype not in _DTYPES:
        raise ValueError(f"adamw_step: grad {g.dtype} {tuple(g.shape)} must be fp32/bf16 of the param shape "
                         f"{tuple(p.shape)}")
    if step < 1:
        raise ValueError(f"adamw_step: step={step} must be >= 1 (increment the step count before stepping)")
    _check_scale("adamw_step", p, grad_scale)
    if p_low is not None and (p_low.shape != p.shape or p_low.dtype != torch.bfloat16
                              or g.dtype != torch.bfloat16 or not p_low.is_contiguous()):
        raise ValueError(f"adamw_step: p_low {p_low.dtype} {tuple(p_low.shape)} must be a contiguous bf16 "
                         f"tensor of the param shape {tuple(p.shape)}, with a bf16 grad (got {g.dtype})")
    device, arch = runtime.device_arch(p, g, m, v)
    n = p.numel()
    if n == 0:
        return
    g = g.contiguous()
    ptrs = [t.data_ptr() for t in (p, g, m, v)]
    low = p if p_low is None else p_low
    vec = 4 if all(a % VEC_BYTES == 0 for a in ptrs) and low.data_ptr() % 8 == 0 else 1
    coeffs = (1.0 - lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 - beta1**step,
              1.0 - beta2**step, lr, eps)
    scale = p if grad_scale is None else grad_scale
    launch = ADAMW.launcher(arch, vec=vec, grad_dtype=_DTYPES[g.dtype], scaled=grad_scale is not None,
                            low=p_low is not None, state_dtype=_DTYPES[m.dtype])
    launch(device, *ptrs, scale.data_ptr(), low.data_ptr(), n, *coeffs)


def newton_schulz5(g: Tensor, steps: int = 5) -> Tensor:
    """~ U V^T of g per matrix over the last two dims: fp32 iterate, bf16 GEMM operands, fp32 GEMM outputs.

    X = g / (||g||_F + 1e-7), transposed when rows > cols; X <- a X + (b A + c A A) X with A = X X^T.
    """
    if g.dim() < 2:
        raise ValueError(f"newton_schulz5: input must be a matrix (or a batch), got shape {tuple(g.shape)}")
    if steps < 1:
        raise ValueError(f"newton_schulz5: steps={steps} must be >= 1")
    runtime.device_arch(g)
    a, b, c = NS5_COEFFS
    x = g.to(torch.float32).reshape(-1, g.shape[-2], g.shape[-1])
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, ord="fro", keepdim=True) + NS5_EPS)
    for _ in range(steps):
        xb = x.to(torch.bfloat16)
        gram = torch.bmm(xb, xb.mT, out_dtype=torch.float32)
        gb = gram.to(torch.bfloat16)
        poly = b * gram + c * torch.bmm(gb, gb, out_dtype=torch.float32)
        x = a * x + torch.bmm(poly.to(torch.bfloat16), xb, out_dtype=torch.float32)
    out: Tensor = (x.mT if tall else x).reshape(g.shape)
    return out


def muon_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """0.2 * sqrt(max(rows, cols)) (Moonlight, arXiv:2502.16982): an AdamW-like update RMS."""
    return MUON_RMS_MATCH * math.sqrt(max(shape[-2], shape[-1]))


def muon_step(p: Tensor, g: Tensor, buf: Tensor, lr: float, momentum: float, weight_decay: float,
              nesterov: bool = True, ns_steps: int = 5, grad_scale: Tensor | None = None,
              p_low: Tensor | None = None) -> None:
    """The spec's Muon step in place on fp32 p and buf, matrices over the last two dims (g times grad_scale
    when given); p_low, a bf16 param over this master, gets the new p rounded once."""
    # buf = mu*buf + g; u = g + mu*buf (nesterov) or buf; p *= 1 - lr*wd; p -= lr*muon_scale*NS5(u).
    _check_master("muon_step", p, buf)
    if p.dim() < 2:
        raise ValueError(f"muon_step: param shape {tuple(p.shape)} is not a matrix; step it with adamw_step")
    if g.shape != p.shape:
        raise ValueError(f"muon_step: grad shape {tuple(g.shape)} must equal param shape {tuple(p.shape)}")
    _check_scale("muon_step", p, grad_scale)
    runtime.device_arch(p, g, buf)
    gf = g.to(torch.float32) if grad_scale is None else g.to(torch.float32) * grad_scale
    buf.mul_(momentum).add_(gf)
    update = gf + momentum * buf if nesterov else buf
    ortho = newton_schulz5(update, ns_steps)
    p.mul_(1.0 - lr * weight_decay)
    p.sub_((lr * muon_scale(p.shape)) * ortho)
    if p_low is not None:
        p_low.copy_(p)


# Every AdamW step must round once (no FMA contraction, no approximate sqrt/div, no flush to zero).
_FORBID = (r"\b(rsqrt|sqrt|rcp|div)\.approx\b", r"\bdiv\.full\b", r"\.ftz\b", r"\bfma\.",
           r"\b(ld|st)\.local\b")
_CVT_BF16 = r"\bcvt\.rn\.bf16(x2)?\.f32\b"
_ROUNDED = (r"\bsqrt\.rn\.f32\b", r"\bdiv\.rn\.f32\b", r"\bmul\.rn\.f32\b", r"\badd\.rn\.f32\b",
            r"\bsub\.rn\.f32\b")


def _kernel_specs() -> tuple[KernelSpec, ...]:
    """The 128-bit kernels, and the scalar ones adamw_step compiles for tensors off 16-byte alignment; each
    with and without the folded grad scale, and with bf16 grads also writing the bf16 param (low); bf16
    moments where a trainer uses them (bf16 grads and param, clip factor)."""
    fp32 = tuple(
        runtime.portable_spec(
            "adamw", f"adamw_{tag}{'_v1' * (vec == 1)}{'_scaled' * scaled}{'_low' * low}",
            ADAMW.compiler(vec=vec, grad_dtype=gd, scaled=scaled, low=low, state_dtype="float32"),
            (*_ROUNDED, runtime.LD128, runtime.ST128) if vec == 4 else _ROUNDED, _FORBID)
        for vec in (4, 1) for gd, tag in (("float32", "g32"), ("bfloat16", "gbf16"))
        for scaled in (False, True) for low in ((False, True) if gd == "bfloat16" else (False,))
    )
    bf16 = tuple(
        runtime.portable_spec(
            "adamw", f"adamw_gbf16{'_v1' * (vec == 1)}_scaled_low_mbf16",
            ADAMW.compiler(vec=vec, grad_dtype="bfloat16", scaled=True, low=True, state_dtype="bfloat16"),
            (*_ROUNDED, runtime.LD128, runtime.ST128, _CVT_BF16) if vec == 4 else (*_ROUNDED, _CVT_BF16),
            _FORBID)
        for vec in (4, 1)
    )
    return fp32 + bf16


KERNELS: tuple[KernelSpec, ...] = _kernel_specs()
