"""dispatch.fast_*: defects in the CuTeDSL permute/unpermute/embedding_bwd kernels; GPU host only."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/kernels/dispatch.py"
TESTS = "tests/test_fast_dispatch.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "dispatch.fast_unstable_order", FILE,
        "return Int32(base + cute.arch.popc(before))",
        "return Int32(base + cute.arch.popc(peers) - 1 - cute.arch.popc(before))",
        "rows of one expert land in reverse (t, k) order within a warp", TESTS, ("permute",), device="gpu",
    ),
    sep_mutation(
        "dispatch.fast_pad_rows_garbage", FILE,
        "        d.fill(Int32(0))", "        pass",
        "pad rows are left with stale memory instead of zeros", TESTS, ("permute",), device="gpu",
    ),
    sep_mutation(
        "dispatch.fast_offs_unpadded", FILE,
        "padded = (count + align - 1) // align * align", "padded = count",
        "segment ends not padded to align", TESTS, ("permute",), device="gpu",
    ),
    sep_mutation(
        "dispatch.fast_missing_slot_unchecked", FILE,
        "        if n != 1:", "        if n > 1:",
        "unpermute accepts a slot map in which a slot is missing", TESTS, ("unpermute",), device="gpu",
    ),
    sep_mutation(
        "dispatch.fast_row_of_next_row", FILE,
        "        mrow[s] = dest\n", "        mrow[s] = dest + 1\n",
        "row_of names the row after the one that holds each slot (the routing-only permute copies no rows, "
        "so only row_of shows it)", TESTS, ("permute",), device="gpu",
    ),
    sep_mutation(
        "dispatch.fast_spread_pitch_ignored", FILE,
        "            vals = _load_vecs(src, Int64(w), v0, row_vecs, src_vecs)\n",
        "            vals = _load_vecs(src, Int64(w), v0, row_vecs, row_vecs)\n",
        "the row copy reads x's rows back to back, ignoring the pitch of a column slice", TESTS, ("permute",),
        device="gpu",
    ),
    sep_mutation(
        "dispatch.fast_embed_last_token_dropped", FILE,
        "            for j in dsl.range(0, count, 1):\n",
        "            for j in dsl.range(0, count - 1, 1):\n",
        "each vocab row of the embedding gradient leaves out its last token", TESTS, ("embedding_bwd",),
        device="gpu",
    ),
)
