"""adamw.*, muon.*, wsd.*: defects in nmoe/reference/optim.py."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/reference/optim.py"
TESTS = "tests/test_optim.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "adamw.coupled_weight_decay", FILE,
        "    p.mul_(1.0 - lr * weight_decay)\n    mw, vw = ",
        "    gf = gf + weight_decay * p\n    mw, vw = ",
        "weight decay added to the gradient (Adam + L2) instead of decoupled from the adaptive step", TESTS,
        ("adamw",),
    ),
    sep_mutation(
        "adamw.no_bias_correction", FILE,
        "    bias1 = 1.0 - beta1**step\n    bias2 = 1.0 - beta2**step",
        "    bias1 = 1.0\n    bias2 = 1.0",
        "AdamW moments used without the 1 - beta^t bias correction", TESTS, ("adamw",),
    ),
    sep_mutation(
        "adamw.grad_scale_ignored", FILE,
        "    return gf * grad_scale.to(p.dtype)\n", "    return gf\n",
        "the clip factor handed to the step is dropped, so clipping never takes effect", TESTS, ("adamw",),
    ),
    sep_mutation(
        "adamw.bf16_moments_rounded_update", FILE,
        "    p.sub_(lr * (mw / bias1)",
        "    mw, vw = mw.to(m.dtype).to(p.dtype), vw.to(v.dtype).to(p.dtype)\n    p.sub_(lr * (mw / bias1)",
        "with bf16 moments, p moves by the stored (rounded) moments instead of the values just computed",
        TESTS, ("adamw",),
    ),
    sep_mutation(
        "muon.ns_coeffs_swapped", FILE,
        "NS5_COEFFS = (3.4445, -4.7750, 2.0315)",
        "NS5_COEFFS = (2.0315, -4.7750, 3.4445)",
        "Newton-Schulz quintic coefficients a and c swapped", TESTS, ("muon",),
    ),
    sep_mutation(
        "wsd.decay_by_steps", FILE,
        "    if progress.tokens < warmup_tokens:\n"
        "        return progress.tokens / warmup_tokens\n"
        "    if progress.tokens <= decay_start or decay_tokens == 0:\n"
        "        return 1.0\n"
        "    frac = min((progress.tokens - decay_start) / decay_tokens, 1.0)",
        "    if progress.step < warmup_tokens:\n"
        "        return progress.step / warmup_tokens\n"
        "    if progress.step <= decay_start or decay_tokens == 0:\n"
        "        return 1.0\n"
        "    frac = min((progress.step - decay_start) / decay_tokens, 1.0)",
        "WSD schedule position read from the optimizer step count instead of tokens consumed", TESTS,
        ("wsd",),
    ),
)
