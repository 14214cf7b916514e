"""gemm.*: defects in the grouped GEMM (nmoe/reference/gemm.py)."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/reference/gemm.py"
TESTS = "tests/test_gemm.py"
TILE_LOOP = "    for r0 in range(0, a.shape[1], K_TILE):"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "gemm.accumulate_bf16", FILE,
        "        acc = acc + a[:, r0:r0 + K_TILE].float() @ b[r0:r0 + K_TILE].float()",
        "        acc = (acc + a[:, r0:r0 + K_TILE].float() @ b[r0:r0 + K_TILE].float()).bfloat16().float()",
        "accumulator rounded to bf16 after every K tile instead of staying fp32", TESTS, ("grouped_gemm",),
    ),
    sep_mutation(
        "gemm.skip_last_k_tile", FILE,
        TILE_LOOP,
        "    for r0 in range(0, (-(-a.shape[1] // K_TILE) - 1) * K_TILE, K_TILE):",
        "the last K tile (full or ragged) never reaches the accumulator", TESTS, ("grouped_gemm",),
    ),
    sep_mutation(
        "gemm.group_boundary_off_by_one", FILE,
        "    return list(zip(starts, ends, strict=True))",
        "    return [(min(s + 1, m), min(e + 1, m)) for s, e in zip(starts, ends, strict=True)]",
        "group row ranges shifted by one: each group's first row is computed with the previous expert",
        TESTS, ("grouped_gemm",),
    ),
    Mutation(
        "gemm.skip_partial_k_tile", FILE,
        TILE_LOOP,
        "    for r0 in range(0, a.shape[1] // K_TILE * K_TILE, K_TILE):",
        "a ragged last K tile (K not a multiple of 128) is skipped; full tiles are kept",
        tests=(f"{TESTS}::test_sep_gemm_skip_last_k_tile",), contracts=("grouped_gemm",),
    ),
)
