"""adamw.fast_*, muon.fast_*: defects in the fast optimizer steps (nmoe/fast/optim.py and the AdamW kernel
nmoe/fast/kernels/optim.py); GPU host only."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

GLUE = "nmoe/fast/optim.py"
KERNEL = "nmoe/fast/kernels/optim.py"
TESTS = "tests/test_fast_optim.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "adamw.fast_no_bias_correction", GLUE,
        "1.0 - beta1**step,\n              1.0 - beta2**step,", "1.0,\n              1.0,",
        "AdamW without bias correction of m and v", TESTS, ("adamw",), device="gpu",
    ),
    sep_mutation(
        "adamw.fast_decay_on_m", KERNEL,
        "        p1 = mul_rn(fp[j], decay)\n        m1 = add_rn(mul_rn(fm[j], b1), mul_rn(g, omb1))",
        "        p1 = fp[j]\n        m1 = add_rn(mul_rn(mul_rn(fm[j], decay), b1), mul_rn(g, omb1))",
        "weight decay shrinks the first moment instead of the parameter", TESTS, ("adamw",), device="gpu",
    ),
    sep_mutation(
        "adamw.fast_grad_scale_ignored", KERNEL,
        "            g = mul_rn(g, scale)\n", "            g = g\n",
        "the AdamW kernel never multiplies g by the clip factor it is handed", TESTS, ("adamw",),
        device="gpu",
    ),
    sep_mutation(
        "adamw.fast_bf16_moments_swapped", KERNEL,
        "        _store_rounded(mm, fm, i, base, n, vec, full)\n"
        "        _store_rounded(mv, fv, i, base, n, vec, full)\n",
        "        _store_rounded(mm, fv, i, base, n, vec, full)\n"
        "        _store_rounded(mv, fm, i, base, n, vec, full)\n",
        "bf16 moments stored into each other's tensors (m gets v's rounding, v gets m's)", TESTS, ("adamw",),
        device="gpu",
    ),
    sep_mutation(
        "adamw.fast_low_copy_from_moment", KERNEL,
        "            fl.store(out_bits(fp.load(), \"bfloat16\"))\n            cute.zipped_divide",
        "            fl.store(out_bits(fm.load(), \"bfloat16\"))\n            cute.zipped_divide",
        "the bf16 param a master step writes takes the first moment's bits instead of the new master's",
        TESTS, ("adamw",), device="gpu",
    ),
    sep_mutation(
        "muon.fast_grad_scale_ignored", GLUE,
        "    gf = g.to(torch.float32) if grad_scale is None else g.to(torch.float32) * grad_scale\n",
        "    gf = g.to(torch.float32)\n",
        "the fast Muon step drops the clip factor it is handed", TESTS, ("muon",), device="gpu",
    ),
    sep_mutation(
        "muon.fast_ns_coeffs_swapped", GLUE,
        "NS5_COEFFS: Final[tuple[float, float, float]] = (3.4445, -4.7750, 2.0315)",
        "NS5_COEFFS: Final[tuple[float, float, float]] = (2.0315, -4.7750, 3.4445)",
        "Newton-Schulz quintic with a and c swapped: the iteration no longer orthogonalises", TESTS,
        ("muon",), device="gpu",
    ),
)
