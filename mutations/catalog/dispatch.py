"""dispatch.*: defects in permute/unpermute/embedding_bwd (nmoe/reference/dispatch.py)."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/reference/dispatch.py"
TESTS = "tests/test_dispatch.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "dispatch.unstable_order", FILE,
        "    key = eid * (t * k) + slots",
        "    key = eid * (t * k) + (t * k - 1 - slots)",
        "rows inside an expert segment not in (t, k) order (reversed, as an unstable sort on the expert id "
        "alone may leave them)", TESTS, ("permute",),
    ),
    sep_mutation(
        "dispatch.pad_rows_garbage", FILE,
        "    xp = torch.zeros(n_rows, x.shape[1], dtype=x.dtype)",
        "    xp = torch.full((n_rows, x.shape[1]), 7.0, dtype=x.dtype)",
        "pad and tail rows keep stale buffer contents (modelled as 7.0) instead of zeros", TESTS,
        ("permute",),
    ),
    sep_mutation(
        "dispatch.embedding_bwd_reverse_order", FILE,
        "    for t, v in enumerate(ids.tolist()):\n",
        "    for t, v in reversed(list(enumerate(ids.tolist()))):\n",
        "the embedding gradient's rows summed from the last token back (another fp32 rounding order)", TESTS,
        ("embedding_bwd",),
    ),
)
