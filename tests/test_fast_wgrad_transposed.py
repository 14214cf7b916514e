"""The transposed gathered wgrad (grouped_gemm_wgrad_gathered(..., transposed=True)): x^T @ dy with the
token-major x on the kernel's M side, dw[e] leaving transposed by stmatrix.trans into M-contiguous subtiles
and a 3-d TMA bounded by the group. Its contract: bit for bit the dy-side kernel's x^T @ dy, transposed (the
same MMAs); added into dw, bit for bit a bf16 add. Compile rules need no GPU."""

from __future__ import annotations

import re

import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from test_fast_gemm import into_nan
from test_fast_gemm_gather import CASES as GATHER_CASES
from test_fast_gemm_gather import _ids
from test_fast_wgrad_accumulate import _spec
from torch import Tensor

from nmoe.fast.dispatch import permute
from nmoe.fast.gemm import sm90

gpu = pytest.mark.gpu
STORE, ADD = "grouped_gemm_wgrad_gathered_x_on_m_n256", "grouped_gemm_wgrad_gathered_x_on_m_accumulate_n128"
# (tokens, top_k, H = x's width, N = dy's width, experts, align, -, routing): H = 288 and 64 cut the last M
# tile (TMA drops the rest), N = 384 takes 128-wide tiles; the last case's heavy experts split their rows.
CASES = [*GATHER_CASES, (8192, 8, 512, 256, 16, 8, "-", "skew")]
Case = tuple[int, int, int, int, int, int, str, str]


def test_transposed_wgrads_compile_to_transposing_stores() -> None:
    """Both compile with stmatrix.trans and one 3-d TMA kind (a store, or a reduce-add when adding), and
    none of the row-major epilogue: no plain stmatrix, no 2-d TMA store or add, no masked chunk."""
    rows = compile_rows("nmoe.fast.gemm.sm90", (STORE, ADD))
    assert_rows_ok(rows["sm_90a"], "sm_90a", 2)
    plain = "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%r1]"
    trans = "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%r1]"
    operands = ".bulk_group [%rd1, {%r1, %r2, %r3}], [%r4];"
    store3, add3 = (f"cp.{w}async.bulk.tensor.3d.global.shared::cta.{a}tile{operands}"
                    for w, a in (("", ""), ("reduce.", "add.")))
    for name, mine, other in ((STORE, store3, add3), (ADD, add3, store3)):
        spec = _spec(name)
        assert any(re.search(rx, mine) for rx in spec.expect["sm_90a"])
        assert any(re.search(rx, other) for rx in spec.forbid["sm_90a"])
        assert any(re.search(rx, trans) for rx in spec.expect["sm_90a"])
        assert any(re.search(rx, plain) for rx in spec.forbid["sm_90a"])
        assert not any(re.search(rx, trans) for rx in spec.forbid["sm_90a"])


def _operands(case: Case) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """(x [T, H] token-major, dy [R, N] in permuted order with pad rows, slot, offs, top_k) on the GPU."""
    t, k, hid, n, e, align, _, routing = case
    g = torch.Generator().manual_seed(t * 3 + hid)
    x = torch.randn(t, hid, generator=g).to(torch.bfloat16).cuda()
    p = permute(x.new_empty(t, 0), _ids(t, k, e, routing, g).cuda(), e, align)
    dy = torch.randn(p.slot.shape[0], n, generator=g).to(torch.bfloat16).cuda()
    return x, dy, p.slot, p.offs, k


def _pair(case: Case) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor, Tensor, int]]:
    """(transposed kernel's dw [E, N, H], the dy-side kernel's x^T @ dy [E, H, N] transposed), from NaN."""
    x, dy, slot, offs, k = ops = _operands(case)
    e, n, hid = offs.shape[0], dy.shape[1], x.shape[1]
    got = into_nan([(e * n, hid)],
                   lambda: sm90.grouped_gemm_wgrad_gathered(dy, x, slot, k, offs, transposed=True))
    want = into_nan([(e * hid, n)], lambda: sm90.grouped_gemm_wgrad_gathered(x, dy, slot, k, offs, side="dy"))
    return got, want.transpose(1, 2), ops


@gpu
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}K{c[1]}H{c[2]}N{c[3]}E{c[4]}-{c[7]}" for c in CASES])
def test_transposed_wgrad_is_the_dy_side_ones_transposed(case: Case) -> None:
    got, want, _ = _pair(case)
    assert bool(want.abs().amax() > 0)
    assert torch.equal(got.view(torch.int16), want.contiguous().view(torch.int16)), "dw differs"


@gpu
@pytest.mark.parametrize("case", CASES[::2], ids=[f"T{c[0]}H{c[2]}N{c[3]}" for c in CASES[::2]])
def test_transposed_wgrad_adds_bit_for_bit_a_bf16_add(case: Case) -> None:
    got, _, (x, dy, slot, offs, k) = _pair(case)
    dw = torch.randn(got.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    want = (dw.float() + got.float()).to(torch.bfloat16)
    sm90.grouped_gemm_wgrad_gathered_add(dy, x, slot, k, offs, "x", dw, transposed=True)
    torch.cuda.synchronize()
    assert torch.equal(dw.view(torch.int16), want.view(torch.int16)), "dw + wgrad differs from a bf16 add"


@gpu
def test_sep_gemm_fast_wgrad_transposed_tile_swapped() -> None:
    """Tile (m, n) sent to tile (n, m)'s box: H = 288 makes three M tiles against one N tile of 256, so
    tiles 1 and 2 would land past N (dropped by TMA) and their dw columns stay NaN."""
    got, want, _ = _pair(CASES[0])
    assert want.shape[2] > 256 and want.shape[1] <= 256 and bool(want[:, :, 128:].abs().amax() > 0)
    assert torch.equal(got.view(torch.int16), want.contiguous().view(torch.int16))


@gpu
def test_sep_gemm_fast_wgrad_transposed_group_stride() -> None:
    """Each group's dw^T starts n * k elements after the last: a later group placed elsewhere moves a nonzero
    result, since several groups hold rows here."""
    got, want, (_, _, _, offs, _) = _pair(CASES[1])
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    assert int((counts[1:] > 0).sum()) > 1 and bool(want[1:].abs().amax() > 0)
    assert torch.equal(got.view(torch.int16), want.contiguous().view(torch.int16))
