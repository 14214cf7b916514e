"""The verdict of one A/B bench row: BASE's timings against the new tree's, judged against the noise an
A/A run (the unchanged kernel timed again) shows, so a change is faster or slower only beyond that noise."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

Verdict = Literal["faster", "slower", "within noise"]
MIN_NOISE: Final = 0.01


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
