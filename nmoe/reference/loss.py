"""Chunked cross-entropy spec: per token chunk, fp32 logits = h @ w_out^T and lse = m + log(sum(exp(l - m))).

Loss = sum over kept tokens / n_kept. No kept token (all ignore_index) -> loss 0 and zero gradients, not NaN.
"""

import torch
from torch import Tensor

from nmoe.config import TrainConfig


def _acc_dtype(h: Tensor, w_out: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(h.dtype, w_out.dtype), torch.float32)


def _check(h: Tensor, w_out: Tensor, targets: Tensor, ignore_index: int, chunk: int) -> Tensor:
    """Validate shapes/targets; return the kept-token mask."""
    if h.dim() != 2 or w_out.dim() != 2 or h.shape[1] != w_out.shape[1]:
        raise ValueError(
            f"cross_entropy: h {tuple(h.shape)} must be [T, D] and w_out {tuple(w_out.shape)} [V, D]"
        )
    if targets.shape != (h.shape[0],) or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cross_entropy: targets must be int32/int64 [{h.shape[0]}], "
            f"got {targets.dtype} {tuple(targets.shape)}"
        )
    if chunk < 1:
        raise ValueError(f"cross_entropy: chunk={chunk} must be >= 1 (tokens per logits chunk)")
    kept = targets != ignore_index
    bad = kept & ((targets < 0) | (targets >= w_out.shape[0]))
    if bool(bad.any()):
        first = int(targets[bad][0])
        raise ValueError(
            f"cross_entropy: target {first} is outside [0, {w_out.shape[0]}) and is not ignore_index="
            f"{ignore_index}; fix the data or the vocab size"
        )
    return kept


def _logsumexp(logits: Tensor) -> Tensor:
    m = logits.amax(dim=-1, keepdim=True)
    return (m + torch.log(torch.exp(logits - m).sum(dim=-1, keepdim=True))).squeeze(-1)


def cross_entropy(
    h: Tensor, w_out: Tensor, targets: Tensor, ignore_index: int = -100, chunk: int = TrainConfig.ce_chunk
) -> Tensor:
    """Mean CE over kept tokens of softmax(h @ w_out^T); 0-dim fp32 (fp64 for fp64 inputs).

    Per-chunk fp32 sums are added in chunk order; the mean divides by n_kept (0 when no token is kept).
    """
    kept = _check(h, w_out, targets, ignore_index, chunk)
    acc = _acc_dtype(h, w_out)
    w = w_out.to(acc)
    total = torch.zeros((), dtype=acc, device=h.device)
    for start in range(0, h.shape[0], chunk):
        logits = h[start : start + chunk].to(acc) @ w.T
        keep = kept[start : start + chunk]
        tgt = torch.where(keep, targets[start : start + chunk], 0).to(torch.int64)
        picked = logits.gather(1, tgt.unsqueeze(1)).squeeze(1)
        per_token = _logsumexp(logits) - picked
        total = total + torch.where(keep, per_token, 0.0).sum()
    n_kept = int(kept.sum())
    return total / n_kept if n_kept > 0 else total * 0.0


def cross_entropy_bwd(
    dloss: Tensor | float,
    h: Tensor,
    w_out: Tensor,
    targets: Tensor,
    ignore_index: int = -100,
    chunk: int = TrainConfig.ce_chunk,
) -> tuple[Tensor, Tensor]:
    """(dh, dw_out) of cross_entropy: dlogits = dloss*(softmax - onehot)/n_kept on kept rows, 0 elsewhere.

    fp32 math; dw_out accumulates chunk contributions in chunk order; dh -> h.dtype, dw_out -> w_out.dtype.
    """
    kept = _check(h, w_out, targets, ignore_index, chunk)
    acc = _acc_dtype(h, w_out)
    w = w_out.to(acc)
    dh = torch.zeros(h.shape, dtype=acc, device=h.device)
    dw = torch.zeros(w_out.shape, dtype=acc, device=h.device)
    n_kept = int(kept.sum())
    if n_kept == 0:
        return dh.to(h.dtype), dw.to(w_out.dtype)
    coef = torch.as_tensor(dloss, dtype=acc, device=h.device) / n_kept
    for start in range(0, h.shape[0], chunk):
        hc = h[start : start + chunk].to(acc)
        logits = hc @ w.T
        keep = kept[start : start + chunk]
        tgt = torch.where(keep, targets[start : start + chunk], 0).to(torch.int64)
        probs = torch.exp(logits - _logsumexp(logits).unsqueeze(1))
        probs[torch.arange(tgt.shape[0], device=h.device), tgt] -= 1.0
        dlogits = torch.where(keep.unsqueeze(1), probs, 0.0) * coef
        dh[start : start + chunk] = dlogits @ w
        dw = dw + dlogits.T @ hc
    return dh.to(h.dtype), dw.to(w_out.dtype)
