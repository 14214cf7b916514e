"""Spec tests for permute/unpermute against a plain-Python oracle of the (expert, t, k) layout."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nmoe.reference.dispatch import embedding_bwd, padded_rows, permute, unpermute


def oracle(ids: list[list[int]], n_experts: int, align: int) -> tuple[list[int], list[int], list[int], int]:
    """(counts, offs, slot per row, R) from nested loops over experts and slots."""
    t_n, k_n = len(ids), len(ids[0]) if ids else 0
    counts, offs, slot = [], [], []
    for e in range(n_experts):
        seg = [t * k_n + k for t in range(t_n) for k in range(k_n) if ids[t][k] == e]
        pad = -len(seg) % align
        counts.append(len(seg))
        slot += seg + [-1] * pad
        offs.append(len(slot))
    r = -(-(t_n * k_n + n_experts * (align - 1)) // align) * align
    return counts, offs, slot + [-1] * (r - len(slot)), r


def check_against_oracle(x: Tensor, ids: Tensor, n_experts: int, align: int) -> None:
    t_n, k_n = ids.shape
    p = permute(x, ids, n_experts, align)
    counts, offs, slot, r = oracle(ids.tolist(), n_experts, align)
    assert p.counts.dtype == torch.int32 and p.offs.dtype == torch.int32 and p.slot.dtype == torch.int64
    assert p.counts.tolist() == counts and p.offs.tolist() == offs and p.slot.tolist() == slot
    assert p.xp.shape == (r, x.shape[1]) and p.xp.dtype == x.dtype
    for row, s in enumerate(slot):
        want = x[s // k_n] if s >= 0 else torch.zeros_like(x[0])
        assert torch.equal(p.xp[row].view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32))
    y = unpermute(p.xp, p.slot, t_n, k_n)
    assert torch.equal(y, x[:, None, :].expand(t_n, k_n, x.shape[1]))


@settings(max_examples=30, deadline=None)
@given(
    t=st.integers(1, 12),
    k=st.integers(1, 4),
    e=st.integers(1, 9),
    align=st.sampled_from([1, 2, 4, 8, 16]),
    skew=st.booleans(),
    seed=st.integers(0, 2**20),
)
def test_permute_vs_oracle_and_roundtrip(t: int, k: int, e: int, align: int, skew: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    hi = min(e, 2) if skew else e
    ids = torch.randint(0, hi, (t, k), generator=gen)
    x = torch.randn(t, 5, generator=gen).to(torch.bfloat16)
    check_against_oracle(x, ids, e, align)


def test_dispatch_order_hand_vector() -> None:
    ids = torch.tensor([[2, 0], [0, 2], [1, 0]])
    x = torch.tensor([[10.0], [20.0], [30.0]])
    p = permute(x, ids, 3, 4)
    assert padded_rows(6, 3, 4) == 16
    assert p.counts.tolist() == [3, 1, 2] and p.offs.tolist() == [4, 8, 12]
    assert p.slot.tolist() == [1, 2, 5, -1, 4, -1, -1, -1, 0, 3, -1, -1, -1, -1, -1, -1]
    assert p.xp[:, 0].tolist() == [10, 20, 30, 0, 30, 0, 0, 0, 10, 20, 0, 0, 0, 0, 0, 0]


def test_empty_expert_groups_k1_single_token() -> None:
    p = permute(torch.tensor([[7.0, 8.0]]), torch.tensor([[3]]), 5, 4)
    assert p.counts.tolist() == [0, 0, 0, 1, 0] and p.offs.tolist() == [0, 0, 0, 4, 4]
    assert p.slot.tolist()[:4] == [0, -1, -1, -1] and p.xp.shape[0] == padded_rows(1, 5, 4) == 16
    check_against_oracle(torch.randn(6, 3), torch.tensor([[1], [3], [1], [3], [3], [1]]), 5, 2)


def test_padded_rows_is_exhaustive_upper_bound() -> None:
    for n, e, a in itertools.product(range(7), range(1, 4), (1, 2, 3, 4)):
        splits = (cs for cs in itertools.product(range(n + 1), repeat=e) if sum(cs) == n)
        worst = max(sum(-(-c // a) * a for c in cs) for cs in splits)
        cap = padded_rows(n, e, a)
        assert worst <= cap and cap % a == 0 and cap - worst < a + e * a
    assert padded_rows(10, 4, 8) == 40
    with pytest.raises(ValueError, match="align >= 1"):
        padded_rows(4, 2, 0)


def test_errors() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="integer"):
        permute(x, torch.zeros(2, 1), 2, 1)
    with pytest.raises(ValueError, match="lie in"):
        permute(x, torch.tensor([[2], [0]]), 2, 1)
    with pytest.raises(ValueError, match="T=2"):
        permute(torch.zeros(3, 3), torch.tensor([[1], [0]]), 2, 1)
    with pytest.raises(ValueError, match="yp"):
        unpermute(torch.zeros(4, 3), torch.zeros(3, dtype=torch.int64), 1, 1)
    with pytest.raises(ValueError, match="once"):
        unpermute(torch.zeros(2, 3), torch.tensor([0, 0]), 1, 2)


# ---- separating inputs: the mutated formula (written here) differs on the data, the code is correct ----


def test_sep_dispatch_unstable_order() -> None:
    """Many slots per expert; the mutant keeps the segments but not the (t, k) order inside them
    (what an unstable sort on the expert id alone gives)."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 3, (2048, 2), generator=gen)
    counts, _, correct, _ = oracle(ids.tolist(), 3, 1)
    mutant: list[int] = []
    start = 0
    for c in counts:
        mutant += correct[start:start + c][::-1]
        start += c
    assert mutant != correct
    assert permute(torch.zeros(2048, 1), ids, 3, 1).slot.tolist() == correct


