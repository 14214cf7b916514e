"""ce.*: defects in the chunked cross-entropy (nmoe/reference/loss.py)."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/reference/loss.py"
TESTS = "tests/test_loss.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "ce.ignored_tokens_counted", FILE,
        "    n_kept = int(kept.sum())\n    return total",
        "    n_kept = int(targets.numel())\n    return total",
        "mean divides by all tokens, ignore_index ones included", TESTS, ("cross_entropy",),
    ),
    sep_mutation(
        "ce.no_max_subtraction", FILE,
        "    m = logits.amax(dim=-1, keepdim=True)",
        "    m = torch.zeros_like(logits.amax(dim=-1, keepdim=True))",
        "logsumexp without subtracting the row max: exp overflows for large logits", TESTS,
        ("cross_entropy",),
    ),
    Mutation(
        "ce.bwd_onehot_not_subtracted", FILE,
        "        probs[torch.arange(tgt.shape[0], device=h.device), tgt] -= 1.0\n",
        "",
        "cross-entropy backward returns softmax without subtracting the target one-hot",
        tests=(f"{TESTS}::test_gradcheck_fwd_and_explicit_bwd",), contracts=("cross_entropy",),
    ),
)
