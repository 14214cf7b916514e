"""Spec tests of reference/optim.py: float64 hand loops, torch.optim.AdamW, SVD oracle for Newton-Schulz."""

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from bf16_oracle import bf16_nearest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nmoe.reference.optim import (
    TrainProgress,
    adamw_step,
    muon_scale,
    muon_step,
    newton_schulz5,
    wsd_factor,
    wsd_lr,
)

ABC = (3.4445, -4.7750, 2.0315)


def gen(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


# ---------------------------------------------------------------- AdamW

HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def adamw_hand(
    p: Tensor,
    grads: list[Tensor],
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    wd: float,
    decoupled: bool = True,
    bias_correction: bool = True,
) -> Tensor:
    p, m, v = p.clone(), torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p = p - lr * wd * p
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        c1, c2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
        p = p - lr * (m / c1) / (torch.sqrt(v / c2) + eps)
    return p


def run_adamw(p0: Tensor, grads: list[Tensor], dtype: torch.dtype = torch.float64) -> Tensor:
    p = p0.to(dtype).clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        assert adamw_step(p, g, m, v, t, **HP) is None  # type: ignore[func-returns-value]
    return p


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 40), steps=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_adamw_matches_float64_hand_loop(n: int, steps: int, seed: int) -> None:
    p0 = gen((n,), seed)
    grads = [gen((n,), seed + 1 + k) for k in range(steps)]
    want = adamw_hand(p0, grads, 1e-2, 0.9, 0.95, 1e-8, 0.1)
    assert torch.allclose(run_adamw(p0, grads), want, rtol=1e-13, atol=1e-15)
    got32 = run_adamw(p0, [g.bfloat16() for g in grads], torch.float32)
    want_bf16_grads = adamw_hand(p0, [g.bfloat16().double() for g in grads], 1e-2, 0.9, 0.95, 1e-8, 0.1)
    assert torch.allclose(got32.double(), want_bf16_grads, rtol=1e-6, atol=1e-6)


def test_adamw_matches_torch_optim() -> None:
    p0 = gen((5, 7), 1)
    grads = [gen((5, 7), 2 + k) for k in range(5)]
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for g in grads:
        ref.grad = g.clone()
        opt.step()
    assert torch.allclose(run_adamw(p0, grads), ref.detach(), rtol=1e-12, atol=1e-14)


def test_adamw_errors() -> None:
    p = torch.zeros(3)
    with pytest.raises(ValueError, match="fp32 master"):
        adamw_step(p.bfloat16(), p, p.bfloat16(), p.bfloat16(), 1, **HP)
    with pytest.raises(ValueError, match="state"):
        adamw_step(p, p, torch.zeros(4), p.clone(), 1, **HP)
    with pytest.raises(ValueError, match="grad shape"):
        adamw_step(p, torch.zeros(4), p.clone(), p.clone(), 1, **HP)
    with pytest.raises(ValueError, match="step=0"):
        adamw_step(p, p.clone(), p.clone(), p.clone(), 0, **HP)


def test_sep_adamw_coupled_weight_decay() -> None:
    p0 = gen((6,), 3, 5.0)
    grads = [gen((6,), 4 + k, 0.1) for k in range(4)]
    correct = adamw_hand(p0, grads, 1e-2, 0.9, 0.95, 1e-8, 0.1)
    mutated = adamw_hand(p0, grads, 1e-2, 0.9, 0.95, 1e-8, 0.1, decoupled=False)
    assert not torch.allclose(correct, mutated, rtol=1e-4)
    assert torch.allclose(run_adamw(p0, grads), correct, rtol=1e-13, atol=1e-15)


def test_sep_adamw_no_bias_correction() -> None:
    p0 = gen((6,), 5)
    grads = [gen((6,), 6 + k) for k in range(3)]
    correct = adamw_hand(p0, grads, 1e-2, 0.9, 0.95, 1e-8, 0.1)
    mutated = adamw_hand(p0, grads, 1e-2, 0.9, 0.95, 1e-8, 0.1, bias_correction=False)
    assert not torch.allclose(correct, mutated, rtol=1e-4)
    assert torch.allclose(run_adamw(p0, grads), correct, rtol=1e-13, atol=1e-15)


