"""Spec tests for the one-process RDEP simulation against a nested-loop oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nmoe.reference.rdep import rdep_dispatch, rdep_return


def oracle(ids: list[list[list[int]]], n_experts: int) -> list[list[tuple[int, int, int, int]]]:
    """Per dst rank: (local expert, src, t, k) tuples in arrival order."""
    w = len(ids)
    n_local = n_experts // w
    out: list[list[tuple[int, int, int, int]]] = [[] for _ in range(w)]
    for src, rank_ids in enumerate(ids):
        for t, row in enumerate(rank_ids):
            for k, e in enumerate(row):
                out[e // n_local].append((e % n_local, src, t, k))
    return [sorted(rows) for rows in out]


def make(w: int, n_local: int, t: int, k: int, seed: int) -> tuple[list[Tensor], list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, 3, generator=gen).to(torch.bfloat16) for _ in range(w)]
    ids = [torch.randint(0, w * n_local, (t, k), generator=gen) for _ in range(w)]
    return xs, ids


def needed(ids: list[Tensor], n_experts: int) -> int:
    owners = torch.cat([i.reshape(-1) for i in ids]) // (n_experts // len(ids))
    return int(torch.bincount(owners, minlength=len(ids)).max())


@settings(max_examples=30, deadline=None)
@given(
    w=st.integers(1, 4), n_local=st.integers(1, 3), t=st.integers(1, 5), k=st.integers(1, 3),
    seed=st.integers(0, 2**20),
)
def test_dispatch_vs_oracle_and_every_row_once(w: int, n_local: int, t: int, k: int, seed: int) -> None:
    xs, ids = make(w, n_local, t, k, seed)
    e = w * n_local
    recvs = rdep_dispatch(xs, ids, e, needed(ids, e))
    want = oracle([i.tolist() for i in ids], e)
    for r, rc in enumerate(recvs):
        assert rc.local_eid.tolist() == [le for le, _, _, _ in want[r]]
        assert rc.row_id.tolist() == [((s * t) + tt) * k + kk for _, s, tt, kk in want[r]]
        assert rc.counts.tolist() == [sum(1 for le, *_ in want[r] if le == j) for j in range(n_local)]
        for i, (_, s, tt, _) in enumerate(want[r]):
            assert torch.equal(rc.x[i], xs[s][tt])
    all_rows = torch.cat([rc.row_id for rc in recvs])
    assert sorted(all_rows.tolist()) == list(range(w * t * k))

    ys = [rc.x.float() + 100.0 * (r * n_local + rc.local_eid[:, None]).float() for r, rc in enumerate(recvs)]
    back = rdep_return(ys, recvs, t, k)
    for s in range(w):
        assert back[s].shape == (t, k, 3)
        want_back = xs[s].float()[:, None, :] + 100.0 * ids[s][:, :, None].float()
        assert torch.equal(back[s], want_back)


def test_arrival_order_hand_vector() -> None:
    """W=2, n_local=2: rank 1 owns experts 2, 3; rows arrive by (local expert, src, t, k)."""
    xs = [torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [4.0]])]
    ids = [torch.tensor([[3, 2], [0, 3]]), torch.tensor([[2, 1], [3, 2]])]
    r0, r1 = rdep_dispatch(xs, ids, 4, 6)
    assert r1.local_eid.tolist() == [0, 0, 0, 1, 1, 1]
    assert r1.row_id.tolist() == [1, 4, 7, 0, 3, 6]
    assert r1.x[:, 0].tolist() == [1.0, 3.0, 4.0, 1.0, 2.0, 4.0]
    assert r1.counts.tolist() == [3, 3]
    assert r0.row_id.tolist() == [2, 5] and r0.counts.tolist() == [1, 1]


def test_empty_rank_and_single_token() -> None:
    xs, ids = [torch.ones(1, 2), torch.ones(1, 2)], [torch.tensor([[0]]), torch.tensor([[1]])]
    r0, r1 = rdep_dispatch(xs, ids, 4, 2)
    assert r0.row_id.tolist() == [0, 1] and r1.x.shape == (0, 2) and r1.counts.tolist() == [0, 0]
    back = rdep_return([r0.x * 2, r1.x], [r0, r1], 1, 1)
    assert [b.tolist() for b in back] == [[[[2.0, 2.0]]], [[[2.0, 2.0]]]]


def test_capacity_boundary_and_overflow_message() -> None:
    xs, ids = make(3, 2, 6, 2, 4)
    need = needed(ids, 6)
    rdep_dispatch(xs, ids, 6, need)
    with pytest.raises(RuntimeError, match=rf"capacity is {need - 1}.*at least {need}"):
        rdep_dispatch(xs, ids, 6, need - 1)


def test_errors() -> None:
    x, i = torch.zeros(2, 3), torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="one x and one ids"):
        rdep_dispatch([x], [i, i], 2, 8)
    with pytest.raises(ValueError, match="multiple of world size"):
        rdep_dispatch([x, x], [i, i], 3, 8)
    with pytest.raises(ValueError, match="every rank must send"):
        rdep_dispatch([x, torch.zeros(3, 3)], [i, i], 2, 8)
    with pytest.raises(ValueError, match="expert ids"):
        rdep_dispatch([x], [i + 5], 2, 8)
    recvs = rdep_dispatch([x], [i], 2, 8)
    with pytest.raises(ValueError, match="outputs for"):
        rdep_return([], recvs, 2, 1)
    with pytest.raises(ValueError, match="one row per received"):
        rdep_return([torch.zeros(1, 3)], recvs, 2, 1)
    with pytest.raises(ValueError, match="exactly once"):
        rdep_return([recvs[0].x], recvs, 3, 1)


# ---- separating inputs: the mutated formula (written here) differs on the data, the code is correct ----


def test_sep_rdep_silent_drop_on_overflow() -> None:
    xs, ids = make(2, 2, 5, 2, 9)
    need = needed(ids, 4)
    cap = need - 1
    correct_rows = sorted(r for rows in oracle([i.tolist() for i in ids], 4) for r in rows)
    mutant_rows = sorted(r for rows in oracle([i.tolist() for i in ids], 4) for r in rows[:cap])
    assert len(correct_rows) == 2 * 5 * 2 and len(mutant_rows) < len(correct_rows)
    with pytest.raises(RuntimeError, match=rf"capacity is {cap}.*at least {need}"):
        rdep_dispatch(xs, ids, 4, cap)


def test_sep_rdep_owner_off_by_one() -> None:
    n_local, w = 3, 2
    eids = list(range(n_local * w))
    correct = [e // n_local for e in eids]
    mutant = [((e + 1) // n_local) % w for e in eids]
    assert correct != mutant
    ids = [torch.tensor([eids]), torch.tensor([eids[::-1]])]
    xs = [torch.zeros(1, 1), torch.ones(1, 1)]
    recvs = rdep_dispatch(xs, ids, n_local * w, 12)
    for r, rc in enumerate(recvs):
        got_eids = [int(ids[int(rid) // 6][0, int(rid) % 6]) for rid in rc.row_id]
        assert sorted(got_eids) == sorted(2 * [e for e in eids if correct[e] == r])
        assert [e % n_local for e in got_eids] == rc.local_eid.tolist()
