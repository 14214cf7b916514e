"""A cp.async gathering producer fed by a tile queue (the dynamic gathered fwd/dgrad and wgrad) lands
each stage gather_lag stages after issuing it, so the consumers finish a tile only once the producer has
issued more. A unit with no stages (the zero-filled rows past offs[-1], a wgrad tile of an empty group) issues
none: the producer would hand such units on until its queue is full while the consumers wait for stages only
it lands. Its contract: at such a unit it lands all in flight (chunkload.land_pending), and its lag is at most
the queue's depth (queued_lag); every run returns. A model of the protocol states it; the GPU tests run the
shapes that stood still before (c1 of bench.ablate's gather set; empty experts) in a child with a timeout."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fastcompile import assert_rows_ok, compile_rows
from test_fast_wgrad_accumulate import _spec

from nmoe.checkout import tree_pythonpath
from nmoe.fast.kernels.sm90.gatherplan import queued_lag
from nmoe.fast.limits import GEMM_GATHER_LAG

gpu = pytest.mark.gpu
QUEUED = ("grouped_gemm_act_gathered_swiglu_n256_dynamic", "grouped_gemm_dgrad_gathered_n256_dynamic",
          "grouped_gemm_wgrad_gathered_x_on_m_dynamic_n256",
          "grouped_gemm_wgrad_gathered_dy_accumulate_dynamic_n128")
STATIC = ("grouped_gemm_act_gathered_relu2_n128_k288", "grouped_gemm_wgrad_gathered_x_on_m_n256")
DEPTH = 4
ROOT = Path(__file__).resolve().parents[1]


def pipeline_finishes(stages: int, lag: int, units: list[int], land_at_empty: bool = True,
                      depth: int | None = DEPTH) -> bool:
    """Play a gathering pipeline out: the producer takes stage p's slot once stage p - stages is released and
    lands p - lag after issuing p (with land_at_empty, all at a unit with no stages; the rest at its end); the
    consumers need stage j landed, release j - 1 once j's MMAs are issued and a unit's last stage once its
    MMAs drain, then read the next unit. With a queue, the producer hands unit i (and its end) only once the
    consumers have read unit i - depth. False at a standstill."""
    starts = [sum(units[:i]) for i in range(len(units) + 1)]
    total = starts[-1]
    handed = issued = arrived = consumed = 0
    read = 1
    released: set[int] = set()
    while read <= len(units) or consumed < total:
        moved = False
        free = depth is None or handed < depth or handed - depth < read
        if handed <= len(units) and (handed == 0 or issued == starts[handed]) and free:
            handed += 1
            if handed > len(units):
                arrived = total
            elif units[handed - 1] == 0 and land_at_empty:
                arrived = issued
            moved = True
        elif handed and handed <= len(units) and issued < starts[handed] and (
                issued < stages or issued - stages in released):
            issued += 1
            arrived = max(arrived, issued - lag)
            moved = True
        u = read - 1
        if u < len(units) and consumed < starts[u + 1] and consumed < arrived:
            j = consumed
            if j > starts[u]:
                released.add(j - 1)
            if j == starts[u + 1] - 1:
                released.add(j)
            consumed += 1
            moved = True
        elif read <= len(units) and consumed == starts[read] and read < handed:
            read += 1
            moved = True
        if not moved:
            return False
    return True


def test_units_without_stages_stand_still_unless_landed() -> None:
    """A tile of three stages, then units with none: handing them on fills the queue while the tile's last
    stages wait to land; landing all at the first of them lets it finish."""
    units = [3, 0, 0, 0, 0, 0]
    assert not pipeline_finishes(4, 2, units, land_at_empty=False)
    assert pipeline_finishes(4, 2, units)
    assert pipeline_finishes(4, 2, [3, 1, 1, 1, 1, 1], land_at_empty=False), "later stages land earlier ones"


def test_queued_lag_is_bounded_by_the_queue() -> None:
    """Landing at empty units, one-stage units, runs of empty ones and random mixes finish for every depth
    queued_lag allows; one lag past the queue's depth stands still on one-stage units, and it is refused."""
    queue = (ROOT / "nmoe/fast/kernels/sm90/tilequeue.py").read_text()
    assert re.search(rf"^QUEUE_DEPTH = {DEPTH}$", queue, re.M), "the model's depth is the kernels' queue's"
    rng = random.Random(7)
    for stages in range(3, DEPTH + 4):
        mixes = [[1] * 20, [5, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0],
                 [rng.choice((0, 0, 1, 2, 9)) for _ in range(40)]]
        for lag in range(1, min(stages - 2, DEPTH) + 1):
            assert all(pipeline_finishes(stages, queued_lag(stages, DEPTH, lag), m) for m in mixes), stages
    assert not pipeline_finishes(DEPTH + 3, DEPTH + 1, [1] * 20)
    with pytest.raises(ValueError, match="could fill the queue"):
        queued_lag(DEPTH + 3, DEPTH, DEPTH + 1)
    assert queued_lag(DEPTH + 3, DEPTH) == GEMM_GATHER_LAG <= DEPTH, "the kernels' lag fits the queue"


