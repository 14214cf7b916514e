"""RDEP expert-parallel dispatch/return, simulated for W ranks in one process.

Each routed slot (src, t, k) travels to owner rank eid // n_local and comes back to its source by
row_id = ((src*T)+t)*K+k. A rank receiving more than `capacity` rows raises: rows are never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RdepRecv:
    x: Tensor
    row_id: Tensor
    local_eid: Tensor
    counts: Tensor


def rdep_dispatch(xs: list[Tensor], ids: list[Tensor], n_experts: int, capacity: int) -> list[RdepRecv]:
    """Per destination rank: rows ordered by (local expert, src rank, t, k), with per-local-expert counts."""
    w = len(xs)
    if w < 1 or len(ids) != w:
        raise ValueError(f"rdep_dispatch: need one x and one ids per rank, got {len(xs)} and {len(ids)}")
    if n_experts % w != 0:
        raise ValueError(f"rdep_dispatch: n_experts={n_experts} must be a multiple of world size {w}")
    t, k = ids[0].shape
    h = xs[0].shape[1]
    for r in range(w):
        if xs[r].shape != (t, h) or ids[r].shape != (t, k):
            raise ValueError(
                f"rdep_dispatch: rank {r} has x {tuple(xs[r].shape)}, ids {tuple(ids[r].shape)}; "
                f"every rank must send x [{t},{h}] and ids [{t},{k}]"
            )
    eid = torch.stack([i.to(torch.int64) for i in ids]).reshape(-1)
    if eid.numel() and (int(eid.min()) < 0 or int(eid.max()) >= n_experts):
        raise ValueError(f"rdep_dispatch: expert ids must lie in [0, {n_experts}); fix the router output")
    n_local = n_experts // w
    x_all = torch.stack(xs).reshape(w * t, h)
    row_id = torch.arange(w * t * k, dtype=torch.int64)
    owner = eid // n_local
    local = eid % n_local

    per_rank = torch.bincount(owner, minlength=w)
    need = int(per_rank.max()) if per_rank.numel() else 0
    if need > capacity:
        worst = int(torch.argmax(per_rank))
        raise RuntimeError(
            f"rdep_dispatch: rank {worst} would receive {need} rows but capacity is {capacity}; "
            f"raise capacity to at least {need}"
        )

    recvs = []
    for r in range(w):
        rows = row_id[owner == r]
        rows = rows[torch.argsort(local[rows] * (w * t * k) + rows)]
        recvs.append(RdepRecv(
            x=x_all[rows // k].clone(),
            row_id=rows,
            local_eid=local[rows],
            counts=torch.bincount(local[rows], minlength=n_local),
        ))
    return recvs


def rdep_return(ys: list[Tensor], recvs: list[RdepRecv], t: int, k: int) -> list[Tensor]:
    """Send each received row's output back to (src, t, k) = row_id; every row_id must come back once."""
    w = len(recvs)
    if len(ys) != w:
        raise ValueError(f"rdep_return: got {len(ys)} outputs for {w} ranks; pass one y per received batch")
    for r in range(w):
        if ys[r].dim() != 2 or ys[r].shape[0] != recvs[r].row_id.numel():
            raise ValueError(
                f"rdep_return: rank {r} output {tuple(ys[r].shape)} must have one row per received "
                f"row ({recvs[r].row_id.numel()})"
            )
    h = ys[0].shape[1]
    n = w * t * k
    rows = torch.cat([rc.row_id for rc in recvs])
    if rows.numel() != n or not bool((torch.bincount(rows, minlength=n) == 1).all()):
        raise ValueError(f"rdep_return: row ids must cover 0..{n - 1} exactly once; pass dispatch's recvs")
    out = torch.zeros(n, h, dtype=ys[0].dtype)
    out[rows] = torch.cat(ys)
    return list(out.reshape(w, t, k, h).unbind(0))
