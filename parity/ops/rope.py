"""Rotary embedding (apply_rope)."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity.compare import (
    Contract,
)
from parity.entry import (
    CANCEL,
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
    randn,
    space,
    uniform,
    with_adv,
)
from parity.oracles import (
    Expect,
    d,
)


def space_rope(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        B=I(1, 4 if big else 2),
        S=I(1, 512 if big else 12),
        D=by_size(big, [2, 8, 64], [64, 128]),
        heads=I(1, 16 if big else 3),
        span=S([1.0, 100.0, 1e4]),
    )


def cos_sin(s: int, d: int, span: float, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin [S, D/2] of random fp32 angles, each rounded once from float64."""
    ang = uniform([s, d // 2], g, -span, span).to(torch.float32).to(torch.float64)
    return torch.cos(ang).to(torch.float32), torch.sin(ang).to(torch.float32)


def make_rope(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = with_adv(p, adv, **({"S": 1} if adv == "single_token" else {}))
    dtype, b, h, s, d = dt(q["dtype"]), q["B"], q["heads"], q["S"], q["D"]
    x = adversarial_fill(randn([b, h, s, d], dtype, g, 3.0), adv, g)
    cos, sin = cos_sin(s, d, float(q["span"]), g)
    return Inputs((x, cos, sin), shape={"B": b, "H": h, "S": s, "D": d}, dtype=q["dtype"])


def rope(inp: Inputs, c: Contract) -> list[Expect | None]:
    """y0 = x0*c - x1*s cancels; two fp32 products and one add give |err| <= 2u(|x0 c| + |x1 s|)."""
    x, cos, sin = d(inp.args[0]), d(inp.args[1]), d(inp.args[2])
    x0, x1 = x[..., 0::2], x[..., 1::2]
    val = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    mag = torch.stack(((x0 * cos).abs() + (x1 * sin).abs(), (x0 * sin).abs() + (x1 * cos).abs()), -1).flatten(
        -2
    )
    return [Expect(val, mag=mag, k=2.0)]


ENTRIES: list[OpEntry] = [
    OpEntry(
        name="rope",
        module="rope",
        fn="apply_rope",
        space=space_rope,
        make=make_rope,
        contract=CANCEL,
        oracle=rope,
        adversarial=("nan", "inf", "denormal", "zero", "single_token"),
        ref64=True,
    ),
]
