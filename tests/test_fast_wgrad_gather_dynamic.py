"""The gathered wgrad's dynamic schedule (GEMM_WGRAD_GATHER_DYNAMIC): each tile of the heaviest-first list
comes from a device counter placed after the split counters, taken by producer warp 0 and handed through a
shared ring to the other producer warps and the consumers. Its contract: bit for bit the static schedule's dw
(which CTA runs a tile never changes its bits), every element written. Compile rules need no GPU."""

from __future__ import annotations

import re

import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from test_fast_gemm import into_nan
from test_fast_wgrad_accumulate import _spec
from test_fast_wgrad_transposed import CASES, Case, _operands
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.gemm import sm90

gpu = pytest.mark.gpu
DYNAMIC = ("grouped_gemm_wgrad_gathered_x_on_m_dynamic_n256",
           "grouped_gemm_wgrad_gathered_dy_accumulate_dynamic_n128")
STATIC = "grouped_gemm_wgrad_gathered_x_on_m_n256"
ADD = "atom.global.acq_rel.gpu.add.u32 %r1, [%rd1], 1;"
# How the wgrad reads its token-major side: x on N, dout on M, x on M stored transposed.
SIDES = ("x", "dy", "x_on_m")


def test_dynamic_kernels_compile_to_a_second_counter() -> None:
    """The dynamic kernels hold a fetch-and-add beside the split path's one; the static kernel's rule
    forbids a second, and the rule tells one add from two."""
    rows = compile_rows("nmoe.fast.gemm.sm90", (*DYNAMIC, STATIC))
    assert_rows_ok(rows["sm_90a"], "sm_90a", 3)
    two, one = f"{ADD}\n\tbar.sync 1, 256;\n{ADD}", ADD
    for name in DYNAMIC:
        assert any(re.search(rx, two) and not re.search(rx, one) for rx in _spec(name).expect["sm_90a"])
    assert any(re.search(rx, two) and not re.search(rx, one) for rx in _spec(STATIC).forbid["sm_90a"])


def _dw(case: Case, side: str, monkeypatch: pytest.MonkeyPatch, dynamic: bool,
        dw: Tensor | None = None) -> Tensor:
    """The gathered wgrad of the case's operands, `side` token-major, from NaN blocks (or added into dw)."""
    monkeypatch.setattr(sm90, "GEMM_WGRAD_GATHER_DYNAMIC", dynamic)
    x, dy, slot, offs, k = _operands(case)
    e, n, hid = offs.shape[0], dy.shape[1], x.shape[1]
    a, b, tokens = (x, dy, "dy") if side == "dy" else (dy, x, "x")
    if dw is not None:
        sm90.grouped_gemm_wgrad_gathered_add(a, b, slot, k, offs, tokens, dw, side == "x_on_m")
        torch.cuda.synchronize()
        return dw
    shape = (e * hid, n) if side == "dy" else (e * n, hid)
    return into_nan([shape], lambda: sm90.grouped_gemm_wgrad_gathered(a, b, slot, k, offs, side=tokens,
                                                                      transposed=side == "x_on_m"))


def _assert_same(got: Tensor, want: Tensor) -> None:
    assert bool(want.abs().amax() > 0)
    assert not bool(got.isnan().any()), "a tile the dynamic schedule never ran stays NaN"
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "dw differs from the static schedule's"


@gpu
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}K{c[1]}H{c[2]}N{c[3]}E{c[4]}-{c[7]}" for c in CASES])
def test_dynamic_wgrad_is_the_static_one(case: Case, side: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_same(_dw(case, side, monkeypatch, True), _dw(case, side, monkeypatch, False))


@gpu
@pytest.mark.parametrize("side", SIDES)
def test_dynamic_wgrad_adds_as_the_static_one(side: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[-1]
    shape = _dw(case, side, monkeypatch, False).shape
    start = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).cuda()
    got = _dw(case, side, monkeypatch, True, start.clone())
    _assert_same(got, _dw(case, side, monkeypatch, False, start.clone()))


@gpu
def test_sep_gemm_fast_wgrad_gather_dynamic_split_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The heavy-expert case splits group 0's rows, so its first tile counts chunks on the first split
    counter: tiles taken from that counter would collide with them."""
    case = CASES[-1]
    _, dy, slot, offs, _ = _operands(case)
    hid, n = case[2], dy.shape[1]
    split = sm90.wgrad_split(slot.shape[0], hid, n, sm90.pick_bn(n), offs.shape[0],
                             runtime.sm_count(dy.device.index))
    assert int(offs[0]) > split.thresh, "group 0 is split"
    _assert_same(_dw(case, "x_on_m", monkeypatch, True), _dw(case, "x_on_m", monkeypatch, False))
