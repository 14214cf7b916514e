"""rmsnorm.*: defects in nmoe/reference/norm.py."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/reference/norm.py"
TESTS = "tests/test_norm.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "rmsnorm.eps_outside_sqrt", FILE,
        "    r = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)\n"
        "    return (xf * r * w.to(acc)).to(x.dtype)",
        "    r = 1.0 / (torch.sqrt(xf.square().mean(dim=-1, keepdim=True)) + eps)\n"
        "    return (xf * r * w.to(acc)).to(x.dtype)",
        "eps added to sqrt(mean(x^2)) instead of inside the square root", TESTS, ("rmsnorm",),
    ),
    Mutation(
        "rmsnorm.bwd_mean_term_dropped", FILE,
        "    dx = r * (g - xf * (r * r) * (g * xf).mean(dim=-1, keepdim=True))",
        "    dx = r * g",
        "rmsnorm backward treats rsqrt(mean(x^2)+eps) as a constant (drops the projection term)",
        tests=(f"{TESTS}::test_gradcheck_explicit_bwd",), contracts=("rmsnorm",),
    ),
)
