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
    sep_mutation(
        "rmsnorm.add_normed_before_add", FILE,
        "    s = h + a\n    return s, rmsnorm(s, w, eps)", "    s = h + a\n    return s, rmsnorm(h, w, eps)",
        "add_rmsnorm norms the stream before the residual branch joins it", TESTS, ("add_rmsnorm",),
    ),
    Mutation(
        "rmsnorm.add_bwd_stream_grad_dropped", FILE,
        "    return ds + dx, dw", "    return dx, dw",
        "add_rmsnorm's backward leaves out the stream's own gradient: the residual path carries none",
        tests=(f"{TESTS}::test_add_rmsnorm_gradcheck_autograd_and_explicit_bwd",), contracts=("add_rmsnorm",),
    ),
)
