"""combine.fast_*: defects in the CuTeDSL combine kernels (nmoe/fast/kernels/combine.py); GPU host only."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/kernels/combine.py"
TESTS = "tests/test_fast_combine.py"
ROWS_TESTS = "tests/test_fast_expert_rows.py"
FWD_SUM = (
    "        ws = mw[t * k + s]\n"
    "        for j in range_constexpr(vec):\n"
    "            if const_expr(s == 0):\n"
    "                acc[j] = mul_rn(ws, ys[j])\n"
    "            else:\n"
    "                acc[j] = add_rn(acc[j], mul_rn(ws, ys[j]))\n"
    "    for j in range_constexpr(vec):\n"
    "        acc[j] = mul_rn(acc[j], scale)\n"
)

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "combine.fast_fma_contracted", FILE,
        "                acc[j] = add_rn(acc[j], mul_rn(ws, ys[j]))",
        "                acc[j] = acc[j] + ws * ys[j]",
        "slot products summed with plain fp32 ops that ptxas contracts into FMA (product not rounded)",
        TESTS, ("combine",), device="gpu",
    ),
    sep_mutation(
        "combine.fast_scale_folded", FILE, FWD_SUM,
        FWD_SUM.replace("ws = mw[t * k + s]", "ws = mul_rn(mw[t * k + s], scale)")
        .replace("    for j in range_constexpr(vec):\n        acc[j] = mul_rn(acc[j], scale)\n", ""),
        "fast combine folds routed_scale into each weight instead of scaling the fp32 sum", TESTS,
        ("combine",), device="gpu",
    ),
    sep_mutation(
        "combine.fast_bwd_scale_dropped", FILE,
        "            for j in range_constexpr(vec):\n                g[j] = mul_rn(g[j], scale)\n",
        "",
        "fast combine backward forgets routed_scale in dy and dw", TESTS, ("combine",), device="gpu",
    ),
    sep_mutation(
        "combine.fast_gather_row_off_by_one", FILE,
        "row = Int64(mrow[t * k + s]) if const_expr(gather)",
        "row = Int64(mrow[t * k + s]) + 1 if const_expr(gather)",
        "combine_gather reads the permuted row after the slot's own", "tests/test_fast_combine_gather.py",
        ("combine_gather",), device="gpu",
    ),
    sep_mutation(
        "combine.fast_rows_dot_of_scaled_dz", FILE,
        "                part[0] = add_rn(part[0], mul_rn(g[j], a[j]))\n",
        "                part[0] = add_rn(part[0], mul_rn(dzw[j], a[j]))\n",
        "the expert rows' pass sums <a, dz * w> for the router weight's gradient instead of <a, dz>",
        ROWS_TESTS, ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "combine.fast_rows_dh_unscaled", FILE,
        "_act_bwd(_rounded(dzw, vec), hf, vec, act)",
        "_act_bwd(g, hf, vec, act)",
        "the expert rows' pass feeds act_bwd the unscaled dz (router weight dropped from dh)",
        ROWS_TESTS, ("moe_layer",), device="gpu",
    ),
)
