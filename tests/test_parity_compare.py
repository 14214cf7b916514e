"""Parity comparators against independent oracles: float64 ordinals, brute-force nearest-value rounding,
and, per contract kind, a deliberately wrong implementation that must be caught while a correct one passes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import Tensor

from parity import compare as c

BF = torch.bfloat16


def _all_bf16() -> Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(BF)


def _ordinal(v: np.ndarray, p: int, emin: int) -> np.ndarray:
    """Signed count of representable magnitudes below |v| (float64 math only); Inf one past the max."""
    a = np.abs(v)
    m, e = np.frexp(a)
    quantum = 2.0 ** (emin - p + 1)
    per_binade = 2.0 ** (p - 1)
    normal = per_binade + (e - 1 - emin) * per_binade + (2 * m - 1) * per_binade
    o = np.where(a < 2.0**emin, a / quantum, normal)
    o = np.where(np.isinf(a), per_binade * (254 + 1) if p == 8 else np.nan, o)
    return np.where(np.signbit(v), -o, o)


def test_ulp_distance_every_bf16_pattern_matches_float64_ordinals() -> None:
    a = _all_bf16()
    g = torch.Generator().manual_seed(0)
    n = a.numel()
    partners = [
        a[torch.randperm(n, generator=g)],
        a.view(torch.int16).roll(1).view(BF),
        (a.view(torch.int16) ^ torch.tensor(-(2**15), dtype=torch.int16)).view(BF),
        a.view(torch.int16)[(torch.arange(n) + torch.randint(-300, 300, (n,), generator=g)) % n].view(BF),
    ]
    av = a.to(torch.float64).numpy()
    for b in partners:
        bv = b.to(torch.float64).numpy()
        want = np.abs(_ordinal(av, 8, -126) - _ordinal(bv, 8, -126))
        na, nb = np.isnan(av), np.isnan(bv)
        want = np.where(na & nb, 0.0, np.where(na ^ nb, np.inf, want))
        got = c.ulp_distance(a, b).numpy()
        assert np.array_equal(got, want)


def _brute_round(x: np.ndarray, values: np.ndarray, codes: np.ndarray, overflow: float) -> np.ndarray:
    """Nearest of the sorted finite `values` to |x|, ties to the even code, sign of x; overflow -> Inf."""
    a = np.abs(x)
    hi = np.clip(np.searchsorted(values, a, side="left"), 0, len(values) - 1)
    lo = np.clip(hi - 1, 0, len(values) - 1)
    dlo, dhi = np.abs(a - values[lo]), np.abs(values[hi] - a)
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (codes[hi] % 2 == 0))
    out = np.where(pick_hi, values[hi], values[lo])
    over = (a > overflow) | ((a == overflow) & (codes[-1] % 2 == 1))
    res: np.ndarray = np.where(over, np.copysign(np.inf, x), np.copysign(np.abs(out), x))
    return res


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_round_once_is_nearest_even_by_brute_force(dtype: torch.dtype) -> None:
    bits = 16 if dtype != torch.float8_e4m3fn else 8
    ity = {16: torch.int16, 8: torch.uint8}[bits]
    pos = torch.arange(0, 2 ** (bits - 1), dtype=torch.int32).to(ity).view(dtype).to(torch.float64)
    codes = np.arange(0, 2 ** (bits - 1))
    finite = np.isfinite(pos.numpy())
    values, codes = pos.numpy()[finite], codes[finite]
    vmax = float(values.max())
    ulp_max = vmax - float(values[-2])
    overflow = vmax + ulp_max / 2
    mids = (values[:-1] + values[1:]) / 2
    g = np.random.default_rng(1)
    rnd = np.ldexp(g.uniform(0.5, 1.0, 20000), g.integers(-140 if bits == 16 else -12, 20, 20000))
    xs = np.concatenate([mids, rnd, values, np.nextafter(mids, 0), np.nextafter(mids, np.inf)])
    xs = np.concatenate([xs, -xs, [overflow, np.nextafter(overflow, 0)]])
    # past the overflow midpoint IEEE formats give Inf and e4m3fn (no Inf) NaN; at it, ties-to-even decides
    want = _brute_round(xs[np.abs(xs) <= 1e30], values, codes, overflow)
    got = c.round_once(torch.from_numpy(xs[np.abs(xs) <= 1e30]), dtype).to(torch.float64).numpy()
    if dtype == torch.float8_e4m3fn:
        want = np.where(np.isinf(want), np.nan, want)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all(), xs[np.abs(xs) <= 1e30][~same][:5]
    real = ~np.isnan(got)
    assert np.array_equal(np.signbit(got[real]), np.signbit(want[real]))


def test_ulp_of_and_acc_hand_values() -> None:
    assert c.ulp_of(torch.tensor([1.0, 3.0, 0.0]), BF).tolist() == [2.0**-7, 2.0**-6, 2.0**-133]
    k = c.Contract("bound", n=1, c=2, u_acc=2.0**-24, block=128, u_block=2.0**-14)
    assert k.acc(256) == 128 * 2.0**-14 + 2 * 2.0**-24
    assert c.bound_contract(1, 2).acc(100) == 100 * 2.0**-24
    assert k.label() == "bound(1,2;blk128@2^-14)" and c.bound_contract(1, 2).label() == "bound(1,2)"
    assert c.ulp_contract(1).label() == "ulp(1)" and c.ratio_contract(2).label() == "ratio(2)"


# ----------------------------------------------------------------------------------------------------------
# One deliberately wrong implementation per contract kind; separation is asserted before the verdicts.

def _payload_nans() -> Tensor:
    bits = torch.tensor([0x7FC1, 0x7F81, -0x0041, 0x3F80], dtype=torch.int32).to(torch.int16)
    return bits.view(BF)


def test_sep_bitwise_nan_payload_dropped() -> None:
    x = _payload_nans()
    correct = x.clone()
    wrong = torch.where(torch.isnan(x), torch.full_like(x, math.nan), x)
    assert not torch.equal(correct.view(torch.int16), wrong.view(torch.int16))
    assert c.bitwise(correct, x).passed
    v = c.bitwise(wrong, x)
    assert not v.passed and v.worst["mismatches"] >= 1


def test_sep_bitwise_negative_zero_kept() -> None:
    x = torch.tensor([-0.0, -2.0, 3.0], dtype=BF)
    ref = torch.where(x <= 0, torch.zeros_like(x), x)
    wrong = torch.where(x < 0, torch.zeros_like(x), x)
    assert wrong.view(torch.int16)[0] != ref.view(torch.int16)[0]
    assert c.bitwise(ref.clone(), ref).passed
    assert not c.bitwise(wrong, ref).passed


def _swiglu64(h: Tensor) -> Tensor:
    hd = h.to(torch.float64)
    g, u = hd[..., 0::2], hd[..., 1::2]
    return g / (1 + torch.exp(-g)) * u


def test_sep_ulp_bf16_intermediates() -> None:
    h = (torch.randn(64, 512, generator=torch.Generator().manual_seed(2)) * 3).to(BF)
    ref64 = _swiglu64(h)
    hf = h.float()
    correct = (hf[:, 0::2] * torch.sigmoid(hf[:, 0::2]) * hf[:, 1::2]).to(BF)
    wrong = (torch.sigmoid(h[:, 0::2]) * h[:, 0::2]) * h[:, 1::2]
    assert not torch.equal(correct, wrong)
    assert c.ulp(correct, ref64, 1).passed
    v = c.ulp(wrong, ref64, 1)
    assert not v.passed and v.worst["ulp"] > 1


def _gemm_inputs(k: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(16, k, generator=g).to(BF), torch.randn(24, k, generator=g).to(BF)


def test_sep_bound_bf16_accumulator() -> None:
    x, w = _gemm_inputs(512)
    xd, wd = x.double(), w.double()
    ref64, mag = xd @ wd.T, xd.abs() @ wd.abs().T
    correct = (x.float() @ w.float().T).to(BF)
    wrong = torch.zeros(16, 24, dtype=BF)
    for j in range(512):
        wrong = (wrong + x[:, j : j + 1] * w[:, j]).to(BF)
    assert not torch.equal(correct, wrong)
    contract = c.bound_contract(1, 2)
    radius = c.gemm_radius(contract, mag, 512)
    assert c.bound(correct, ref64, radius, 1).passed
    v = c.bound(wrong, ref64, radius, 1)
    assert not v.passed and v.worst["bound_ratio"] > 1


def _round_bits(x: Tensor, bits: int) -> Tensor:
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 2.0**bits) / 2.0**bits, e)


def test_sep_bound_hopper_fp8_block_precision_needs_its_own_u() -> None:
    g = torch.Generator().manual_seed(4)
    a = torch.randn(8, 256, generator=g, dtype=torch.float64)
    b = torch.randn(256, 8, generator=g, dtype=torch.float64)
    ref64, mag = a @ b, a.abs() @ b.abs()
    acc = torch.zeros(8, 8, dtype=torch.float64)
    for blk in range(0, 256, 128):
        part = torch.zeros(8, 8, dtype=torch.float64)
        for j in range(blk, blk + 128):
            part = _round_bits(part + a[:, j : j + 1] * b[j], 14)
        acc = (acc + part).float().double()
    hopper = acc.float()
    exact = ref64.float()
    assert not torch.equal(hopper, exact)
    sm90 = c.Contract("bound", n=1, c=2, u_acc=c.U_FP32, block=128, u_block=c.U_HOPPER_FP8_BLOCK)
    fp32 = c.bound_contract(1, 2)
    assert c.bound(hopper, ref64, c.gemm_radius(sm90, mag, 256), 1).passed
    assert not c.bound(hopper, ref64, c.gemm_radius(fp32, mag, 256), 1).passed


def test_sep_interval_relu2_epilogue_without_clamp() -> None:
    x, w = _gemm_inputs(64)
    h64, mag = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
    rad = c.gemm_radius(c.bound_contract(1, 2), mag, 64) + c.ulp_of(h64, BF)
    lo, hi = h64 - rad, h64 + rad
    rl, rh = torch.clamp(lo, min=0), torch.clamp(hi, min=0)
    hf = x.float() @ w.float().T
    correct = (torch.clamp(hf, min=0) ** 2).to(BF)
    wrong = (hf * hf).to(BF)
    assert not torch.equal(correct, wrong)
    assert c.interval(correct, rl * rl, rh * rh, 1).passed
    assert not c.interval(wrong, rl * rl, rh * rh, 1).passed


def _attn(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    s = (q @ k.mT) * scale
    s = s.masked_fill(torch.ones(s.shape[-1], s.shape[-1], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v


def test_sep_ratio_attention_scale_off() -> None:
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 32, 16, generator=g).to(BF) for _ in range(3))
    scale = 16**-0.5
    ref64 = _attn(q.double(), k.double(), v.double(), scale)
    low = _attn(q, k, v, scale)
    correct = _attn(q.float(), k.float(), v.float(), scale).to(BF)
    wrong = _attn(q.float(), k.float(), v.float(), scale * 1.05).to(BF)
    assert (wrong.double() - ref64).abs().max() > 2 * (low.double() - ref64).abs().max()
    assert c.ratio(correct, ref64, low, 2.0).passed
    v_ = c.ratio(wrong, ref64, low, 2.0)
    assert not v_.passed and v_.worst["err_ratio"] > 1


def test_sep_conservation_dropped_and_duplicated_rows() -> None:
    good = torch.randperm(40, generator=torch.Generator().manual_seed(6))
    dropped, duplicated = good[:-1], torch.cat([good[:-1], good[:1]])
    assert set(dropped.tolist()) != set(range(40)) and duplicated.numel() == 40
    assert c.conservation(good, 40).passed
    assert not c.conservation(dropped, 40).passed
    assert c.conservation(duplicated, 40).worst["violations"] == 2


def test_sep_permutation_changed_row() -> None:
    a = torch.randn(10, 4, generator=torch.Generator().manual_seed(7))
    b = a[torch.randperm(10, generator=torch.Generator().manual_seed(8))]
    bad = b.clone()
    bad[3, 1] += 1.0
    assert not torch.equal(bad, b)
    assert c.permutation(a, b).passed
    assert not c.permutation(a, bad).passed


def test_sep_determinism_unordered_sum() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(9)) * torch.logspace(-6, 6, 4096)
    g = torch.Generator().manual_seed(10)

    def unordered() -> list[Tensor]:
        acc = torch.zeros((), dtype=torch.float32)
        for v in x[torch.randperm(x.numel(), generator=g)]:
            acc = acc + v
        return [acc]

    first, second = unordered(), unordered()
    assert not torch.equal(first[0], second[0])
    ordered = [x.sum()]
    assert c.determinism(ordered, [x.sum()]).passed
    assert not c.determinism(first, second).passed


def test_bound_nonfinite_must_match_and_merge() -> None:
    ref = torch.tensor([math.inf, math.nan, 1.0], dtype=torch.float64)
    ok = torch.tensor([math.inf, math.nan, 1.0], dtype=BF)
    bad = torch.tensor([-math.inf, 0.0, 1.0], dtype=BF)
    assert c.bound(ok, ref, 0.0, 1).passed
    assert not c.bound(bad, ref, 0.0, 1).passed
    m = c.merge([c.Verdict(True, {"ulp": 1.0}), c.Verdict(False, {"ulp": 3.0}, "x")])
    assert not m.passed and m.worst == {"ulp": 3.0} and m.detail == "x"


def test_ulp_zero_is_bitwise_against_the_once_rounded_reference() -> None:
    """The reference-vs-oracle bitwise check: ulp(n=0) sees -0 vs +0 and NaN payloads; n >= 1 does not."""
    ref64 = torch.tensor([0.0, math.nan, 1.5], dtype=torch.float64)
    right = torch.tensor([0x0000, 0x7FC0, 0x3FC0], dtype=torch.int32).to(torch.int16).view(BF)
    assert c.ulp(right, ref64, 0).passed
    for bits in ([0x8000, 0x7FC0, 0x3FC0], [0x0000, 0xFFC1 - 2**16, 0x3FC0]):
        wrong = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(BF)
        assert c.ulp(wrong, ref64, 1).passed
        v = c.ulp(wrong, ref64, 0)
        assert not v.passed and "differ in bits" in v.detail


def test_adversarial_nans_carry_both_signs() -> None:
    from parity.inputs import generator, quiet_nans

    for dtype, ity, sign in ((BF, torch.int16, 15), (torch.float32, torch.int32, 31)):
        x = quiet_nans(64, dtype, generator(0))
        assert torch.isnan(x).all()
        signs = {int(b) >> sign & 1 for b in x.view(ity).tolist()}
        assert signs == {0, 1}


def test_bitwise_reports_the_widest_ulp_gap_among_the_mismatches() -> None:
    x = torch.linspace(1.0, 2.0, 257, dtype=BF)
    bits = x.view(torch.int16).clone()
    bits[7] += 3
    bits[100] -= 1
    v = c.bitwise(bits.view(BF), x)
    assert not v.passed and v.worst == {"mismatches": 2.0, "ulp": 3.0}
    assert c.bitwise(x[7], x[7].clone()).worst == {"mismatches": 0.0, "ulp": 0.0}
    assert c.bitwise(bits.view(BF)[7], x[7]).worst == {"mismatches": 1.0, "ulp": 3.0}
