"""The accumulating wgrads (grouped_gemm_wgrad_cols(..., accumulate=True) and the gathered
grouped_gemm_wgrad_gathered_add), which the MoE layer's later microbatches add their expert gradients with:
their PTX adds (TMA reduce-add for full tiles; a load, an fp32 add and one rounding for tiles cut by n or k)
and never stores over dw; on a GPU, bit for bit dw + wgrad in bf16."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from test_fast_gemm import cumsum, offs_of
from test_fast_wgrad_schedule import SKEWED

from nmoe.fast.gemm import grouped_gemm_wgrad
from nmoe.fast.gemm import sm90 as gemm

gpu = pytest.mark.gpu
ACC = "grouped_gemm_wgrad_cols_accumulate_n256"
STORE = "grouped_gemm_wgrad_cols_n256"
GATHERED_ACC = "grouped_gemm_wgrad_gathered_dy_accumulate_n256"
GATHERED_STORE = "grouped_gemm_wgrad_gathered_dy_n128"


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict[str, Any]]]:
    return compile_rows("nmoe.fast.gemm.sm90", (ACC, STORE, GATHERED_ACC, GATHERED_STORE))


def _spec(name: str) -> Any:
    return next(k for k in gemm.KERNELS if k.name == name)


def _check_rules(rows: dict[str, list[dict[str, Any]]], acc: str = ACC, store_kernel: str = STORE) -> None:
    """The accumulating kernel compiles to reduce-adds and load-add-stores, the storing one to stores; each
    rule set tells a TMA store from a TMA reduce-add and a masked add from a masked store."""
    operands = ".bulk_group [%rd1, {%r1, %r2}], [%r3];"
    reduce_add = "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile" + operands
    store = "cp.async.bulk.tensor.2d.global.shared::cta.tile" + operands
    acc_ptx = next(r for r in rows["sm_90a"] if r["kernel"] == acc)
    assert acc_ptx["status"] == "ok", acc_ptx
    acc_rules = _spec(acc).forbid["sm_90a"]
    assert any(re.search(rx, store) for rx in acc_rules)
    assert not any(re.search(rx, reduce_add) for rx in acc_rules)
    store_rules = _spec(store_kernel).forbid["sm_90a"]
    assert any(re.search(rx, reduce_add) for rx in store_rules)
    assert not any(re.search(rx, store) for rx in store_rules)
    assert "ld\\.global\\.v4" in " ".join(_spec(acc).expect["sm_90a"])
    assert_rows_ok([r for r in rows["sm_90a"] if r["kernel"] == acc], "sm_90a", 1)
    assert_rows_ok([r for r in rows["sm_90a"] if r["kernel"] == store_kernel], "sm_90a", 1)


def test_accumulating_wgrad_compiles_to_adds(rows: dict[str, list[dict[str, Any]]]) -> None:
    _check_rules(rows)
    _check_rules(rows, GATHERED_ACC, GATHERED_STORE)


def test_sep_gemm_fast_wgrad_gathered_add_stores(rows: dict[str, list[dict[str, Any]]]) -> None:
    """The gathered wgrad's full tiles stored by a plain TMA store overwrite the gradient they add to."""
    _check_rules(rows, GATHERED_ACC, GATHERED_STORE)


def test_sep_gemm_fast_wgrad_accumulate_stores(rows: dict[str, list[dict[str, Any]]]) -> None:
    """Full tiles stored by a plain TMA store overwrite the gradient they should add to."""
    _check_rules(rows)


def test_sep_gemm_fast_wgrad_accumulate_cut_tile_stores(rows: dict[str, list[dict[str, Any]]]) -> None:
    """Cut tiles stored chunk by chunk overwrite theirs: no ld.global.v4 of dw in the kernel."""
    assert "ld\\.global\\.v4" in " ".join(_spec(ACC).expect["sm_90a"])
    _check_rules(rows)


@gpu
@pytest.mark.parametrize(("n", "k"), [(256, 512), (200, 136)])
def test_accumulate_adds_bit_for_bit_a_bf16_add(n: int, k: int) -> None:
    """Two column chunks added into a random dw under skewed groups that split: dw + wgrad rounded as
    torch's bf16 add, full tiles (256 x 512) and tiles cut by n and k (200 x 136); no rows leave dw as is."""
    m = sum(SKEWED) + 5
    g = torch.Generator().manual_seed(31)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(m, 2 * k, generator=g).to(torch.bfloat16).cuda()
    offs = offs_of(cumsum(SKEWED))
    old = torch.randn(offs.numel(), n, 2 * k, generator=g).to(torch.bfloat16).cuda()
    bounds = [0, k, 2 * k]
    new = torch.cat([grouped_gemm_wgrad(dy, x[:, c0:c1].contiguous(), offs)
                     for c0, c1 in itertools.pairwise(bounds)], dim=2)
    want = old + new
    assert not torch.equal(want, new) and not torch.equal(want, old)
    got = old.clone()
    for c0, c1 in itertools.pairwise(bounds):
        gemm.grouped_gemm_wgrad_cols(dy, x[:, c0:c1].contiguous(), offs, got, c0, accumulate=True)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    none = torch.zeros_like(offs)
    gemm.grouped_gemm_wgrad_cols(dy[:0], x[:0, :k].contiguous(), none, got, 0, accumulate=True)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@gpu
@pytest.mark.parametrize(("hid", "inter"), [(1536, 256), (200, 136)])
def test_gathered_add_is_bit_for_bit_a_bf16_add(hid: int, inter: int) -> None:
    """The down wgrad read from dout's token rows added into a random dw2 under a skewed routing: dw2 + the
    stored gathered wgrad rounded as torch's bf16 add, full tiles (1536 x 256) and tiles cut by n and k
    (200 x 136); no rows leave dw2 as it is."""
    from test_fast_gemm_gather import _ids

    from nmoe.fast.dispatch import permute

    t, k, e = 3000, 4, 8
    g = torch.Generator().manual_seed(37)
    dout = torch.randn(t, hid, generator=g).to(torch.bfloat16).cuda()
    p = permute(dout, _ids(t, k, e, "skew", g).cuda(), e, 128)
    a = torch.randn(p.xp.shape[0], inter, generator=g).to(torch.bfloat16).cuda()
    old = torch.randn(e, hid, inter, generator=g).to(torch.bfloat16).cuda()
    new = gemm.grouped_gemm_wgrad_gathered(dout, a, p.slot, k, p.offs, side="dy")
    want = old + new
    assert not torch.equal(want, new) and not torch.equal(want, old)
    got = old.clone()
    gemm.grouped_gemm_wgrad_gathered_add(dout, a, p.slot, k, p.offs, "dy", got)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    gemm.grouped_gemm_wgrad_gathered_add(dout, a[:0], p.slot[:0], k, torch.zeros_like(p.offs), "dy", got)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
