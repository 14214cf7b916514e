"""router.scale_in_weights and moe.*: defects in the MoE layer composition (nmoe/reference/moe.py)."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/reference/moe.py"
TESTS = "tests/test_moe.py"
COMBINE = "    out: Tensor = _apply(_Combine, y, weights, cfg.route_scale, shared)"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "router.scale_in_weights", FILE, COMBINE,
        "    weights = weights * cfg.route_scale\n"
        "    out: Tensor = _apply(_Combine, y, weights, 1.0, shared)",
        "route_scale multiplied into the router weights (which then no longer sum to 1) instead of combine",
        TESTS, ("moe_layer",),
    ),
    sep_mutation(
        "moe.shared_expert_dropped", FILE, COMBINE,
        "    out: Tensor = _apply(_Combine, y, weights, cfg.route_scale, None)",
        "shared experts computed but never added to the layer output", TESTS, ("moe_layer",),
    ),
)
