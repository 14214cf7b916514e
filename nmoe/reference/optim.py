"""Optimizer spec: AdamW, Muon (Newton-Schulz 5) and the WSD learning-rate schedule by tokens.

Steps update fp32 master tensors in place and return None; Python-float coefficients act in the tensor dtype.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

NS5_COEFFS = (3.4445, -4.7750, 2.0315)
NS5_EPS = 1e-7
MUON_RMS_MATCH = 0.2


def scaled_grad(name: str, p: Tensor, g: Tensor, grad_scale: Tensor | None) -> Tensor:
    """g in the param dtype, times grad_scale (a 0-dim tensor: the clip factor) rounded once: clipping folded
    into the step, so it never rewrites the gradients."""
    gf = g.to(p.dtype)
    if grad_scale is None:
        return gf
    if grad_scale.dim() != 0 or grad_scale.dtype != torch.float32 or grad_scale.device != p.device:
        raise ValueError(f"{name}: grad_scale must be a 0-dim fp32 tensor on {p.device}, got "
                         f"{grad_scale.dtype} {tuple(grad_scale.shape)} on {grad_scale.device}")
    return gf * grad_scale.to(p.dtype)


def _check_master(name: str, p: Tensor, *state: Tensor, low_ok: bool = False) -> None:
    """State matches the master; with low_ok (AdamW's moments) it may also be bf16, stored rounded."""
    if p.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name}: param dtype {p.dtype} must be fp32 (or fp64); step the fp32 master copy")
    dtypes = (p.dtype, torch.bfloat16) if low_ok else (p.dtype,)
    for t in state:
        if t.shape != p.shape or t.dtype not in dtypes:
            raise ValueError(
                f"{name}: state {t.dtype} {tuple(t.shape)} must match the param {p.dtype} {tuple(p.shape)}"
                + (" (or be bf16)" if low_ok else "")
            )


def adamw_step(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: Tensor | None = None,
    p_low: Tensor | None = None,
) -> None:
    """AdamW (Loshchilov & Hutter) in place, step from 1; g *= grad_scale first, p_low (bf16) gets p after:
    p *= 1-lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g; p -= lr*(m/(1-b1^t)) / (sqrt(v/(1-b2^t))+eps)
    bf16 m, v (DeepSeek-V3's moments) update in p's dtype and are stored rounded; p moves by the unrounded."""
    _check_master("adamw_step", p, m, v, low_ok=True)
    if m.dtype != v.dtype:
        raise ValueError(f"adamw_step: moments {m.dtype} / {v.dtype} must share one dtype")
    if g.shape != p.shape:
        raise ValueError(f"adamw_step: grad shape {tuple(g.shape)} must equal param shape {tuple(p.shape)}")
    if step < 1:
        raise ValueError(f"adamw_step: step={step} must be >= 1 (increment the step count before stepping)")
    gf = scaled_grad("adamw_step", p, g, grad_scale)
    p.mul_(1.0 - lr * weight_decay)
    mw, vw = m.to(p.dtype), v.to(p.dtype)
    mw.mul_(beta1).add_(gf, alpha=1.0 - beta1)
    vw.mul_(beta2).addcmul_(gf, gf, value=1.0 - beta2)
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    p.sub_(lr * (mw / bias1) / ((vw / bias2).sqrt() + eps))
    if mw is not m:
        m.copy_(mw)
        v.copy_(vw)
    if p_low is not None:
        p_low.copy_(p)


def newton_schulz5(g: Tensor, steps: int = 5) -> Tensor:
    """Approximate U V^T of g's SVD per matrix over the last two dims (Jordan et al., Muon), fp32 iteration.

    X = g / (||g||_F + 1e-7), transposed when rows > cols; X <- a X + (b A + c A A) X with A = X X^T.
    """
    if g.dim() < 2:
        raise ValueError(f"newton_schulz5: input must be a matrix (or a batch), got shape {tuple(g.shape)}")
    if steps < 1:
        raise ValueError(f"newton_schulz5: steps={steps} must be >= 1")
    a, b, c = NS5_COEFFS
    x = g.to(torch.promote_types(g.dtype, torch.float32))
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, ord="fro", keepdim=True) + NS5_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    out: Tensor = x.mT if tall else x
    return out


