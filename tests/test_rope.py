"""Spec tests of reference/rope.py: hand-derived YaRN frequencies, complex-number rotation oracle."""

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nmoe.reference.rope import apply_rope, apply_rope_bwd, yarn_cos_sin, yarn_inv_freq, yarn_mscale

# DeepSeek-V3 rope settings: rope dim 64, theta 1e4, factor 40, 4096 -> 163840 tokens, betas 32/1.
V3 = {
    "rope_dim": 64,
    "rope_theta": 10000.0,
    "rope_factor": 40.0,
    "original_seq_len": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


def gen(shape: tuple[int, ...], seed: int) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def hand_freq(j: int, dim: int, theta: float, factor: float, low: int, high: int) -> float:
    base = math.pow(theta, -2.0 * j / dim)
    ramp = min(max((j - low) / (high - low), 0.0), 1.0)
    return base * (1.0 - ramp) + base / factor * ramp


def test_v3_correction_range_by_hand() -> None:
    # d(n) = 64 ln(4096 / (2 pi n)) / (2 ln 1e4): d(32) = 10.47 -> floor 10; d(1) = 22.5 -> ceil 23.
    d_fast = 64 * math.log(4096 / (2 * math.pi * 32)) / (2 * math.log(10000.0))
    d_slow = 64 * math.log(4096 / (2 * math.pi * 1)) / (2 * math.log(10000.0))
    assert (math.floor(d_fast), math.ceil(d_slow)) == (10, 23)
    f = yarn_inv_freq(163840, **V3)  # type: ignore[arg-type]
    assert f.dtype == torch.float32 and f.shape == (32,)
    want = np.array([hand_freq(j, 64, 1e4, 40.0, 10, 23) for j in range(32)], dtype=np.float64)
    assert np.array_equal(f.numpy(), want.astype(np.float32))
    assert float(f[3]) == np.float32(1e4 ** (-6 / 64))
    assert float(f[30]) == np.float32(1e4 ** (-60 / 64) / 40)


def test_no_yarn_when_seq_fits_original() -> None:
    f = yarn_inv_freq(4096, **V3)  # type: ignore[arg-type]
    want = np.array([1e4 ** (-2 * j / 64) for j in range(32)]).astype(np.float32)
    assert np.array_equal(f.numpy(), want)
    assert yarn_mscale(40.0, 1.0, 4096, 4096) == 1.0


def test_equal_low_high_uses_tiny_span() -> None:
    # original_seq_len 4 < 2 pi: both correction dims are in (-inf, 0], so low = high = 0 and the ramp
    # jumps from 0 (pair 0 kept) to 1 (pairs >= 1 divided by the factor).
    assert math.ceil(8 * math.log(4 / (2 * math.pi)) / (2 * math.log(1e4))) == 0
    f = yarn_inv_freq(64, 8, 1e4, 4.0, 4, 32.0, 1.0)
    want = np.array([1.0] + [1e4 ** (-2 * j / 8) / 4.0 for j in range(1, 4)]).astype(np.float32)
    assert np.array_equal(f.numpy(), want)


def test_mscale_hand_value() -> None:
    assert yarn_mscale(40.0, 1.0, 163840, 4096) == pytest.approx(1.0 + 0.1 * math.log(40.0), rel=1e-15)
    assert yarn_mscale(1.0, 1.0, 163840, 4096) == 1.0


def test_cos_sin_fp32_angles() -> None:
    cos, sin = yarn_cos_sin(300, **V3)  # type: ignore[arg-type]
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (300, 32)
    freq = yarn_inv_freq(300, **V3).numpy()  # type: ignore[arg-type]
    angle32 = np.arange(300, dtype=np.float32)[:, None] * freq[None, :]
    assert angle32.dtype == np.float32
    assert np.array_equal(cos.numpy(), np.cos(angle32.astype(np.float64)).astype(np.float32))
    assert np.array_equal(sin.numpy(), np.sin(angle32.astype(np.float64)).astype(np.float32))


def complex_oracle(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double())
    rot = torch.complex(cos.double(), sin.double())
    return torch.view_as_real(z * rot).flatten(-2)


@settings(max_examples=10, deadline=None)
@given(s=st.integers(1, 9), half=st.integers(1, 8), heads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_apply_matches_complex_oracle_and_keeps_pair_norms(s: int, half: int, heads: int, seed: int) -> None:
    cos, sin = yarn_cos_sin(s, 2 * half, 500.0, 4.0, 4, 8.0, 1.0)
    x = gen((2, heads, s, 2 * half), seed)
    y = apply_rope(x, cos, sin)
    assert torch.allclose(y, complex_oracle(x, cos, sin), rtol=1e-13, atol=1e-13)
    n_in = x[..., 0::2] ** 2 + x[..., 1::2] ** 2
    n_out = y[..., 0::2] ** 2 + y[..., 1::2] ** 2
    assert torch.allclose(n_in, n_out, rtol=3e-7)  # cos^2 + sin^2 = 1 up to fp32 rounding of the tables
    y32 = apply_rope(x.float(), cos, sin)
    assert y32.dtype == torch.float32
    assert torch.allclose(y32.double(), complex_oracle(x.float(), cos, sin), rtol=1e-6, atol=1e-6)


def test_bf16_rounded_once() -> None:
    cos, sin = yarn_cos_sin(16, 8, 1e4, 1.0, 16, 32.0, 1.0)
    x = gen((3, 16, 8), 1).bfloat16()
    y = apply_rope(x, cos, sin)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, complex_oracle(x, cos, sin).to(torch.bfloat16))


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return apply_rope(x, cos, sin)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return apply_rope_bwd(dy, cos, sin), None, None


def test_gradcheck_fwd_and_explicit_bwd() -> None:
    theta = gen((5, 3), 2)
    cos, sin = torch.cos(theta), torch.sin(theta)
    x = gen((2, 5, 6), 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin), (x,))
    assert torch.autograd.gradcheck(lambda t: _RopeFn.apply(t, cos, sin), (x,))  # type: ignore[no-untyped-call]


