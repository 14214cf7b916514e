"""Input builders for the number-format contracts: quantizers and dequantizers (MX-FP8, NVFP4)."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity.builders import I, S
from parity.inputs import (
    E2M1_MIDPOINTS,
    Inputs,
    Params,
    dt,
    e4m3_midpoints,
    pick,
    randint,
    randn,
    space,
    sprinkle,
    uniform,
)

# ----------------------------------------------------------------------------------------------------------
# formats


def space_quant(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(M=I(1, 512 if big else 12), KB=I(1, 56 if big else 4), scale=S([1.0, 1e-3, 300.0, 1e-30]))


def space_quant_w(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        E=I(1, 8 if big else 2),
        NB=I(1, 8 if big else 2),
        KB=I(1, 16 if big else 2),
        scale=S([1.0, 1e-3, 300.0]),
    )


def _quant_x(shape: list[int], block_of_last: int, p: Params, g: torch.Generator, adv: str | None) -> Tensor:
    dtype = dt(p["dtype"])
    x = randn(shape, torch.float64, g, float(p.get("scale", 1.0)))
    if adv == "ties":
        per = [*shape[:-1], shape[-1] // block_of_last, block_of_last]
        j = randint(-20, 20, [*per[:-1], 1], g).to(torch.float64)
        mids = e4m3_midpoints(math.prod(per), g).to(torch.float64).reshape(per)
        mids[..., 0] = 448.0
        x = (mids * torch.pow(2.0, j)).reshape(shape)
    x = x.to(dtype)
    if adv == "zero":
        x = x.reshape(-1, block_of_last)
        x[::2] = 0.0
        x[1::4] = -0.0
        x = x.reshape(shape)
    elif adv in ("nan", "inf", "max", "denormal"):
        x = sprinkle(x, adv, g, 0.02)
    return x


def make_quantize_mxfp8(block: int) -> Any:
    def make(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
        m, k = p["M"], p["KB"] * block
        return Inputs(
            (_quant_x([m, k], block, p, g, adv), block),
            shape={"M": m, "K": k},
            dtype=p["dtype"],
            meta={"block": block},
        )

    return make


def make_quantize_mxfp8_w128(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    e, n, k = p["E"], p["NB"] * 128, p["KB"] * 128
    x = _quant_x([e, n, k], 128, p, g, adv)
    return Inputs((x,), shape={"E": e, "N": n, "K": k}, dtype=p["dtype"])


def make_quantize_nvfp4(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    m, k = p["M"], p["KB"] * 16
    if adv == "ties":
        per = [m, k // 16, 16]
        j = randint(-6, 6, [m, k // 16, 1], g).to(torch.float64)
        mids = pick(torch.tensor(E2M1_MIDPOINTS, dtype=torch.float64), m * k, g).reshape(per)
        sign = torch.where(randint(0, 2, per, g) == 1, -1.0, 1.0)
        mids = mids * sign
        mids[..., 0] = 6.0
        x = (mids * torch.pow(2.0, j)).reshape(m, k)
        x.reshape(-1)[0] = 2688.0 * 2.0 ** int(j.max())
        x = x.to(dt(p["dtype"]))
    else:
        x = _quant_x([m, k], 16, p, g, adv)
    return Inputs((x,), shape={"M": m, "K": k}, dtype=p["dtype"])


def space_dequant(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        M=I(1, 512 if big else 12), KB=I(1, 56 if big else 4), lo=S([0, 100, 118]), hi=S([137, 160, 256])
    )


def _scale_bytes(shape: list[int], p: Params, g: torch.Generator, adv: str | None) -> Tensor:
    lo, hi = int(p.get("lo", 110)), int(p.get("hi", 145))
    if adv == "max":
        lo, hi = 250, 256
    elif adv == "denormal":
        lo, hi = 0, 8
    b = randint(lo, max(hi, lo + 1), shape, g).to(torch.uint8)
    if adv == "nan" and b.numel():
        b.reshape(-1)[0] = 255
    return b


def _all_codes(shape: list[int], g: torch.Generator) -> Tensor:
    """Random e4m3 codes covering all 256 patterns (NaN codes included) when the tensor is large enough."""
    n = math.prod(shape)
    base = torch.arange(256, dtype=torch.int64)[torch.randperm(256, generator=g)]
    reps = -(-n // 256)
    return base.repeat(reps)[:n].reshape(shape).to(torch.uint8)


def make_dequantize_mxfp8(block: int) -> Any:
    def make(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
        m, k = p["M"], p["KB"] * block
        codes = _all_codes([m, k], g)
        scales = _scale_bytes([m, k // block], p, g, adv)
        return Inputs((codes, scales, block), shape={"M": m, "K": k}, dtype="e4m3", meta={"block": block})

    return make


def make_dequantize_mxfp8_w128(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    e, n, k = p["E"], p["NB"] * 128, p["KB"] * 128
    codes = _all_codes([e, n, k], g)
    scales = _scale_bytes([e, n // 128, k // 128], p, g, adv)
    return Inputs((codes, scales), shape={"E": e, "N": n, "K": k}, dtype="e4m3")


def make_dequantize_nvfp4(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    m, k = p["M"], p["KB"] * 16
    packed = randint(0, 256, [m, k // 2], g).to(torch.uint8)
    bs = _all_codes([m, k // 16], g) if adv != "denormal" else randint(0, 8, [m, k // 16], g).to(torch.uint8)
    ts = (uniform([], g, 0.5, 2.0) * float(2.0 ** int(randint(-20, 4, [1], g)))).to(torch.float32)
    if adv == "max":
        ts = torch.tensor(float(torch.finfo(torch.float32).max) / 2688.0, dtype=torch.float32)
    return Inputs((packed, bs, ts), shape={"M": m, "K": k}, dtype="nvfp4")
