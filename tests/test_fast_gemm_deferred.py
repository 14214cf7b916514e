"""The deferred epilogue (GEMM_WGRAD_DEFERRED, GEMM_FWD_DEFERRED, GEMM_GATHER_DEFERRED): a finished tile's
bf16 subtiles wait in registers and leave one per K box of the CTA's next tile, under its wgmmas, act(h) of
each computed as it leaves. The values and their rounding are the plain epilogue's, so the contract is that
epilogue's output bit for bit, every tile written (NaN-filled outputs): split and unsplit groups, tiles cut
by n and k, tiles with fewer K boxes than subtiles, the accumulating wgrad, the cooperative fwd and dgrad,
the gathering ones with and without h, and the last tile of each CTA."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any, cast

import pytest
import torch
from fastcompile import assemble
from test_fast_gemm import ROOT, child_env, cumsum, into_nan, offs_of, zipf_counts
from test_fast_gemm_gather_dynamic import WIDE_CASES as GATHER_CASES
from test_fast_gemm_gather_dynamic import Case as GatherCase
from test_fast_gemm_gather_dynamic import case_tensors as gather_case
from test_fast_wgrad_schedule import SKEWED

from nmoe.fast.gemm import sm90 as gemm

gpu = pytest.mark.gpu
CASES = {"zipf": SKEWED, "uniform": [1024] * 16, "one": [0, 0, 7000, 3], "short": [70, 1, 130, 0, 64],
         "many": zipf_counts(40000, 128)}


def _both(run: object, monkeypatch: pytest.MonkeyPatch,
          flag: str = "GEMM_WGRAD_DEFERRED") -> list[torch.Tensor]:
    outs = []
    for deferred in (False, True):
        monkeypatch.setattr(gemm, flag, deferred)
        outs.append(run())  # type: ignore[operator]
    return outs


@gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("n", "k", "bn"), [(1024, 1024, 128), (200, 136, 128), (384, 1024, 256)])
def test_deferred_epilogue_equals_the_plain_one(case: str, n: int, k: int, bn: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    counts = CASES[case]
    m = sum(counts) + 5
    g = torch.Generator().manual_seed(41)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    offs = offs_of(cumsum(counts))

    def run() -> torch.Tensor:
        dw = torch.full((len(counts), n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemm._launch_wgrad(dy, x, offs, dw, bn)
        torch.cuda.synchronize()
        return dw

    plain, deferred = _both(run, monkeypatch)
    assert not bool(deferred.isnan().any()), "a held subtile never left"
    assert torch.equal(deferred.view(torch.int16), plain.view(torch.int16))


@gpu
def test_deferred_epilogue_accumulates_column_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's accumulating column-chunk wgrad: two chunks added into a random dw, bit for bit."""
    n, k = 256, 512
    m = sum(SKEWED) + 5
    g = torch.Generator().manual_seed(42)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(m, 2 * k, generator=g).to(torch.bfloat16).cuda()
    offs = offs_of(cumsum(SKEWED))
    old = torch.randn(len(SKEWED), n, 2 * k, generator=g).to(torch.bfloat16).cuda()

    def run() -> torch.Tensor:
        dw = old.clone()
        gemm.grouped_gemm_wgrad_cols(dy, x[:, k:].contiguous(), offs, dw, k, accumulate=True)
        gemm.grouped_gemm_wgrad_cols(dy, x[:, :k].contiguous(), offs, dw, 0, accumulate=True)
        torch.cuda.synchronize()
        return dw

    plain, deferred = _both(run, monkeypatch)
    assert torch.equal(deferred.view(torch.int16), plain.view(torch.int16))


