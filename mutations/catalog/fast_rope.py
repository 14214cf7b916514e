"""rope.fast_*: defects in the CuTeDSL rope kernel (nmoe/fast/kernels/rope.py); GPU host only."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/kernels/rope.py"
TESTS = "tests/test_fast_rope.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "rope.fast_sin_sign_flipped", FILE,
        "            y[2 * k] = sub_rn(mul_rn(x0, c), mul_rn(x1, s))\n",
        "            y[2 * k] = add_rn(mul_rn(x0, c), mul_rn(x1, s))\n",
        "fast rope forward computes y0 = x0 c + x1 s (sin sign flipped in the first output of each pair)",
        TESTS, ("rope",), device="gpu",
    ),
    sep_mutation(
        "rope.fast_pair_swapped", FILE,
        "x0, x1, c, s = xv[2 * k], xv[2 * k + 1], cv[k], sv[k]",
        "x0, x1, c, s = xv[2 * k + 1], xv[2 * k], cv[k], sv[k]",
        "fast rope reads each interleaved pair as (x[2i+1], x[2i]), rotating the wrong way round", TESTS,
        ("rope", "rope_bwd"), device="gpu",
    ),
    sep_mutation(
        "rope.fast_table_row_ignores_inner", FILE,
        "        pos = (row // inner) % s_len\n",
        "        pos = row % s_len\n",
        "fast rope picks the table row by x's row index, ignoring the dims between S and D ([B, S, H, D])",
        TESTS, ("rope",), device="gpu",
    ),
    sep_mutation(
        "rope.fast_bwd_not_inverse", FILE,
        "        if const_expr(inverse):\n",
        "        if const_expr(False):\n",
        "fast rope backward rotates by +angle (the forward) instead of the inverse rotation", TESTS,
        ("rope_bwd",), device="gpu",
    ),
    sep_mutation(
        "rope.fast_pitch_ignored", FILE,
        "        at = (row * ld + col) // vec\n",
        "        at = (row * d + col) // vec\n",
        "fast rope walks x's rows d apart, ignoring the row pitch of a column slice (MLA's rope part)", TESTS,
        ("rope",), device="gpu",
    ),
)
