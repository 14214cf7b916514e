"""The mutation catalog: one module per op family, each exporting MUTATIONS (see mutations.model.Mutation)."""

from __future__ import annotations

import importlib

from mutations.model import Mutation

FAMILIES: tuple[str, ...] = (
    "formats", "activation", "combine", "router", "dispatch", "rdep", "gemm", "norm", "rope", "attention",
    "loss", "optim", "moe", "model", "fast_activation", "fast_combine", "fast_swiglu", "fast_router",
    "fast_dispatch", "fast_gemm", "fast_gemm_fp8", "fast_formats", "fast_norm", "fast_loss",
    "fast_optim", "fast_moe", "fast_rope", "fast_attention", "fast_model", "fast_rdep", "fast_launch",
    "train",
)

TESTS_BY_FILE: dict[str, tuple[str, ...]] = {
    "nmoe/reference/moe.py": ("tests/test_moe.py",),
    "nmoe/reference/model.py": ("tests/test_model.py",),
    "nmoe/modeldef.py": ("tests/test_model.py", "tests/test_fast_model.py"),
}


def _collect() -> tuple[Mutation, ...]:
    out: list[Mutation] = []
    for fam in FAMILIES:
        out += importlib.import_module(f"mutations.catalog.{fam}").MUTATIONS
    return tuple(out)


CATALOG: tuple[Mutation, ...] = _collect()
