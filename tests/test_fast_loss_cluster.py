"""The cross-entropy's cluster row kernel (CE_CLUSTER = N): persistent clusters of N CTAs each stream 1/N of a
logits row, swap partial lse through global memory across the cluster barrier, and re-read their slice for
dlogits. CPU: its sizing, refusals and the barrier its PTX must hold; GPU: the two-pass kernel's contracts."""

from __future__ import annotations

import re

import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from test_fast_loss import IGN, check_budget_case, make, per_token, sep_loss

from nmoe.fast import loss as fast
from nmoe.fast.arch import SUPPORTED_ARCHS

gpu = pytest.mark.gpu
CLUSTER = fast.CHECKED_CLUSTER


@pytest.fixture
def one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast, "CE_CLUSTER", CLUSTER)


def test_cluster_sizing_and_refusals() -> None:
    """V = 201088 over 8 ranks: 50272 4-wide vectors, 6284 per rank; V = 4 leaves seven ranks empty."""
    assert fast.cluster_segment(201088, 8) == 6284
    assert fast.cluster_segment(4, 8) == 1
    with pytest.raises(ValueError, match="V % 4 == 0"):
        fast.cluster_segment(201090, 8)


def test_sep_cross_entropy_bwd_fast_cluster_wait_dropped() -> None:
    """Each rank reads the others' partial lse: its PTX must arrive at the cluster barrier and then wait on
    it (without the wait it reads partials not yet posted). The expect list tells the two apart."""
    arrive, wait = "barrier.cluster.arrive;\n", "barrier.cluster.wait;\n"
    grad = next(k for k in fast.KERNELS if k.name == f"ce_cluster{CLUSTER}_grad")
    for arch in SUPPORTED_ARCHS:
        def clean(ptx: str, arch: str = arch) -> bool:
            return all(re.search(rx, ptx) for rx in grad.expect[arch] if "cluster" in rx)

        assert clean(arrive + wait)
        assert not clean(arrive)  # the mutant: no wait
        assert not clean(wait + arrive)
    rows = compile_rows("nmoe.fast.loss", [f"ce_cluster{CLUSTER}_grad"])
    for arch in SUPPORTED_ARCHS:
        assert_rows_ok(rows[arch], arch, 1)


@gpu
@pytest.mark.usefixtures("one_pass")
@pytest.mark.parametrize(("t", "d", "v", "chunk"), [(1, 8, 4, 4096), (13, 32, 300, 3), (64, 64, 1000, 16),
                                                    (257, 128, 8192, 100), (40, 64, 201088, 16)])
def test_loss_and_grads_within_float64_budget(t: int, d: int, v: int, chunk: int) -> None:
    """The two-pass kernel's contracts, at widths that leave ranks without a vector (V 4: seven of eight)."""
    check_budget_case(t, d, v, chunk)


@gpu
@pytest.mark.usefixtures("one_pass")
def test_deterministic_and_no_host_sync() -> None:
    h, w, tg = make(64, 64, 201088, 11)
    hc, wc, tc = h.cuda(), w.cuda(), tg.cuda()
    dloss = torch.ones((), device="cuda")
    a = fast.cross_entropy_bwd(dloss, hc, wc, tc, IGN, 16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        b = fast.cross_entropy_bwd(dloss, hc, wc, tc, IGN, 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@gpu
@pytest.mark.usefixtures("one_pass")
def test_sep_cross_entropy_fast_cluster_last_rank_dropped() -> None:
    """The last rank's columns (175952 on, of 201088) carry the largest logits: a merge that leaves its
    partial out scores every token against the other ranks' columns only."""
    h, w, tg = make(24, 64, 201088, 12, ignored=0.0)
    first = (CLUSTER - 1) * fast.cluster_segment(201088, CLUSTER) * fast.VEC
    assert first == 175952
    w[first:] = (w[first:].float() * 4).bfloat16()
    tg[:] = torch.randint(0, first, tg.shape)
    logits = h.double() @ w.double().T
    mutant = (torch.logsumexp(logits[:, :first], -1) - logits.gather(1, tg[:, None]).squeeze(1)).mean()
    assert float(per_token(h, w, tg).mean()) > float(mutant) + 1.0
    sep_loss(h, w, tg, 8, float(mutant))
