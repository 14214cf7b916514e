"""Spec tests of nmoe.reference.formats against independent oracles.

Oracles: ml_dtypes casts, numpy fp32 arithmetic (IEEE, correctly rounded), float64/math, exhaustive
enumeration and hand-derived tables. Nothing here calls the code under test to produce an expected value.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nmoe.reference import formats as F

E4M3 = ml_dtypes.float8_e4m3fn
F32 = np.float32

# Hand-derived e2m1 table: code -> value (bit 3 = sign, then 2 exponent bits (bias 1), 1 mantissa bit).
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# Every tie between neighbours and the code RNE picks (the even code) vs ties-away (larger magnitude).
E2M1_TIES_RNE = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}
E2M1_TIES_AWAY = {0.25: 1, 0.75: 2, 1.25: 3, 1.75: 4, 2.5: 5, 3.5: 6, 5.0: 7}


# ----------------------------------------------------------------------------- oracles


def e4m3_oracle(x: np.ndarray) -> np.ndarray:
    """Spec e4m3 = explicit clamp to ±448, then RNE (ml_dtypes); ml_dtypes alone turns overflow into NaN."""
    x = np.asarray(x, dtype=F32)
    c = np.where(np.isnan(x), x, np.clip(x, -448.0, 448.0)).astype(F32)
    out: np.ndarray = c.astype(E4M3).view(np.uint8)
    return out


def e4m3_value(codes: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.asarray(codes, dtype=np.uint8).view(E4M3).astype(np.float64)
    return out


def e4m3_oracle_f64(v: np.ndarray) -> np.ndarray:
    """e4m3 of exact float64 values: those below 2^-11 are ±0 outright; the rest must be fp32-exact."""
    v = np.asarray(v, dtype=np.float64)
    tiny = np.abs(v) < 2.0**-11
    v32 = np.where(tiny, np.copysign(0.0, v), v).astype(F32)
    finite = np.isfinite(v)
    assert np.array_equal(v32.astype(np.float64)[finite & ~tiny], v[finite & ~tiny])
    return e4m3_oracle(v32)


def e2m1_oracle(v: float) -> int:
    """Nearest table value by brute force, ties to the even code, saturating at 6."""
    a = min(abs(v), 6.0)
    d = [abs(a - t) for t in E2M1_TABLE]
    best = [i for i, di in enumerate(d) if di == min(d)]
    i = best[0] if len(best) == 1 else next(c for c in best if c % 2 == 0)
    return (8 if math.copysign(1.0, v) < 0 else 0) | i


def e2m1_value(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1_TABLE[code & 7]


def ceil_log2(s: float) -> int:
    """ceil(log2 s) for s > 0 via frexp (s = m·2^e, m in [0.5, 1)), cross-checked against math.log2."""
    m, e = math.frexp(s)
    c = e - 1 if m == 0.5 else e
    assert c == math.ceil(math.log2(s))
    return c


def mx_block_oracle(blk: np.ndarray) -> tuple[np.ndarray, int]:
    """Spec MX-FP8 for one block of fp32 values: (codes, scale byte)."""
    v = blk.astype(np.float64)
    if not np.isfinite(v).all():
        return e4m3_oracle_f64(v * 2.0**-128), 255
    amax = float(np.abs(v).max())
    s = F32(amax) / F32(448.0)
    byte = 1 if s == 0 else min(max(127 + ceil_log2(float(s)), 1), 254)
    codes = e4m3_oracle_f64(v * 2.0 ** (127 - byte))
    if amax == 0:
        codes = np.zeros_like(codes)
    return codes, byte


def mx_oracle(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    rows = x.reshape(-1, x.shape[-1])
    codes = np.zeros(rows.shape, np.uint8)
    scales = np.zeros((rows.shape[0], rows.shape[1] // block), np.uint8)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // block):
            sl = slice(b * block, (b + 1) * block)
            codes[r, sl], scales[r, b] = mx_block_oracle(rows[r, sl])
    return codes.reshape(x.shape), scales.reshape(*x.shape[:-1], -1)


def mx_weight_oracle(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n, k = w.shape
    codes = np.zeros(w.shape, np.uint8)
    scales = np.zeros((n // 128, k // 128), np.uint8)
    for i in range(n // 128):
        for j in range(k // 128):
            tile = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            c, b = mx_block_oracle(tile.reshape(-1))
            codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = c.reshape(128, 128)
            scales[i, j] = b
    return codes, scales


def mx_dequant_oracle(codes: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    sc = np.where(scales == 255, np.nan, np.ldexp(1.0, scales.astype(np.int64) - 127))
    out: np.ndarray = e4m3_value(codes) * np.repeat(sc, block, axis=-1)
    return out


def nvfp4_oracle(x: np.ndarray, block: int = 16) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """Spec NVFP4 in numpy fp32 ops, pinned order: g = amax/2688; s = e4m3((amax_b/6)/g); q = x/(s·g)."""
    rows = x.reshape(-1, x.shape[-1]).astype(F32)
    fin = np.isfinite(rows)
    amax_t = F32(np.abs(np.where(fin, rows, 0)).max()) if rows.size else F32(0)
    g = F32(amax_t) / F32(2688.0)
    codes = np.zeros(rows.shape, np.int64)
    sc = np.zeros((rows.shape[0], rows.shape[1] // block), np.uint8)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // block):
            blk = rows[r, b * block:(b + 1) * block]
            if not np.isfinite(blk).all():
                sc[r, b] = 0x7F
                continue
            amax_b = F32(np.abs(blk).max())
            s_real = (amax_b / F32(6.0)) / g if g > 0 else F32(0)
            sc[r, b] = e4m3_oracle(np.array([min(s_real, F32(448.0))], F32))[0]
            denom = F32(e4m3_value(sc[r, b : b + 1])[0]) * g
            if denom == 0:
                continue
            q = np.clip(blk / denom, F32(-6), F32(6))
            codes[r, b * block:(b + 1) * block] = [e2m1_oracle(float(v)) for v in q]
    return codes.reshape(x.shape), sc.reshape(*x.shape[:-1], -1), g


def nvfp4_dequant_oracle(codes: np.ndarray, sc: np.ndarray, g: np.float32, block: int = 16) -> np.ndarray:
    vals = np.vectorize(e2m1_value)(codes) if codes.size else codes.astype(np.float64)
    cs = vals * np.repeat(e4m3_value(sc), block, axis=-1)
    out: np.ndarray = (cs * np.float64(g)).astype(F32)
    return out


def u8(a: npt.ArrayLike) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.uint8))


def t32(a: npt.ArrayLike) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(np.asarray(a, dtype=F32)))


def positive_e4m3_values() -> np.ndarray:
    return e4m3_value(np.arange(0x7F, dtype=np.uint8))  # codes 0..0x7E: every finite non-negative value


def scrambled(rng: np.random.Generator, shape: tuple[int, ...], spread: float = 6.0) -> np.ndarray:
    """Normal values times a per-element log-normal magnitude, in fp32 (overflow to ±Inf allowed)."""
    with np.errstate(over="ignore"):
        return (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape) * spread)).astype(F32)


# ----------------------------------------------------------------------------- bf16


def test_to_bf16_vs_ml_dtypes() -> None:
    rng = np.random.default_rng(0)
    x = scrambled(rng, (20000,), 20.0)
    base = rng.integers(0, 2**16, 2000, dtype=np.uint32) << 16
    ties = (base | 0x8000).view(F32)  # exactly halfway between two bf16 values
    near = np.concatenate([(base | 0x7FFF).view(F32), (base | 0x8001).view(F32)])
    big = np.array([3.3895313e38, 3.3961776e38, 3.4e38, np.inf, -np.inf, 1e-45, -1e-45, 0.0, -0.0], F32)
    x = np.concatenate([x, ties, near, big])
    fin = ~np.isnan(x)
    got = F.to_bf16(t32(x)).view(torch.int16).numpy().view(np.uint16)
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(got[fin], want[fin])
    nan_bits = F.to_bf16(t32([np.nan, -np.nan, np.float32(np.uint32(0x7F800001).view(F32))]))
    assert nan_bits.view(torch.int16).tolist() == [0x7FC0] * 3


def test_to_bf16_rejects_fp64_and_widens_bf16() -> None:
    with pytest.raises(ValueError, match="float32 explicitly"):
        F.to_bf16(torch.zeros(2, dtype=torch.float64))
    b = torch.tensor([1.5, -3.25], dtype=torch.bfloat16)
    assert torch.equal(F.to_bf16(b).view(torch.int16), b.view(torch.int16))


# ----------------------------------------------------------------------------- e4m3


def test_e4m3_all_codes_decode_and_round_trip() -> None:
    codes = np.arange(256, dtype=np.uint8)
    dec = F.e4m3_decode(u8(codes)).numpy()
    want = codes.view(E4M3).astype(F32)
    assert np.array_equal(dec, want, equal_nan=True)
    assert np.isnan(dec).sum() == 2 and np.isnan(dec[[0x7F, 0xFF]]).all()
    assert dec[0x7E] == 448.0 and dec[0x01] == 2.0**-9 and dec[0x08] == 2.0**-6
    assert np.array_equal(F.e4m3_encode(t32(dec)).numpy(), codes)  # NaN codes keep their sign; -0 is 0x80


def test_e4m3_encode_random_vs_ml_dtypes() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([scrambled(rng, (50000,), 5.0), (rng.standard_normal(5000) * 2.0**-8).astype(F32)])
    assert np.array_equal(F.e4m3_encode(t32(x)).numpy(), e4m3_oracle(x))


def test_e4m3_every_tie_goes_to_even() -> None:
    v = positive_e4m3_values()
    mids = (v[:-1] + v[1:]) / 2
    assert np.array_equal(mids.astype(F32).astype(np.float64), mids)  # ties are exact in fp32
    lower = np.arange(len(mids))
    want = np.where(lower % 2 == 0, lower, lower + 1).astype(np.uint8)
    both = np.concatenate([mids, -mids]).astype(F32)
    got = F.e4m3_encode(t32(both)).numpy()
    assert np.array_equal(got, np.concatenate([want, want | 0x80]))
    assert np.array_equal(got, e4m3_oracle(both))


def test_e4m3_extremes_overflow_nan_denormals() -> None:
    x = np.array([448, -448, 449, 464, 465, 480, 1e30, np.inf, -np.inf, -464, np.nan, -np.nan,
                  1e-40, -1e-40, 0.0, -0.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-10 + 2.0**-30,
                  7 * 2.0**-9, 15 * 2.0**-10, 2.0**-6], F32)
    want = [0x7E, 0xFE, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F, 0xFF,
            0x00, 0x80, 0x00, 0x80, 0x01, 0x00, 0x02, 0x01, 0x07, 0x08, 0x08]
    got = F.e4m3_encode(t32(x)).numpy()
    assert got.tolist() == want
    assert np.array_equal(got, e4m3_oracle(x))


# ----------------------------------------------------------------------------- e8m0


def test_e8m0_all_bytes() -> None:
    b = np.arange(256, dtype=np.uint8)
    got = F.e8m0_decode(u8(b)).numpy()
    want = np.array([math.ldexp(1.0, int(i) - 127) for i in range(255)] + [math.nan])
    assert np.array_equal(got.astype(np.float64), want, equal_nan=True)
    assert np.array_equal(got, b.view(ml_dtypes.float8_e8m0fnu).astype(F32), equal_nan=True)


def test_codes_must_be_uint8() -> None:
    for fn in (F.e4m3_decode, F.e8m0_decode, F.e2m1_decode, F.unpack_e2m1, F.pack_e2m1):
        with pytest.raises(ValueError, match="uint8"):
            fn(torch.zeros(2, dtype=torch.int32))


# ----------------------------------------------------------------------------- e2m1


def test_e2m1_all_codes_vs_hand_table() -> None:
    got = F.e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist()
    assert got == [e2m1_value(c) for c in range(16)]
    assert got[8] == 0.0 and math.copysign(1.0, got[8]) < 0
    assert F.e2m1_encode(torch.tensor(got)).tolist() == list(range(16))


def test_e2m1_every_tie_and_saturation() -> None:
    ties = list(E2M1_TIES_RNE)
    x = torch.tensor(ties + [-t for t in ties])
    want = [E2M1_TIES_RNE[t] for t in ties]
    assert F.e2m1_encode(x).tolist() == want + [8 | c for c in want]
    sat = torch.tensor([6.0, 6.5, 7.0, 1e30, float("inf"), -7.0, -float("inf"), 0.2, -0.2, 1e-45])
    assert F.e2m1_encode(sat).tolist() == [7, 7, 7, 7, 7, 15, 15, 0, 8, 0]


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_e2m1_random_vs_brute_force(seed: int) -> None:
    x = scrambled(np.random.default_rng(seed), (64,), 1.5)
    assert F.e2m1_encode(t32(x)).tolist() == [e2m1_oracle(float(v)) for v in x]


def test_e2m1_rejects_nan_and_wide_codes() -> None:
    with pytest.raises(ValueError, match="NaN"):
        F.e2m1_encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="unpack_e2m1"):
        F.e2m1_decode(u8([16]))


def test_pack_unpack_nibble_order_hand_vector() -> None:
    codes = u8([0x1, 0x2, 0x3, 0x4, 0xF, 0x0, 0x0, 0x9])
    packed = F.pack_e2m1(codes)
    assert packed.tolist() == [0x21, 0x43, 0x0F, 0x90]
    assert F.unpack_e2m1(packed).tolist() == codes.tolist()
    assert F.unpack_e2m1(u8([[0xAB], [0x05]])).tolist() == [[0xB, 0xA], [0x5, 0x0]]
    with pytest.raises(ValueError, match="odd"):
        F.pack_e2m1(u8([1, 2, 3]))
    with pytest.raises(ValueError, match="above 15"):
        F.pack_e2m1(u8([1, 16]))


# ----------------------------------------------------------------------------- MX-FP8


def mx_test_input(block: int) -> np.ndarray:
    """Blocks: random magnitudes, exact 448·2^k amax, tiny amax (byte clamps to 1), all-zero with -0."""
    rng = np.random.default_rng(block)
    x = scrambled(rng, (6, 4 * block), 4.0)
    x[1, :block] = (rng.standard_normal(block) * 1e-38).astype(F32)
    x[1, block:2 * block] = 0.0
    x[1, block + 3] = -0.0
    x[2, :block] *= 0.0
    x[2, 0] = 448.0 * 2.0**-3
    x[2, 2 * block:3 * block] = (rng.standard_normal(block) * 1e-44).astype(F32)
    x[3] *= F32(2.0**100)
    return x


@pytest.mark.parametrize("block", [32, 128])
def test_mxfp8_vs_f64_oracle(block: int) -> None:
    x = mx_test_input(block)
    codes, scales = F.quantize_mxfp8(t32(x), block)
    oc, os_ = mx_oracle(x, block)
    assert scales.dtype == torch.uint8 and scales.shape == (6, 4)
    assert np.array_equal(scales.numpy(), os_)
    assert np.array_equal(codes.numpy(), oc)
    assert scales[1, 1] == 1 and (codes[1, block:2 * block] == 0).all()
    assert scales[1, 0] == 1 and scales[2, 2] == 1
    deq = F.dequantize_mxfp8(codes, scales, block).numpy()
    assert np.array_equal(deq.astype(np.float64), mx_dequant_oracle(oc, os_, block))
    xr = x[[0, 3]].reshape(2, 4, block).astype(np.float64)
    err = np.abs(deq[[0, 3]].reshape(2, 4, block) - xr)
    assert (err <= np.abs(xr).max(-1, keepdims=True) / 8).all()  # unclamped blocks: within e4m3's half-ulp


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_mxfp8_nonfinite_block(bad: str) -> None:
    x = mx_test_input(32)[:2]
    x[0, 40] = float(bad)
    x[0, 33] = 3e38
    codes, scales = F.quantize_mxfp8(t32(x), 32)
    oc, os_ = mx_oracle(x, 32)
    assert scales[0, 1] == 255 and np.array_equal(scales.numpy(), os_)
    assert np.array_equal(codes.numpy(), oc)
    deq = F.dequantize_mxfp8(codes, scales, 32)
    assert torch.isnan(deq[0, 32:64]).all() and torch.isfinite(deq[0, :32]).all()


def test_mxfp8_bf16_input_and_leading_dims() -> None:
    x = torch.from_numpy(scrambled(np.random.default_rng(5), (2, 3, 64), 2.0)).to(torch.bfloat16)
    codes, scales = F.quantize_mxfp8(x, 32)
    oc, os_ = mx_oracle(x.float().numpy(), 32)
    assert codes.shape == (2, 3, 64) and scales.shape == (2, 3, 2)
    assert np.array_equal(codes.numpy(), oc) and np.array_equal(scales.numpy(), os_)


def test_mxfp8_weight_128x128_vs_f64_oracle() -> None:
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((2, 256, 384)) * 0.02).astype(F32)
    w[0, :128, 128:256] *= 0.0
    w[1, 128:, :128] *= F32(1e5)
    w[1, 0, 300] = np.nan
    codes, scales = F.quantize_mxfp8_weight(t32(w))
    assert scales.shape == (2, 2, 3)
    for e in range(2):
        oc, os_ = mx_weight_oracle(w[e])
        assert np.array_equal(scales[e].numpy(), os_)
        assert np.array_equal(codes[e].numpy(), oc)
    assert scales[0, 0, 1] == 1 and scales[1, 0, 2] == 255
    deq = F.dequantize_mxfp8_weight(codes, scales).numpy()
    sc = np.where(scales.numpy() == 255, np.nan, np.ldexp(1.0, scales.numpy().astype(np.int64) - 127))
    want = e4m3_value(codes.numpy()) * np.repeat(np.repeat(sc, 128, axis=-1), 128, axis=-2)
    assert np.array_equal(deq.astype(np.float64), want, equal_nan=True)


def test_mxfp8_shape_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="multiple of the block 32"):
        F.quantize_mxfp8(torch.zeros(2, 48), 32)
    with pytest.raises(ValueError, match="use 32"):
        F.quantize_mxfp8(torch.zeros(2, 64), 16)
    with pytest.raises(ValueError, match="scales"):
        F.dequantize_mxfp8(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="multiple of the block 128"):
        F.quantize_mxfp8_weight(torch.zeros(128, 100))
    with pytest.raises(ValueError, match=r"\[\.\.\., N, K\]"):
        F.quantize_mxfp8_weight(torch.zeros(128))
    with pytest.raises(ValueError, match="scales"):
        F.dequantize_mxfp8_weight(u8(np.zeros((128, 128))), u8(np.zeros((2, 1))))
    with pytest.raises(ValueError, match="float32 explicitly"):
        F.quantize_mxfp8(torch.zeros(2, 32, dtype=torch.float64), 32)


# ----------------------------------------------------------------------------- NVFP4


def check_nvfp4(x: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    packed, bs, g = F.quantize_nvfp4(t32(x))
    oc, osc, og = nvfp4_oracle(x)
    assert g.dtype == torch.float32 and g.dim() == 0
    assert np.array_equal(np.array([g.item()], F32).view(np.uint32), np.array([og], F32).view(np.uint32))
    assert np.array_equal(bs.numpy(), osc)
    assert np.array_equal(F.unpack_e2m1(packed).numpy(), oc)
    deq = F.dequantize_nvfp4(packed, bs, g).numpy()
    want = nvfp4_dequant_oracle(oc, osc, og)
    assert np.array_equal(deq, want, equal_nan=True)
    return packed, bs, g


def test_nvfp4_vs_oracle() -> None:
    rng = np.random.default_rng(11)
    x = scrambled(rng, (5, 96), 1.5)
    x[0, 16:32] = 0.0
    x[1, :16] *= F32(1e-3)
    x[2, 32:48] = (rng.standard_normal(16) * 1e-9).astype(F32)  # block scale underflows to 0 -> codes 0
    packed, bs, _ = check_nvfp4(x)
    assert packed.shape == (5, 48) and bs.shape == (5, 6)
    assert bs[0, 1] == 0 and (F.unpack_e2m1(packed)[0, 16:32] == 0).all()
    assert bs[2, 2] == 0


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.sampled_from([16, 32, 64]))
def test_nvfp4_random_shapes(seed: int, rows: int, k: int) -> None:
    check_nvfp4(scrambled(np.random.default_rng(seed), (rows, k), 2.0))


def test_nvfp4_all_zero_and_nonfinite() -> None:
    packed, bs, g = check_nvfp4(np.zeros((2, 32), F32))
    assert g.item() == 0 and (bs == 0).all() and (packed == 0).all()
    x = scrambled(np.random.default_rng(3), (2, 32), 1.0)
    x[1, 20], x[0, 3] = np.inf, np.nan
    packed, bs, g = check_nvfp4(x)
    assert bs.tolist() == [[0x7F, bs[0, 1].item()], [bs[1, 0].item(), 0x7F]]
    deq = F.dequantize_nvfp4(packed, bs, g)
    assert torch.isnan(deq[0, :16]).all() and torch.isnan(deq[1, 16:]).all()
    assert torch.isfinite(deq[0, 16:]).all()
    assert F.quantize_nvfp4(torch.zeros(0, 16))[2].item() == 0


def test_nvfp4_tensor_max_over_finite_values_only() -> None:
    """docs/spec-corners.md: g = 2688/2688 = 1 from the finite maximum; the Inf block is flagged, the
    others keep their scales (an Inf maximum would make g = Inf and every code 0)."""
    x = np.zeros((1, 32), F32)
    x[0, 0], x[0, 16], x[0, 17] = 2688.0, np.inf, 1.0
    packed, bs, g = check_nvfp4(x)
    assert g.item() == 1.0 and bs[0, 1] == 0x7F and bs[0, 0] == 0x7E
    assert (F.unpack_e2m1(packed)[0, 16:] == 0).all()


def test_nvfp4_subnormal_tensor_scale_and_zero_block_scale() -> None:
    """A tensor near fp32's subnormal floor: g is subnormal, a block 2^-20 below the maximum gets s_b = 0
    (its codes +0: the spec never divides by s_b*g = 0), the largest block keeps codes."""
    x = np.zeros((1, 32), F32)
    x[0, :16] = F32(2.0**-131)
    x[0, 16:] = F32(-(2.0**-148))
    packed, bs, g = check_nvfp4(x)
    assert 0 < g.item() < 2.0**-126
    assert bs[0, 1] == 0 and (F.unpack_e2m1(packed)[0, 16:] == 0).all()
    assert (F.unpack_e2m1(packed)[0, :16] == 7).all()


def test_nvfp4_errors() -> None:
    with pytest.raises(ValueError, match="multiple of the block 16"):
        F.quantize_nvfp4(torch.zeros(2, 24))
    packed, bs, g = F.quantize_nvfp4(torch.ones(2, 32))
    with pytest.raises(ValueError, match="block_scales"):
        F.dequantize_nvfp4(packed, bs[:, :1], g)
    with pytest.raises(ValueError, match="0-dim fp32"):
        F.dequantize_nvfp4(packed, bs, g.reshape(1))


def fp32_bits(v: np.float32) -> int:
    return int(np.array([v], F32).view(np.uint32)[0])


def test_nvfp4_op_order_tensor_scale() -> None:
    """g = amax/2688 in one division; amax/448/6 and amax*(1/2688) differ on these amax values."""
    amaxes = [F32(1 + i * 2.0**-23) * F32(3.7) for i in range(200)]
    sep = [a for a in amaxes if fp32_bits(a / F32(2688)) != fp32_bits(a / F32(448) / F32(6))]
    sep = [a for a in sep if fp32_bits(a / F32(2688)) != fp32_bits(a * (F32(1) / F32(2688)))] or sep
    assert sep, "no separating amax found"
    for a in sep[:5]:
        x = np.zeros((1, 16), F32)
        x[0, 5] = -a
        g = F.quantize_nvfp4(t32(x))[2]
        assert fp32_bits(F32(g.item())) == fp32_bits(a / F32(2688))


def fp32_neighbourhood(c: np.float32, radius: int) -> np.ndarray:
    """The fp32 values within `radius` ulps of positive c."""
    bits = np.array([c], F32).view(np.int32).astype(np.int64) + np.arange(-radius, radius + 1)
    return bits.astype(np.int32).view(F32)


def test_nvfp4_op_order_block_scale() -> None:
    """s_b = e4m3((amax_b/6)/g); a/(6g) lands on the other side of an e4m3 tie for the amax found here."""
    v = positive_e4m3_values()
    mids = (v[56:126] + v[57:127]) / 2
    amax_t = F32(1000.0)
    g = amax_t / F32(2688)
    found = []
    for m in mids:
        a = fp32_neighbourhood(F32(m * 6.0 * float(g)), 40)
        a = a[a < amax_t]
        pinned, other = e4m3_oracle((a / F32(6)) / g), e4m3_oracle(a / (F32(6) * g))
        found += [(ai, p) for ai, p, o in zip(a, pinned, other, strict=True) if p != o][:1]
    assert len(found) >= 3, "too few separating block amaxes found"
    x = np.zeros((len(found) + 1, 16), F32)
    x[0, 0] = amax_t
    for i, (a, _) in enumerate(found):
        x[i + 1, 3] = -a
    bs = F.quantize_nvfp4(t32(x))[1]
    assert bs[1:, 0].tolist() == [int(p) for _, p in found]


def test_nvfp4_op_order_codes() -> None:
    """codes = e2m1(x/(s_b·g)); (x/s_b)/g lands on the other side of an e2m1 tie for the x found here."""
    amax_t = F32(1000.0)
    g = amax_t / F32(2688)
    top = F32(39.0) * g
    s = e4m3_oracle(np.array([(top / F32(6)) / g]))[0]
    sv = F32(e4m3_value(np.array([s]))[0])
    assert sv == 6.5  # not a power of two, so the two orders round differently
    found = []
    for tie in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        xs = fp32_neighbourhood(F32(tie) * (sv * g), 30)
        for xv in xs:
            pinned, other = e2m1_oracle(float(xv / (sv * g))), e2m1_oracle(float((xv / sv) / g))
            if pinned != other:
                found.append((xv, pinned))
                break
    assert len(found) >= 3, "too few separating elements found"
    x = np.zeros((1, 32), F32)
    x[0, 0], x[0, 16] = amax_t, top
    for j, (xv, _) in enumerate(found):
        x[0, 17 + j] = xv
    packed, bs, _ = F.quantize_nvfp4(t32(x))
    assert bs[0, 1].item() == s
    codes = F.unpack_e2m1(packed)
    assert [codes[0, 17 + j].item() for j in range(len(found))] == [p for _, p in found]


# ----------------------------------------------------------------------------- separating inputs


def test_sep_mxfp8_scale_floor_not_ceil() -> None:
    x = np.full((1, 32), 0.5, F32)
    x[0, 7] = 448.0 * 1.5
    s = float(F32(x.max()) / F32(448))
    correct, mutated = 127 + math.ceil(math.log2(s)), 127 + math.floor(math.log2(s))
    assert correct != mutated
    codes, scales = F.quantize_mxfp8(t32(x), 32)
    assert scales.item() == correct == 128
    assert np.array_equal(codes.numpy(), e4m3_oracle_f64(x.astype(np.float64) * 2.0 ** (127 - correct)))


def test_sep_mxfp8_no_clamp() -> None:
    """Both clamps: scale byte to [1, 254] (all-zero block) and codes to ±448 (Inf in a NaN-scaled block)."""
    x = np.zeros((1, 64), F32)
    x[0, 40], x[0, 41] = np.inf, 1.0
    s0 = np.float32(0.0).view(np.uint32)
    unclamped_byte = int(s0 >> 23) + int((s0 & 0x7FFFFF) != 0)
    assert unclamped_byte != min(max(unclamped_byte, 1), 254) == 1
    raw = np.array([np.inf], F32).astype(E4M3).view(np.uint8)[0]
    assert raw != e4m3_oracle(np.array([np.inf]))[0] == 0x7E
    codes, scales = F.quantize_mxfp8(t32(x), 32)
    assert scales.tolist() == [[1, 255]]
    assert codes[0, 40].item() == 0x7E and codes[0, 41].item() == 0 and (codes[0, :32] == 0).all()


def nvfp4_dequant_f64(x: np.ndarray, block: int) -> np.ndarray:
    """Written-out NVFP4 (finite data) with a configurable block, dequantized; op order as pinned."""
    g = F32(np.abs(x).max()) / F32(2688)
    out = np.zeros(x.shape)
    for b in range(x.shape[-1] // block):
        blk = x[..., b * block:(b + 1) * block]
        s = e4m3_oracle(np.array([(F32(np.abs(blk).max()) / F32(6)) / g]))[0]
        sv = F32(e4m3_value(np.array([s]))[0])
        for i, v in enumerate(blk.reshape(-1)):
            q = float(np.clip(v / (sv * g), -6, 6))
            out.reshape(-1)[b * block + i] = e2m1_value(e2m1_oracle(q)) * sv * g
    return out


def test_sep_nvfp4_block_32_not_16() -> None:
    x = np.concatenate([np.linspace(-0.1, 0.1, 16), np.linspace(-5, 5, 16)]).astype(F32)
    correct, mutated = nvfp4_dequant_f64(x, 16), nvfp4_dequant_f64(x, 32)
    assert not np.array_equal(correct, mutated)
    packed, bs, g = F.quantize_nvfp4(t32(x))
    assert bs.shape == (2,)
    assert np.allclose(F.dequantize_nvfp4(packed, bs, g).numpy(), correct, rtol=2.0**-22, atol=0)


def test_sep_nvfp4_scale_round_up() -> None:
    x = np.zeros(16, F32)
    x[0], x[1], x[2] = 2688.0, 6.3 * 0.99, 2.3
    x = np.concatenate([x, np.array([6.3] + [0.7] * 15, F32)])
    s_real = (F32(6.3) / F32(6)) / (F32(2688) / F32(2688))
    lo, hi = positive_e4m3_values()[0x38], positive_e4m3_values()[0x39]
    assert lo < s_real < hi
    correct = e4m3_oracle(np.array([s_real]))[0]
    mutated = np.uint8(0x39)  # the next e4m3 code above s_real
    assert correct != mutated and correct == 0x38
    packed, bs, _ = F.quantize_nvfp4(t32(x))
    assert bs[1].item() == correct
    codes = F.unpack_e2m1(packed)[16:].tolist()
    assert codes == [e2m1_oracle(float(v / F32(1.0))) for v in x[16:]]


def test_sep_e2m1_ties_away() -> None:
    ties = [0.25, 1.25, 2.5, 5.0, -0.25, -2.5]
    correct = [E2M1_TIES_RNE[abs(t)] | (8 if t < 0 else 0) for t in ties]
    mutated = [E2M1_TIES_AWAY[abs(t)] | (8 if t < 0 else 0) for t in ties]
    assert all(c != m for c, m in zip(correct, mutated, strict=True))
    assert F.e2m1_encode(torch.tensor(ties)).tolist() == correct


def test_sep_e4m3_ties_away() -> None:
    v = positive_e4m3_values()
    lower = np.arange(0, 126, 2)  # even lower neighbour: RNE rounds down, ties-away rounds up
    mids = ((v[lower] + v[lower + 1]) / 2).astype(F32)
    correct, mutated = lower.astype(np.uint8), (lower + 1).astype(np.uint8)
    assert (correct != mutated).all()
    assert np.array_equal(F.e4m3_encode(t32(mids)).numpy(), correct)
    assert np.array_equal(F.e4m3_encode(t32(-mids)).numpy(), correct | 0x80)


def test_round_to_pins_canonical_nan_and_refuses_unknown_dtypes() -> None:
    x = torch.tensor([1.0, float("nan"), -float("nan")], dtype=torch.float32)
    assert F.round_to(x, torch.bfloat16).view(torch.int16).tolist()[1:] == [0x7FC0, 0x7FC0]
    assert F.round_to(x, torch.float32).view(torch.int32).tolist()[1:] == [0x7FC00000, 0x7FC00000]
    assert F.round_to(x.double(), torch.float64).dtype == torch.float64
    with pytest.raises(ValueError, match="not in the spec"):
        F.round_to(x, torch.float16)


def test_sep_e4m3_nan_sign_dropped() -> None:
    x = np.array([-np.nan, np.nan], F32)
    keeps = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert keeps.tolist() == [0xFF, 0x7F] and keeps[0] != 0x7F  # separating: the sign bit is the defect
    assert F.e4m3_encode(t32(x)).numpy().tolist() == [0xFF, 0x7F]


def test_sep_nvfp4_amax_includes_nonfinite() -> None:
    x = np.zeros((1, 32), F32)
    x[0, 0], x[0, 16] = 2688.0, np.inf
    finite_only, with_inf = 2688.0 / 2688.0, np.inf / 2688.0
    assert finite_only != with_inf
    assert F.quantize_nvfp4(t32(x))[2].item() == finite_only
