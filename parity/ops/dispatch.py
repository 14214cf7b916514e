"""permute / unpermute: rows sorted by (expert, t, k), segments padded to align, pad rows zero; embedding_bwd:
the table gradient summed in token order."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from torch import Tensor

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
    adversarial_fill,
    by_size,
    dt,
    nan_payloads,
    randn,
    route,
    routing_params,
    skew_of,
    space,
)
from parity.oracles import (
    Expect,
    spec_out,
)


def space_permute(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 512 if big else 24),
        K=I(1, 8),
        E=I(8, 64) if big else I(1, 12),
        H=by_size(big, [1, 8, 32], [2048, 7168]),
        align=by_size(big, [1, 4, 16], [128]),
    )


def payload_x(shape: list[int], dtype: torch.dtype, g: torch.Generator, adv: str | None) -> Tensor:
    x = randn(shape, dtype, g)
    if adv == "nan" and x.numel():
        flat = x.reshape(-1)
        pos = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 4)]
        flat[pos] = nan_payloads(pos.numel(), dtype, g)
        return flat.reshape(shape)
    return adversarial_fill(x, adv, g) if adv in ("zero", "inf", "denormal", "max") else x


def make_permute(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = routing_params(p, adv)
    dtype, t, k, h, align = dt(q["dtype"]), q["T"], q["K"], q["H"], q["align"]
    e = max(q["E"], k)
    ids = route(t, k, e, g, skew_of(adv))
    x = payload_x([t, h], dtype, g, adv)
    return Inputs(
        (x, ids, e, align), shape={"T": t, "K": k, "E": e, "H": h, "align": align}, dtype=q["dtype"]
    )


def make_unpermute(p: Params, g: torch.Generator, adv: str | None) -> Inputs:

    q = routing_params(p, adv)
    dtype, t, k, h, align = dt(q["dtype"]), q["T"], q["K"], q["H"], q["align"]
    e = max(q["E"], k)
    slot, _, _ = permute_layout(route(t, k, e, g, skew_of(adv)), e, align)
    yp = payload_x([slot.numel(), h], dtype, g, adv)
    return Inputs((yp, slot, t, k), shape={"T": t, "K": k, "E": e, "H": h, "align": align}, dtype=q["dtype"])


def permute_layout(ids: Tensor, n_experts: int, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """(slot [R], counts int32 [E], offs int32 [E]) by plain loops: rows sorted by (expert, t, k)."""
    flat = ids.reshape(-1).tolist()
    n = len(flat)
    rows = -(-(n + n_experts * (align - 1)) // align) * align
    by_e: list[list[int]] = [[] for _ in range(n_experts)]
    for s, e in enumerate(flat):
        by_e[e].append(s)
    slot = [-1] * rows
    counts, offs, pos = [], [], 0
    for e in range(n_experts):
        for j, s in enumerate(by_e[e]):
            slot[pos + j] = s
        counts.append(len(by_e[e]))
        pos += -(-len(by_e[e]) // align) * align
        offs.append(pos)
    return (
        torch.tensor(slot, dtype=torch.int64),
        torch.tensor(counts, dtype=torch.int32),
        torch.tensor(offs, dtype=torch.int32),
    )


def permute(inp: Inputs, c: Contract) -> list[Expect | None]:
    x, ids, e, align = inp.args
    slot, counts, offs = permute_layout(ids, e, align)
    k = ids.shape[1]
    xp = torch.zeros(slot.numel(), x.shape[1], dtype=x.dtype)
    real = slot >= 0
    xp[real] = x[slot[real] // k]
    return [
        Expect(xp, exact=True),
        Expect(counts, exact=True),
        Expect(offs, exact=True),
        Expect(slot, exact=True),
    ]


def permute_invariants(inp: Inputs, out: Any) -> Verdict:
    ids = inp.args[1]
    slot = out.slot
    return conservation(slot[slot >= 0], ids.numel(), "slot")


def unpermute(inp: Inputs, c: Contract) -> list[Expect | None]:
    yp, slot, t, k = inp.args
    y = torch.zeros(t * k, yp.shape[1], dtype=yp.dtype)
    for r, s in enumerate(slot.tolist()):
        if s >= 0:
            y[s] = yp[r]
    return [Expect(y.reshape(t, k, yp.shape[1]), exact=True)]


def space_embedding_bwd(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(0, 4096 if big else 40),
        H=by_size(big, [8, 16, 64], [1024, 2048]),
        V=I(1, 50) if not big else S([1000, 201088]),
    )


def make_embedding_bwd(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    """Rows over six decades (the fp32 order of a token-order sum shows), ids with one heavy token (zipf) or
    all alike (single_token), most of a big vocab never named."""
    t, h, v = p["T"], p["H"], p["V"]
    dy = randn([t, h], torch.float32, g) * torch.logspace(-3, 3, max(t, 1))[:t, None]
    dy = adversarial_fill(dy.to(torch.bfloat16), adv, g)
    ids = torch.randint(0, v, (t,), generator=g)
    if adv == "zipf" and t:
        ids[torch.rand(t, generator=g) < 0.5] = v // 2
    elif adv == "single_token":
        ids.fill_(v - 1)
    return Inputs((dy, ids, v), shape={"T": t, "H": h, "V": v}, dtype="bf16")


def embedding_bwd(inp: Inputs, c: Contract) -> list[Expect | None]:
    """numpy float32 accumulation row by row in token order, rounded once to bf16 (NaN canonical)."""
    dy, ids, v = inp.args
    acc = np.zeros((v, dy.shape[1]), dtype=np.float32)
    rows = dy.float().numpy()
    for tok, vid in enumerate(ids.tolist()):
        acc[vid] = acc[vid] + rows[tok]
    return [spec_out(torch.from_numpy(acc).double(), dy.dtype)]


ENTRIES: list[OpEntry] = [
    OpEntry(
        name="permute",
        module="dispatch",
        fn="permute",
        space=space_permute,
        make=make_permute,
        contract=BITWISE,
        oracle=permute,
        output_names=("xp", "counts", "offs", "slot"),
        invariants=(permute_invariants,),
        adversarial=(*ROUTING_ADV, "nan", "zero"),
    ),
    OpEntry(
        name="unpermute",
        module="dispatch",
        fn="unpermute",
        space=space_permute,
        make=make_unpermute,
        contract=BITWISE,
        oracle=unpermute,
        adversarial=(*ROUTING_ADV, "nan"),
    ),
    OpEntry(
        name="embedding_bwd",
        module="dispatch",
        fn="embedding_bwd",
        space=space_embedding_bwd,
        make=make_embedding_bwd,
        contract=BITWISE,
        oracle=embedding_bwd,
        adversarial=("zipf", "single_token", "nan", "inf", "zero"),
    ),
]
