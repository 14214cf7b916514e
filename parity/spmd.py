"""The spec's all-ranks signature over the SPMD fast path: W spawned ranks run their own rdep_dispatch /
rdep_return (nmoe.fast.rdep); their results come back as the spec's list of per-rank batches.
"""

# NMOE_RDEP_PLACEMENT picks the GPUs: 'shared' (default; every rank on GPU 0, so the contract needs one GPU)
# or 'distinct' (one GPU per rank). Rank pools are spawned once per world size and kept for the run.

from __future__ import annotations

import atexit
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from nmoe.reference.rdep import RdepRecv

PLACEMENT_ENV = "NMOE_RDEP_PLACEMENT"
_pools: dict[tuple[int, str], Any] = {}


def placement_kind() -> str:
    return os.environ.get(PLACEMENT_ENV, "shared")


def pool(world: int) -> Any:
    """The cached rank pool of `world` ranks for this run's placement; a broken one (a rank died, stalled or
    trapped) is replaced."""
    from nmoe.fast.rdep import spmd

    key = (world, placement_kind())
    if key not in _pools or _pools[key].broken:
        _pools[key] = spmd.Pool(spmd.placement(world, key[1]))
    return _pools[key]


@atexit.register
def close_pools() -> None:
    while _pools:
        _pools.popitem()[1].close()


def _run(kind: str, shape: Any, args: list[tuple[Any, ...]]) -> list[dict[str, Tensor]]:
    from nmoe.fast.rdep import spmd

    try:
        return list(pool(len(args)).run(spmd.Job(kind, shape, tuple(args))))
    except spmd.RankError as e:
        raise RuntimeError(str(e)) from None


def _shape(w: int, e: int, t: int, k: int, h: int, dtype: torch.dtype, capacity: int) -> Any:
    from nmoe.fast.rdep import RdepShape

    return RdepShape(world=w, n_experts=e, tokens=t, top_k=k, hidden=h, dtype=dtype, capacity=capacity)


def _check_tail(r: int, got: dict[str, Tensor]) -> None:
    for name in ("tail_row_id", "tail_local_eid"):
        if bool((got[name] != -1).any()):
            raise RuntimeError(f"rdep_dispatch: rank {r} left {name.removeprefix('tail_')} rows past n_recv "
                               "unmarked (must be -1)")


def rdep_dispatch(
    xs: Sequence[Tensor], ids: Sequence[Tensor], n_experts: int, capacity: int
) -> list[RdepRecv]:
    """Every rank dispatches its (x, ids) through RDEP; each rank's receive batch, cut to its rows."""
    w = len(xs)
    t, k = ids[0].shape
    shape = _shape(w, n_experts, t, k, xs[0].shape[1], xs[0].dtype, capacity)
    outs = _run("dispatch", shape, [(x.cpu(), i.cpu()) for x, i in zip(xs, ids, strict=True)])
    for r, got in enumerate(outs):
        _check_tail(r, got)
    return [RdepRecv(x=o["x"], row_id=o["row_id"], local_eid=o["local_eid"], counts=o["counts"])
            for o in outs]


def routes_of(recvs: Sequence[RdepRecv], t: int, k: int) -> list[Tensor]:
    """The ids [T,K] per source rank that produce these receive batches (owner r, expert r*n_local+eid)."""
    w = len(recvs)
    n_local = recvs[0].counts.numel()
    ids = torch.full((w * t * k,), -1, dtype=torch.int64)
    for r, rc in enumerate(recvs):
        ids[rc.row_id.cpu()] = r * n_local + rc.local_eid.cpu()
    if bool((ids < 0).any()):
        raise ValueError("rdep_return: recvs do not cover every row_id; pass dispatch's recvs")
    return list(ids.view(w, t, k).unbind(0))


def rdep_return(ys: Sequence[Tensor], recvs: Sequence[RdepRecv], t: int, k: int) -> list[Tensor]:
    """Re-dispatch the routes behind `recvs` (the fast dispatch must reproduce their order), then every
    rank returns its y; each source's [T, K, H]. The return window is poisoned first."""
    w = len(recvs)
    ids = routes_of(recvs, t, k)
    h, dtype = ys[0].shape[1], ys[0].dtype
    cap = max(1, *(int(rc.row_id.numel()) for rc in recvs))
    shape = _shape(w, w * recvs[0].counts.numel(), t, k, h, dtype, cap)
    xs = [torch.zeros(t, h, dtype=dtype) for _ in range(w)]
    outs = _run("roundtrip", shape, [(xs[r], ids[r], ys[r].cpu(), True) for r in range(w)])
    for r, (got, rc) in enumerate(zip(outs, recvs, strict=True)):
        if not torch.equal(got["row_id"], rc.row_id.cpu()):
            raise RuntimeError(f"rdep_return: rank {r}'s fast dispatch received rows in another order than "
                               "the given recvs; the y rows would not line up")
    return [o["out"] for o in outs]
