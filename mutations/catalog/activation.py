"""relu2.* and swiglu.*: defects in nmoe/reference/activation.py."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/reference/activation.py"
TESTS = "tests/test_activation.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "relu2.square_dropped", FILE,
        "    return round_to(r * r, x.dtype)",
        "    return round_to(r, x.dtype)",
        "relu2 forgets the square: returns relu(x)", TESTS, ("relu2",),
    ),
    sep_mutation(
        "relu2.silu", FILE,
        "    r = _relu(xf)\n    return round_to(r * r, x.dtype)",
        "    return round_to(xf * torch.sigmoid(xf), x.dtype)",
        "relu2 computes silu(x) instead of relu(x)^2 (wrong activation wired in)", TESTS, ("relu2",),
    ),
    sep_mutation(
        "relu2.square_in_bf16", FILE,
        "    return round_to(r * r, x.dtype)",
        "    rb = r.to(torch.bfloat16)\n    return round_to(rb * rb, x.dtype)",
        "relu2 narrows to bf16 before squaring: two roundings instead of one fp32 square", TESTS, ("relu2",),
    ),
    sep_mutation(
        "swiglu.concat_layout", FILE,
        "    return h[..., 0::2], h[..., 1::2]",
        "    half = h.shape[-1] // 2\n    return h[..., :half], h[..., half:]",
        "swiglu reads w13 as [gate | up] halves instead of interleaved rows (2i gate, 2i+1 up)", TESTS,
        ("swiglu",),
    ),
    Mutation(
        "relu2.bwd_factor_dropped", FILE,
        "    two_r = 2 * _relu(x.to(acc))",
        "    two_r = _relu(x.to(acc))",
        "relu2 backward computes dy * relu(x), dropping the factor 2",
        tests=(f"{TESTS}::test_relu2_bwd_all_bf16_bit_patterns",), contracts=("relu2",),
    ),
    sep_mutation(
        "swiglu.sigmoid_flushes", FILE,
        "    e = torch.exp(-g.abs())\n    return torch.where(g >= 0, 1 / (1 + e), e / (1 + e))",
        "    return torch.sigmoid(g)",
        "swiglu's sigmoid via torch.sigmoid, which flushes to 0 below g = -88: the subnormal tail is lost",
        TESTS, ("swiglu", "swiglu_bwd"),
    ),
)
