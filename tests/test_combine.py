"""Spec tests for combine: fp32 slot-order sum, each product and sum rounded, then scale, then shared.

Oracle: float64 numpy with an explicit cast to fp32 after every op (double rounding 53 -> 24 bits is
innocuous for + and *), final rounding by ml_dtypes. Never the code under test.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nmoe.reference.combine import combine, combine_bwd

F32 = np.float32


def f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).astype(F32).astype(np.float64)


def oracle_fp32(y: Tensor, w: Tensor, s: float, shared: Tensor | None) -> np.ndarray:
    y64, w64 = y.double().numpy(), w.double().numpy()
    acc = f32(w64[:, 0, None] * y64[:, 0])
    for k in range(1, y.shape[1]):
        acc = f32(acc + f32(w64[:, k, None] * y64[:, k]))
    acc = f32(acc * float(F32(s)))
    if shared is not None:
        acc = f32(acc + shared.double().numpy())
    return acc.astype(F32)


def to_out(acc32: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Output bit patterns of the once-rounded result, as the code's dtype would hold them."""
    if dtype == torch.bfloat16:
        return acc32.astype(ml_dtypes.bfloat16).view(np.uint16)
    return acc32.view(np.uint32)


def bits(t: Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.contiguous().numpy().view(np.uint32)


def make(
    t: int, k: int, h: int, dtype: torch.dtype, seed: int, with_shared: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(t, k, h, generator=gen).to(dtype)
    w = torch.rand(t, k, generator=gen)
    w = w / w.sum(dim=1, keepdim=True)
    shared = torch.randn(t, h, generator=gen).to(dtype) if with_shared else None
    return y, w, shared


@settings(max_examples=30, deadline=None)
@given(
    t=st.integers(1, 9),
    k=st.integers(1, 8),
    h=st.integers(1, 40),
    bf16=st.booleans(),
    with_shared=st.booleans(),
    scale=st.sampled_from([1.0, 2.5, 0.3, 16.0, 1.0 / 3.0]),
    seed=st.integers(0, 2**20),
)
def test_combine_bitwise_vs_fp32_oracle(
    t: int, k: int, h: int, bf16: bool, with_shared: bool, scale: float, seed: int
) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    y, w, shared = make(t, k, h, dtype, seed, with_shared)
    out = combine(y, w, scale, shared)
    assert out.dtype == dtype and out.shape == (t, h)
    assert np.array_equal(bits(out), to_out(oracle_fp32(y, w, scale, shared), dtype))


def test_k1_single_token_hand_vector() -> None:
    y = torch.tensor([[[1.5, -2.0, 4.0]]], dtype=torch.bfloat16)
    w = torch.tensor([[0.5]])
    shared = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.bfloat16)
    out = combine(y, w, 2.0, shared)
    assert out.tolist() == [[2.5, -1.0, 3.0]]
    assert combine(y, w, 2.0).tolist() == [[1.5, -2.0, 4.0]]


def combine_t64(y: Tensor, w: Tensor, s: float, shared: Tensor) -> Tensor:
    return s * (w[..., None] * y).sum(dim=1) + shared


class _CombineExplicit(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, y: Tensor, w: Tensor, shared: Tensor) -> Tensor:
        ctx.save_for_backward(y, w)
        return combine(y, w, 1.75, shared)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        y, w = ctx.saved_tensors  # type: ignore[attr-defined]
        return combine_bwd(dout, y, w, 1.75)


def test_gradcheck_float64() -> None:
    gen = torch.Generator().manual_seed(5)
    y = torch.randn(3, 4, 5, dtype=torch.float64, generator=gen).requires_grad_()
    w = torch.rand(3, 4, dtype=torch.float64, generator=gen).requires_grad_()
    sh = torch.randn(3, 5, dtype=torch.float64, generator=gen).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: combine(a, b, 1.75, c), (y, w, sh))
    assert torch.autograd.gradcheck(_CombineExplicit.apply, (y, w, sh))


@settings(max_examples=15, deadline=None)
@given(t=st.integers(1, 6), k=st.integers(1, 6), h=st.integers(1, 12), seed=st.integers(0, 2**20))
def test_explicit_bwd_matches_autograd_of_float64_formula(t: int, k: int, h: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(t, k, h, dtype=torch.float64, generator=gen).requires_grad_()
    w = torch.rand(t, k, dtype=torch.float64, generator=gen).requires_grad_()
    sh = torch.randn(t, h, dtype=torch.float64, generator=gen).requires_grad_()
    dout = torch.randn(t, h, dtype=torch.float64, generator=gen)
    want = torch.autograd.grad(combine_t64(y, w, 2.5, sh), (y, w, sh), dout)
    got = combine_bwd(dout, y.detach(), w.detach(), 2.5)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-13, atol=1e-13)


