"""Expert activations: relu2 (bitwise) and interleaved swiglu, forward and backward."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity.compare import BITWISE, Contract, bound_contract
from parity.entry import (
    ELEMENTWISE_ADV,
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
    pow2,
    randn,
    space,
    tie_candidates,
    uniform,
)
from parity.oracles import Expect, d, relu64, sigmoid64, spec_out


def space_rows(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 512 if big else 24),
        H=by_size(big, [1, 8, 64, 130], [128, 2048, 7168]),
        scale=S([1.0, 4.0, 1e-3]),
    )


def product_ties(dtype: torch.dtype, n: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """n pairs (a, b) of few-bit values whose exact product a*b is a rounding tie of `dtype`."""
    c = tie_candidates(dtype)
    if c.numel() > 256:
        c = c[torch.randperm(c.numel(), generator=g)[:256]]
    a, b = torch.meshgrid(c, c, indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)
    ok = is_tie(a * b, dtype)
    idx = pick(torch.nonzero(ok).reshape(-1), n, g)
    sa, sb = pow2([n], -6, 6, g), pow2([n], -6, 6, g)
    return a[idx] * sa, b[idx] * sb


def square_ties(dtype: torch.dtype, n: int, g: torch.Generator) -> Tensor:
    """n values x (float64, representable in dtype) whose exact square is a rounding tie of `dtype`."""
    c = tie_candidates(dtype)
    return pick(c[is_tie(c * c, dtype)], n, g) * pow2([n], -6, 6, g)


def make_relu2(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    dtype, t, h = dt(p["dtype"]), p["T"], p["H"]
    if adv == "ties":
        x = square_ties(dtype, t * h, g).to(dtype).reshape(t, h)
    else:
        x = adversarial_fill(randn([t, h], dtype, g, 4.0 * p.get("scale", 1.0)), adv, g)
    return Inputs((x,), shape={"T": t, "H": h}, dtype=p["dtype"])


def make_relu2_bwd(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    dtype, t, h = dt(p["dtype"]), p["T"], p["H"]
    if adv == "ties":
        a, b = product_ties(dtype, t * h, g)
        dy, x = a.to(dtype).reshape(t, h), (b / 2).to(dtype).reshape(t, h)
    else:
        x = adversarial_fill(randn([t, h], dtype, g, 4.0 * p.get("scale", 1.0)), adv, g)
        dy = adversarial_fill(randn([t, h], dtype, g), adv, g)
    return Inputs((dy, x), shape={"T": t, "H": h}, dtype=p["dtype"])


def space_swiglu(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 512 if big else 24),
        I=by_size(big, [1, 4, 32, 65], [128, 1408, 2048]),
        scale=S([1.0, 4.0, 0.05]),
    )


def _swiglu_h(p: Params, g: torch.Generator, adv: str | None) -> Tensor:
    """h = [gate, up] interleaved; adv=underflow puts gates in [-110, -87.5] (sigmoid subnormal or 0 in
    fp32) next to ups up to 2^128, so fp32's absolute floor shows in the output."""
    dtype, t, i = dt(p["dtype"]), p["T"], p["I"]
    h = adversarial_fill(randn([t, 2 * i], dtype, g, 2.0 * p.get("scale", 1.0)), adv, g)
    if adv == "underflow":
        gate = -uniform([t, i], g, 87.5, 110.0)
        gate.reshape(-1)[0] = -95.0
        sign = torch.where(torch.rand(t, i, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
        up = sign * pow2([t, i], 90, 127, g) * uniform([t, i], g, 1.0, 1.9)
        h = torch.stack((gate, up), dim=-1).flatten(-2).to(dtype)
    return h


def make_swiglu(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    h = _swiglu_h(p, g, adv)
    return Inputs((h,), shape={"T": p["T"], "I": p["I"]}, dtype=p["dtype"])


def make_swiglu_bwd(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    """dy stays in [-1, 1] where h holds values near the bf16 max: the contract's domain keeps dy*u inside
    fp32's range (docs/spec-corners.md)."""
    dtype, t, i = dt(p["dtype"]), p["T"], p["I"]
    h = _swiglu_h(p, g, adv)
    dy = randn([t, i], dtype, g)
    dy = torch.clamp(dy, -1.0, 1.0) if adv in ("max", "underflow") else adversarial_fill(dy, adv, g)
    return Inputs((dy, h), shape={"T": t, "I": i}, dtype=p["dtype"])


def relu2(inp: Inputs, c: Contract) -> list[Expect | None]:
    """relu(x)^2 with one rounding to x's dtype (the square of a bf16/fp32 value is exact in float64)."""
    x = inp.args[0]
    r = relu64(d(x))
    return [spec_out(r * r, x.dtype)]


def relu2_bwd(inp: Inputs, c: Contract) -> list[Expect | None]:
    """dy * (2 relu(x)), one rounding to dy's dtype (the product of two fp32 values is exact in float64)."""
    dy, x = inp.args
    return [spec_out(d(dy) * (2 * relu64(d(x))), dy.dtype)]


FLOOR = 2.0**-148
"""Twice fp32's smallest subnormal: the absolute error of one fp32 value in the subnormal range, doubled
for the product that carries it (silu = g*s, ds = s*(1+g*(1-s)))."""


def _swiglu_expect(v: Tensor, floor: Tensor) -> Expect:
    """The float64 value, widened by fp32's absolute floor where sigmoid(g) leaves fp32's normal range."""
    r = torch.nan_to_num(floor, nan=0.0, posinf=0.0)
    return Expect(v, lo=v - r, hi=v + r)


def swiglu(inp: Inputs, c: Contract) -> list[Expect | None]:
    h = d(inp.args[0])
    g, u = h[..., 0::2], h[..., 1::2]
    return [_swiglu_expect(g * sigmoid64(g) * u, u.abs() * (g.abs() + 2) * FLOOR)]


def swiglu_bwd(inp: Inputs, c: Contract) -> list[Expect | None]:
    """dg = dy*u*sigmoid'(g)-part and du = dy*silu(g) in float64; nothing of the spec's fp32 op order."""
    dy, h = d(inp.args[0]), d(inp.args[1])
    g, u = h[..., 0::2], h[..., 1::2]
    s = sigmoid64(g)
    dg = dy * u * s * (1 + g * (1 - s))
    du = dy * g * s
    floor = (g.abs() + 2) * FLOOR
    v = torch.stack((dg, du), dim=-1).flatten(-2)
    r = torch.stack(((dy * u).abs() * floor, dy.abs() * floor), dim=-1).flatten(-2)
    return [_swiglu_expect(v, r)]


SWIGLU = bound_contract(
    1,
    0,
    note="1 ULP of the float64 value, plus fp32's absolute floor where sigmoid(g) is subnormal or 0 "
    "(g < -87.3): 2^-148 (|g| + 2) times the factors after it; dy*u must stay inside fp32's range "
    "(docs/spec-corners.md)",
)


ENTRIES: list[OpEntry] = [
    OpEntry(
        name="relu2",
        module="activation",
        fn="relu2",
        space=space_rows,
        make=make_relu2,
        contract=BITWISE,
        oracle=relu2,
        adversarial=(*ELEMENTWISE_ADV, "ties"),
        dtypes=("bf16", "fp32"),
        ref64=True,
    ),
    OpEntry(
        name="relu2_bwd",
        module="activation",
        fn="relu2_bwd",
        space=space_rows,
        make=make_relu2_bwd,
        contract=BITWISE,
        oracle=relu2_bwd,
        adversarial=(*ELEMENTWISE_ADV, "ties"),
        dtypes=("bf16", "fp32"),
        ref64=True,
    ),
    OpEntry(
        name="swiglu",
        module="activation",
        fn="swiglu",
        space=space_swiglu,
        make=make_swiglu,
        contract=SWIGLU,
        oracle=swiglu,
        adversarial=(*ELEMENTWISE_ADV, "underflow"),
        ref64=True,
    ),
    OpEntry(
        name="swiglu_bwd",
        module="activation",
        fn="swiglu_bwd",
        space=space_swiglu,
        make=make_swiglu_bwd,
        contract=SWIGLU,
        oracle=swiglu_bwd,
        adversarial=(*ELEMENTWISE_ADV, "underflow"),
        ref64=True,
    ),
]
