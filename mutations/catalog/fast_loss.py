"""cross_entropy.fast_*: defects in the fast fused-linear cross-entropy (nmoe/fast/loss.py and its kernel
nmoe/fast/kernels/loss.py); GPU host only."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

GLUE = "nmoe/fast/loss.py"
KERNEL = "nmoe/fast/kernels/loss.py"
TESTS = "tests/test_fast_loss.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "cross_entropy_bwd.fast_scale_ignored", KERNEL,
        "        store_full(cute.zipped_divide(mo, (SCALE_VEC,)), i, out_bits(g * s, \"bfloat16\"))\n",
        "        store_full(cute.zipped_divide(mo, (SCALE_VEC,)), i, out_bits(g, \"bfloat16\"))\n",
        "the backward's gradients are rounded to bf16 without the dloss factor", TESTS,
        ("cross_entropy_bwd",), device="gpu",
    ),
    sep_mutation(
        "cross_entropy.fast_ignore_not_excluded", GLUE,
        "v, targets), -1).to(torch.int32)", "v, targets), 0).to(torch.int32)",
        "ignore_index tokens are scored against token 0 instead of dropped", TESTS, ("cross_entropy",),
        device="gpu",
    ),
    sep_mutation(
        "cross_entropy.fast_max_not_subtracted", KERNEL,
        "        mn = cute.arch.fmax(m, mu)\n", "        mn = Float32(0.0)\n",
        "logsumexp without the running max: exp overflows on large logits", TESTS, ("cross_entropy",),
        device="gpu",
    ),
    sep_mutation(
        "cross_entropy.fast_chunk_tail_dropped", GLUE,
        "        for start in range(0, t, chunk):",
        "        for start in range(0, t - t % chunk or t, chunk):",
        "the last partial token chunk is never scored", TESTS, ("cross_entropy",), device="gpu",
    ),
    sep_mutation(
        "cross_entropy.fast_mean_over_t", GLUE,
        "    loss = per_row.sum() / denom",
        "    loss = per_row.sum() / max(t, 1)",
        "the mean divides by all tokens, ignored ones included", TESTS, ("cross_entropy",), device="gpu",
    ),
    sep_mutation(
        "cross_entropy_bwd.fast_onehot_dropped", KERNEL,
        "                    p = select_(i == tgt, p - Float32(1.0), p)\n", "",
        "dlogits is softmax without the target one-hot subtracted", TESTS, ("cross_entropy_bwd",),
        device="gpu",
    ),
    sep_mutation(
        "cross_entropy_bwd.fast_tile_barrier_dropped", KERNEL,
        "            cute.arch.sync_threads()\n", "",
        "dlogits tiles are stored with no barrier after the tile's loads: a thread overwrites logits another "
        "has not read", TESTS, ("cross_entropy_bwd",),
    ),
    sep_mutation(
        "cross_entropy_bwd.fast_dw_chunk_overwritten", GLUE,
        "                    torch.addmm(dw32, dlogits.T, hc, out_dtype=torch.float32, out=dw32)\n",
        "                    torch.mm(dlogits.T, hc, out_dtype=torch.float32, out=dw32)\n",
        "each chunk's dw_out overwrites the last instead of adding to it: only the last chunk's tokens count",
        TESTS, ("cross_entropy_bwd",), device="gpu",
    ),
)