def test_bwd_bf16_dy_bitwise_and_dw_close() -> None:
    y, w, _ = make(7, 4, 33, torch.bfloat16, 11, False)
    dout = torch.randn(7, 33, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    dy, dw, dsh = combine_bwd(dout, y, w, 0.3)
    g = f32(dout.double().numpy() * float(F32(0.3)))
    want_dy = f32(g[:, None, :] * w.double().numpy()[:, :, None]).astype(F32)
    assert np.array_equal(bits(dy), to_out(want_dy, torch.bfloat16))
    want_dw = (g[:, None, :] * y.double().numpy()).sum(-1)
    assert dw.dtype == torch.float32 and np.allclose(dw.numpy(), want_dw, rtol=1e-5, atol=1e-5)
    assert torch.equal(dsh, dout)


def test_errors() -> None:
    y = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="fp32"):
        combine(y, torch.zeros(2, 3, dtype=torch.bfloat16), 1.0)
    with pytest.raises(ValueError, match=r"\[T,K,H\]"):
        combine(y, torch.zeros(2, 4), 1.0)
    with pytest.raises(ValueError, match="K must be"):
        combine(torch.zeros(2, 0, 4), torch.zeros(2, 0), 1.0)
    with pytest.raises(ValueError, match="shared"):
        combine(y, torch.zeros(2, 3), 1.0, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="dout"):
        combine_bwd(torch.zeros(3, 4), y, torch.zeros(2, 3), 1.0)


# ---- separating inputs: the mutated formula (written here) differs on the data, the code is correct ----


def test_sep_combine_scale_dropped() -> None:
    y, w, sh = make(4, 3, 8, torch.bfloat16, 1, True)
    correct = to_out(oracle_fp32(y, w, 2.5, sh), torch.bfloat16)
    mutant = to_out(oracle_fp32(y, w, 1.0, sh), torch.bfloat16)
    assert not np.array_equal(correct, mutant)
    assert np.array_equal(bits(combine(y, w, 2.5, sh)), correct)


def test_sep_combine_scale_on_shared_too() -> None:
    y, w, sh = make(4, 3, 8, torch.bfloat16, 2, True)
    assert sh is not None
    correct = to_out(oracle_fp32(y, w, 2.5, sh), torch.bfloat16)
    mutant = to_out(f32(oracle_fp32(y, w, 1.0, sh).astype(np.float64) * 2.5).astype(F32), torch.bfloat16)
    assert not np.array_equal(correct, mutant)
    assert np.array_equal(bits(combine(y, w, 2.5, sh)), correct)


def test_sep_combine_scale_folded_into_weights() -> None:
    """fp32 output so the fp32 bits of (sum w*y)*s vs sum (w*s)*y are visible."""
    y, w, _ = make(16, 4, 32, torch.float32, 3, False)
    s = 1.0 / 3.0
    correct = to_out(oracle_fp32(y, w, s, None), torch.float32)
    w_folded = torch.from_numpy(f32(w.double().numpy() * float(F32(s))).astype(F32))
    mutant = to_out(oracle_fp32(y, w_folded, 1.0, None), torch.float32)
    assert not np.array_equal(correct, mutant)
    assert np.array_equal(bits(combine(y, w, s)), correct)


def test_sep_combine_slot_order_reversed() -> None:
    """Hand-derived: (1 + 2^-24) + 2^-24 = 1 in fp32 (tie to even), but 2^-24 + 2^-24 + 1 = 1 + 2^-23."""
    y = torch.tensor([[[1.0], [2.0**-24], [2.0**-24]]])
    w = torch.ones(1, 3)
    correct = np.array([[1.0]], dtype=F32)
    mutant = oracle_fp32(y.flip(1), w, 1.0, None)
    assert mutant.tolist() == [[1.0 + 2.0**-23]]
    assert np.array_equal(oracle_fp32(y, w, 1.0, None), correct)
    assert not np.array_equal(correct, mutant)
    assert np.array_equal(bits(combine(y, w, 1.0)), correct.view(np.uint32))


def test_routed_scale_is_rounded_to_fp32_before_use() -> None:
    """docs/spec-corners.md: moonlet's 2.446 is not an fp32 value; the spec multiplies by fp32(2.446)."""
    s = 2.446
    assert float(F32(s)) != s
    y = torch.tensor([[[1.0 + 2.0**-20]]], dtype=torch.float32)
    w = torch.ones(1, 1)
    want = F32(F32(1.0 + 2.0**-20) * F32(s))
    exact_scale = F32(np.float64(F32(1.0 + 2.0**-20)) * s)
    assert want != exact_scale  # separating: the scale's own rounding shows in the output
    assert bits(combine(y, w, s)).tolist() == [[int(np.array(want, F32).view(np.uint32))]]
