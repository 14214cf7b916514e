"""The gathering fwd/dgrad's dynamic schedule (GEMM_GATHER_DYNAMIC): warp 0 of each CTA takes the next unit
from a device counter and hands it to the CTA's other producer and consumer warps through a shared ring.
Which CTA computes a unit never changes its bits, so the contract is the static schedule's, bit for bit. The
plumbing and the compile-checked kernels need no GPU."""

from __future__ import annotations

import pytest
import torch
from test_fast_gemm_gather import CASES as GATHER_CASES
from test_fast_gemm_gather import _ids
from torch import Tensor

from nmoe.fast.dispatch import permute
from nmoe.fast.gemm import sm90

gpu = pytest.mark.gpu

# The gathering test's cases (K tails, skew, a mostly zero-filled tail at T = 5), then two with several units
# per CTA so each ring wraps many times: N 1024 (four N tiles), N 256 (one).
CASES = [*GATHER_CASES, (4096, 8, 512, 1024, 32, 8, "swiglu", "uniform"),
         (4096, 8, 512, 256, 32, 8, "relu2", "skew")]
# The gathering test's cases with N widened so each M tile spans two to eight 256-wide N tiles.
WIDE_CASES = [(*c[:3], n, *c[4:]) for c, n in zip(GATHER_CASES, (512, 1024, 2048, 512), strict=True)]
Case = tuple[int, int, int, int, int, int, str, str]


def case_tensors(case: Case) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x, w, dy, slot and offs of a case (tokens, top_k, hidden, N, experts, align, activation, routing)."""
    t, k, hid, n, e, align, _, routing = case
    g = torch.Generator().manual_seed(t * 11 + e)
    x = torch.randn(t, hid, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(e, n, hid, generator=g) / hid**0.5).to(torch.bfloat16).cuda()
    dy = torch.randn(t, n, generator=g).to(torch.bfloat16).cuda()
    p = permute(x.new_empty(t, 0), _ids(t, k, e, routing, g).cuda(), e, align)
    return x, w, dy, p.slot, p.offs


def poisoned_runs(case: Case, x: Tensor | None = None) -> list[Tensor]:
    """h, act(h) and the gathered dgrad dy[slot // K] @ w (x: the case's unless given), their outputs carved
    from a freed NaN block so a unit or row no thread wrote cannot pass for a computed one."""
    x0, w, dy, slot, offs = case_tensors(case)
    x = x0 if x is None else x
    k, act = case[1], case[6]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    poison = torch.full((1 << 26,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del poison
    a, h = sm90.grouped_gemm_act_gathered(x, slot, k, w, offs, act)
    dx = sm90.grouped_gemm_dgrad_gathered(dy, slot, k, w, offs)
    torch.cuda.synchronize()
    return [h, a, dx]


def assert_runs_equal(got: list[Tensor], want: list[Tensor], what: str) -> None:
    """poisoned_runs' h, act(h) and dgrad bit for bit alike, none left NaN (unwritten), `what` naming the
    change between the two runs."""
    for name, g, w in zip(("h", "act(h)", "dgrad"), got, want, strict=True):
        assert not bool(g.isnan().any()), f"{name}: a unit or row no thread wrote stays NaN {what}"
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)), f"{name} differs {what}"


def _runs(case: Case, monkeypatch: pytest.MonkeyPatch, dynamic: bool) -> list[Tensor]:
    monkeypatch.setattr(sm90, "GEMM_GATHER_DYNAMIC", dynamic)
    return poisoned_runs(case)


def test_dynamic_kernels_are_compile_checked() -> None:
    """The up projection (with and without h) and the dgrad compile with the counter's fetch-and-add; alone,
    no CTA hands a unit to another by st.async."""
    names = {s.name: s for s in sm90.KERNELS if s.name.endswith("_dynamic")
             and s.name.startswith(("grouped_gemm_act_gathered", "grouped_gemm_dgrad_gathered"))}
    assert set(names) == {"grouped_gemm_act_gathered_swiglu_n256_dynamic",
                          "grouped_gemm_act_gathered_swiglu_n256_act_only_dynamic",
                          "grouped_gemm_dgrad_gathered_n256_dynamic",
                          "grouped_gemm_dgrad_gathered_n256_spill_dynamic"}
    for spec in names.values():
        expect = " ".join(spec.expect["sm_90a"])
        assert "atom" in expect and "st\\.async" not in expect


@gpu
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}K{c[1]}H{c[2]}N{c[3]}E{c[4]}-{c[6]}" for c in CASES])
def test_dynamic_schedule_equals_the_static_one(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_runs_equal(_runs(case, monkeypatch, True), _runs(case, monkeypatch, False), "when dynamic")


@gpu
def test_sep_gemm_fast_gather_dynamic_counter_from_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A counter that starts at 1 skips unit 0 (the first expert's first M tile, its first N tiles): its rows
    are nonzero under the static schedule, so left unwritten they show."""
    case = CASES[4]
    want = _runs(case, monkeypatch, False)[0]
    assert bool(want[:128, :256].abs().sum() > 0), "unit 0's tile holds nonzero values"
    got = _runs(case, monkeypatch, True)[0]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
