"""The fp8 fwd's overlapped schedule (GEMM_FP8_OVERLAP): block kt's wgmmas stay in flight while block kt - 1
is promoted from the other block accumulator. Promotions keep K order, so its contract is the serial
schedule's, bit for bit (as is the staged output tile's); its PTX shape is read without a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_fast_gemm import cumsum, zipf_counts
from test_fast_gemm_fp8 import BLK, Case, _separates, assert_contract, make, probe, sm90
from torch import Tensor

from nmoe.fast.gemm import sm90_fp8 as gemm_fp8
from nmoe.fast.gemm.sm90_fp8 import KERNELS
from nmoe.fast.kernels.sm90.tiles import EPI_N

gpu = pytest.mark.gpu
__all__ = ["probe"]


def _k_blocks(name: str) -> int:
    spec = {s.name: s for s in KERNELS}[name]
    return int(dict(spec.compile.spec)["k"]) // BLK


def test_overlapped_kernels_are_compile_checked_for_even_and_odd_k_blocks() -> None:
    blocks = {_k_blocks(s.name) for s in KERNELS if "overlap" in s.name}
    assert any(b % 2 == 0 for b in blocks) and any(b % 2 == 1 for b in blocks), blocks
    for s in KERNELS:
        if "overlap" in s.name:
            assert any("aligned\\s+1" in rx for rx in s.expect["sm_90a"]), s.name


def test_consumer_promotes_each_block_under_the_next_blocks_mmas(probe: dict[str, Any]) -> None:
    """Block 0 is issued alone; every later block is issued, then wait_group 1 leaves it in flight while the
    block before is promoted (64 FMAs); the last is waited with wait_group 0 and promoted before the
    epilogue (an unrolled K loop: ptxas serializes the wgmmas of a rolled one)."""
    issue = [["ld.global.b8", 3], ["mbarrier.try_wait", 1], ["wgmma.fence", 1], ["wgmma.mma_async", 4]]
    step = [*issue, ["wgmma.wait_group.sync.aligned 1", 1], ["fma.rn.f32", 64]]
    names = [n for n in probe["ops"] if "overlap" in n]
    assert len(names) == 6, names
    for name in names:
        ops = probe["ops"][name]
        consumer = ops[[op for op, _ in ops].index("setmaxnreg.inc") + 1:]
        stmatrix = 16 if "at_once" in name else 8
        tail = [["wgmma.wait_group.sync.aligned 0", 1], ["fma.rn.f32", 64], ["stmatrix", stmatrix]]
        body = issue + step * (_k_blocks(name) - 1) + tail
        assert consumer[: len(body)] == body, (name, consumer[: len(body) + 2])


def _both(case: Case, monkeypatch: pytest.MonkeyPatch) -> tuple[Tensor, Tensor]:
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_OVERLAP", False)
    serial = case.run()
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_OVERLAP", True)
    overlapped = case.run()
    torch.cuda.synchronize()
    return serial, overlapped


@gpu
@sm90
@pytest.mark.parametrize("k", [128, 256, 384, 512, 1024, 4096])
def test_overlapped_schedule_equals_the_serial_one(k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = [0, 1, 300, 0, 129, 2, 700, 0, 64]
    case = make(sum(counts) + 5, 384, k, cumsum(counts), seed=k)
    serial, overlapped = _both(case, monkeypatch)
    assert torch.equal(overlapped.view(torch.int16), serial.view(torch.int16))
    ref, mag = case.ref()
    assert_contract(overlapped, ref, mag, k)


@gpu
@sm90
def test_overlapped_schedule_equals_the_serial_one_under_skew(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = zipf_counts(6000, 64)
    case = make(6000, 512, 2048, cumsum(counts), seed=21)
    serial, overlapped = _both(case, monkeypatch)
    assert torch.equal(overlapped.view(torch.int16), serial.view(torch.int16))


@gpu
@sm90
def test_sep_gemm_fast_fp8_overlap_next_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: block kt - 1 promoted (under block kt's wgmmas) with block kt's scales; the last block,
    promoted after the loop, keeps its own."""
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_OVERLAP", True)
    case = make(260, 256, 512, cumsum([130, 130]), seed=22)
    sx, sw = case.x_scale().clone(), case.w_scale().clone()
    sx[:-1], sw[:-1] = sx[1:].clone(), sw[1:].clone()
    ref, mag = _separates(case, case.formula(sx=sx, sw=sw))
    assert_contract(case.run(), ref, mag, case.k)


