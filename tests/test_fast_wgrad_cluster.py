"""The TMA-fed wgrad in M clusters (GEMM_WGRAD_CLUSTER_M): the CTAs of a cluster take one work item's M tiles
side by side and share each x box by TMA multicast; when dynamic, CTA 0 takes each item from the counter and
stores it into every CTA's ring. Who computes a tile never changes its bits, so the contract is the
unclustered wgrad's, bit for bit, every tile written (NaN-filled outputs). The schedule needs no GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from test_fast_wgrad_dynamic import run_chunks, run_wgrad
from test_fast_wgrad_schedule import SKEWED

from nmoe.fast.gemm import sm90 as gemm
from nmoe.fast.limits import GEMM_BM

gpu = pytest.mark.gpu

DYNAMIC, STATIC = "grouped_gemm_wgrad_cluster2_dynamic_n256", "grouped_gemm_wgrad_cluster2_n256"
N = 512
ROUTINGS = {"zipf": SKEWED, "uniform": [1024] * 16, "one": [0, 0, 7000, 3]}


def test_schedule_clusters_only_m_tiles_that_fill_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm, "GEMM_WGRAD_CLUSTER_M", 2)
    assert gemm.wgrad_cluster(2048) == 2
    assert gemm.wgrad_cluster(3 * GEMM_BM) == 1, "three M tiles do not pair up"
    assert gemm.wgrad_cluster(GEMM_BM) == 1, "one M tile: no pair to share x with"
    monkeypatch.setattr(gemm, "GEMM_WGRAD_CLUSTER_M", 4)
    assert gemm.wgrad_cluster(4 * GEMM_BM) == 4
    assert gemm.wgrad_cluster(6 * GEMM_BM) == 2, "six M tiles: the widest cluster they fill"
    monkeypatch.setattr(gemm, "GEMM_WGRAD_CLUSTER_M", 1)
    assert gemm.wgrad_cluster(2048) == 1


def test_cluster_launches_whole_clusters(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CTA per SM rounded down to whole clusters; a grid sized by a few tiles stays a multiple too."""
    monkeypatch.setattr(gemm.runtime, "sm_count", lambda device: 133)
    assert gemm._wgrad_grid(0, 1 << 16, 2048, 4096, 256, 8, True, 2)[0] == 132
    assert gemm._wgrad_grid(0, 1 << 16, 2048, 4096, 256, 8, True, 1)[0] == 133
    assert gemm._wgrad_grid(0, 64, 256, 256, 256, 1, True, 2)[0] == 2, "two tiles: one cluster"


def test_kernel_refuses_a_cluster_its_m_tiles_do_not_fill() -> None:
    """Direct callers of the kernel get the refusal the schedule never triggers."""
    code = ("from nmoe.fast import runtime; runtime.import_cutlass('sm_90a'); "
            "from nmoe.fast.kernels.sm90 import grouped_gemm_wgrad as k; "
            "k.compile_args(384, 512, 128, 512, cm=2)")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "fill whole clusters" in r.stderr, r.stderr[-2000:]


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict[str, Any]]]:
    return compile_rows("nmoe.fast.gemm.sm90", (DYNAMIC, STATIC))


def _rules(name: str, kind: str) -> tuple[str, ...]:
    spec = next(s for s in gemm.KERNELS if s.name == name)
    out: tuple[str, ...] = getattr(spec, kind)["sm_90a"]
    return out


def test_cluster_kernels_multicast_and_hand_items_over(rows: dict[str, list[dict[str, Any]]]) -> None:
    """Both compile with the x box multicast and the cluster barrier; only the dynamic one stores items
    into the other CTAs' rings, which the static one's rules refuse."""
    store = "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%r1], %r2, [%r3];"
    multicast = ("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 ".multicast::cluster.L2::cache_hint [%r1], [%rd1, {%r2, %r3}], [%r4], %rs1, %rd2;")
    assert any(re.search(rx, store) for rx in _rules(DYNAMIC, "expect"))
    assert any(re.search(rx, store) for rx in _rules(STATIC, "forbid"))
    for name in (DYNAMIC, STATIC):
        assert any(re.search(rx, multicast) for rx in _rules(name, "expect")), name
        assert_rows_ok([r for r in rows["sm_90a"] if r["kernel"] == name], "sm_90a", 1)


def _wgrad(counts: list[int], seed: int, monkeypatch: pytest.MonkeyPatch, cm: int,
           dynamic: bool = True) -> torch.Tensor:
    dw = run_wgrad(counts, seed, monkeypatch, N, GEMM_WGRAD_CLUSTER_M=cm, GEMM_WGRAD_DYNAMIC=dynamic)
    assert gemm.wgrad_cluster(N) == cm, "the case ran in clusters of cm"
    return dw


@gpu
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("cm", [2, 4])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_cluster_equals_the_unclustered_wgrad(routing: str, cm: int, dynamic: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    counts = ROUTINGS[routing]
    alone = _wgrad(counts, 41, monkeypatch, 1)
    clustered = _wgrad(counts, 41, monkeypatch, cm, dynamic)
    assert not bool(clustered.isnan().any()), "a tile no CTA took stays NaN"
    assert torch.equal(clustered.view(torch.int16), alone.view(torch.int16))


@gpu
def test_cluster_column_chunks_accumulate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's column-chunk wgrad (rows ld apart, added into dw) in clusters of two: bit for bit alone."""
    alone = run_chunks(42, monkeypatch, N, True, GEMM_WGRAD_CLUSTER_M=1)
    clustered = run_chunks(42, monkeypatch, N, True, GEMM_WGRAD_CLUSTER_M=2)
    assert torch.equal(clustered.view(torch.int16), alone.view(torch.int16))


@gpu
def test_sep_gemm_fast_wgrad_cluster_rank_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """CTA r of a cluster takes the item's r-th M tile: without its rank every CTA takes the first, and the
    other M tiles of every item stay NaN."""
    got = _wgrad(SKEWED, 43, monkeypatch, 2)
    assert not bool(got.isnan().any()), "every M tile of every item written"
    assert torch.equal(got.view(torch.int16), _wgrad(SKEWED, 43, monkeypatch, 1).view(torch.int16))


@gpu
def test_sep_gemm_fast_wgrad_cluster_x_same_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each CTA loads its own half of the x box for both: both loading the first delivers the same bytes (no
    hang) but never the second half, whose place then holds an earlier stage's data."""
    want = _wgrad(ROUTINGS["uniform"], 44, monkeypatch, 1)
    assert bool((want.float().abs().sum(dim=(0, 1)) > 0).all()), "every column of dw depends on x's rows"
    got = _wgrad(ROUTINGS["uniform"], 44, monkeypatch, 2)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