def test_sep_dispatch_pad_rows_garbage() -> None:
    ids = torch.tensor([[0, 1], [1, 1], [3, 0]])
    x = torch.arange(1.0, 7.0).reshape(3, 2)
    _, _, slot, r = oracle(ids.tolist(), 4, 8)
    pad = np.array(slot) < 0
    junk = torch.full((r, 2), 7.0)
    mutant = junk.clone()
    for row, s in enumerate(slot):
        if s >= 0:
            mutant[row] = x[s // 2]
    correct = torch.where(torch.from_numpy(pad)[:, None], torch.zeros(()), mutant)
    assert pad.any() and not torch.equal(correct, mutant)
    del junk, mutant
    p = permute(x, ids, 4, 8)
    assert torch.equal(p.xp.view(torch.int32), correct.view(torch.int32))


def _embed_oracle(dy: Tensor, ids: Tensor, vocab: int) -> Tensor:
    """The parity oracle: numpy float32 accumulation, row by row in token order, rounded once."""
    from parity.compare import BITWISE
    from parity.inputs import Inputs
    from parity.ops.dispatch import embedding_bwd as oracle

    (want,) = oracle(Inputs((dy, ids, vocab)), BITWISE)
    assert want is not None
    return want.value


def test_embedding_bwd_hand_vectors() -> None:
    dy = torch.tensor([[1.0, 2.0], [3.0, -4.0], [0.5, 0.25]], dtype=torch.bfloat16)
    got = embedding_bwd(dy, torch.tensor([2, 0, 2]), 4)
    want = torch.tensor([[3.0, -4.0], [0.0, 0.0], [1.5, 2.25], [0.0, 0.0]], dtype=torch.bfloat16)
    assert torch.equal(got, want)


@settings(max_examples=40, deadline=None)
@given(t=st.integers(0, 40), h=st.integers(1, 5), vocab=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_embedding_bwd_is_fp32_token_order_sum_rounded_once(t: int, h: int, vocab: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    dy = (torch.randn(t, h, generator=g) * torch.logspace(-3, 3, t).unsqueeze(1)).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (t,), generator=g)
    want = _embed_oracle(dy, ids, vocab)
    assert torch.equal(embedding_bwd(dy, ids, vocab).view(torch.int16), want.view(torch.int16))


def test_sep_dispatch_embedding_bwd_reverse_order() -> None:
    """Three bf16 values whose fp32 sum depends on the order: 2^24 + 1 - 2^24 is 0 forward, 1 reversed."""
    dy = torch.tensor([[2.0**24], [1.0], [-(2.0**24)]], dtype=torch.bfloat16)
    ids = torch.zeros(3, dtype=torch.int64)
    forward, backward = _embed_oracle(dy, ids, 1), _embed_oracle(dy.flip(0), ids, 1)
    assert not torch.equal(forward, backward)
    assert torch.equal(embedding_bwd(dy, ids, 1), forward)


def test_embedding_bwd_nan_rows_are_the_canonical_nan() -> None:
    """docs/spec-corners.md: a NaN the sum produces leaves as 0x7FC0, whatever sign or payload fed it."""
    bits = torch.tensor([[0xFFA1 - 0x10000, 0x3F80], [0x7F81, 0x3F80]], dtype=torch.int16)
    dy = bits.view(torch.bfloat16)
    got = embedding_bwd(dy, torch.tensor([0, 1]), 2).view(torch.int16)
    assert dy.float().to(torch.bfloat16).view(torch.int16)[0, 0] != 0x7FC0
    want = torch.tensor([[0x7FC0, 0x3F80], [0x7FC0, 0x3F80]], dtype=torch.int16)
    assert torch.equal(got, want)
    assert torch.equal(_embed_oracle(dy, torch.tensor([0, 1]), 2).view(torch.int16), want)


def test_embedding_bwd_refuses_ids_outside_the_vocab() -> None:
    dy = torch.zeros(2, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="vocab size"):
        embedding_bwd(dy, torch.tensor([0, 5]), 4)
    with pytest.raises(ValueError, match="integer ids"):
        embedding_bwd(dy, torch.tensor([0.0, 1.0]), 4)
