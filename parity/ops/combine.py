"""combine and combine_bwd: the fp32 slot-order weighted sum, routed_scale, shared experts."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity.compare import (
    BITWISE,
    Contract,
    bound_contract,
)
from parity.entry import (
    ELEMENTWISE_ADV,
    FP32_NOTE,
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
    is_tie,
    pick,
    randn,
    space,
    tie_candidates,
    with_adv,
)
from parity.oracles import (
    F64,
    Expect,
    d,
    f32,
    spec_out,
)


def space_combine(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 256 if big else 16),
        K=I(1, 8),
        H=by_size(big, [1, 8, 64], [2048, 7168]),
        shared=st.booleans(),
        routed_scale=S([1.0, 2.5, 0.3]),
    )


def _combine_common(p: Params, g: torch.Generator, adv: str | None) -> tuple[Tensor, Tensor, dict[str, int]]:
    q = with_adv(
        p, adv, **({"K": 1} if adv in ("k1", "ties") else {}), **({"T": 1} if adv == "single_token" else {})
    )
    dtype, t, k, h = dt(q["dtype"]), q["T"], q["K"], q["H"]
    w = torch.softmax(randn([t, k], torch.float64, g), dim=-1).to(torch.float32)
    y = adversarial_fill(randn([t, k, h], dtype, g, 2.0), adv, g)
    if adv == "ties":
        c = tie_candidates(dtype)
        a = pick(c[is_tie(c[:, None] * c[None, :], dtype).any(dim=1)], t, g)
        rows = [pick(c[is_tie(a[i] * c, dtype)], h, g) for i in range(t)]
        w = a.reshape(t, 1).to(torch.float32)
        y = torch.stack(rows).reshape(t, 1, h).to(dtype)
    return w, y, {"T": t, "K": k, "H": h}


def make_combine(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    w, y, shape = _combine_common(p, g, adv)
    scale = 1.0 if adv == "ties" else float(p["routed_scale"])
    shared = None
    if p["shared"] and adv != "ties":
        shared = adversarial_fill(randn([shape["T"], shape["H"]], y.dtype, g), adv, g)
    return Inputs((y, w, scale, shared), shape=shape, dtype=p["dtype"])


def make_combine_bwd(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    w, y, shape = _combine_common(p, g, adv)
    dout = adversarial_fill(randn([shape["T"], shape["H"]], y.dtype, g), adv, g)
    return Inputs((dout, y, w, float(p["routed_scale"])), shape=shape, dtype=p["dtype"])


def combine(inp: Inputs, c: Contract) -> list[Expect | None]:
    """The spec text pins this fp32 order (docs/design.md, combine): w_k*y_k and each running sum rounded in
    slot order, then times fp32(routed_scale), then + shared, then one rounding to y's dtype."""
    y, w, scale, shared = inp.args
    yd, wd = d(y), d(w)
    acc = f32(wd[:, 0, None] * yd[:, 0])
    for k in range(1, y.shape[1]):
        acc = f32(acc + f32(wd[:, k, None] * yd[:, k]))
    acc = f32(acc * f32(torch.tensor(float(scale), dtype=F64)))
    if shared is not None:
        acc = f32(acc + d(shared))
    return [spec_out(acc, y.dtype)]


def make_combine_gather(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    """combine's inputs with y's slots scattered over a longer yp in a random order (zero rows between)."""
    y, w, scale, shared = make_combine(p, g, adv).args
    t, k, h = y.shape
    n_rows = t * k + 3 * k
    rows = torch.randperm(n_rows, generator=g)[: t * k]
    yp = torch.zeros(n_rows, h, dtype=y.dtype)
    yp[rows] = y.reshape(t * k, h)
    row_of = rows.to(torch.int32).reshape(t, k)
    shape = {"T": t, "K": k, "H": h, "R": n_rows}
    return Inputs((yp, row_of, w, scale, shared), shape=shape, dtype=p["dtype"])


def combine_gather(inp: Inputs, c: Contract) -> list[Expect | None]:
    """The combine oracle on the gathered slots."""
    yp, row_of, w, scale, shared = inp.args
    y = yp[row_of.to(torch.int64)]
    return combine(Inputs((y, w, scale, shared), shape=inp.shape, dtype=inp.dtype), c)


def combine_bwd(inp: Inputs, c: Contract) -> list[Expect | None]:
    """Spec text: g = fp32(dout * fp32(routed_scale)), dy_k = g*w_k rounded once; dw sums in any order."""
    dout, y, w, scale = inp.args
    g = f32(d(dout) * f32(torch.tensor(float(scale), dtype=F64)))
    dy = f32(g[:, None, :] * d(w)[:, :, None])
    dw = (g[:, None, :] * d(y)).sum(-1)
    mag = (g[:, None, :].abs() * d(y).abs()).sum(-1)
    return [spec_out(dy, y.dtype), Expect(dw, mag=mag, k=float(y.shape[2])), Expect(dout.clone(), exact=True)]


ENTRIES: list[OpEntry] = [
    OpEntry(
        name="combine",
        module="combine",
        fn="combine",
        space=space_combine,
        make=make_combine,
        contract=BITWISE,
        oracle=combine,
        adversarial=(*ELEMENTWISE_ADV, "ties", "k1", "single_token"),
        ref64=True,
    ),
    OpEntry(
        name="combine_gather",
        module="combine",
        fn="combine_gather",
        space=space_combine,
        make=make_combine_gather,
        contract=BITWISE,
        oracle=combine_gather,
        adversarial=(*ELEMENTWISE_ADV, "ties", "k1", "single_token"),
        ref64=True,
        note="combine reading each slot's row of the permuted expert output in place",
    ),
    OpEntry(
        name="combine_bwd",
        module="combine",
        fn="combine_bwd",
        space=space_combine,
        make=make_combine_bwd,
        contract=BITWISE,
        oracle=combine_bwd,
        output_names=("dy", "dw", "dshared"),
        output_contracts={1: bound_contract(1, 2, note="dw: fp32 sum over H, order unpinned; " + FP32_NOTE)},
        adversarial=("nan", "inf", "denormal", "zero", "k1", "single_token"),
        ref64=True,
    ),
]
