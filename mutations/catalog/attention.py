"""mla.*: defects in MLA attention (nmoe/reference/attention.py) and its softmax scale (nmoe/yarn.py)."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/reference/attention.py"
TESTS = "tests/test_attention.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "mla.no_causal_mask", FILE,
        "    scores = scores.masked_fill(future, -math.inf)\n",
        "",
        "attention sees future tokens (causal mask never applied)", TESTS, ("mla_attention",),
    ),
    sep_mutation(
        "mla.softmax_scale_no_mscale", "nmoe/yarn.py",
        "    return math.pow(qk_head_dim, -0.5) * m * m",
        "    return math.pow(qk_head_dim, -0.5)",
        "softmax scale lacks the YaRN mscale^2 factor", TESTS, ("mla_attention",),
    ),
)
