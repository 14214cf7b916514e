"""The TMA-fed wgrad in ping-pong (GEMM_WGRAD_PINGPONG): each consumer warpgroup takes every other work
item of its CTA, a whole BM x GEMM_PINGPONG_BN tile, and their mainloops take turns, so one's epilogue runs
under the other's wgmmas. Which warpgroup computes a tile never changes its bits, so the contract is the
cooperative wgrad's at the same tile width, bit for bit, every tile written (NaN-filled outputs): ragged,
split and empty groups, both schedules, the layer's accumulating column chunks. The schedule and refusals
need no GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from test_fast_wgrad_dynamic import BN, K, run_chunks, run_wgrad
from test_fast_wgrad_schedule import SKEWED

from nmoe.fast.gemm import sm90 as gemm
from nmoe.fast.limits import GEMM_PINGPONG_BN

gpu = pytest.mark.gpu

DYNAMIC = "grouped_gemm_wgrad_pingpong_dynamic_n128"
CHUNKS = "grouped_gemm_wgrad_pingpong_cols_accumulate_n128"
N = 256
ROUTINGS = {"zipf": SKEWED, "uniform": [1024] * 16, "one": [0, 0, 7000, 3], "short": [70, 1, 130, 0, 64]}


def test_schedule_takes_pingpong_tiles_unless_another_width_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm, "GEMM_WGRAD_PINGPONG", False)
    assert gemm.wgrad_schedule(4096) == (gemm.pick_bn(4096), False)
    monkeypatch.setattr(gemm, "GEMM_WGRAD_PINGPONG", True)
    assert gemm.wgrad_schedule(4096) == (GEMM_PINGPONG_BN, True)
    assert gemm.wgrad_schedule(4096, GEMM_PINGPONG_BN) == (GEMM_PINGPONG_BN, True)
    assert gemm.wgrad_schedule(4096, 256) == (256, False), "another width asked for: cooperative"


@pytest.mark.parametrize(("flag", "value"), [("GEMM_WGRAD_DEFERRED", True), ("GEMM_WGRAD_CLUSTER_M", 2)])
def test_schedule_refuses_flags_pingpong_cannot_honour(flag: str, value: object,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm, "GEMM_WGRAD_PINGPONG", True)
    monkeypatch.setattr(gemm, flag, value)
    with pytest.raises(ValueError, match=f"{flag}={value}"):
        gemm.wgrad_schedule(4096)


def test_kernel_refuses_what_pingpong_cannot_run() -> None:
    """Direct callers of the kernel get the refusals: a 256-wide tile, a cluster, a deferred epilogue."""
    code = ("from nmoe.fast import runtime; runtime.import_cutlass('sm_90a')\n"
            "from nmoe.fast.kernels.sm90 import grouped_gemm_wgrad as k\n"
            "for kw in ({'bn': 256}, {'bn': 128, 'cm': 2}, {'bn': 128, 'deferred': True}):\n"
            "    try:\n"
            "        k.compile_args(2048, 4096, ld=4096, pingpong=True, **kw)\n"
            "    except ValueError as e:\n"
            "        print('REFUSED', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"},
                       capture_output=True, text=True, timeout=300)
    refusals = [line for line in r.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refusals) == 3 and all("takes bn=128, cm=1" in line for line in refusals), r.stdout + r.stderr


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict[str, Any]]]:
    return compile_rows("nmoe.fast.gemm.sm90", (DYNAMIC, CHUNKS))


def test_pingpong_kernels_take_turns(rows: dict[str, list[dict[str, Any]]]) -> None:
    """Both compile with 128-wide wgmmas, the turn barrier's arrive and the wgrad's mask, split and (for the
    column chunks) reduce-add rules."""
    for name in (DYNAMIC, CHUNKS):
        spec = next(s for s in gemm.KERNELS if s.name == name)
        assert any(re.search(rx, "bar.arrive %r745, 256;") for rx in spec.expect["sm_90a"]), name
        assert_rows_ok([r for r in rows["sm_90a"] if r["kernel"] == name], "sm_90a", 1)


def _pair(counts: list[int], seed: int, monkeypatch: pytest.MonkeyPatch,
          dynamic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    runs = [run_wgrad(counts, seed, monkeypatch, N, GEMM_WGRAD_PINGPONG=pp, GEMM_WGRAD_DYNAMIC=dynamic)
            for pp in (False, True)]
    assert gemm.wgrad_schedule(K, BN) == (BN, True), "the second run was ping-pong"
    return runs[0], runs[1]


@gpu
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_pingpong_equals_the_cooperative_wgrad(routing: str, dynamic: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cooperative, pingpong = _pair(ROUTINGS[routing], 51, monkeypatch, dynamic)
    assert not bool(pingpong.isnan().any()), "a tile neither warpgroup took stays NaN"
    assert torch.equal(pingpong.view(torch.int16), cooperative.view(torch.int16))


@gpu
def test_pingpong_column_chunks_accumulate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's column-chunk wgrad (rows ld apart, added into dw): bit for bit the cooperative 128-wide
    tile's."""
    cooperative = run_chunks(52, monkeypatch, N, True, GEMM_WGRAD_PINGPONG=False, pick_bn=lambda n: BN)
    pingpong = run_chunks(52, monkeypatch, N, True, GEMM_WGRAD_PINGPONG=True)
    assert torch.equal(pingpong.view(torch.int16), cooperative.view(torch.int16))


@gpu
def test_sep_gemm_fast_wgrad_pingpong_tid_unshifted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each warpgroup masks a group's last box and publishes a split chunk with its threads numbered from 0:
    numbered by consumer thread, warpgroup 1 skips the mask's first 128 chunks and never sets its split flag,
    so the next group's rows leak into its tiles. Short groups end inside boxes; the 7000-row one splits."""
    counts = [70, 1, 7000, 130, 0, 64, 3]
    cooperative, pingpong = _pair(counts, 53, monkeypatch, True)
    assert not bool(pingpong.isnan().any())
    assert torch.equal(pingpong.view(torch.int16), cooperative.view(torch.int16))
