"""Token-choice router: fp32 scores, top-k on biased scores, aux-loss-free bias update (DeepSeek-V3).

Ties are broken toward the lower expert (and group) id by a stable descending sort, never by
torch.topk, whose tie order is unspecified. fp32 scores use a pinned exp built from round-to-nearest
fp32 add/sub/mul/div only: torch's sigmoid/softmax bits depend on the SIMD path and element position.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nmoe.reference.formats import round_to

SCORE_FUNCS = ("sigmoid", "softmax")


def _f32_const(bits: int) -> Tensor:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32)[0]


_LOG2E, _LN2_HI, _LN2_LO = _f32_const(0x3FB8AA3B), _f32_const(0x3F317200), _f32_const(0x35BFBE8E)
_SHIFT = torch.tensor(12582912.0, dtype=torch.float32)
_TAYLOR = tuple(torch.tensor(1.0 / m, dtype=torch.float32) for m in (5040.0, 720.0, 120.0, 24.0, 6.0, 2.0))
_ONE = torch.tensor(1.0, dtype=torch.float32)


def pinned_exp(x: Tensor) -> Tensor:
    """fp32 exp: Cody-Waite reduction by ln2 (hi/lo), degree-7 Taylor in Horner form, two-step 2^n scale.

    Within 1.1 ulp of exp; every step is one correctly rounded fp32 op, so any IEEE machine gets these bits.
    """
    xc = torch.clamp(x, -104.0, 89.0)
    nf = (xc * _LOG2E + _SHIFT) - _SHIFT
    n = torch.nan_to_num(nf).to(torch.int32)
    r = (xc - nf * _LN2_HI) - nf * _LN2_LO
    q = _TAYLOR[0].expand_as(r)
    for c in _TAYLOR[1:]:
        q = q * r + c
    p = _ONE + (r + (r * r) * q)
    a = n >> 1
    res = (p * ((a + 127) << 23).view(torch.float32)) * ((n - a + 127) << 23).view(torch.float32)
    res = torch.where(x < -104.0, 0.0, torch.where(x > 89.0, float("inf"), res))
    return torch.where(torch.isnan(x), x, res)


def _pinned_scores(logits: Tensor, score_func: str) -> Tensor:
    if score_func == "sigmoid":
        return torch.div(_ONE, _ONE + pinned_exp(-logits))
    e = pinned_exp(logits - logits.amax(dim=-1, keepdim=True))
    total = torch.zeros(logits.shape[0], dtype=torch.float32)
    for j in range(logits.shape[1]):
        total = total + e[:, j]
    return torch.div(e, total[:, None])


class _PinnedScores(torch.autograd.Function):
    """Pinned forward bits; the backward is the analytic derivative of the exact sigmoid/softmax."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, score_func: str) -> Tensor:
        s = _pinned_scores(logits.detach(), score_func)
        ctx.save_for_backward(s)
        ctx.score_func = score_func
        return s

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        (s,) = ctx.saved_tensors
        if ctx.score_func == "sigmoid":
            return g * s * (1 - s), None
        return s * (g - (g * s).sum(dim=-1, keepdim=True)), None


def router_scores(logits: Tensor, score_func: str) -> Tensor:
    """sigmoid = 1/(1+exp(-x)); softmax = exp(x-max)/sum, the sum taken in ascending expert id."""
    if logits.dtype == torch.float64:
        return torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, dim=-1)
    out: Tensor = _PinnedScores.apply(logits, score_func)  # type: ignore[no-untyped-call]
    return out


def router_logits(x: Tensor, wr: Tensor) -> Tensor:
    if x.dim() != 2 or wr.dim() != 2 or x.shape[1] != wr.shape[1]:
        raise ValueError(f"router_logits: need x [T,H], wr [E,H]; got {tuple(x.shape)}, {tuple(wr.shape)}")
    acc = torch.promote_types(torch.float32, torch.promote_types(x.dtype, wr.dtype))
    return x.to(acc) @ wr.to(acc).T


