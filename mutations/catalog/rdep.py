"""rdep.*: defects in the expert-parallel dispatch simulation (nmoe/reference/rdep.py)."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/reference/rdep.py"
TESTS = "tests/test_rdep.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "rdep.silent_drop_on_overflow", FILE,
        "    if need > capacity:\n"
        "        worst = int(torch.argmax(per_rank))\n"
        "        raise RuntimeError(\n"
        "            f\"rdep_dispatch: rank {worst} would receive {need} rows "
        "but capacity is {capacity}; \"\n"
        "            f\"raise capacity to at least {need}\"\n"
        "        )\n"
        "\n"
        "    recvs = []\n"
        "    for r in range(w):\n"
        "        rows = row_id[owner == r]\n"
        "        rows = rows[torch.argsort(local[rows] * (w * t * k) + rows)]\n",
        "    recvs = []\n"
        "    for r in range(w):\n"
        "        rows = row_id[owner == r]\n"
        "        rows = rows[torch.argsort(local[rows] * (w * t * k) + rows)][:capacity]\n",
        "rows past a rank's capacity silently dropped instead of raising", TESTS, ("rdep",),
    ),
    sep_mutation(
        "rdep.owner_off_by_one", FILE,
        "    owner = eid // n_local",
        "    owner = ((eid + 1) // n_local) % w",
        "owner rank computed as (eid + 1) // n_local: the last expert of each rank lands on the next rank",
        TESTS, ("rdep",),
    ),
)
