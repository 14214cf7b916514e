"""What every family's oracle shares: the Expect record, float64 helpers and the spec's output rounding.
Oracles are written independently of nmoe.reference (float64 math, ml_dtypes/torch float8 casts, plain
loops); where the spec pins an fp32 step, the oracle cites the spec text (docs/spec-corners.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from parity.compare import Contract, Verdict, round_once
from parity.inputs import Inputs, e4m3_values

F64 = torch.float64


@dataclass(frozen=True)
class Expect:
    """Expected value of one output: float64 `value` (or exact bits when exact=True), plus what the
    contract needs: mag/k for bound radii, lo/hi for bounds propagated through an epilogue, lowprec for
    ratio contracts."""

    value: Tensor
    exact: bool = False
    mag: Tensor | None = None
    k: float | Tensor = 0.0
    lo: Tensor | None = None
    hi: Tensor | None = None
    lowprec: Tensor | None = None


Oracle = Callable[[Inputs, Contract], Sequence["Expect | None"]]
Invariant = Callable[[Inputs, Any], Verdict]


def f32(x: Tensor) -> Tensor:
    """Round float64 to fp32 once (IEEE cast) and widen back: models one pinned fp32 operation."""
    return x.to(torch.float32).to(F64)


def d(x: Tensor) -> Tensor:
    return x.to(F64)


def _grid_exponent(v: Tensor) -> int:
    """The least k with every entry of v times 2**k an integer (v holds low-precision values)."""
    for k in range(0, 200):
        if bool((torch.frac(v * 2.0**k) == 0).all()):
            return k
    raise ValueError("values are not on a binary grid finer than 2**-200")


def fp32_dot_exact(a: Tensor, b: Tensor) -> bool:
    """True when every partial sum of every row of a @ b.T is a multiple of one grid unit below 2**24 units,
    so fp32 accumulation in any order (split, tree, tensor-core) is exact."""
    a64, b64 = d(a), d(b)
    unit = 2.0 ** -(_grid_exponent(a64) + _grid_exponent(b64))
    worst = float((a64.abs() @ b64.abs().T).max()) if a64.numel() and b64.numel() else 0.0
    return worst / unit < 2.0**24


def spec_out(x64: Tensor, dtype: torch.dtype) -> Expect:
    """Exact expected bits: x64 rounded once to the output dtype, every NaN the positive quiet NaN
    (0x7FC0 bf16, 0x7FC00000 fp32), as docs/spec-corners.md pins for bitwise float outputs."""
    x = x64.to(F64)
    positive_nan = torch.where(torch.isnan(x), torch.full_like(x, math.nan).abs(), x)
    return Expect(round_once(positive_nan, dtype), exact=True)


def relu64(x: Tensor) -> Tensor:
    return torch.where(x <= 0, torch.zeros_like(x), x)


def sigmoid64(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def dequant_mx(codes: Tensor, scales: Tensor, rows: int, cols: int) -> Tensor:
    """float64 e4m3 values times 2^(byte-127), each scale covering a rows x cols block of the last 2 dims."""
    s = torch.where(scales == 255, math.nan, torch.pow(2.0, scales.to(F64) - 127))
    s = s.repeat_interleave(cols, dim=-1)
    if rows > 1:
        s = s.repeat_interleave(rows, dim=-2)
    return e4m3_values(codes) * s


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F64)


def e2m1_values(packed: Tensor) -> Tensor:
    """float64 e2m1 values of a packed byte tensor (element 2i in the low nibble)."""
    p = packed.to(torch.int64)
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)
    mag = E2M1[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


def dequant_nvfp4(packed: Tensor, bs: Tensor, ts: Tensor) -> Tensor:
    """(code * s_b) * g in float64: the first product is exact, so fp32 rounds only the last multiply."""
    return e2m1_values(packed) * e4m3_values(bs).repeat_interleave(16, dim=-1) * d(ts)
