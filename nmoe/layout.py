"""Layout shared by the spec and the fast path of permute: the static row capacity and the result bundle."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Permuted:
    """xp [R,H] expert-sorted rows, counts (real rows), offs (cumulative padded ends), slot per row."""

    xp: Tensor
    counts: Tensor
    offs: Tensor
    slot: Tensor


def padded_rows(n_slots: int, n_experts: int, align: int) -> int:
    """Worst case of sum_e ceil(c_e/align)*align over all routings of n_slots slots."""
    if n_slots < 0 or n_experts < 1 or align < 1:
        raise ValueError(
            f"padded_rows: need n_slots >= 0, n_experts >= 1, align >= 1; got {n_slots}, {n_experts}, {align}"
        )
    worst = n_slots + n_experts * (align - 1)
    return -(-worst // align) * align