@gpu
@sm90
@pytest.mark.parametrize("k", [256, 384])
def test_sep_gemm_fast_fp8_overlap_tail_dropped(k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: a tile's last K block's wgmmas are waited for but never promoted (even and odd counts)."""
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_OVERLAP", True)
    case = make(200, 256, k, cumsum([130, 70]), seed=23)
    kept = slice(0, k // BLK - 1)
    mutated = case.formula(sx=case.x_scale()[kept], sw=case.w_scale()[kept], p=case.blocks()[kept])
    ref, mag = _separates(case, mutated)
    assert_contract(case.run(), ref, mag, case.k)


@gpu
@sm90
@pytest.mark.parametrize("k", [512, 4096])
def test_staged_tile_equals_two_subtiles(k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMM_FP8_STAGED_TILE moves only where the output waits in shared memory: the same bits, cut tiles
    (group ends, the last columns) included."""
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_TILE_AT_ONCE", False)
    _same_bits_either_way("GEMM_FP8_STAGED_TILE", k, k + 1, monkeypatch)


def _same_bits_either_way(flag: str, k: int, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The overlapped fwd gives the same bits with a store flag off and on: cut tiles (group ends, the last
    rows and columns) and clusters included."""
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_OVERLAP", True)
    counts = [0, 1, 300, 0, 129, 2, 700, 0, 64]
    case = make(sum(counts) + 5, 384, k, cumsum(counts), seed=seed)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(gemm_fp8, flag, on)
        outs.append(case.run())
    torch.cuda.synchronize()
    assert torch.equal(outs[1].view(torch.int16), outs[0].view(torch.int16))


def test_store_schedule_refuses_a_tile_at_once_that_is_not_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_TILE_AT_ONCE", True)
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_STAGED_TILE", False)
    with pytest.raises(ValueError, match="set GEMM_FP8_STAGED_TILE too"):
        gemm_fp8.store_schedule()


@pytest.mark.parametrize("at_once", [False, True])
def test_store_schedule_reads_the_flags(at_once: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_STAGED_TILE", True)
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_TILE_AT_ONCE", at_once)
    assert gemm_fp8.store_schedule() == (True, at_once)


@gpu
@sm90
@pytest.mark.parametrize("k", [256, 384, 512, 4096])
def test_tile_at_once_equals_per_subtile_stores(k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMM_FP8_TILE_AT_ONCE moves only when a staged tile's stores are issued: the same bits, cut tiles
    (group ends, the last rows), clusters and odd K block counts included."""
    _same_bits_either_way("GEMM_FP8_TILE_AT_ONCE", k, k + 2, monkeypatch)


@gpu
@sm90
def test_sep_gemm_fast_fp8_tile_at_once_first_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: a full tile leaving at once sends its first subtile's buffer to every subtile's columns."""
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_TILE_AT_ONCE", True)
    case = make(256, 256, 512, cumsum([128, 128]), seed=25)
    subtiles = case.formula().view(case.m, -1, BLK // EPI_N, EPI_N)
    first = subtiles[:, :, :1].expand_as(subtiles).reshape(case.m, case.n)
    ref, mag = _separates(case, first)
    assert_contract(case.run(), ref, mag, case.k)


@gpu
@sm90
def test_sep_gemm_fast_fp8_staged_store_next_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: each full tile's subtile store reads the next subtile's buffer, so it leaves with that
    subtile's values or an earlier tile's; the next subtile's values break the bound on this data."""
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_STAGED_TILE", True)
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_TILE_AT_ONCE", False)
    case = make(256, 256, 512, cumsum([128, 128]), seed=24)
    f = case.formula()
    nxt = f.view(case.m, -1, BLK // EPI_N, EPI_N).roll(-1, dims=2).reshape(case.m, case.n)
    ref, mag = _separates(case, nxt)
    assert_contract(case.run(), ref, mag, case.k)


@gpu
@sm90
def test_sep_gemm_fast_fp8_cluster_b_slice_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: both CTAs of a cluster load slice 0 of each B box, so the box's other half (its last 64 N rows
    or K columns, as the multicast splits it) keeps stale bytes; modelled as zeros, either half breaks it."""
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_CLUSTER_M", 2)
    case = make(384, 256, 512, cumsum([256, 128]), seed=24)
    assert case.k <= gemm_fp8.GEMM_FP8_CLUSTER_MAX_K
    boxes = case.wq.cpu().reshape(2, 256 // BLK, BLK, case.k // BLK, BLK)
    for lost in ((..., slice(BLK // 2, None), slice(None), slice(None)), (..., slice(BLK // 2, None))):
        wq = boxes.clone()
        wq[lost] = 0
        mutated = Case(case.xq.cpu(), case.xs.cpu(), wq.reshape(2, 256, case.k), case.ws.cpu(), case.ends)
        ref, mag = _separates(case, mutated.formula())
    assert_contract(case.run(), ref, mag, case.k)


@gpu
@sm90
@pytest.mark.parametrize("counts", [[0, 1, 300, 0, 129, 2, 700, 0, 64], [5, 5, 5, 1000]],
                         ids=["mixed", "small"])
def test_cluster_two_equals_ctas_alone(counts: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMM_FP8_CLUSTER_M = 2: two M tiles share each B box (multicast), a cluster's tile past its group's
    end is computed and never stored; the bits are those of CTAs alone, odd tile counts included."""
    case = make(sum(counts) + 5, 384, 512, cumsum(counts), seed=31)
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_CLUSTER_M", 1)
    alone = case.run()
    monkeypatch.setattr(gemm_fp8, "GEMM_FP8_CLUSTER_M", 2)
    clustered = case.run()
    torch.cuda.synchronize()
    assert torch.equal(clustered.view(torch.int16), alone.view(torch.int16))