def _wgrad_every_subtile_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Subtile 1 of a held wgrad tile leaves when the CTA's next tile has two or more K boxes (256 tiles over
    at most 132 CTAs, groups of 2-5 boxes): no NaN stays where the plain epilogue writes numbers."""
    counts = [300, 200, 0, 129]
    m = sum(counts)
    g = torch.Generator().manual_seed(43)
    dy = torch.randn(m, 1024, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(m, 1024, generator=g).to(torch.bfloat16).cuda()
    offs = offs_of(cumsum(counts))

    def run() -> torch.Tensor:
        dw = torch.full((len(counts), 1024, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemm._launch_wgrad(dy, x, offs, dw, 128)
        torch.cuda.synchronize()
        return dw

    plain, deferred = _both(run, monkeypatch)
    assert not bool(plain.isnan().any())
    assert not bool(deferred.isnan().any()), "a held subtile never left"
    assert torch.equal(deferred.view(torch.int16), plain.view(torch.int16))


@gpu
@pytest.mark.parametrize("case", ["zipf", "uniform", "one", "short"])
@pytest.mark.parametrize(("op", "n", "k", "bn"), [("grouped_gemm", 1024, 2048, 256),
                                                  ("grouped_gemm", 200, 192, 128),
                                                  ("grouped_gemm_dgrad", 1024, 2048, 256),
                                                  ("swiglu", 1024, 2048, 256),
                                                  ("relu2", 384, 192, 128)])
def test_deferred_fwd_equals_the_plain_one(case: str, op: str, n: int, k: int, bn: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The cooperative fwd (with either fused activation: h and act(h)) and dgrad, forced at K = 192 too
    (3 K boxes under 4 subtiles)."""
    counts = CASES[case]
    m = sum(counts) + 5
    g = torch.Generator().manual_seed(44)
    a = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    fwd = op != "grouped_gemm_dgrad"
    w = torch.randn(len(counts), *((n, k) if fwd else (k, n)), generator=g) / k**0.5
    w = w.to(torch.bfloat16).cuda()
    offs = offs_of(cumsum(counts))
    act = op if op in ("swiglu", "relu2") else "none"

    def run() -> list[torch.Tensor]:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        act_out = None if act == "none" else torch.full((m, gemm.act_width(w, act)), float("nan"),
                                                        dtype=torch.bfloat16, device="cuda")
        gemm._launch(op, a, w, offs, out, fwd, bn, act_out, act, pingpong=False)
        torch.cuda.synchronize()
        return [out] if act_out is None else [out, act_out]

    plain, deferred = _both(run, monkeypatch, "GEMM_FWD_DEFERRED")
    for want, got in zip(plain, deferred, strict=True):
        assert not bool(got[: sum(counts)].isnan().any()), "a held subtile never left"
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@gpu
def test_sep_gemm_fast_deferred_subtile_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Box kt sending subtile kt + 1 (one K loop serves the fwd, dgrad and wgrad): subtile 1 of every held
    tile never leaves (fwd: 32 K boxes a tile, 512 tiles over at most 132 CTAs), so NaN stays where the
    plain epilogue writes numbers."""
    test_deferred_fwd_equals_the_plain_one("uniform", "grouped_gemm", 1024, 2048, 256, monkeypatch)
    _wgrad_every_subtile_leaves(monkeypatch)


@gpu
@pytest.mark.parametrize("case", GATHER_CASES, ids=[f"H{c[2]}N{c[3]}-{c[6]}" for c in GATHER_CASES])
@pytest.mark.parametrize("keep_h", [True, False])
def test_deferred_gathered_equals_the_plain_one(case: GatherCase, keep_h: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The gathering up projection (h and act(h), or act(h) alone) and the gathered dgrad: K boxes from 1 to
    32 under 8 subtiles, several N tiles per M tile, pad rows and a zero-filled tail."""
    x, w, dy, slot, offs = gather_case(case)
    k, act, m = case[1], case[6], slot.shape[0]
    shapes = [(m, w.shape[1]), (m, gemm.act_width(w, act))][0 if keep_h else 1:]

    def up() -> tuple[torch.Tensor, ...]:
        return gemm.grouped_gemm_act_gathered(x, slot, k, w, offs, act, keep_h)

    def dgrad() -> tuple[torch.Tensor, ...]:
        return (gemm.grouped_gemm_dgrad_gathered(dy, slot, k, w, offs),)

    def run() -> list[torch.Tensor]:
        return [*into_nan(shapes, up), *into_nan([(m, x.shape[1])], dgrad)]

    plain, deferred = _both(run, monkeypatch, "GEMM_GATHER_DEFERRED")
    for name, want, got in zip(("act(h)", "h", "dx"), plain, deferred, strict=True):
        assert not bool(want.isnan().any()), f"plain {name} has NaN: the NaN fill would not show"
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"deferred {name} differs"


