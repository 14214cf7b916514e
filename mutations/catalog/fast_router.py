"""router.fast_*: defects in the CuTeDSL router top-k kernel (nmoe/fast/kernels/router.py) and the fast
router_logits / bias_update glue (nmoe/fast/router.py); GPU host only, but for the router gradient's bf16
split, which its CPU test runs."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/kernels/router.py"
TESTS = "tests/test_fast_router.py"
GLUE = "nmoe/fast/router.py"
OPS_TESTS = "tests/test_fast_router_ops.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "router.fast_tie_breaks_high", FILE,
        "(_ties(av, bv) & (ai < bi))", "(_ties(av, bv) & (ai > bi))",
        "equal biased scores pick the higher expert id", TESTS, ("router_topk",), device="gpu",
    ),
    sep_mutation(
        "router.fast_redux_tie_high", FILE,
        'sel(key == top, i, INVALID_ID), "min")', 'sel(key == top, i, -1), "max")',
        "lanes whose best values tie hand the pick to the higher expert id", TESTS, ("router_topk",),
        device="gpu",
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
    Mutation(
        "router.fast_exp_fused", FILE,
        "q = add_rn(mul_rn(q, r), Float32(c))", "q = Float32(q * r + Float32(c))",
        "pinned exp's Horner step contracted into FMA (product not rounded): score bits drift from the spec",
        tests=(f"{TESTS}::test_topk_bitwise_vs_pinned_oracle",), device="gpu", contracts=("router_topk",),
    ),
    sep_mutation(
        "router.fast_logits_bf16_rounded", GLUE,
        "return torch.mm(x, wr.t(), out_dtype=torch.float32)", "return torch.mm(x, wr.t()).float()",
        "router logits of bf16 operands rounded to bf16 before the fp32 widening", OPS_TESTS,
        ("router_logits",), device="gpu",
    ),
    sep_mutation(
        "router.fast_bias_update_sign_flipped", GLUE,
        "torch.sign(c.sum() - bias.numel() * c)", "torch.sign(bias.numel() * c - c.sum())",
        "aux-loss-free bias update raises the bias of overloaded experts", OPS_TESTS, ("bias_update",),
        device="gpu",
    ),
    sep_mutation(
        "router.fast_logits_grad_lo_dropped", GLUE,
        "    lo = (g - hi.float()).to(torch.bfloat16)\n",
        "    lo = torch.zeros_like(hi)\n",
        "the router gradient enters its bf16 GEMMs as its bf16 rounding alone (8 of 24 bits)", OPS_TESTS,
        ("router_logits",),
    ),
)
