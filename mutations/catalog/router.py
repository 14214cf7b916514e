"""router.* and bias_update.*: defects in nmoe/reference/router.py."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/reference/router.py"
TESTS = "tests/test_router.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "router.tie_breaks_high", FILE,
        "    return torch.sort(v, dim=-1, descending=True, stable=True).indices",
        "    flipped = torch.sort(v.flip(-1), dim=-1, descending=True, stable=True).indices\n"
        "    return v.shape[-1] - 1 - flipped",
        "equal biased scores break toward the higher expert (and group) id", TESTS, ("router_topk",),
    ),
    sep_mutation(
        "router.bias_in_weights", FILE,
        "    picked = scores.gather(1, ids)",
        "    picked = biased.gather(1, ids)",
        "combine weights taken from the biased scores instead of the unbiased ones", TESTS, ("router_topk",),
    ),
    sep_mutation(
        "router.softmax_unnormalised", FILE,
        "    return round_to(picked / denom[:, None], picked.dtype), ids",
        "    return round_to(picked if score_func == \"softmax\" else picked / denom[:, None],"
        " picked.dtype), ids",
        "softmax top-k weights not renormalised to sum 1 over the k picked experts", TESTS, ("router_topk",),
    ),
    sep_mutation(
        "bias_update.sign_flipped", FILE,
        "    direction = torch.sign(c.sum() - bias.numel() * c).to(bias.dtype)",
        "    direction = torch.sign(bias.numel() * c - c.sum()).to(bias.dtype)",
        "aux-loss-free bias pushed up for overloaded experts (sign of the DeepSeek-V3 rule flipped)", TESTS,
        ("bias_update",),
    ),
)
