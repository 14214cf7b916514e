"""Comparators for the five contract kinds: bitwise, ulp(n), bound(n, c), ratio(c), invariant.
Each returns a Verdict with the worst ULP / bound ratio / error ratio seen, so a report shows how close
a passing case came to its contract, not just that it passed."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

Kind = Literal["bitwise", "ulp", "bound", "ratio", "invariant"]

U_FP32 = 2.0**-24
"""Unit roundoff of an fp32 accumulator (24-bit significand, round to nearest)."""
U_HOPPER_FP8_BLOCK = 2.0**-14
"""Hopper fp8 wgmma keeps ~14 significand bits while summing inside one 128-wide K block before the
partial sum is promoted to fp32 (DeepSeek-V3 report, sec. 3.3.2), so in-block error uses u = 2^-14."""


@dataclass(frozen=True)
class Contract:
    """A kind plus its numbers; `note` derives u_acc so nobody tunes it to pass. bound: |fast - ref64| <=
    n*ulp(ref) + c*acc(K)*mag (acc in `acc`); ratio: max|fast - ref64| <= c*max|lowprec - ref64| +
    floor*max|ref64|."""

    kind: Kind
    n: float = 0.0
    c: float = 0.0
    u_acc: float = 0.0
    block: int = 0
    u_block: float = 0.0
    floor: float = 0.0
    note: str = ""

    def label(self) -> str:
        if self.kind == "ulp":
            return f"ulp({_num(self.n)})"
        if self.kind == "bound":
            blk = f";blk{self.block}@2^{math.log2(self.u_block):g}" if self.block > 0 else ""
            return f"bound({_num(self.n)},{_num(self.c)}{blk})"
        if self.kind == "ratio":
            return f"ratio({_num(self.c)})"
        return self.kind

    def acc(self, k: float | Tensor) -> float | Tensor:
        """K*u_acc; with block > 0, min(K, block)*u_block + ceil(K/block)*u_acc (low-precision in-block sums
        promoted to the accumulator every block)."""
        if self.block <= 0:
            return k * self.u_acc
        if isinstance(k, Tensor):
            kd = k.to(torch.float64)
            return (
                torch.clamp(kd, max=float(self.block)) * self.u_block
                + torch.ceil(kd / self.block) * self.u_acc
            )
        return min(float(k), float(self.block)) * self.u_block + math.ceil(float(k) / self.block) * self.u_acc


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


BITWISE = Contract("bitwise")


def ulp_contract(n: float, note: str = "") -> Contract:
    return Contract("ulp", n=n, note=note)


def bound_contract(
    n: float,
    c: float,
    u_acc: float = U_FP32,
    block: int = 0,
    u_block: float = 0.0,
    note: str = "fp32 accumulator: u_acc = 2^-24",
) -> Contract:
    return Contract("bound", n=n, c=c, u_acc=u_acc, block=block, u_block=u_block, note=note)


def ratio_contract(c: float, floor: float = 0.0, note: str = "") -> Contract:
    return Contract("ratio", c=c, floor=floor, note=note)


@dataclass(frozen=True)
class Verdict:
    """Outcome of one comparison; `worst` maps metric name (ulp, bound_ratio, err_ratio, ...) to its max."""

    passed: bool
    worst: Mapping[str, float] = field(default_factory=dict)
    detail: str = ""


def merge(verdicts: Sequence[Verdict]) -> Verdict:
    """All must pass; worst is the max per metric; details of failures are joined."""
    worst: dict[str, float] = {}
    for v in verdicts:
        for key, val in v.worst.items():
            worst[key] = max(worst.get(key, val), val)
    fails = [v.detail for v in verdicts if not v.passed and v.detail]
    return Verdict(all(v.passed for v in verdicts), worst, "; ".join(fails))


# ----------------------------------------------------------------------------------------------------------
# Float formats: significand bits p (hidden bit included), min normal exponent, max finite, has inf


@dataclass(frozen=True)
class FloatFormat:
    name: str
    bits: int
    p: int
    emin: int
    vmax: float
    has_inf: bool


FORMATS: dict[torch.dtype, FloatFormat] = {
    torch.bfloat16: FloatFormat("bf16", 16, 8, -126, float(torch.finfo(torch.bfloat16).max), True),
    torch.float16: FloatFormat("fp16", 16, 11, -14, 65504.0, True),
    torch.float32: FloatFormat("fp32", 32, 24, -126, float(torch.finfo(torch.float32).max), True),
    torch.float8_e4m3fn: FloatFormat("e4m3", 8, 4, -6, 448.0, False),
}
_INT_VIEW = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def fmt(dtype: torch.dtype) -> FloatFormat:
    if dtype not in FORMATS:
        raise ValueError(f"no ULP format for {dtype}; ULP contracts cover bf16, fp16, fp32 and e4m3 outputs")
    return FORMATS[dtype]


def _pow2_f64(e: Tensor) -> Tensor:
    """Exact float64 2^e for integer e in [-1022, 1023], built from bits."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _lead_exponent(a: Tensor, emin: int) -> Tensor:
    """floor(log2 a) for finite a > 0 from frexp (exact), floored at the format's min normal exponent."""
    _, e = torch.frexp(a)
    return torch.clamp(e.to(torch.int64) - 1, min=emin)


