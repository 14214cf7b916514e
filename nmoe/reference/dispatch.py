"""Permute token slots into expert-contiguous, align-padded segments and back.

Counts and offsets come from tensor ops only (no host sync), so the fast path can mirror them on device;
the row capacity is static (padded_rows) so shapes never depend on routing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmoe.layout import Permuted, check_embedding_grad, padded_rows
from nmoe.reference.formats import round_to


def _check_ids(ids: Tensor, n_experts: int) -> None:
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"permute: ids must be integer [T,K], got {ids.dtype} {tuple(ids.shape)}")
    if ids.numel() and (bool((ids < 0).any()) or bool((ids >= n_experts).any())):
        raise ValueError(f"permute: ids must lie in [0, {n_experts}); fix the router output or n_experts")


def permute(x: Tensor, ids: Tensor, n_experts: int, align: int) -> Permuted:
    """Rows sorted by (expert, t, k); each expert segment padded to `align`; pad and tail rows are zero."""
    _check_ids(ids, n_experts)
    t, k = ids.shape
    if x.dim() != 2 or x.shape[0] != t:
        raise ValueError(f"permute: x must be [T,H] with T={t} from ids, got {tuple(x.shape)}")
    n_rows = padded_rows(t * k, n_experts, align)

    eid = ids.reshape(-1).to(torch.int64)
    slots = torch.arange(t * k, dtype=torch.int64)
    key = eid * (t * k) + slots
    order = torch.argsort(key)
    sorted_eid = eid[order]

    counts = torch.zeros(n_experts, dtype=torch.int64).scatter_add_(0, eid, torch.ones_like(eid))
    padded = (counts + (align - 1)) // align * align
    offs = torch.cumsum(padded, dim=0)
    seg_start = offs - padded
    count_start = torch.cumsum(counts, dim=0) - counts
    rank_in_seg = torch.arange(t * k, dtype=torch.int64) - count_start[sorted_eid]
    dest = seg_start[sorted_eid] + rank_in_seg

    xp = torch.zeros(n_rows, x.shape[1], dtype=x.dtype)
    xp[dest] = x[order // k]
    slot = torch.full((n_rows,), -1, dtype=torch.int64)
    slot[dest] = order
    return Permuted(xp=xp, counts=counts.to(torch.int32), offs=offs.to(torch.int32), slot=slot)


def unpermute(yp: Tensor, slot: Tensor, t: int, k: int) -> Tensor:
    """Scatter rows back to [T,K,H] slot order; pad rows (slot -1) go to a discarded sink row."""
    if yp.dim() != 2 or slot.shape != (yp.shape[0],):
        raise ValueError(f"unpermute: need yp [R,H] and slot [R]; got {tuple(yp.shape)}, {tuple(slot.shape)}")
    real = slot[slot >= 0]
    if real.numel() != t * k or not bool((torch.bincount(real, minlength=t * k) == 1).all()):
        raise ValueError(f"unpermute: slot must hold each of 0..{t * k - 1} once; pass permute's slot")
    sink = t * k
    idx = torch.where(slot >= 0, slot, sink)
    y = torch.zeros(t * k + 1, yp.shape[1], dtype=yp.dtype)
    y.index_copy_(0, idx, yp)
    return y[:sink].reshape(t, k, yp.shape[1])


def embedding_bwd(dy: Tensor, ids: Tensor, vocab: int) -> Tensor:
    """The embedding table's gradient [vocab, H] in dy's dtype: row v is the fp32 sum, in token order, of the
    rows of dy [T, H] whose id is v, rounded once (NaN canonical); a row no token names is zero."""
    check_embedding_grad(dy, ids)
    if vocab < 1 or (ids.numel() and (bool((ids < 0).any()) or bool((ids >= vocab).any()))):
        raise ValueError(f"embedding_bwd: ids must lie in [0, {vocab}) (the vocab size); fix the tokens")
    acc = torch.zeros(vocab, dy.shape[1], dtype=torch.float32)
    for t, v in enumerate(ids.tolist()):
        acc[v] += dy[t].float()
    return round_to(acc, dy.dtype)
