"""rope.*: defects in nmoe/reference/rope.py."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/reference/rope.py"
TESTS = "tests/test_rope.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "rope.half_split_layout", FILE,
        "    x0 = xf[..., 0::2]\n"
        "    x1 = xf[..., 1::2]\n"
        "    y = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)\n"
        "    return round_to(y.flatten(-2), x.dtype)",
        "    half = xf.shape[-1] // 2\n"
        "    x0 = xf[..., :half]\n"
        "    x1 = xf[..., half:]\n"
        "    return round_to(torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1), x.dtype)",
        "rope rotates (x[i], x[i + D/2]) half-split pairs instead of interleaved (x[2i], x[2i+1])", TESTS,
        ("rope",),
    ),
    Mutation(
        "rope.bwd_angle_not_negated", FILE,
        "    return apply_rope(dy, cos, -sin)",
        "    return apply_rope(dy, cos, sin)",
        "rope backward rotates by +angle instead of the inverse rotation",
        tests=(f"{TESTS}::test_gradcheck_fwd_and_explicit_bwd",), contracts=("rope",),
    ),
)
