"""The cases of one op: seeded hypothesis draws over its input space plus one case per adversarial kind and
dtype, each built into concrete inputs."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from parity.inputs import Inputs, draws, generator
from parity.registry import OpEntry


@dataclass(frozen=True)
class Case:
    name: str
    params: dict[str, Any]
    adv: str | None


def op_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003) ^ zlib.crc32(name.encode())


def make_cases(entry: OpEntry, n_random: int, seed: int, big: bool) -> list[Case]:
    """n_random hypothesis draws plus one case per (adversarial kind, dtype), all from `seed`."""
    s = op_seed(seed, entry.name)
    cases = [Case(f"random/{i}", p, None) for i, p in enumerate(draws(entry.full_space(big), n_random, s))]
    pool = draws(entry.space(big), 4, s + 1) if entry.adversarial else []
    for j, adv in enumerate(entry.adversarial):
        for dtype in entry.dtypes:
            base = dict(pool[(j + 1) % len(pool)]) if pool else {}
            base["dtype"] = dtype
            cases.append(Case(f"adv:{adv}" + (f"/{dtype}" if len(entry.dtypes) > 1 else ""), base, adv))
    return cases


def build(entry: OpEntry, case: Case) -> Inputs:
    return entry.make(case.params, generator(int(case.params.get("seed", 0))), case.adv)