def round_once(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Round float64 x to `dtype` exactly once (RNE); torch's own casts may round twice via fp32.

    Overflow gives ±Inf for IEEE formats and NaN for e4m3fn (it has no Inf), as a plain cast would. A NaN
    becomes the quiet NaN of x's sign, written as bits: torch's vectorised casts vary NaN bits.
    """
    f = fmt(dtype)
    x = x.to(torch.float64)
    a = x.abs()
    finite = torch.isfinite(a) & (a > 0)
    safe = torch.where(finite, a, torch.ones_like(a))
    q = _pow2_f64(_lead_exponent(safe, f.emin) - (f.p - 1))
    r = torch.round(safe / q) * q
    r = torch.where(finite, r, a)
    over = r > f.vmax
    r = torch.where(over & torch.isfinite(r), torch.full_like(r, math.inf if f.has_inf else math.nan), r)
    if not f.has_inf:
        r = torch.where(torch.isinf(r), torch.full_like(r, math.nan), r)
    out = torch.copysign(r, x).to(dtype)
    nan = torch.isnan(x)
    if not bool(nan.any()):
        return out
    quiet = 0x7F if not f.has_inf else ((1 << (f.bits - 1)) - 1) ^ ((1 << (f.p - 2)) - 1)
    bits = torch.where(torch.signbit(x), quiet | (1 << (f.bits - 1)), quiet)
    bits = torch.where(bits >= 1 << (f.bits - 1), bits - (1 << f.bits), bits).to(_INT_VIEW[f.bits])
    return torch.where(nan, bits.view(dtype), out)


def ulp_of(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Spacing of `dtype` at |x| (float64): 2^(max(floor(log2|x|), emin) - p + 1); subnormal spacing at 0."""
    f = fmt(dtype)
    a = x.to(torch.float64).abs()
    ok = torch.isfinite(a) & (a > 0)
    e = _lead_exponent(torch.where(ok, a, torch.ones_like(a)), f.emin)
    e = torch.where(ok, e, torch.full_like(e, f.emin))
    e = torch.where(torch.isfinite(a), e, torch.full_like(e, math.frexp(f.vmax)[1] - 1))
    return _pow2_f64(e - (f.p - 1))


def ordered(x: Tensor) -> Tensor:
    """Sign-magnitude bits mapped to integers whose order is the float order (+0 and -0 both map to 0)."""
    f = fmt(x.dtype)
    bits = x.contiguous().view(_INT_VIEW[f.bits]).to(torch.int64) & ((1 << f.bits) - 1)
    mag = bits & ((1 << (f.bits - 1)) - 1)
    return torch.where((bits >> (f.bits - 1)) == 1, -mag, mag)


def ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """|ordered(a) - ordered(b)| in float64; both NaN -> 0, exactly one NaN -> Inf; Inf sits 1 past max."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(
            f"ulp_distance: need equal dtype/shape, got {a.dtype}{tuple(a.shape)} vs "
            f"{b.dtype}{tuple(b.shape)}"
        )
    d = (ordered(a) - ordered(b)).abs().to(torch.float64)
    na, nb = torch.isnan(a), torch.isnan(b)
    d = torch.where(na & nb, torch.zeros_like(d), d)
    return torch.where(na ^ nb, torch.full_like(d, math.inf), d)


# ----------------------------------------------------------------------------------------------------------
# Comparators


def _shape_check(fast: Tensor, ref: Tensor, what: str) -> Verdict | None:
    if fast.shape != ref.shape:
        return Verdict(False, {}, f"{what}: shape {tuple(fast.shape)} != expected {tuple(ref.shape)}")
    return None


def _where(mask: Tensor) -> str:
    idx = torch.nonzero(mask)
    return "" if idx.numel() == 0 else f" first at {tuple(int(i) for i in idx[0])}"


def int_view(t: Tensor) -> Tensor:
    """The raw bits of t as an integer tensor (bool as uint8); NaN payloads and -0 stay visible."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_floating_point():
        return t.contiguous().view(_INT_VIEW[t.element_size() * 8])
    return t


def bitwise(fast: Tensor, ref: Tensor, what: str = "out") -> Verdict:
    """Identical dtype, shape and bits; worst reports the mismatch count and, for floats, the max ULP gap."""
    bad = _shape_check(fast, ref, what)
    if bad is not None:
        return bad
    if fast.dtype != ref.dtype:
        return Verdict(False, {}, f"{what}: dtype {fast.dtype} != expected {ref.dtype}")
    diff = int_view(fast) != int_view(ref)
    worst: dict[str, float] = {"mismatches": float(diff.sum())}
    if fast.dtype in FORMATS and fast.numel():
        worst["ulp"] = float(ulp_distance(fast[diff], ref[diff]).max()) if bool(diff.any()) else 0.0
    gap = f" (up to {worst['ulp']:g} ULP apart)" if "ulp" in worst else ""
    detail = f"{what}: {int(diff.sum())} of {diff.numel()} elements differ in bits{gap}{_where(diff)}"
    return Verdict(not bool(diff.any()), worst, "" if not bool(diff.any()) else detail)


def ulp(fast: Tensor, ref64: Tensor, n: float, what: str = "out") -> Verdict:
    """ULP distance of fast from the float64 reference rounded once to fast.dtype; pass iff <= n.

    n = 0 is the bitwise contract: the bits must equal the once-rounded reference (±0 and NaN payloads count).
    """
    bad = _shape_check(fast, ref64, what)
    if bad is not None:
        return bad
    if fast.numel() == 0:
        return Verdict(True, {"ulp": 0.0})
    if n == 0 and ref64.dtype != fast.dtype:
        return bitwise(fast, round_once(ref64, fast.dtype), what)
    if n == 0:
        return bitwise(fast, ref64, what)
    d = ulp_distance(fast, round_once(ref64, fast.dtype))
    worst = float(d.max())
    ok = worst <= n
    return Verdict(ok, {"ulp": worst}, "" if ok else f"{what}: {worst:g} ULP > {n:g}{_where(d > n)}")


def bound(
    fast: Tensor,
    ref64: Tensor,
    radius: Tensor | float,
    n: float,
    what: str = "out",
    ulp_at: Tensor | None = None,
) -> Verdict:
    """|fast - ref64| <= n*ulp(ref) + radius elementwise; worst is max(err / allowed) ("bound_ratio").

    Where ref64 rounds to a non-finite output value, fast must be that same value (Inf sign, or NaN).
    """
    bad = _shape_check(fast, ref64, what)
    if bad is not None:
        return bad
    if fast.numel() == 0:
        return Verdict(True, {"bound_ratio": 0.0})
    f = fast.to(torch.float64)
    ref64 = ref64.to(torch.float64)
    rr = round_once(ref64, fast.dtype).to(torch.float64) if fast.dtype in FORMATS else ref64
    nonfinite = ~torch.isfinite(rr)
    same_nf = (torch.isnan(rr) & torch.isnan(f)) | (rr == f)
    rad = torch.as_tensor(radius, dtype=torch.float64).expand_as(ref64)
    ulps = ulp_of(ref64 if ulp_at is None else ulp_at, fast.dtype) if fast.dtype in FORMATS else 0.0
    allowed = n * ulps + rad
    err = (f - ref64).abs()
    ratio = torch.where(err == 0, torch.zeros_like(err), err / allowed)
    ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
    ratio = torch.where(nonfinite, torch.where(same_nf, 0.0, math.inf), ratio)
    ratio = torch.where(~nonfinite & ~torch.isfinite(f), torch.full_like(ratio, math.inf), ratio)
    worst = float(ratio.max())
    ok = worst <= 1.0
    return Verdict(
        ok, {"bound_ratio": worst}, "" if ok else f"{what}: bound ratio {worst:.3g} > 1{_where(ratio > 1)}"
    )


def gemm_radius(contract: Contract, mag: Tensor, k: float | Tensor) -> Tensor:
    """c * acc(K) * mag: the forward-error bound of a length-K reduction whose |terms| sum to mag."""
    return contract.c * contract.acc(k) * mag.to(torch.float64)


def interval(fast: Tensor, lo: Tensor, hi: Tensor, n: float, what: str = "out") -> Verdict:
    """fast within [lo, hi] widened by n ULPs of the larger end: a bound propagated through an epilogue."""
    mid = (lo + hi) / 2
    half = (hi - lo) / 2
    return bound(fast, mid, half, n, what, ulp_at=torch.maximum(lo.abs(), hi.abs()))


def ratio(
    fast: Tensor, ref64: Tensor, lowprec: Tensor, c: float, floor: float = 0.0, what: str = "out"
) -> Verdict:
    """FlashAttention-style: max|fast - ref64| <= c*max|lowprec - ref64| + floor; worst is the error ratio."""
    bad = _shape_check(fast, ref64, what)
    if bad is not None:
        return bad
    ref64 = ref64.to(torch.float64)
    err = (fast.to(torch.float64) - ref64).abs()
    base = (lowprec.to(torch.float64) - ref64).abs()
    e = float(torch.nan_to_num(err, nan=math.inf).max()) if err.numel() else 0.0
    b = float(torch.nan_to_num(base, nan=math.inf).max()) if base.numel() else 0.0
    allowed = c * b + floor
    worst = 0.0 if e == 0 else (math.inf if allowed == 0 or math.isnan(e) else e / allowed)
    ok = worst <= 1.0
    detail = f"{what}: max err {e:.3g} > {c:g} x low-precision err {b:.3g} + {floor:g}"
    return Verdict(ok, {"err_ratio": worst}, "" if ok else detail)


# ----------------------------------------------------------------------------------------------------------
# Invariants


def conservation(ids: Tensor, n: int, what: str = "row_id") -> Verdict:
    """Every id in 0..n-1 occurs exactly once: nothing dropped, nothing duplicated, nothing invented."""
    flat = ids.reshape(-1).to(torch.int64)
    outside = int(((flat < 0) | (flat >= n)).sum())
    inside = flat[(flat >= 0) & (flat < n)]
    counts = torch.bincount(inside, minlength=n) if n > 0 else torch.zeros(0, dtype=torch.int64)
    violations = outside + int((counts != 1).sum())
    ok = violations == 0
    detail = f"{what}: {violations} violations (ids missing, repeated or outside [0, {n}))"
    return Verdict(ok, {"violations": float(violations)}, "" if ok else detail)


def permutation(a: Tensor, b: Tensor, what: str = "rows") -> Verdict:
    """b's rows are a reordering of a's rows, compared by their bits."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return Verdict(
            False, {"violations": 1.0}, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
    ra = int_view(a).reshape(a.shape[0], -1).to(torch.int64) if a.dim() else int_view(a).reshape(1, 1)
    rb = int_view(b).reshape(b.shape[0], -1).to(torch.int64) if b.dim() else int_view(b).reshape(1, 1)
    sa = sorted(tuple(r) for r in ra.tolist())
    sb = sorted(tuple(r) for r in rb.tolist())
    bad = sum(1 for x, y in zip(sa, sb, strict=True) if x != y)
    return Verdict(
        bad == 0, {"violations": float(bad)}, "" if bad == 0 else f"{what}: {bad} rows not matched"
    )


def determinism(first: Sequence[Tensor], second: Sequence[Tensor]) -> Verdict:
    """Two runs on the same inputs give the same bits in every output."""
    if len(first) != len(second):
        return Verdict(False, {"violations": 1.0}, f"determinism: {len(first)} vs {len(second)} outputs")
    vs = [bitwise(b, a, f"rerun out[{i}]") for i, (a, b) in enumerate(zip(first, second, strict=True))]
    m = merge(vs)
    return Verdict(m.passed, {"violations": float(sum(not v.passed for v in vs))}, m.detail)