def test_sep_adamw_grad_scale_ignored() -> None:
    """The clip factor folded into the step: fp64 and fp32 steps with grad_scale = s_t follow the fp64 hand
    loop on s_t * g_t. Adam is blind to one factor over all steps, so it changes per step here (as a clip
    factor does), which moves the result away from the unscaled loop; a bad factor is refused."""
    p0 = gen((9,), 7)
    grads = [gen((9,), 8 + k) for k in range(3)]
    scales = [0.125, 1.0, 0.5]
    want = adamw_hand(p0, [s * g for s, g in zip(scales, grads, strict=True)], 1e-2, 0.9, 0.95, 1e-8, 0.1)
    assert not torch.allclose(want, adamw_hand(p0, grads, 1e-2, 0.9, 0.95, 1e-8, 0.1), rtol=1e-4)
    for dtype in (torch.float64, torch.float32):
        p, m, v = p0.clone().to(dtype), torch.zeros(9, dtype=dtype), torch.zeros(9, dtype=dtype)
        for t, (s, g) in enumerate(zip(scales, grads, strict=True), start=1):
            adamw_step(p, g.to(dtype), m, v, t, **HP, grad_scale=torch.tensor(s))
        assert torch.allclose(p.double(), want, rtol=1e-6 if dtype == torch.float32 else 1e-13, atol=1e-15)
    with pytest.raises(ValueError, match="0-dim fp32"):
        adamw_step(p0.clone(), grads[0], torch.zeros_like(p0), torch.zeros_like(p0), 1, **HP,
                   grad_scale=torch.ones(1))


def test_adamw_and_muon_round_the_new_master_into_p_low() -> None:
    """p_low (a bf16 param over an fp32 master) holds the stepped master rounded to nearest even, checked
    against ml_dtypes' rounding; the step moves the master far enough that the old one rounds elsewhere."""
    p = gen((4, 6), 11).float()
    g = gen((4, 6), 12).bfloat16()
    for step in (adamw_step, muon_step):
        w, low = p.clone(), torch.zeros(4, 6, dtype=torch.bfloat16)
        if step is adamw_step:
            step(w, g, torch.zeros(4, 6), torch.zeros(4, 6), 1, **HP, p_low=low)
        else:
            step(w, g, torch.zeros(4, 6), 0.02, 0.95, 0.0, p_low=low)
        want = torch.from_numpy(w.numpy().astype(ml_dtypes.bfloat16).view(np.int16))
        assert not torch.equal(want, p.bfloat16().view(torch.int16)), "the step changes the rounded param"
        assert torch.equal(low.view(torch.int16), want), step.__name__


def adamw_bf16_moments_oracle(p0: Tensor, grads: list[Tensor], rounded_update: bool = False) -> tuple[
        np.ndarray, np.ndarray, np.ndarray]:
    """float64 AdamW whose m, v live in bf16 (ml_dtypes rounding, to nearest even) between steps; p moves by
    the float64 moments of the step (or, the defect, by their bf16 roundings)."""
    hp = HP
    p, m, v = p0.numpy().copy(), np.zeros(p0.shape), np.zeros(p0.shape)
    for t, g in enumerate(grads, start=1):
        gn = g.numpy()
        p = p * (1 - hp["lr"] * hp["weight_decay"])
        m1 = hp["beta1"] * m + (1 - hp["beta1"]) * gn
        v1 = hp["beta2"] * v + (1 - hp["beta2"]) * gn * gn
        m, v = bf16_nearest(m1), bf16_nearest(v1)
        mu, vu = (m, v) if rounded_update else (m1, v1)
        p = p - hp["lr"] * (mu / (1 - hp["beta1"] ** t)) / (np.sqrt(vu / (1 - hp["beta2"] ** t)) + hp["eps"])
    return p, m, v


