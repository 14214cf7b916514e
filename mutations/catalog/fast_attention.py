"""mla.fast_*: defects in the fast MLA glue (nmoe/fast/attention.py): what it passes to flash-attn-4, what
it rotates, and the k/dkv assembly kernels (nmoe/fast/kernels/mla.py); dq's rotation dies on the CPU."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/attention.py"
TESTS = "tests/test_fast_attention.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "mla.fast_causal_off_by_one", FILE,
        "softmax_scale=scale, causal=True, return_lse=True)",
        "softmax_scale=scale, window_size_right=1, return_lse=True)",
        "each query also sees the next token (FA4 local window right = 1 instead of the causal mask)", TESTS,
        ("mla_attention",), device="gpu",
    ),
    sep_mutation(
        "mla.fast_softmax_scale_no_mscale", FILE,
        "fa._flash_attn_fwd(q, k, v, softmax_scale=scale,",
        "fa._flash_attn_fwd(q, k, v, softmax_scale=None,",
        "FA4 uses its default scale qk_head_dim^-0.5, dropping the YaRN mscale^2 the caller passed", TESTS,
        ("mla_attention",), device="gpu",
    ),
    sep_mutation(
        "mla.fast_rope_on_nope_part", FILE,
        "        rope_inplace(q4[..., dn:], cos, sin)\n",
        "        rope_inplace(q4[..., :2 * cos.shape[-1]], cos, sin)\n",
        "rope rotates the first qk_rope_head_dim dims of q's nope part instead of its rope part", TESTS,
        ("mla_attention",), device="gpu",
    ),
    sep_mutation(
        "mla.fast_k_rope_dropped", FILE,
        "    k_pe = apply_rope(k_pe, cos_s, sin_s)\n",
        "    k_pe = k_pe\n",
        "the shared rope key is never rotated (only q carries positions)", TESTS, ("mla_attention",),
        device="gpu",
    ),
    sep_mutation(
        "mla.fast_k_pe_grad_one_head", "nmoe/fast/kernels/mla.py",
        "        for head in range_constexpr(1, h):\n",
        "        for head in range_constexpr(1, 1):\n",
        "the shared rope key's gradient comes from head 0 only instead of the sum over the heads it feeds",
        TESTS, ("mla_attention",), device="gpu",
    ),
    sep_mutation(
        "mla.fast_k_pe_from_wrong_column", "nmoe/fast/kernels/mla.py",
        "        dst.store(_vec_at(pb, rows // share * wb, ((r // share) * wb + c - dn) // VEC).load())\n",
        "        dst.store(_vec_at(pb, rows // share * wb, ((r // share) * wb + c - wb) // VEC).load())\n",
        "the joined rows' second part is read dn - wb columns past its start: k's rope part from the next "
        "token's shared key (MLA's dn 128, dr 64)",
        TESTS, ("mla_attention",), device="gpu",
    ),
    sep_mutation(
        "mla.fast_dq_rope_not_inverse", FILE,
        "        rope_inplace(dq[..., dn:], cos, sin, inverse=True)\n",
        "        rope_inplace(dq[..., dn:], cos, sin, inverse=False)\n",
        "q's rope-part gradient is rotated by +angle (the forward) instead of the inverse rotation", TESTS,
        ("mla_attention",),
    ),
    sep_mutation(
        "mla.fast_second_dx_dropped", FILE,
        "            dx = torch.mm(g1, w1).addmm_(g2, w2).view(x.shape)\n",
        "            dx = torch.mm(g1, w1).view(x.shape)\n",
        "x's gradient takes the q projection's share only: the kv projection's addend is dropped", TESTS,
        ("mla_attention",),
    ),
)
