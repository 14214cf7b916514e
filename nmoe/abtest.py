"""The A/B bench of `nmoe prove`: BASE's tree and the new tree timed in their own worker processes with the
repetitions interleaved, an A/A rerun of BASE in a third process setting the noise floor, and the verdict of
each row: faster or slower only beyond that noise."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from nmoe.checkout import tree_pythonpath

Verdict = Literal["faster", "slower", "within noise"]
MIN_NOISE: Final = 0.01
MIN_REPS: Final = 4


@dataclass(frozen=True)
class RowVerdict:
    """`change` and `noise` are relative (0.05 = 5 %); `change` < 0 means the new tree takes less time."""

    verdict: Verdict
    base_ms: float
    new_ms: float
    aa_ms: float
    change: float
    noise: float


def _timings(name: str, xs: Sequence[float]) -> list[float]:
    out = [float(x) for x in xs]
    if not out or not all(math.isfinite(x) and x > 0 for x in out):
        raise ValueError(f"{name} timings must be a non-empty list of positive finite ms, got {list(xs)!r}")
    return out


def _spread(xs: Sequence[float]) -> float:
    """Half the interquartile range over the median: the relative scatter of one side's repetitions."""
    if len(xs) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return (q3 - q1) / 2 / statistics.median(xs)


def verdict(base: Sequence[float], new: Sequence[float], aa: Sequence[float],
            min_noise: float = MIN_NOISE) -> RowVerdict:
    """Medians of each side; the noise floor is the largest of `min_noise`, the A/A run's shift against BASE
    and each side's relative spread. Faster or slower only when the change exceeds that floor."""
    b, n, a = _timings("BASE", base), _timings("new", new), _timings("A/A", aa)
    mb, mn, ma = statistics.median(b), statistics.median(n), statistics.median(a)
    noise = max(min_noise, abs(ma / mb - 1), _spread(b), _spread(n), _spread(a))
    change = mn / mb - 1
    v: Verdict = "faster" if change < -noise else "slower" if change > noise else "within noise"
    return RowVerdict(v, mb, mn, ma, change, noise)


SIDES: Final = ("base", "new", "aa")


class Worker:
    """One tree's bench worker (`bench/abrows.py`) in its own process, with its own kernel cache directory so
    two trees never share compiled kernels; it answers one command at a time."""

    def __init__(self, script: Path, side: str, tree: Path, work: Path) -> None:
        from nmoe.fast.runtime import CACHE_ENV

        self.side, self.log = side, work / f"{side}.log"
        env = {k: v for k, v in os.environ.items() if k != CACHE_ENV}
        env.update(PYTHONPATH=tree_pythonpath(tree, env.get("PYTHONPATH")), PYTHONDONTWRITEBYTECODE="1")
        env[CACHE_ENV] = str(work / f"kernels-{side}")
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([sys.executable, str(script)], cwd=tree, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)

    def send(self, verb: str, row: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{verb} {row}\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text(errors="replace")[-1500:] if self.log.is_file() else ""
            raise ABError(f"the {self.side} worker exited ({self.proc.wait()}) without an answer: {tail}")
        doc: dict[str, Any] = json.loads(line)
        if "error" in doc and "row" not in doc:
            raise ABError(f"the {self.side} worker refused: {doc['error']}")
        return doc

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ABError(RuntimeError):
    """A bench worker died or refused its tree; the message carries its log's tail."""


def order(rep: int) -> tuple[str, ...]:
    """Repetition `rep`'s side order: BASE, new, A/A rotated by one each repetition, so no side always
    follows the same one."""
    k = rep % len(SIDES)
    return SIDES[k:] + SIDES[:k]


Samples = dict[str, list[float]]


def _row(workers: Mapping[str, Worker], name: str, reps: int) -> tuple[Samples, dict[str, str]]:
    """One row on every side: built in parallel (compiles overlap), sampled interleaved, then dropped."""
    samples: Samples = {s: [] for s in SIDES}
    for w in workers.values():
        w.send("build", name)
    errors = {s: str(doc["error"]) for s, w in workers.items() if "error" in (doc := w.read())}
    for rep in range(reps if not errors else 0):
        for side in order(rep):
            workers[side].send("time", name)
            doc = workers[side].read()
            if "error" in doc:
                errors[side] = str(doc["error"])
                break
            samples[side].append(float(doc["ms"]))
        if errors:
            break
    for w in workers.values():
        w.send("drop", name)
        w.read()
    return samples, errors


def run_ab(script: Path, trees: Mapping[str, Path], rows: Mapping[str, tuple[str, float]], reps: int,
           work: Path) -> list[dict[str, Any]]:
    """rows: name -> (op, min_noise). BASE (twice: BASE and the A/A rerun) and the new tree each in their own
    worker process; row by row, each side builds it, then the sides are sampled one at a time, interleaved.
    One dict per row: its samples and verdict, or `error` naming the side whose tree could not run it."""
    if reps < MIN_REPS:
        raise ValueError(f"--reps {reps}: the A/B test needs at least {MIN_REPS} repetitions per side (the "
                         "spread of each side is part of its noise floor)")
    work.mkdir(parents=True, exist_ok=True)
    tree_of = {"base": trees["base"].resolve(), "new": trees["new"].resolve(), "aa": trees["base"].resolve()}
    workers = {s: Worker(script.resolve(), s, tree_of[s], work.resolve()) for s in SIDES}
    out: list[dict[str, Any]] = []
    try:
        for w in workers.values():
            w.read()
        for name, (op, floor) in rows.items():
            s, errors = _row(workers, name, reps)
            if errors:
                out.append({"name": name, "op": op, "error": errors})
                continue
            v = verdict(s["base"], s["new"], s["aa"], floor)
            out.append({"name": name, "op": op, "base_ms": s["base"], "new_ms": s["new"], "aa_ms": s["aa"],
                        "median_base_ms": v.base_ms, "median_new_ms": v.new_ms, "median_aa_ms": v.aa_ms,
                        "change": v.change, "noise": v.noise, "verdict": v.verdict})
    finally:
        for w in workers.values():
            w.close()
    return out