def _stable_desc_order(v: Tensor) -> Tensor:
    """Indices of v sorted by descending value along the last dim; equal values keep ascending id."""
    return torch.sort(v, dim=-1, descending=True, stable=True).indices


def router_topk(
    logits: Tensor,
    bias: Tensor,
    k: int,
    score_func: str,
    n_groups: int = 1,
    topk_groups: int = 1,
) -> tuple[Tensor, Tensor]:
    """Group-limited routing pin: a group's score is the sum of its top-2 biased scores (DeepSeek-V3),
    the top `topk_groups` groups survive (ties -> lower group id); weights = unbiased scores / their sum."""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"router_topk: logits must be fp32 [T,E], got {logits.dtype} {tuple(logits.shape)}")
    t, e = logits.shape
    if bias.shape != (e,):
        raise ValueError(f"router_topk: bias shape {tuple(bias.shape)} must be [E] = ({e},)")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"router_topk: score_func {score_func!r} unknown; use one of {SCORE_FUNCS}")
    if bool(torch.isnan(logits).any()) or bool(torch.isnan(bias).any()):
        raise ValueError("router_topk: NaN in logits or bias; the ranking is undefined, fix the upstream op")
    if n_groups < 1 or e % n_groups != 0:
        raise ValueError(f"router_topk: n_groups={n_groups} must be >= 1 and divide E={e}")
    group_size = e // n_groups
    if n_groups > 1 and group_size < 2:
        raise ValueError(f"router_topk: group size {group_size} < 2; top-2 group scores need >= 2 per group")
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"router_topk: topk_groups={topk_groups} must lie in [1, n_groups={n_groups}]")
    avail = e if n_groups == 1 else topk_groups * group_size
    if not 1 <= k <= avail:
        raise ValueError(f"router_topk: k={k} must lie in [1, {avail}] (experts reachable after group limit)")

    scores = router_scores(logits, score_func)
    biased = scores + bias.to(scores.dtype)

    if n_groups > 1:
        grouped = biased.view(t, n_groups, group_size)
        top2 = torch.sort(grouped, dim=-1, descending=True).values
        group_score = top2[..., 0] + top2[..., 1]
        keep_groups = _stable_desc_order(group_score)[:, :topk_groups]
        keep = torch.zeros(t, n_groups, dtype=torch.bool).scatter_(1, keep_groups, True)
        biased = biased.masked_fill(~keep.repeat_interleave(group_size, dim=1), float("-inf"))

    ids = _stable_desc_order(biased)[:, :k]
    picked = scores.gather(1, ids)
    denom = picked[:, 0]
    for j in range(1, k):
        denom = denom + picked[:, j]
    return round_to(picked / denom[:, None], picked.dtype), ids


def expert_counts(ids: Tensor, n_experts: int) -> Tensor:
    flat = ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n_experts):
        lo, hi = int(flat.min()), int(flat.max())
        raise ValueError(f"expert_counts: ids must lie in [0, {n_experts}); got [{lo}, {hi}]; fix the router")
    return torch.bincount(flat, minlength=n_experts)


def bias_update(bias: Tensor, counts: Tensor, rate: float, clamp: float) -> Tensor:
    """DeepSeek-V3 aux-loss-free rule: bias_e += rate*sign(mean_load - load_e), then clamp to [-clamp, clamp].

    The sign is taken exactly in integers as sign(sum(counts) - E*counts_e); the add is fp32.
    """
    if bias.dim() != 1 or counts.shape != bias.shape:
        raise ValueError(f"bias_update: bias {tuple(bias.shape)}, counts {tuple(counts.shape)} must be [E]")
    if not rate >= 0 or not clamp > 0:
        raise ValueError(f"bias_update: need rate >= 0 and clamp > 0, got rate={rate}, clamp={clamp}")
    c = counts.to(torch.int64)
    direction = torch.sign(c.sum() - bias.numel() * c).to(bias.dtype)
    step = torch.tensor(rate, dtype=bias.dtype) * direction
    return torch.clamp(bias + step, min=-clamp, max=clamp)
