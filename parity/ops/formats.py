"""Number formats: MX-FP8 (blocks 32/128 and 128x128 weights) and NVFP4 quantize/dequantize, bitwise."""

from __future__ import annotations

import math
import struct
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity.compare import (
    BITWISE,
    Contract,
)
from parity.entry import (
    OpEntry,
)
from parity.inputs import (
    E2M1_MIDPOINTS,
    I,
    Inputs,
    Params,
    S,
    dt,
    e4m3_midpoints,
    pick,
    pow2,
    randint,
    randn,
    space,
    sprinkle,
    uniform,
)
from parity.oracles import (
    F64,
    Expect,
    d,
    dequant_mx,
    dequant_nvfp4,
    f32,
    spec_out,
)


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
    """adv=underflow: g is subnormal (amax ~ 2^-130), so fp32(s_b*g) is 0 for small s_b, and blocks 2^-24
    below the largest get s_b = 0."""
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
    elif adv == "underflow":
        blocks = randn([m, k // 16, 16], torch.float64, g) * pow2([m, k // 16, 1], -20, -13, g)
        blocks[0, 0, 0] = 3.0
        x = (blocks * 2.0**-132).reshape(m, k).to(dt(p["dtype"]))
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


def _e4m3_codes(x32: Tensor) -> Tensor:
    """float8_e4m3fn codes of fp32 values already clamped to ±448 (torch's RNE cast; NaN -> 0x7F/0xFF)."""
    return x32.to(torch.float8_e4m3fn).view(torch.uint8)


def _mx_byte(amax: Tensor) -> Tensor:
    """127 + ceil(log2(fp32(amax/448))) by frexp on float64, clamped to [1, 254]."""
    s = f32(amax / 448.0)
    m, e = torch.frexp(torch.where(s > 0, s, torch.ones_like(s)))
    ceil_log2 = torch.where(m == 0.5, e - 1, e).to(torch.int64)
    return torch.where(s > 0, torch.clamp(127 + ceil_log2, 1, 254), torch.ones_like(ceil_log2))


def _mx_quantize(xb: Tensor, dims: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    x = d(xb)
    finite = torch.isfinite(x).all(dim=dims[0], keepdim=True)
    for dd in dims[1:]:
        finite = finite.all(dim=dd, keepdim=True)
    amax = torch.where(torch.isfinite(x), x.abs(), 0.0)
    for dd in dims:
        amax = amax.amax(dim=dd, keepdim=True)
    byte = torch.where(finite, _mx_byte(amax), 255)
    scaled = (x * torch.pow(2.0, (127 - byte).to(F64))).to(torch.float32)
    codes = _e4m3_codes(torch.clamp(scaled, -448.0, 448.0))
    codes = torch.where(finite & (amax == 0), torch.zeros_like(codes), codes)
    return codes, byte.to(torch.uint8)


def quantize_mxfp8(inp: Inputs, c: Contract) -> list[Expect | None]:
    x, block = inp.args
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    codes, byte = _mx_quantize(xb, (-1,))
    return [Expect(codes.reshape(x.shape), exact=True), Expect(byte.squeeze(-1), exact=True)]


def quantize_mxfp8_weight(inp: Inputs, c: Contract) -> list[Expect | None]:
    (w,) = inp.args
    *lead, n, k = w.shape
    wb = w.reshape(*lead, n // 128, 128, k // 128, 128)
    codes, byte = _mx_quantize(wb, (-3, -1))
    return [Expect(codes.reshape(w.shape), exact=True), Expect(byte.squeeze(-1).squeeze(-2), exact=True)]


def dequantize_mxfp8(inp: Inputs, c: Contract) -> list[Expect | None]:
    codes, scales, block = inp.args
    return [spec_out(dequant_mx(codes, scales, 1, block), torch.float32)]


def dequantize_mxfp8_weight(inp: Inputs, c: Contract) -> list[Expect | None]:
    codes, scales = inp.args
    return [spec_out(dequant_mx(codes, scales, 128, 128), torch.float32)]


def _fp32(v: float) -> float:
    """One IEEE fp32 rounding of a float64 result of fp32 operands (53 >= 2*24 + 2: no double rounding)."""
    try:
        return float(struct.unpack("f", struct.pack("f", v))[0])
    except OverflowError:
        return math.copysign(math.inf, v)


def _grid(ebits: int, mbits: int, bias: int) -> list[float]:
    """Non-negative values of a minifloat by code (sign bit excluded), subnormals where the exponent is 0."""
    out = []
    for e in range(2**ebits):
        for m in range(2**mbits):
            out.append(m * 2.0 ** (1 - bias - mbits) if e == 0 else (1 + m / 2**mbits) * 2.0 ** (e - bias))
    return out


E4M3_GRID = _grid(4, 3, 7)[:0x7F]
E2M1_GRID = _grid(2, 1, 1)


def _nearest_even(v: float, grid: list[float]) -> int:
    """The code of the grid value nearest v (v inside the grid's range); a tie goes to the even code."""
    return min(range(len(grid)), key=lambda c: (abs(grid[c] - v), c % 2))


def quantize_nvfp4(inp: Inputs, c: Contract) -> list[Expect | None]:
    """Block by block in Python floats from the spec text (docs/spec-corners.md): g = amax/2688 over finite
    elements; a block holding NaN/Inf gets scale 0x7F and codes 0; s_b = e4m3(clamp((amax_b/6)/g, 0, 448)),
    0 when g = 0; where fp32(s_b*g) is 0 the codes are +0, else e2m1(clamp(x/(s_b*g), ±6)), sign kept."""
    (x,) = inp.args
    blocks = d(x).reshape(-1, 16).tolist()
    finite = [abs(v) for blk in blocks for v in blk if math.isfinite(v)]
    g = _fp32(max(finite, default=0.0) / 2688.0)
    codes: list[int] = []
    scales: list[int] = []
    for blk in blocks:
        if not all(math.isfinite(v) for v in blk):
            scales.append(0x7F)
            codes += [0] * 16
            continue
        s = _fp32(_fp32(max(abs(v) for v in blk) / 6.0) / g) if g > 0 else 0.0
        scales.append(_nearest_even(min(s, 448.0), E4M3_GRID))
        den = _fp32(E4M3_GRID[scales[-1]] * g)
        for v in blk:
            q = max(-6.0, min(6.0, _fp32(v / den))) if den > 0 else 0.0
            codes.append(
                _nearest_even(abs(q), E2M1_GRID) | (8 if den > 0 and math.copysign(1.0, q) < 0 else 0)
            )
    lead = x.shape[:-1]
    nib = torch.tensor(codes, dtype=torch.int64).reshape(*lead, x.shape[-1])
    packed = (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)
    sb = torch.tensor(scales, dtype=torch.uint8).reshape(*lead, x.shape[-1] // 16)
    return [
        Expect(packed, exact=True),
        Expect(sb, exact=True),
        Expect(torch.tensor(g, dtype=torch.float32), exact=True),
    ]


def dequantize_nvfp4(inp: Inputs, c: Contract) -> list[Expect | None]:
    packed, bs, ts = inp.args
    return [spec_out(dequant_nvfp4(packed, bs, ts), torch.float32)]


QUANT_ADV = ("nan", "inf", "denormal", "max", "ties", "zero")


def _mx_entries(block: int) -> list[OpEntry]:
    return [
        OpEntry(
            name=f"quantize_mxfp8_{block}",
            module="formats",
            fn="quantize_mxfp8",
            space=space_quant,
            make=make_quantize_mxfp8(block),
            contract=BITWISE,
            oracle=quantize_mxfp8,
            output_names=("codes", "scales"),
            adversarial=QUANT_ADV,
            dtypes=("fp32", "bf16"),
        ),
        OpEntry(
            name=f"dequantize_mxfp8_{block}",
            module="formats",
            fn="dequantize_mxfp8",
            space=space_dequant,
            make=make_dequantize_mxfp8(block),
            contract=BITWISE,
            oracle=dequantize_mxfp8,
            adversarial=("nan", "max", "denormal"),
            dtypes=("fp32",),
        ),
    ]


ENTRIES: list[OpEntry] = [
    *_mx_entries(32),
    *_mx_entries(128),
    OpEntry(
        name="quantize_mxfp8_w128",
        module="formats",
        fn="quantize_mxfp8_weight",
        space=space_quant_w,
        make=make_quantize_mxfp8_w128,
        contract=BITWISE,
        oracle=quantize_mxfp8_weight,
        output_names=("codes", "scales"),
        adversarial=QUANT_ADV,
        dtypes=("fp32", "bf16"),
    ),
    OpEntry(
        name="dequantize_mxfp8_w128",
        module="formats",
        fn="dequantize_mxfp8_weight",
        space=space_quant_w,
        make=make_dequantize_mxfp8_w128,
        contract=BITWISE,
        oracle=dequantize_mxfp8_weight,
        adversarial=("nan", "max", "denormal"),
        dtypes=("fp32",),
    ),
    OpEntry(
        name="quantize_nvfp4",
        module="formats",
        fn="quantize_nvfp4",
        space=space_quant,
        make=make_quantize_nvfp4,
        contract=BITWISE,
        oracle=quantize_nvfp4,
        output_names=("packed", "block_scales", "tensor_scale"),
        adversarial=(*QUANT_ADV, "underflow"),
        dtypes=("fp32", "bf16"),
    ),
    OpEntry(
        name="dequantize_nvfp4",
        module="formats",
        fn="dequantize_nvfp4",
        space=space_dequant,
        make=make_dequantize_nvfp4,
        contract=BITWISE,
        oracle=dequantize_nvfp4,
        adversarial=("max", "denormal"),
        dtypes=("fp32",),
    ),
]
