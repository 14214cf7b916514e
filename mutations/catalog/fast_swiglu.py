"""swiglu.fast_*: defects in the CuTeDSL swiglu kernels (nmoe/fast/kernels/swiglu.py); GPU host only."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/kernels/swiglu.py"
TESTS = "tests/test_fast_swiglu.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "swiglu.fast_concat_layout", FILE,
        "        g[j] = hf[2 * j]\n        u[j] = hf[2 * j + 1]",
        "        g[j] = hf[j]\n        u[j] = hf[vec + j]",
        "fast swiglu reads each 2*vec input chunk as [vec gates | vec ups] instead of interleaved pairs",
        TESTS, ("swiglu",), device="gpu",
    ),
    sep_mutation(
        "swiglu.fast_du_not_silu", FILE,
        "        dh[2 * j + 1] = mul_rn(df[j], mul_rn(g[j], s[j]))",
        "        dh[2 * j + 1] = mul_rn(df[j], g[j])",
        "fast swiglu backward du = dy*g (sigmoid dropped) instead of dy*silu(g)", TESTS, ("swiglu",),
        device="gpu",
    ),
    sep_mutation(
        "swiglu.fast_quotient_uncorrected", FILE,
        "    return fma_rn(y, fma_rn(-den, q, num), q)\n", "    return q\n",
        "the sigmoid's quotient stops at num times the refined reciprocal, without div.rn's one correction "
        "step, so some quotients are an ulp off IEEE division", TESTS, ("swiglu", "swiglu_bwd"), device="gpu",
    ),
)
