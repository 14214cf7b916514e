"""The TMA-fed fwd/dgrad's dynamic schedule (GEMM_FWD_DYNAMIC): the cluster's CTA 0 producer warp takes each
next unit from a device counter and hands it to every consumer warp (and the other CTA's producer); a
ping-pong warpgroup reads the next unit as soon as its MMAs are issued. Which CTA or warpgroup computes a unit
never changes its bits, so the contract is the static schedule's, bit for bit, every element written."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from test_fast_gemm_pingpong import CASES, IDS, _ends, _inputs
from torch import Tensor

from nmoe.fast.gemm import sm90
from nmoe.fast.limits import pingpong_bn

gpu = pytest.mark.gpu


def _run(a: Tensor, w: Tensor, offs: Tensor, width: int, w_k_major: bool, pingpong: bool, dynamic: bool,
         monkeypatch: pytest.MonkeyPatch, act: str = "none", act_width: int = 0) -> list[Tensor]:
    """(out[, act out]) of one TMA-fed launch (128-wide tiles, ping-pong's own width) into NaN-filled
    outputs."""
    monkeypatch.setattr(sm90, "GEMM_FWD_DYNAMIC", dynamic)
    out = torch.full((a.shape[0], width), float("nan"), dtype=torch.bfloat16, device="cuda")
    act_out = torch.full((a.shape[0], act_width), float("nan"), dtype=torch.bfloat16, device="cuda")
    bn = pingpong_bn(act) if pingpong else 128
    sm90._launch("test", a, w, offs, out, w_k_major, bn, act_out=act_out if act != "none" else None,
                 activation=act, pingpong=pingpong)
    torch.cuda.synchronize()
    return [out, act_out] if act != "none" else [out]


def _same_bits(got: Sequence[Tensor], want: Sequence[Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert not bool(torch.isnan(g).any()), "an output element was never written"
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)), "the dynamic schedule changed bits"


def test_dynamic_tma_kernels_are_compile_checked() -> None:
    """The ping-pong fwd and the deferred cooperative dgrad compile with the counter's fetch-and-add and the
    cluster hand-off by st.async."""
    names = {s.name: s for s in sm90.KERNELS if "dynamic" in s.name and "gather" not in s.name
             and "wgrad" not in s.name}
    assert set(names) == {"grouped_gemm_fwd_pingpong_dynamic", "grouped_gemm_dgrad_deferred_dynamic_n256"}
    for spec in names.values():
        expect = " ".join(spec.expect["sm_90a"])
        assert "atom" in expect and "st\\.async" in expect


@gpu
@pytest.mark.parametrize("pingpong", [False, True], ids=["cooperative", "pingpong"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_dynamic_fwd_and_dgrad_equal_the_static_ones(case: tuple[int, int, int, list[int]], pingpong: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    m, n, k, counts = case
    x, w = _inputs(m, n, k, len(counts), 7)
    offs = _ends(counts)
    for w_k_major, width in ((True, n), (False, k)):
        a = x if w_k_major else torch.randn(m, n, generator=torch.Generator().manual_seed(8)).to(x).cuda()
        want = _run(a, w, offs, width, w_k_major, pingpong, False, monkeypatch)
        got = _run(a, w, offs, width, w_k_major, pingpong, True, monkeypatch)
        _same_bits(got, want)


@gpu
@pytest.mark.parametrize("pingpong", [False, True], ids=["cooperative", "pingpong"])
def test_dynamic_fused_activation_equals_the_static_one(pingpong: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    m, n, k, counts = CASES[1]
    x, w = _inputs(m, n, k, len(counts), 9)
    offs = _ends(counts)
    want = _run(x, w, offs, n, True, pingpong, False, monkeypatch, "swiglu", n // 2)
    got = _run(x, w, offs, n, True, pingpong, True, monkeypatch, "swiglu", n // 2)
    _same_bits(got, want)


@gpu
def test_sep_gemm_fast_fwd_dynamic_counter_from_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A counter that starts at 1 skips unit 0 (the first group's first M tiles at N tile 0): under the static
    schedule that tile is written, so left NaN it shows."""
    m, n, k, counts = CASES[0]
    x, w = _inputs(m, n, k, len(counts), 10)
    offs = _ends(counts)
    want = _run(x, w, offs, n, True, True, False, monkeypatch)
    assert not bool(torch.isnan(want[0][:128, :128]).any()), "the static run writes unit 0's tile"
    got = _run(x, w, offs, n, True, True, True, monkeypatch)
    _same_bits(got, want)