@gpu
def test_sep_gemm_fast_gather_deferred_act_chunk_misplaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each held subtile's act(h) is computed HELD_ACT_VALUES h values at a time: every chunk staged at its
    own outputs, not all at the subtile's first ones (then the others keep an earlier subtile's values)."""
    case = GATHER_CASES[2]
    x, w, _, slot, offs = gather_case(case)
    a, _ = gemm.grouped_gemm_act_gathered(x, slot, case[1], w, offs, case[6])
    rows = int(offs[-1])
    subtiles = a[:rows].view(rows, -1, 16)
    assert not bool((subtiles[:, 2:] == subtiles[:, :-2]).all()), "stale staged outputs would look right"
    test_deferred_gathered_equals_the_plain_one(case, False, monkeypatch)


_PROBE = r"""
import json
from nmoe.fast import runtime
from nmoe.fast.gemm import sm90
runtime.import_cutlass("sm_90a")
out = {"ex2": None, "ptx": {}}
for spec in sm90.KERNELS:
    if "deferred" not in spec.name:
        continue
    ptx = out["ptx"][spec.name] = spec.compile("sm_90a")
    if spec.name == "grouped_gemm_act_gathered_swiglu_n256_deferred":
        lines = ptx.splitlines()
        mma = [i for i, ln in enumerate(lines) if "wgmma.mma_async" in ln]
        batches = [i for j, i in enumerate(mma) if j == 0 or i - mma[j - 1] > 40]
        out["ex2"] = [sum("ex2.approx" in ln for ln in lines[batches[0]:batches[1]]),
                      sum("ex2.approx" in ln for ln in lines)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe() -> dict[str, object]:
    """The deferred kernels' PTX facts, compiled for sm_90a in a fresh process, and ptxas's log of each where
    some install has ptxas (fastcompile.tool)."""
    env = child_env()
    env.pop("CUTE_DSL_ARCH", None)
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=900,
                         cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    found: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    found["ptxas"] = assemble(cast(dict[str, str], found.pop("ptx")), "sm_90a")
    return found


def test_deferred_act_is_computed_under_the_k_box_that_sends_it(probe: dict[str, object]) -> None:
    """Between a unit's first K box's wgmmas and the K loop's, the swiglu deferred kernel computes one held
    subtile's act(h) (8 of its 16 h values' exp), not the whole tile's 64: LLVM hoists the loop-invariant
    activation of every held subtile out of the loop unless the held h passes through `pinned`."""
    before_loop, total = cast(list[int], probe["ex2"])
    assert total >= 64, "the kernel computes no swiglu"
    assert before_loop <= 8, f"{before_loop} exp before the K loop: the held tile's act(h) was hoisted"


def test_deferred_kernels_keep_their_wgmmas_pipelined(probe: dict[str, object]) -> None:
    """ptxas injects waits (C7517) or serializes a kernel's wgmmas (C7514, C7518) where registers a wgmma
    writes may be touched while it is in flight: each deferred kernel must assemble with neither, and the
    plain ones without spilling."""
    runs = cast(dict[str, dict[str, Any]] | None, probe["ptxas"])
    if runs is None:
        pytest.skip("ptxas not installed: the deferred kernels' PTX was not assembled")
    assert len(runs) == sum("deferred" in s.name for s in gemm.KERNELS)
    for name, run in runs.items():
        log = run["log"]
        assert run["rc"] == 0, (name, log)
        assert not re.search(r"C751[478]|serialized", log), (name, log)
        if "act" not in name and "accumulate" not in name:
            assert "0 bytes spill stores" in log, (name, log)