def test_sep_gemm_fast_gather_queued_no_landing() -> None:
    """Separating: the model stands still without the landing at an empty unit and finishes with it (above).
    Which the kernels do: a queue-fed producer waits for all its copies twice (at an empty unit and at its
    end), a static one once; the rules tell one wait from two."""
    assert not pipeline_finishes(4, 2, [3, 0, 0, 0, 0, 0], land_at_empty=False)
    assert pipeline_finishes(4, 2, [3, 0, 0, 0, 0, 0])
    rows = compile_rows("nmoe.fast.gemm.sm90", (*QUEUED, *STATIC))
    assert_rows_ok(rows["sm_90a"], "sm_90a", len(QUEUED) + len(STATIC))
    one = "cp.async.wait_group \t0;"
    two = f"{one}\n\tbar.sync 1, 256;\n{one}"
    for name in QUEUED:
        assert any(re.search(rx, two) and not re.search(rx, one) for rx in _spec(name).expect["sm_90a"])
    for name in STATIC:
        assert any(re.search(rx, two) and not re.search(rx, one) for rx in _spec(name).forbid["sm_90a"])


_ZERO_FILLED = """
import torch
from nmoe.fast.dispatch import permute
from nmoe.fast.gemm import sm90
t, h, i, e, k = 32768, 4096, 1024, 128, 8
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
w = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * h**-0.5).to(torch.bfloat16)
w_down = (torch.randn(e, h, i, device="cuda", generator=g) * i**-0.5).to(torch.bfloat16)
dy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=1).indices
p, dyp = permute(x, ids, e, 128), permute(dy, ids, e, 128).xp
assert p.slot.shape[0] - int(p.offs[-1]) >= 32 * 128, "at least 32 zero-filled row blocks past offs[-1]"
for _ in range(3):
    up = sm90.grouped_gemm_act_gathered(x, p.slot, k, w, p.offs, "swiglu")
    down = sm90.grouped_gemm_dgrad_gathered(dy, p.slot, k, w_down, p.offs)
torch.cuda.synchronize()
tma = [*sm90.grouped_gemm_act_h(p.xp, w, p.offs, "swiglu"), sm90.grouped_gemm_dgrad(dyp, w_down, p.offs)]
outs = {True: [*up, down], False: tma}
"""

_EMPTY_EXPERTS = """
import torch
from nmoe.fast.dispatch import permute
from nmoe.fast.gemm import sm90
t, h, n, e, k = 8192, 2048, 1024, 64, 2
g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
ids = torch.tensor([[0, 1]], device="cuda").expand(t, k).contiguous()
p = permute(x.new_empty(t, 0), ids, e, 128)
dh = torch.randn(p.slot.shape[0], n, device="cuda", dtype=torch.bfloat16, generator=g)
outs = {}
for dynamic in (True, False):
    sm90.GEMM_WGRAD_GATHER_DYNAMIC = dynamic
    for _ in range(3):
        on_m = sm90.grouped_gemm_wgrad_gathered(dh, x, p.slot, k, p.offs, transposed=True)
        dy_side = sm90.grouped_gemm_wgrad_gathered(x, dh, p.slot, k, p.offs, "dy")
    torch.cuda.synchronize()
    outs[dynamic] = [on_m, dy_side]
"""


_SAME = """
pairs = zip(outs[True], outs[False])
print("same", all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in pairs))
"""


def _returns(code: str, seconds: int) -> str:
    """The child's stdout (`code` fills outs[True] and outs[False]; it prints whether every bit is the same);
    a run still going after `seconds` (compiles included) fails the test, not the session."""
    env = {**os.environ, "PYTHONPATH": tree_pythonpath(ROOT, os.environ.get("PYTHONPATH"))}
    try:
        done = subprocess.run([sys.executable, "-c", code + _SAME], capture_output=True, text=True,
                              timeout=seconds, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the kernels did not return within {seconds} s: a producer stood still")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@gpu
def test_gathered_fwd_and_dgrad_return_past_many_zero_filled_units() -> None:
    """c1 of the gather set: hundreds of zero-filled units after the last expert's (it stood still on the
    first call at 134b8b4); three calls each, every bit equal to the TMA-fed kernels' on permute's copies."""
    assert _returns(_ZERO_FILLED, 400).split() == ["same", "True"]


@gpu
def test_dynamic_wgrad_returns_past_many_empty_experts() -> None:
    """Every token on experts 0 and 1 of 64: 62 groups' tiles have no stages, taken last (heaviest first);
    three calls per side, every bit equal to the static schedule's."""
    assert _returns(_EMPTY_EXPERTS, 400).split() == ["same", "True"]
