"""RDEP dispatch / return across ranks: ownership, row order, row_id conservation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity import spmd
from parity.compare import (
    BITWISE,
    Contract,
    Verdict,
    conservation,
)
from parity.entry import (
    ROUTING_ADV,
    OpEntry,
)
from parity.inputs import (
    I,
    Inputs,
    Params,
    S,
    by_size,
    dt,
    route,
    routing_params,
    skew_of,
    space,
)
from parity.ops.dispatch import payload_x
from parity.oracles import (
    Expect,
)


def space_rdep(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        W=S([1, 2, 4, 8] if big else [1, 2, 4]),
        T=I(1, 256 if big else 12),
        K=I(1, 4),
        n_local=I(1, 8 if big else 4),
        H=by_size(big, [1, 8, 32], [2048]),
        slack=I(0, 3),
    )


def _rdep_routes(
    q: Params, g: torch.Generator, adv: str | None
) -> tuple[list[Tensor], list[Tensor], int, int]:
    w, t, k, h = q["W"], q["T"], q["K"], q["H"]
    e = w * q["n_local"]
    k = min(k, e)
    dtype = dt(q["dtype"])
    xs = [payload_x([t, h], dtype, g, adv) for _ in range(w)]
    ids = [route(t, k, e, g, skew_of(adv)) for _ in range(w)]
    owner = torch.stack(ids).reshape(-1) // q["n_local"]
    need = int(torch.bincount(owner, minlength=w).max()) if owner.numel() else 0
    cap = need - 1 if adv == "overflow" else need + int(q["slack"])
    return xs, ids, e, cap


def make_rdep_dispatch(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = routing_params(p, adv)
    xs, ids, e, cap = _rdep_routes(q, g, adv)
    shape = {"W": q["W"], "T": q["T"], "K": ids[0].shape[1], "E": e, "H": q["H"], "capacity": cap}
    return Inputs((xs, ids, e, cap), shape=shape, dtype=q["dtype"], raises=adv == "overflow")


def make_rdep_return(p: Params, g: torch.Generator, adv: str | None) -> Inputs:

    q = routing_params(p, adv)
    xs, ids, e, _ = _rdep_routes(q, g, None if adv == "overflow" else adv)
    recvs = rdep_recvs(xs, ids, e)
    ys = [payload_x([int(r.row_id.numel()), q["H"]], dt(q["dtype"]), g, adv) for r in recvs]
    k = ids[0].shape[1]
    shape = {"W": q["W"], "T": q["T"], "K": k, "E": e, "H": q["H"]}
    return Inputs((ys, recvs, q["T"], k), shape=shape, dtype=q["dtype"])


@dataclass(frozen=True)
class Recv:
    """Field-for-field twin of the reference RdepRecv, used only if the reference is absent."""

    x: Tensor
    row_id: Tensor
    local_eid: Tensor
    counts: Tensor


def _rdep_rows(ids: Sequence[Tensor], n_experts: int) -> list[list[tuple[int, int, int]]]:
    """Per destination rank: (local expert, row_id, src) sorted by (local expert, src, t, k)."""
    w = len(ids)
    n_local = n_experts // w
    t, k = ids[0].shape
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(w)]
    for src in range(w):
        for ti in range(t):
            for ki in range(k):
                eid = int(ids[src][ti, ki])
                out[eid // n_local].append((eid % n_local, (src * t + ti) * k + ki, src))
    return [sorted(rows) for rows in out]


def rdep_recvs(xs: Sequence[Tensor], ids: Sequence[Tensor], n_experts: int) -> list[Any]:
    """Oracle receive batches, typed as the reference's RdepRecv when that module is present."""
    try:
        from nmoe.reference.rdep import RdepRecv

        cls: Any = RdepRecv
    except ImportError:
        cls = Recv
    w = len(xs)
    n_local = n_experts // w
    t, k = ids[0].shape
    h = xs[0].shape[1]
    recvs = []
    for rows in _rdep_rows(ids, n_experts):
        x = (
            torch.stack([xs[rid // (t * k)][(rid // k) % t] for _, rid, _ in rows])
            if rows
            else torch.zeros(0, h, dtype=xs[0].dtype)
        )
        row_id = torch.tensor([rid for _, rid, _ in rows], dtype=torch.int64)
        local = torch.tensor([le for le, _, _ in rows], dtype=torch.int64)
        counts = torch.bincount(local, minlength=n_local)
        recvs.append(cls(x=x, row_id=row_id, local_eid=local, counts=counts))
    return recvs


def rdep_dispatch(inp: Inputs, c: Contract) -> list[Expect | None]:
    xs, ids, e, _ = inp.args
    out: list[Expect | None] = []
    for r in rdep_recvs(xs, ids, e):
        out += [
            Expect(r.x, exact=True),
            Expect(r.row_id, exact=True),
            Expect(r.local_eid, exact=True),
            Expect(r.counts, exact=True),
        ]
    return out


def rdep_dispatch_invariants(inp: Inputs, out: Any) -> Verdict:
    xs, ids, _, _ = inp.args
    rows = torch.cat([r.row_id for r in out]) if out else torch.zeros(0, dtype=torch.int64)
    return conservation(rows, len(xs) * ids[0].numel(), "rdep row_id")


def rdep_return(inp: Inputs, c: Contract) -> list[Expect | None]:
    ys, recvs, t, k = inp.args
    w = len(recvs)
    h = ys[0].shape[1]
    out = torch.zeros(w * t * k, h, dtype=ys[0].dtype)
    for y, r in zip(ys, recvs, strict=True):
        for i, rid in enumerate(r.row_id.tolist()):
            out[rid] = y[i]
    return [Expect(o, exact=True) for o in out.reshape(w, t, k, h).unbind(0)]


def rdep_return_invariants(inp: Inputs, out: Any) -> Verdict:
    _, recvs, t, k = inp.args
    rows = torch.cat([r.row_id for r in recvs])
    return conservation(rows, len(recvs) * t * k, "rdep returned row_id")


ENTRIES: list[OpEntry] = [
    OpEntry(
        name="rdep_dispatch",
        module="rdep",
        fn="rdep_dispatch",
        space=space_rdep,
        make=make_rdep_dispatch,
        contract=BITWISE,
        oracle=rdep_dispatch,
        invariants=(rdep_dispatch_invariants,),
        adversarial=(*ROUTING_ADV, "overflow", "nan"),
        fast=spmd.rdep_dispatch,
        note="fast path: W spawned ranks (parity/spmd.py), each running its own RDEP dispatch",
    ),
    OpEntry(
        name="rdep_return",
        module="rdep",
        fn="rdep_return",
        space=space_rdep,
        make=make_rdep_return,
        contract=BITWISE,
        oracle=rdep_return,
        invariants=(rdep_return_invariants,),
        adversarial=(*ROUTING_ADV, "nan"),
        fast=spmd.rdep_return,
        note="fast path: W spawned ranks (parity/spmd.py) dispatch the recvs' routes, then return y",
    ),
]
