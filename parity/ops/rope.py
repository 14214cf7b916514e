"""Rotary embedding (apply_rope, apply_rope_bwd): bitwise against a float64 oracle of the spec's fp32
steps."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity.compare import BITWISE, Contract
from parity.entry import OpEntry
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
from parity.oracles import Expect, d, f32, spec_out


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


def _rotate64(x: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype) -> list[Expect | None]:
    """Each fp32 product is exact in float64, then rounded once (f32); the fp64 sum of two fp32 values
    rounded to fp32 is correctly rounded (53 >= 2*24 + 2 bits); then one rounding to x's dtype."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    y0 = f32(f32(x0 * cos) - f32(x1 * sin))
    y1 = f32(f32(x0 * sin) + f32(x1 * cos))
    return [spec_out(torch.stack((y0, y1), dim=-1).flatten(-2), dtype)]


def rope(inp: Inputs, c: Contract) -> list[Expect | None]:
    """y0 = x0*c - x1*s, y1 = x0*s + x1*c: every fp32 step the spec pins, so the bits are exact."""
    x, cos, sin = inp.args
    return _rotate64(d(x), d(cos), d(sin), x.dtype)


def rope_bwd(inp: Inputs, c: Contract) -> list[Expect | None]:
    """The spec's apply_rope(dy, cos, -sin); negating sin is exact."""
    dy, cos, sin = inp.args
    return _rotate64(d(dy), d(cos), -d(sin), dy.dtype)


ROPE_ADV = ("nan", "inf", "denormal", "zero", "single_token")

ENTRIES: list[OpEntry] = [
    OpEntry(
        name="rope",
        module="rope",
        fn="apply_rope",
        space=space_rope,
        make=make_rope,
        contract=BITWISE,
        oracle=rope,
        adversarial=ROPE_ADV,
        dtypes=("bf16", "fp32"),
        ref64=True,
    ),
    OpEntry(
        name="rope_bwd",
        module="rope",
        fn="apply_rope_bwd",
        space=space_rope,
        make=make_rope,
        contract=BITWISE,
        oracle=rope_bwd,
        adversarial=ROPE_ADV,
        dtypes=("bf16", "fp32"),
        ref64=True,
    ),
]
