"""moe.fast_*: defects in the fast MoE layer's autograd glue (nmoe/fast/moe.py); killed on CPU by the glue
test, which runs the glue with the spec's ops standing in for the kernels."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/moe.py"
TESTS = "tests/test_fast_moe_glue.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "moe.fast_experts_fp8_weight_grad_dropped", "nmoe/fast/experts.py",
        "        return dx, dw, None\n", "        return dx, None, None\n",
        "the straight-through fp8 expert GEMM gives its weights no gradient", "tests/test_fast_ep_layer.py",
        ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_dweights_scale_dropped", FILE,
        "dweights = (dot * scale).index_select(0, row_of.view(-1)).view(t, k)",
        "dweights = dot.index_select(0, row_of.view(-1)).view(t, k)",
        "router-weight gradient <a, dout @ W2> without route_scale", TESTS, ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_shared_grad_dropped", FILE,
        "return dx, dwr, None, dw_up, dw2, dw_up_s, dw2_s, None",
        "return dx, dwr, None, dw_up, dw2, None, None, None",
        "shared expert's weights get no gradient from the backward", TESTS, ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_shared_dx_dropped", FILE,
        "dx_r, dwr = logits_grads(dlogits, x, wr, need_x, need_wr, dx_s, ids)",
        "dx_r, dwr = logits_grads(dlogits, x, wr, need_x, need_wr, None, ids)",
        "the shared expert's share of dx is left out of the router dx GEMM's addend (only the routed and "
        "router dx flow back)",
        TESTS, ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_router_dx_dropped", FILE,
        "dx = combine_gather(dxp, row_of, ones, 1.0, dx_r)",
        "dx = combine_gather(dxp, row_of, ones, 1.0, dx_s)",
        "x's gradient through the router logits is left out of combine_gather's addend", TESTS,
        ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_weight_wrong_slot", FILE,
        "return flat[torch.where(slot >= 0, slot, flat.numel() - 1)]",
        "return flat[torch.where(slot >= 0, slot ^ 1, flat.numel() - 1)]",
        "each permuted row's dy scaled by a neighbouring slot's router weight", TESTS, ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_gather_off_by_one", FILE,
        "spread_rows(src[:, c0:c0 + cols], slot, row_of)",
        "spread_rows(src.roll(1, 0)[:, c0:c0 + cols], slot, row_of)",
        "the wgrads' permuted copies of x and dout hold the previous token's rows", TESTS, ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_up_wgrad_chunk_at_col0", FILE,
        "sm90.grouped_gemm_wgrad_cols(dy, part, offs, dw, c0, accumulate=add)",
        "sm90.grouped_gemm_wgrad_cols(dy, part, offs, dw, 0, accumulate=add)",
        "every column chunk of the up wgrad lands on dw's first columns", TESTS, ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_down_wgrad_chunk_at_row0", FILE,
        "sm90.grouped_gemm_wgrad_cols(part, x, offs, dw, 0, c0, accumulate=add)",
        "sm90.grouped_gemm_wgrad_cols(part, x, offs, dw, 0, 0, accumulate=add)",
        "every chunk of dout's columns lands on dw2's first rows", TESTS, ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_held_grad_returned_too", FILE,
        "    return None if add else dw\n", "    return dw\n",
        "a later microbatch's expert wgrads, added into .grad by the kernel, are also handed to autograd, "
        "which adds them again", TESTS, ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_gathered_held_grad_returned_too", FILE,
        "        sm90.grouped_gemm_wgrad_gathered_add(dy, x, slot, k, offs, tokens, into, transposed)\n"
        "        return None\n",
        "        sm90.grouped_gemm_wgrad_gathered_add(dy, x, slot, k, offs, tokens, into, transposed)\n"
        "        return into\n",
        "the down wgrad gathered from dout's rows and added into .grad by the kernel is also handed to "
        "autograd, which adds it again", TESTS, ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_gathered_down_rows_shifted", FILE,
        "return sm90.grouped_gemm_wgrad_gathered(dy, x, slot, k, offs, side=tokens, ",
        "return sm90.grouped_gemm_wgrad_gathered(dy.roll(1, 0), x, slot, k, offs, side=tokens, ",
        "the gathered down wgrad reads each slot's previous token's dout row", TESTS, ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_gathered_up_wgrad_side_swapped", FILE,
        "side=tokens, ", "side=\"dy\" if tokens == \"x\" else tokens, ",
        "the gathered up wgrad reads dh through slot as if it were token-major and x as permuted rows",
        TESTS, ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_adding_flag_ignored", FILE,
        "    if (not adding() or not w.is_leaf", "    if (not w.is_leaf",
        "expert wgrads go into a held .grad even outside adding_to_grads: torch.autograd.grad gets None for "
        "them and .grad changes under it", TESTS, ("moe_layer",),
    ),
    sep_mutation(
        "moe.fast_topk_grad_unnormalised", FILE,
        "    d = (g - (g * weights).sum(-1, keepdim=True)) * weights\n",
        "    d = g * weights\n",
        "router top-k backward drops the renormalisation's term: the raw scores' derivative",
        TESTS,
        ("moe_layer",),
    ),
)
