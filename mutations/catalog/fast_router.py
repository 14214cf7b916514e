"""router.fast_* and bias_update.fast_*: defects in the CuTeDSL router top-k kernel
(nmoe/fast/kernels/router.py) and the fast bias update (nmoe/fast/router.py); GPU host only."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/kernels/router.py"
GLUE = "nmoe/fast/router.py"
TESTS = "tests/test_fast_router.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "router.fast_tie_breaks_high", FILE,
        "(_ties(av, bv) & (ai < bi))", "(_ties(av, bv) & (ai > bi))",
        "equal biased scores pick the higher expert id", TESTS, ("router_topk",), device="gpu",
    ),
    sep_mutation(
        "router.fast_group_top1_only", FILE,
        "group_score.append(add_rn(t1, t2))", "group_score.append(t1)",
        "group score is the top-1 instead of the sum of the top-2 biased scores", TESTS, ("router_topk",),
        device="gpu",
    ),
    sep_mutation(
        "router.fast_weights_biased", FILE,
        "bsc = _sel_f(take, scores[j], bsc)", "bsc = _sel_f(take, biased[j], bsc)",
        "weights taken from biased scores instead of the unbiased ones", TESTS, ("router_topk",),
        device="gpu",
    ),
    sep_mutation(
        "bias_update.fast_sign_flipped", GLUE,
        "    direction = torch.sign(c.sum() - bias.numel() * c).to(torch.float32)",
        "    direction = torch.sign(bias.numel() * c - c.sum()).to(torch.float32)",
        "fast aux-loss-free bias pushed up for overloaded experts (sign of the DeepSeek-V3 rule flipped)",
        TESTS, ("bias_update",), device="gpu",
    ),
    Mutation(
        "router.fast_exp_fused", FILE,
        "q = add_rn(mul_rn(q, r), Float32(c))", "q = Float32(q * r + Float32(c))",
        "pinned exp's Horner step contracted into FMA (product not rounded): score bits drift from the spec",
        tests=(f"{TESTS}::test_topk_bitwise_vs_pinned_oracle",), device="gpu", contracts=("router_topk",),
    ),
)
