"""Combine expert outputs per token: fp32 slot-order sum of w_k*y_k, then routed_scale, then + shared.

Each product is a materialised fp32 tensor before it is added, so no FMA can fuse them; the fast path
must round the same two places. routed_scale is applied to the sum, never folded into the weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmoe.reference.formats import round_to


def _check(y: Tensor, w: Tensor) -> torch.dtype:
    if y.dim() != 3 or w.shape != y.shape[:2]:
        raise ValueError(f"combine: need y [T,K,H] and w [T,K]; got y {tuple(y.shape)}, w {tuple(w.shape)}")
    if y.shape[1] < 1:
        raise ValueError("combine: K must be >= 1; every token needs at least one routed slot")
    if w.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"combine: w must be fp32 router weights, got {w.dtype}; pass w.float()")
    return torch.promote_types(torch.promote_types(torch.float32, y.dtype), w.dtype)


def combine(y: Tensor, w: Tensor, routed_scale: float, shared: Tensor | None = None) -> Tensor:
    acc_dt = _check(y, w)
    wa, ya = w.to(acc_dt), y.to(acc_dt)
    acc = wa[:, 0, None] * ya[:, 0]
    for k in range(1, y.shape[1]):
        prod = wa[:, k, None] * ya[:, k]
        acc = acc + prod
    acc = acc * torch.tensor(routed_scale, dtype=acc_dt)
    if shared is not None:
        if shared.shape != acc.shape:
            raise ValueError(f"combine: shared {tuple(shared.shape)} must be [T,H] = {tuple(acc.shape)}")
        acc = acc + shared.to(acc_dt)
    return round_to(acc, y.dtype)


def combine_gather(yp: Tensor, row_of: Tensor, w: Tensor, routed_scale: float,
                   shared: Tensor | None = None) -> Tensor:
    """combine with slot (t, k)'s expert output read from row row_of[t, k] of the permuted rows yp [R, H]."""
    if yp.dim() != 2 or row_of.dim() != 2 or row_of.dtype != torch.int32:
        raise ValueError(f"combine_gather: need yp [R,H] and int32 row_of [T,K]; got {tuple(yp.shape)}, "
                         f"{row_of.dtype} {tuple(row_of.shape)}")
    rows = row_of.to(torch.int64)
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= yp.shape[0]):
        raise ValueError(f"combine_gather: row_of must lie in [0, {yp.shape[0]}); build it from permute's "
                         "slot")
    return combine(yp[rows], w, routed_scale, shared)


def combine_bwd(dout: Tensor, y: Tensor, w: Tensor, routed_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """g = dout*routed_scale (rounded), dy_k = g*w_k, dw_k = sum_h g*y_k (fp32; reduction order unpinned)."""
    acc_dt = _check(y, w)
    if dout.shape != (y.shape[0], y.shape[2]):
        raise ValueError(f"combine_bwd: dout {tuple(dout.shape)} must be [T,H] = {(y.shape[0], y.shape[2])}")
    g = dout.to(acc_dt) * torch.tensor(routed_scale, dtype=acc_dt)
    dy = round_to(g[:, None, :] * w.to(acc_dt)[:, :, None], y.dtype)
    dw = (g[:, None, :] * y.to(acc_dt)).sum(dim=-1).to(w.dtype)
    return dy, dw, dout.clone()
