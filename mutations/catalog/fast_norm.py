"""rmsnorm.fast_*: defects in the CuTeDSL rmsnorm and add_rmsnorm kernels (nmoe/fast/kernels/norm.py); GPU
host only."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/kernels/norm.py"
TESTS = "tests/test_fast_norm.py"
ADD_TESTS = "tests/test_fast_add_norm.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "rmsnorm.fast_eps_outside_sqrt", FILE,
        "    ms = add_rn(div_rn(sum_sq, Float32(float(d))), eps)\n"
        "    return div_rn(1.0, sqrt_rn(ms))",
        "    ms = div_rn(sum_sq, Float32(float(d)))\n"
        "    return div_rn(1.0, add_rn(sqrt_rn(ms), eps))",
        "eps added after the square root", TESTS, ("rmsnorm",), device="gpu",
    ),
    sep_mutation(
        "rmsnorm.fast_pitch_ignored", FILE,
        "    return cute.make_tensor(px, cute.make_layout((d, rows), stride=(1, pitch)))",
        "    return cute.make_tensor(px, cute.make_layout((d, rows), stride=(1, d)))",
        "rows of a last-dim slice read as if packed at width d (MLA's c_kv in its 576-wide rows)", TESTS,
        ("rmsnorm", "rmsnorm_bwd"), device="gpu",
    ),
    sep_mutation(
        "rmsnorm.fast_pitch_of_one_row_pair", "nmoe/fast/norm.py",
        "        if x.shape[i] != 1 and x.stride(i) != span:\n            return 0\n",
        "        pass\n",
        "the glue takes the stride between two rows for every row's, so a slice of leading dims (rows "
        "not at one pitch) reaches the kernel in place", TESTS, ("rmsnorm",),
    ),
    sep_mutation(
        "rmsnorm_bwd.fast_dw_partial_dropped", FILE,
        "if base + u < nparts:", "if base + u < 1:",
        "dw keeps only the first row-block's partial sum", TESTS, ("rmsnorm_bwd",), device="gpu",
    ),
    sep_mutation(
        "rmsnorm.fast_add_norm_of_unrounded_sum", FILE,
        "            back = low.to(Float32)\n", "            back = frag.load()\n",
        "add_rmsnorm stores the rounded stream but norms the fp32 sum before that rounding", ADD_TESTS,
        ("add_rmsnorm",), device="gpu",
    ),
    sep_mutation(
        "rmsnorm_bwd.fast_add_dx_unrounded", FILE,
        "                out = out.to(m.element_type).to(Float32) + added.to(Float32)\n",
        "                out = out + added.to(Float32)\n",
        "add_rmsnorm's backward adds the stream's gradient to the norm's fp32 dx, one rounding instead of "
        "the two a separate add makes", ADD_TESTS, ("add_rmsnorm_bwd",), device="gpu",
    ),
)