def muon_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """0.2 * sqrt(max(rows, cols)) (Liu et al. 2025, Moonlight, arXiv:2502.16982): AdamW-like update RMS."""
    return MUON_RMS_MATCH * math.sqrt(max(shape[-2], shape[-1]))


def muon_step(
    p: Tensor,
    g: Tensor,
    buf: Tensor,
    lr: float,
    momentum: float,
    weight_decay: float,
    nesterov: bool = True,
    ns_steps: int = 5,
    grad_scale: Tensor | None = None,
    p_low: Tensor | None = None,
) -> None:
    """Muon (Moonlight form) in place over the last two dims; g *= grad_scale first, p_low gets p after:
    buf = mu*buf + g; u = g + mu*buf (nesterov) or buf; p *= 1 - lr*wd; p -= lr*muon_scale*NS5(u).
    """
    _check_master("muon_step", p, buf)
    if p.dim() < 2:
        raise ValueError(f"muon_step: param shape {tuple(p.shape)} is not a matrix; step it with adamw_step")
    if g.shape != p.shape:
        raise ValueError(f"muon_step: grad shape {tuple(g.shape)} must equal param shape {tuple(p.shape)}")
    gf = scaled_grad("muon_step", p, g, grad_scale)
    buf.mul_(momentum).add_(gf)
    update = gf + momentum * buf if nesterov else buf
    ortho = newton_schulz5(update, ns_steps).to(p.dtype)
    p.mul_(1.0 - lr * weight_decay)
    p.sub_((lr * muon_scale(p.shape)) * ortho)
    if p_low is not None:
        p_low.copy_(p)


@dataclass(frozen=True)
class TrainProgress:
    """Where training is: optimizer steps done and tokens consumed INCLUDING the batch this lr is for.

    Variable-length batches make the two disagree; the schedule reads tokens only.
    """

    step: int
    tokens: int


def wsd_factor(
    progress: TrainProgress,
    warmup_tokens: int,
    total_tokens: int,
    decay_fraction: float,
    min_lr_ratio: float,
) -> float:
    """WSD multiplier by tokens: linear 0->1 over warmup, 1, then linear to min_lr_ratio over the last
    decay_fraction of total_tokens; held at min_lr_ratio past total_tokens.
    """
    if progress.step < 0 or progress.tokens < 0:
        raise ValueError(f"wsd: progress {progress} must have step >= 0 and tokens >= 0")
    if not 0.0 <= decay_fraction <= 1.0 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(
            f"wsd: decay_fraction={decay_fraction} and min_lr_ratio={min_lr_ratio} must lie in [0, 1]"
        )
    decay_tokens = decay_fraction * total_tokens
    decay_start = total_tokens - decay_tokens
    if total_tokens < 1 or not 0 <= warmup_tokens <= decay_start:
        raise ValueError(
            f"wsd: need total_tokens >= 1 and 0 <= warmup_tokens <= decay start; got warmup_tokens="
            f"{warmup_tokens}, total_tokens={total_tokens}, decay_fraction={decay_fraction}; shorten warmup"
        )
    if progress.tokens < warmup_tokens:
        return progress.tokens / warmup_tokens
    if progress.tokens <= decay_start or decay_tokens == 0:
        return 1.0
    frac = min((progress.tokens - decay_start) / decay_tokens, 1.0)
    return 1.0 - (1.0 - min_lr_ratio) * frac


def wsd_lr(
    progress: TrainProgress,
    peak_lr: float,
    warmup_tokens: int,
    total_tokens: int,
    decay_fraction: float,
    min_lr_ratio: float,
) -> float:
    """peak_lr * wsd_factor(...); one schedule serves the dense, router and expert peak LRs."""
    return peak_lr * wsd_factor(progress, warmup_tokens, total_tokens, decay_fraction, min_lr_ratio)