def test_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="even"):
        yarn_inv_freq(8, 5, 1e4, 1.0, 8, 32.0, 1.0)
    with pytest.raises(ValueError, match="rope_theta"):
        yarn_inv_freq(8, 4, 1.0, 1.0, 8, 32.0, 1.0)
    with pytest.raises(ValueError, match="rope_factor"):
        yarn_inv_freq(8, 4, 1e4, 0.5, 8, 32.0, 1.0)
    with pytest.raises(ValueError, match="beta_fast"):
        yarn_inv_freq(8, 4, 1e4, 1.0, 8, 1.0, 32.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        yarn_inv_freq(0, 4, 1e4, 1.0, 8, 32.0, 1.0)
    cos, sin = yarn_cos_sin(4, 4, 1e4, 1.0, 8, 32.0, 1.0)
    with pytest.raises(ValueError, match="even"):
        apply_rope(torch.ones(4, 5), cos, sin)
    with pytest.raises(ValueError, match="cos"):
        apply_rope(torch.ones(4, 6), cos, sin)


def test_sep_rope_half_split_layout() -> None:
    s, d = 6, 8
    cos, sin = yarn_cos_sin(s, d, 1e4, 1.0, s, 32.0, 1.0)
    x = gen((s, d), 4)
    c, sn = cos.double(), sin.double()
    correct = torch.empty_like(x)
    correct[:, 0::2] = x[:, 0::2] * c - x[:, 1::2] * sn
    correct[:, 1::2] = x[:, 0::2] * sn + x[:, 1::2] * c
    lo, hi = x[:, : d // 2], x[:, d // 2 :]
    mutated = torch.cat((lo * c - hi * sn, lo * sn + hi * c), dim=-1)
    assert not torch.allclose(correct, mutated, atol=1e-3)
    y = apply_rope(x, cos, sin)
    assert torch.allclose(y, correct, rtol=1e-14, atol=1e-14)


def test_tables_are_built_on_the_host_then_placed() -> None:
    """The fast model asks for its tables on its GPU: the host build is moved, never recomputed there."""
    host = yarn_cos_sin(64, 8, 1e4, 4.0, 16, 32.0, 1.0)
    meta = yarn_cos_sin(64, 8, 1e4, 4.0, 16, 32.0, 1.0, device="meta")
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in host)
    assert all(m.device.type == "meta" and m.shape == h.shape for m, h in zip(meta, host, strict=True))
