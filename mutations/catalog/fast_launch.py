"""launch.fast_*: defects in how kernels are launched under programmatic dependent launch (limits.FAST_PDL):
a kernel that reads before the grid before it has ended. Caught on CPU, in the source and in the PTX."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

TESTS = "tests/test_fast_pdl.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "launch.fast_pdl_wait_dropped", "nmoe/fast/kernels/prims.py",
        "        cute.arch.griddepcontrol_wait()\n", "",
        "await_upstream lets the next grid launch but never waits for the one before it: under PDL every "
        "kernel could read its inputs before they are written", TESTS, ("combine_gather", "permute"),
    ),
    sep_mutation(
        "launch.fast_pdl_kernel_unawaited", "nmoe/fast/kernels/dispatch.py",
        '(slot -1) get zeros."""\n    await_upstream()\n', '(slot -1) get zeros."""\n',
        "spread_rows starts copying rows without waiting for the grid before it", TESTS, ("permute",),
    ),
)