def _run_bf16_moments(p0: Tensor, grads: list[Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    p = p0.to(dtype).clone()
    m, v = torch.zeros_like(p, dtype=torch.bfloat16), torch.zeros_like(p, dtype=torch.bfloat16)
    for t, g in enumerate(grads, start=1):
        adamw_step(p, g.to(dtype), m, v, t, **HP)
    return p, m, v


def test_adamw_bf16_moments_match_the_float64_oracle() -> None:
    """fp64 master: p to 1e-13, the stored moments bit for bit; fp32 master: p to fp32 rounding, the
    moments within one bf16 ulp (their fp32 sums may round across a bf16 tie)."""
    p0 = gen((64,), 31)
    grads = [gen((64,), 32 + k, 0.1) for k in range(5)]
    want_p, want_m, want_v = adamw_bf16_moments_oracle(p0, grads)
    p, m, v = _run_bf16_moments(p0, grads, torch.float64)
    assert m.dtype == v.dtype == torch.bfloat16
    assert np.allclose(p.numpy(), want_p, rtol=1e-13, atol=1e-15)
    assert np.array_equal(m.double().numpy(), want_m) and np.array_equal(v.double().numpy(), want_v)
    p, m, v = _run_bf16_moments(p0, grads, torch.float32)
    assert np.allclose(p.double().numpy(), want_p, rtol=1e-5, atol=1e-8)
    for got, want in ((m, want_m), (v, want_v)):
        assert np.allclose(got.double().numpy(), want, rtol=2.0**-8, atol=0.0)


def test_adamw_moments_refuse_a_third_dtype_and_mixed_pairs() -> None:
    p = gen((4,), 1)
    with pytest.raises(ValueError, match="or be bf16"):
        adamw_step(p, p.clone(), p.half(), p.half(), 1, **HP)
    with pytest.raises(ValueError, match="share one dtype"):
        adamw_step(p, p.clone(), p.bfloat16(), p.clone(), 1, **HP)


def test_sep_adamw_bf16_moments_rounded_update() -> None:
    p0 = gen((64,), 33)
    grads = [gen((64,), 34 + k, 0.1) for k in range(4)]
    correct = adamw_bf16_moments_oracle(p0, grads)[0]
    mutated = adamw_bf16_moments_oracle(p0, grads, rounded_update=True)[0]
    assert not np.allclose(correct, mutated, rtol=1e-9, atol=0.0)
    got = _run_bf16_moments(p0, grads, torch.float64)[0].numpy()
    assert np.allclose(got, correct, rtol=1e-13, atol=1e-15)


# ---------------------------------------------------------------- Newton-Schulz / Muon


def ns_oracle(g: Tensor, abc: tuple[float, float, float] = ABC, steps: int = 5) -> Tensor:
    """NS acts on singular values only: U p^steps(sigma / (||G||_F + 1e-7)) V^T, in float64."""
    a, b, c = abc
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    fro = torch.sqrt((s * s).sum(-1, keepdim=True))
    x = s / (fro + 1e-7)
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    out: Tensor = u @ torch.diag_embed(x) @ vh
    return out


@pytest.mark.parametrize("shape", [(16, 24), (24, 16), (3, 8, 12), (12, 12)])
def test_ns5_matches_singular_value_oracle(shape: tuple[int, ...]) -> None:
    g = gen(shape, sum(shape))
    out = newton_schulz5(g.float())
    assert out.dtype == torch.float32 and out.shape == g.shape
    assert torch.allclose(out.double(), ns_oracle(g), atol=2e-5)
    assert torch.allclose(newton_schulz5(g), ns_oracle(g), atol=1e-10)


def test_ns5_singular_values_in_known_band() -> None:
    # The quintic maps every normalised singular value in [0.01, 1] into [0.6818, 1.1344] after 5 steps
    # (scalar iteration over a fine grid); a 32x64 Gaussian has normalised sigma_min ~ 0.05.
    g = gen((32, 64), 9)
    s = torch.linalg.svdvals(g)
    assert float(s.min() / torch.linalg.matrix_norm(g)) > 0.01
    sv = torch.linalg.svdvals(newton_schulz5(g.float()).double())
    assert float(sv.min()) >= 0.68 and float(sv.max()) <= 1.135


def test_ns5_errors() -> None:
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz5(torch.zeros(4))
    with pytest.raises(ValueError, match="steps"):
        newton_schulz5(torch.zeros(4, 4), steps=0)


def test_sep_muon_ns_coeffs_swapped() -> None:
    g = gen((12, 20), 10)
    correct = ns_oracle(g)
    for perm in itertools.permutations(ABC):
        if perm != ABC:
            assert not torch.allclose(correct, ns_oracle(g, (perm[0], perm[1], perm[2])), atol=1e-2)
    assert torch.allclose(newton_schulz5(g), correct, atol=1e-10)


def muon_hand(p: Tensor, grads: list[Tensor], lr: float, mu: float, wd: float, nesterov: bool) -> Tensor:
    p, buf = p.clone(), torch.zeros_like(p)
    rows, cols = p.shape[-2:]
    for g in grads:
        buf = mu * buf + g
        u = g + mu * buf if nesterov else buf
        p = p * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(rows, cols)) * ns_oracle(u)
    return p


@pytest.mark.parametrize(("shape", "nesterov"), [((8, 20), True), ((20, 8), False), ((2, 6, 10), True)])
def test_muon_matches_float64_hand_loop(shape: tuple[int, ...], nesterov: bool) -> None:
    p0 = gen(shape, 11)
    grads = [gen(shape, 12 + k) for k in range(3)]
    p, buf = p0.clone(), torch.zeros_like(p0)
    for g in grads:
        muon_step(p, g, buf, lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=nesterov)
    assert torch.allclose(p, muon_hand(p0, grads, 0.02, 0.95, 0.1, nesterov), atol=1e-10)


def test_muon_folds_a_per_step_clip_factor() -> None:
    """Muon with grad_scale = s_t follows the fp64 hand loop on s_t * g_t; the factors change per step, which
    moves the result away from the unscaled loop (Newton-Schulz normalises one factor away)."""
    p0 = gen((8, 20), 21)
    grads = [gen((8, 20), 22 + k) for k in range(3)]
    scales = [0.125, 1.0, 0.5]
    want = muon_hand(p0, [s * g for s, g in zip(scales, grads, strict=True)], 0.02, 0.95, 0.1, True)
    assert not torch.allclose(want, muon_hand(p0, grads, 0.02, 0.95, 0.1, True), atol=1e-6)
    p, buf = p0.clone(), torch.zeros_like(p0)
    for s, g in zip(scales, grads, strict=True):
        muon_step(p, g, buf, lr=0.02, momentum=0.95, weight_decay=0.1, grad_scale=torch.tensor(s))
    assert torch.allclose(p, want, atol=1e-10)


def test_muon_scale_hand_values() -> None:
    assert muon_scale((16, 64)) == pytest.approx(1.6, rel=1e-15)
    assert muon_scale((8, 100, 25)) == pytest.approx(2.0, rel=1e-15)


def test_muon_errors() -> None:
    with pytest.raises(ValueError, match="adamw_step"):
        muon_step(torch.zeros(4), torch.zeros(4), torch.zeros(4), 0.02, 0.95, 0.0)
    with pytest.raises(ValueError, match="grad shape"):
        muon_step(torch.zeros(4, 4), torch.zeros(4, 5), torch.zeros(4, 4), 0.02, 0.95, 0.0)
    with pytest.raises(ValueError, match="state"):
        muon_step(torch.zeros(4, 4), torch.zeros(4, 4), torch.zeros(4, 4).double(), 0.02, 0.95, 0.0)


# ---------------------------------------------------------------- WSD by tokens

WSD = {"warmup_tokens": 100, "total_tokens": 1000, "decay_fraction": 0.2, "min_lr_ratio": 0.1}


@pytest.mark.parametrize(
    ("tokens", "want"),
    # warmup 0..100 linear; stable to 800; decay 800..1000 linear 1 -> 0.1; held at 0.1 past the end.
    [
        (0, 0.0),
        (25, 0.25),
        (100, 1.0),
        (500, 1.0),
        (800, 1.0),
        (850, 0.775),
        (900, 0.55),
        (1000, 0.1),
        (1500, 0.1),
    ],
)
def test_wsd_hand_points(tokens: int, want: float) -> None:
    prog = TrainProgress(step=3, tokens=tokens)
    assert wsd_factor(prog, **WSD) == pytest.approx(want, abs=1e-15)  # type: ignore[arg-type]
    assert wsd_lr(prog, 3e-4, **WSD) == pytest.approx(3e-4 * want, abs=1e-18)  # type: ignore[arg-type]


def test_wsd_edge_configs() -> None:
    assert wsd_factor(TrainProgress(0, 0), 0, 1000, 0.5, 0.0) == 1.0
    assert wsd_factor(TrainProgress(9, 750), 0, 1000, 0.5, 0.0) == pytest.approx(0.5)
    assert wsd_factor(TrainProgress(9, 2000), 10, 1000, 0.0, 0.0) == 1.0


def test_wsd_errors() -> None:
    with pytest.raises(ValueError, match="tokens >= 0"):
        wsd_factor(TrainProgress(0, -1), **WSD)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decay_fraction"):
        wsd_factor(TrainProgress(0, 0), 100, 1000, 1.5, 0.1)
    with pytest.raises(ValueError, match="shorten warmup"):
        wsd_factor(TrainProgress(0, 0), 900, 1000, 0.2, 0.1)


def test_sep_wsd_decay_by_steps() -> None:
    # Variable-length batches: 9 steps have consumed 900 tokens of 1000 (decay starts at 800).
    prog = TrainProgress(step=9, tokens=900)

    def hand(x: float) -> float:
        if x < 100:
            return x / 100
        return 1.0 if x <= 800 else 1.0 - 0.9 * min((x - 800) / 200, 1.0)

    correct, mutated = hand(prog.tokens), hand(prog.step)
    assert correct != pytest.approx(mutated)
    assert wsd_factor(prog, **WSD) == pytest.approx(correct, abs=1e-15)  # type: ignore[arg-type]
    same_tokens = TrainProgress(step=450, tokens=900)
    assert wsd_factor(same_tokens, **WSD) == wsd_factor(prog, **WSD)  # type: ignore[arg-type]
