"""Spec tests for the router: selection and tie order, group-limited routing, weights, bias update.

Oracles are float64 Python/numpy written here; exact ties come from equal logits (equal fp32 scores).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nmoe.reference import router as R
from nmoe.reference.router import bias_update, expert_counts, router_logits, router_topk

F32 = np.float32


def scores64(logits: list[float], func: str) -> list[float]:
    if func == "sigmoid":
        return [1.0 / (1.0 + math.exp(-v)) for v in logits]
    m = max(logits)
    e = [math.exp(v - m) for v in logits]
    return [v / sum(e) for v in e]


def oracle_token(
    logits: list[float], bias: list[float], k: int, func: str, n_groups: int, topk_groups: int
) -> tuple[list[int], list[float], float]:
    """Returns (ids, weights, margin): margin is the smallest score gap the selection depends on."""
    s = scores64(logits, func)
    b = [si + bi for si, bi in zip(s, bias, strict=True)]
    allowed = list(range(len(b)))
    margin = math.inf
    if n_groups > 1:
        size = len(b) // n_groups
        gs = []
        for grp in range(n_groups):
            top = sorted(b[grp * size:(grp + 1) * size], reverse=True)
            gs.append(top[0] + top[1])
        gorder = sorted(range(n_groups), key=lambda grp: (-gs[grp], grp))
        margin = min(abs(gs[gorder[i]] - gs[gorder[i + 1]]) for i in range(min(topk_groups, n_groups - 1)))
        kept = set(gorder[:topk_groups])
        allowed = [e for e in allowed if e // size in kept]
    order = sorted(allowed, key=lambda e: (-b[e], e))
    gaps = [abs(b[order[i]] - b[order[i + 1]]) for i in range(min(k, len(order) - 1))]
    margin = min([margin, *gaps])
    ids = order[:k]
    tot = sum(s[e] for e in ids)
    return ids, [s[e] / tot for e in ids], margin


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 6),
    groups=st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 3)]),
    size=st.integers(2, 5),
    func=st.sampled_from(["sigmoid", "softmax"]),
    seed=st.integers(0, 2**20),
    data=st.data(),
)
def test_topk_vs_float64_oracle(
    t: int, groups: tuple[int, int], size: int, func: str, seed: int, data: st.DataObject
) -> None:
    n_groups, topk_groups = groups
    e = n_groups * size
    k = data.draw(st.integers(1, topk_groups * size if n_groups > 1 else e))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=gen) * 3
    bias = torch.randn(e, generator=gen) * 0.1
    w, ids = router_topk(logits, bias, k, func, n_groups, topk_groups)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (t, k)
    checked = 0
    for i in range(t):
        o_ids, o_w, margin = oracle_token(logits[i].double().tolist(), bias.double().tolist(), k, func,
                                          n_groups, topk_groups)
        if margin < 1e-5:  # too close to call across fp32 vs fp64 scores
            continue
        checked += 1
        assert ids[i].tolist() == o_ids
        assert np.allclose(w[i].double().numpy(), o_w, rtol=2e-6, atol=0)
    assert torch.allclose(w.sum(1).double(), torch.ones(t, dtype=torch.float64), rtol=1e-6)
    assert checked >= 1


def test_ties_go_to_lower_id_hand_vector() -> None:
    logits = torch.zeros(2, 6)
    w, ids = router_topk(logits, torch.zeros(6), 4, "sigmoid")
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    assert w.tolist() == [[0.25] * 4] * 2
    _, ids_sm = router_topk(torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]]), torch.zeros(5), 3, "softmax")
    assert ids_sm.tolist() == [[1, 2, 4]]


def test_k1_single_token() -> None:
    w, ids = router_topk(torch.tensor([[0.0, 2.0, 1.0]]), torch.tensor([0.0, 0.0, 1.5]), 1, "sigmoid")
    assert ids.tolist() == [[2]] and w.tolist() == [[1.0]]


def test_group_limited_hand_vector() -> None:
    """Group 0 holds the best expert (sigmoid(3)) but its top-2 sum (= 1.0) ranks below groups 1 and 2."""
    logits = torch.tensor([[3.0, -3.0, 1.0, 1.0, 0.5, 0.5, -1.0, -1.0]])
    w, ids = router_topk(logits, torch.zeros(8), 2, "sigmoid", n_groups=4, topk_groups=2)
    assert ids.tolist() == [[2, 3]] and w.tolist() == [[0.5, 0.5]]
    _, ids_max_pin = router_topk(logits, torch.zeros(8), 2, "sigmoid")
    assert ids_max_pin.tolist() == [[0, 2]]
    _, tied = router_topk(torch.zeros(1, 8), torch.zeros(8), 2, "sigmoid", n_groups=4, topk_groups=1)
    assert tied.tolist() == [[0, 1]]


def test_router_logits_fp32_bound() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    wr = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    out = router_logits(x, wr)
    ref = x.double() @ wr.double().T
    bound = 64 * 2.0**-24 * (x.double().abs() @ wr.double().abs().T) * 2
    assert out.dtype == torch.float32 and bool(((out.double() - ref).abs() <= bound).all())
    with pytest.raises(ValueError, match="router_logits"):
        router_logits(x, wr[:, :3])


def test_expert_counts() -> None:
    assert expert_counts(torch.tensor([[0, 2], [2, 3]]), 5).tolist() == [1, 0, 2, 1, 0]
    assert expert_counts(torch.zeros(0, 2, dtype=torch.int64), 3).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="ids must lie"):
        expert_counts(torch.tensor([[5]]), 5)


def test_bias_update_hand_vector() -> None:
    bias = torch.tensor([0.0, 0.1, -0.2, 0.5])
    out = bias_update(bias, torch.tensor([4, 0, 2, 2]), 0.01, 0.3)
    want = np.array([F32(0) - F32(0.01), F32(0.1) + F32(0.01), F32(-0.2), F32(0.3)], dtype=F32)
    assert np.array_equal(out.numpy(), want)
    same = bias_update(bias[:3], torch.tensor([3, 3, 3]), 0.01, 1.0)
    assert torch.equal(same, bias[:3])


@settings(max_examples=20, deadline=None)
@given(e=st.integers(1, 16), seed=st.integers(0, 2**20), rate=st.sampled_from([1e-3, 0.01, 0.37]))
def test_bias_update_vs_oracle(e: int, seed: int, rate: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(e, generator=gen) * 0.5
    counts = torch.randint(0, 9, (e,), generator=gen)
    c = counts.numpy().astype(np.float64)
    sign = np.sign(c.mean() - c).astype(F32)
    want = np.clip(bias.numpy() + F32(rate) * sign, F32(-1.0), F32(1.0))
    assert np.array_equal(bias_update(bias, counts, rate, 1.0).numpy(), want)


def test_validation_errors() -> None:
    lg = torch.zeros(2, 8)
    b = torch.zeros(8)
    cases: list[tuple[dict[str, object], str]] = [
        (dict(logits=lg.to(torch.bfloat16)), "fp32"),
        (dict(bias=torch.zeros(7)), "bias shape"),
        (dict(score_func="relu"), "unknown"),
        (dict(logits=torch.full((2, 8), float("nan"))), "NaN"),
        (dict(n_groups=3), "divide"),
        (dict(n_groups=8), "group size"),
        (dict(n_groups=2, topk_groups=3), "topk_groups"),
        (dict(k=9), "k=9"),
        (dict(n_groups=4, topk_groups=1, k=3), "k=3"),
    ]
    for kw, msg in cases:
        args: dict[str, object] = dict(logits=lg, bias=b, k=2, score_func="sigmoid", n_groups=1)
        args.update(kw)
        with pytest.raises(ValueError, match=msg):
            router_topk(**args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be"):
        bias_update(b, torch.zeros(3), 0.1, 1.0)
    with pytest.raises(ValueError, match="clamp > 0"):
        bias_update(b, torch.zeros(8), 0.1, 0.0)


# ---- separating inputs: the mutated formula (written here) differs on the data, the code is correct ----


def test_sep_router_tie_breaks_high() -> None:
    logits = [1.0, 3.0, 3.0, 0.0, 3.0]
    s = scores64(logits, "sigmoid")
    correct = sorted(range(5), key=lambda e: (-s[e], e))[:2]
    mutant = sorted(range(5), key=lambda e: (-s[e], -e))[:2]
    assert correct == [1, 2] and mutant == [4, 2]
    _, ids = router_topk(torch.tensor([logits]), torch.zeros(5), 2, "sigmoid")
    assert ids.tolist() == [correct]


def test_sep_router_bias_in_weights() -> None:
    logits, bias = [0.0, 0.5, -0.5, 1.0], [0.0, 0.0, 2.0, 0.0]
    ids, correct, _ = oracle_token(logits, bias, 2, "sigmoid", 1, 1)
    s = scores64(logits, "sigmoid")
    biased = [s[e] + bias[e] for e in ids]
    mutant = [v / sum(biased) for v in biased]
    assert ids == [2, 3] and not np.allclose(correct, mutant, rtol=1e-3)
    w, got = router_topk(torch.tensor([logits]), torch.tensor(bias), 2, "sigmoid")
    assert got.tolist() == [ids] and np.allclose(w[0].double().numpy(), correct, rtol=1e-6, atol=0)


def test_sep_router_softmax_unnormalised() -> None:
    logits = [0.3, -1.0, 2.0, 0.7]
    ids, correct, _ = oracle_token(logits, [0.0] * 4, 2, "softmax", 1, 1)
    s = scores64(logits, "softmax")
    mutant = [s[e] for e in ids]
    assert not np.allclose(correct, mutant, rtol=1e-3)
    w, _ = router_topk(torch.tensor([logits]), torch.zeros(4), 2, "softmax")
    assert np.allclose(w[0].double().numpy(), correct, rtol=1e-6, atol=0)


def test_sep_bias_update_sign_flipped() -> None:
    bias, counts, rate = np.zeros(4, dtype=F32), np.array([6, 1, 1, 0]), F32(0.125)
    sign = np.sign(counts.mean() - counts).astype(F32)
    correct, mutant = bias + rate * sign, bias - rate * sign
    assert not np.array_equal(correct, mutant)
    got = bias_update(torch.from_numpy(bias), torch.from_numpy(counts), 0.125, 1.0)
    assert np.array_equal(got.numpy(), correct)


def test_pinned_exp_within_1_1_ulp_of_float64_exp() -> None:
    """The spec's exp is checked against float64 exp, not against itself."""
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.rand(200_000, generator=g) * 190 - 102, torch.randn(50_000, generator=g)])
    want = torch.exp(x.double())
    got = R.pinned_exp(x).double()
    finite = torch.isfinite(want.float()) & (want.float() != 0)
    ulp = (torch.nextafter(want.float().abs(), torch.tensor(float("inf"))) - want.float().abs()).double()
    assert float(((got - want).abs() / ulp)[finite].max()) < 1.1
    special = R.pinned_exp(torch.tensor([0.0, float("-inf"), float("inf"), float("nan"), -104.5, 89.5]))
    assert special[0] == 1.0 and special[1] == 0.0 and special[4] == 0.0
    assert torch.isinf(special[2]) and torch.isinf(special[5]) and torch.isnan(special[3])


def test_scores_bits_do_not_depend_on_position() -> None:
    """The same logit scores the same bits in the SIMD body and the scalar tail (torch.sigmoid does not)."""
    row = torch.full((1, 23), 0.3224487, dtype=torch.float32)
    for func in ("sigmoid", "softmax"):
        s = R.router_scores(row, func)
        assert bool((s.view(torch.int32) == s.view(torch.int32)[0, 0]).all())
