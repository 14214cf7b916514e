"""Token-choice router: fp32 scores, top-k on biased scores, aux-loss-free bias update (DeepSeek-V3).

Ties are broken toward the lower expert (and group) id by a stable descending sort, never by
torch.topk, whose tie order is unspecified.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCORE_FUNCS = ("sigmoid", "softmax")


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

    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, dim=-1)
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
    return picked / denom[:, None], ids


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
