"""Parity inputs: hypothesis draws shapes/dtypes/seeds; tensors come from a seeded torch.Generator.
`draws` replays a seeded, database-free hypothesis run for N reproducible parameter dicts; builders
turn one dict (plus an optional adversarial kind) into arguments."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st
from torch import Tensor

from parity.compare import round_once, ulp_of

Params = Mapping[str, Any]
Space = Callable[[bool], st.SearchStrategy[dict[str, Any]]]

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}
@dataclass(frozen=True)
class Inputs:
    """Concrete arguments of one case; `raises` marks inputs on which the spec requires an error."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    shape: Mapping[str, int] = field(default_factory=dict)
    dtype: str = ""
    raises: bool = False
    meta: Mapping[str, Any] = field(default_factory=dict)


def draws(space: st.SearchStrategy[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """N parameter dicts from a seeded, database-free hypothesis run (same seed -> same draws).

    Hypothesis skips duplicates, so a tiny space can yield fewer than n; the first draw is the simplest.
    """
    out: list[dict[str, Any]] = []
    if n <= 0:
        return out

    @hyp_seed(seed)
    @settings(
        max_examples=n,
        phases=[Phase.generate],
        database=None,
        deadline=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(space)
    def collect(p: dict[str, Any]) -> None:
        out.append(dict(p))

    collect()
    return out[:n]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)


def dt(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype name {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


S = st.sampled_from
I = st.integers


def by_size(big: bool, small: list[Any], large: list[Any]) -> st.SearchStrategy[Any]:
    """Sizes for a GPU (big) or a CPU space."""
    return S(large if big else small)


def space(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A params strategy; every space also draws the tensor seed."""
    return st.fixed_dictionaries({**fields, "seed": st.integers(0, 2**31 - 1)})


# ----------------------------------------------------------------------------------------------------------
# Tensors


def randn(shape: Sequence[int], dtype: torch.dtype, g: torch.Generator, std: float = 1.0) -> Tensor:
    return (torch.randn(tuple(shape), generator=g, dtype=torch.float64) * std).to(dtype)


def uniform(shape: Sequence[int], g: torch.Generator, lo: float = 0.0, hi: float = 1.0) -> Tensor:
    return torch.rand(tuple(shape), generator=g, dtype=torch.float64) * (hi - lo) + lo


def randint(lo: int, hi: int, shape: Sequence[int], g: torch.Generator) -> Tensor:
    return torch.randint(lo, hi, tuple(shape), generator=g, dtype=torch.int64)


def _bits_view(dtype: torch.dtype) -> tuple[torch.dtype, int, int]:
    """(int dtype, mantissa bits, total bits) of a float format."""
    if dtype == torch.bfloat16:
        return torch.int16, 7, 16
    if dtype == torch.float16:
        return torch.int16, 10, 16
    if dtype == torch.float32:
        return torch.int32, 23, 32
    raise ValueError(f"no bit layout for {dtype}")


def subnormals(n: int, dtype: torch.dtype, g: torch.Generator) -> Tensor:
    """n random nonzero subnormals of `dtype` with random signs, built from bit patterns."""
    ity, mbits, _ = _bits_view(dtype)
    mant = torch.randint(1, 2**mbits, (n,), generator=g, dtype=torch.int64)
    neg = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64).bool()
    mag = mant.to(ity).view(dtype)
    return torch.where(neg, -mag, mag)


def quiet_nans(n: int, dtype: torch.dtype, g: torch.Generator) -> Tensor:
    """n quiet NaNs of `dtype` with random signs, from bits: casts to bf16 drop a NaN's sign."""
    ity, mbits, bits = _bits_view(dtype)
    quiet = ((1 << (bits - 1 - mbits)) - 1) << mbits | (1 << (mbits - 1))
    neg = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) << (bits - 1)
    raw = quiet | neg
    return torch.where(raw >= 2 ** (bits - 1), raw - 2**bits, raw).to(ity).view(dtype)


def nan_payloads(n: int, dtype: torch.dtype, g: torch.Generator) -> Tensor:
    """NaNs with random signs and payloads: a copy must carry every bit."""
    ity, mbits, bits = _bits_view(dtype)
    exp = ((1 << (bits - 1 - mbits)) - 1) << mbits
    raw = exp | torch.randint(1, 2**mbits, (n,), generator=g, dtype=torch.int64)
    raw = raw | (torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) << (bits - 1))
    return torch.where(raw >= 2 ** (bits - 1), raw - 2**bits, raw).to(ity).view(dtype)


def specials(kind: str, n: int, dtype: torch.dtype, g: torch.Generator) -> Tensor:
    """n values of one adversarial kind in `dtype`: nan, inf (±), max (±finite max), denormal."""
    sign = torch.where(torch.randint(0, 2, (n,), generator=g).bool(), -1.0, 1.0).to(torch.float64)
    if kind == "nan":
        return quiet_nans(n, dtype, g)
    if kind == "inf":
        return (sign * math.inf).to(dtype)
    if kind == "max":
        return (sign * float(torch.finfo(dtype).max)).to(dtype)
    if kind == "denormal":
        return subnormals(n, dtype, g)
    raise ValueError(f"specials: unknown kind {kind!r}")


def sprinkle(x: Tensor, kind: str, g: torch.Generator, frac: float = 0.125) -> Tensor:
    """Copy of x with ~frac of its elements (at least one) replaced by `kind` specials."""
    out = x.clone()
    if out.numel() == 0:
        return out
    flat = out.reshape(-1)
    m = max(1, int(flat.numel() * frac))
    pos = torch.randperm(flat.numel(), generator=g)[:m]
    flat[pos] = specials(kind, m, x.dtype, g)
    return flat.reshape(x.shape)


def adversarial_fill(x: Tensor, adv: str | None, g: torch.Generator) -> Tensor:
    """Apply the elementwise adversarial kinds (nan, inf, max, denormal, zero) to a float tensor."""
    if adv in ("nan", "inf", "max", "denormal"):
        return sprinkle(x, adv, g)
    if adv == "zero":
        z = torch.zeros_like(x)
        if z.numel():
            z.reshape(-1)[::2] = -0.0
        return z
    return x


def one_per_row(x: Tensor, kind: str, g: torch.Generator) -> Tensor:
    """One special value per row (reductions: no two overflows that could cancel inside a row)."""
    out = x.clone()
    if out.numel() == 0:
        return out
    rows = out.reshape(-1, out.shape[-1])
    col = torch.randint(0, rows.shape[1], (rows.shape[0],), generator=g)
    sign = torch.where(torch.randint(0, 2, (rows.shape[0],), generator=g).bool(), -1.0, 1.0)
    val = {"max": float(torch.finfo(x.dtype).max), "inf": math.inf}[kind]
    rows[torch.arange(rows.shape[0]), col] = (sign * val).to(x.dtype)
    return rows.reshape(x.shape)


def reduce_fill(x: Tensor, adv: str | None, g: torch.Generator) -> Tensor:
    """Adversarial fill for operands of reductions: specials at most once per row for max."""
    if adv == "max":
        return one_per_row(x, "max", g)
    return adversarial_fill(x, adv, g)


def tie_candidates(dtype: torch.dtype) -> Tensor:
    """Few-bit values in [1, 2) whose products land on exact ties of `dtype` often (float64)."""
    step = 2.0**-4 if dtype in (torch.bfloat16, torch.float16) else 2.0**-12
    n = 16 if dtype in (torch.bfloat16, torch.float16) else 4096
    return 1.0 + torch.arange(n, dtype=torch.float64) * step


def is_tie(v: Tensor, dtype: torch.dtype) -> Tensor:
    """v (float64) lies exactly half way between two neighbours of `dtype`."""
    r = round_once(v, dtype).to(torch.float64)
    return (v - r).abs() == ulp_of(v, dtype) / 2


def pick(pool: Tensor, n: int, g: torch.Generator) -> Tensor:
    if pool.numel() == 0:
        raise RuntimeError("pick: empty candidate pool; widen the candidate set")
    return pool[torch.randint(0, pool.numel(), (n,), generator=g)]


def pow2(shape: Sequence[int], lo: int, hi: int, g: torch.Generator) -> Tensor:
    """Random powers of two 2^e, e in [lo, hi], float64."""
    return torch.pow(2.0, randint(lo, hi + 1, shape, g).to(torch.float64))


def e4m3_values(codes: Tensor) -> Tensor:
    """float64 values of e4m3fn codes via torch's float8 type (NaN codes -> NaN)."""
    return codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)


def e4m3_midpoints(n: int, g: torch.Generator) -> Tensor:
    """n fp32 values exactly half way between adjacent finite e4m3 values (random sign)."""
    c = torch.randint(0, 0x7E, (n,), generator=g, dtype=torch.int64)
    mid = (e4m3_values(c) + e4m3_values(c + 1)) / 2
    sign = torch.where(torch.randint(0, 2, (n,), generator=g).bool(), -1.0, 1.0)
    return (mid * sign).to(torch.float32)


E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ----------------------------------------------------------------------------------------------------------
# Routing


def route(t: int, k: int, e: int, g: torch.Generator, skew: str = "uniform") -> Tensor:
    """ids [T,K] int64, K distinct experts per token; skew: uniform | zipf | empty (half the experts idle)."""
    if k > e:
        raise ValueError(f"route: k={k} > n_experts={e}")
    w = torch.ones(e, dtype=torch.float64)
    if skew == "zipf":
        rank = torch.randperm(e, generator=g).to(torch.float64)
        w = 1.0 / (rank + 1.0) ** 1.5
    elif skew == "empty":
        live = torch.randperm(e, generator=g)[: max(k, e // 2)]
        w = torch.zeros(e, dtype=torch.float64)
        w[live] = 1.0
    if t == 0:
        return torch.zeros(0, k, dtype=torch.int64)
    return torch.multinomial(w.expand(t, e), k, replacement=False, generator=g)


def group_ends(counts: Tensor) -> Tensor:
    """Cumulative group ends (int32) from per-group row counts."""
    return torch.cumsum(counts.to(torch.int64), 0).to(torch.int32)


def group_counts(m: int, e: int, g: torch.Generator, skew: str = "uniform", align: int = 1) -> Tensor:
    """Split m rows (a multiple of align) into e groups of multiples of align; empty groups allowed."""
    units = m // align
    if skew == "empty":
        w = torch.zeros(e, dtype=torch.float64)
        w[torch.randperm(e, generator=g)[: max(1, e // 2)]] = 1.0
    elif skew == "zipf":
        w = 1.0 / (torch.randperm(e, generator=g).to(torch.float64) + 1.0) ** 1.5
    else:
        w = torch.ones(e, dtype=torch.float64)
    if units == 0:
        return torch.zeros(e, dtype=torch.int64)
    pick_ = torch.multinomial(w, units, replacement=True, generator=g)
    return torch.bincount(pick_, minlength=e) * align


def routing_params(p: Params, adv: str | None) -> dict[str, Any]:
    single = {"T": 1} if adv == "single_token" else {}
    return with_adv(p, adv, **single, **({"K": 1} if adv == "k1" else {}))


def skew_of(adv: str | None) -> str:
    return {"empty_expert": "empty", "zipf": "zipf"}.get(adv or "", "uniform")


def with_adv(p: Params, adv: str | None, **changes: Any) -> dict[str, Any]:
    """Params updated for an adversarial kind (e.g. single_token -> T=1)."""
    q = dict(p)
    q.update(changes)
    q["adv"] = adv
    return q
