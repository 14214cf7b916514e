"""rdep.fast_* and moe.fast_ep_*: defects in the CuTeDSL RDEP kernels (nmoe/fast/kernels/rdep.py) and in the
expert-parallel layer (nmoe/fast/moe.py, nmoe/fast/rdep/ep.py), GPU host only; moe.ep_* and rdep.return_*:
defects in the exchange's host glue (ep.py, group.py), killed on a CPU with stand-ins for RDEP."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/kernels/rdep.py"
TESTS = "tests/test_fast_rdep.py"

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "rdep.fast_wrong_rank", FILE,
        "        dest = e // n_local\n", "        dest = (e + 1) // n_local % world\n",
        "the last expert of each rank has its rows written into the next rank's window", TESTS,
        ("rdep_dispatch",), device="gpu",
    ),
    sep_mutation(
        "rdep.fast_order_broken", FILE,
        "pos = Int64(doff[e]) + Int64(j - (Int32(offs[e]) - Int32(counts[e])))",
        "pos = Int64(doff[e]) + Int64(Int32(offs[e]) - 1 - j)",
        "rows of one (source, expert) block land in reverse (t, k) order at the owner", TESTS,
        ("rdep_dispatch",), device="gpu",
    ),
    sep_mutation(
        "rdep.fast_return_slot_reused", FILE,
        "        slot = rid % Int64(n_slots)\n", "        slot = rid % Int64(n_slots) // 2 * 2\n",
        "a returned row goes to the even slot below its own: two rows share a slot, odd slots stay unwritten",
        TESTS, ("rdep_return",), device="gpu",
    ),
    sep_mutation(
        "rdep.fast_overflow_off_by_one", FILE,
        "        if need > capacity:\n", "        if need > capacity + 1:\n",
        "a rank receiving capacity + 1 rows passes the check (and writes one row past its window's rows)",
        TESTS, ("rdep_dispatch",), device="gpu",
    ),
    sep_mutation(
        "rdep.fast_return_buffer_by_device_count", FILE,
        "Int64(buf) * Int64(n_slots) + slot,", "(Int64(epoch[E_RETURN]) + 1) % 2 * Int64(n_slots) + slot,",
        "a return picks its buffer by the device's call count, not the host's: a CUDA graph replayed "
        "after an odd count of eager returns writes the buffer its captured reads do not see",
        "tests/test_fast_ep_layer.py", ("rdep_return",), device="gpu",
    ),
    sep_mutation(
        "rdep.return_view_other_buffer", "nmoe/fast/rdep/group.py",
        "    return group.outs[buf]\n", "    return group.outs[1 - buf]\n",
        "rdep_return hands its caller the other buffer than the one it names to the kernel",
        "tests/test_fast_ep_layer.py", ("rdep_return",),
    ),
    sep_mutation(
        "moe.fast_ep_shared_dropped", "nmoe/fast/moe.py",
        "out = ep_routed(x, weights, ids, up, p.w2, cfg.activation, cfg.route_scale, shared, ex,",
        "out = ep_routed(x, weights, ids, up, p.w2, cfg.activation, cfg.route_scale, None, ex,",
        "expert-parallel layer leaves the shared expert out of its combine", TESTS, ("moe_layer",),
        device="gpu",
    ),
    sep_mutation(
        "moe.fast_ep_fp8_down_unquantized", "nmoe/fast/rdep/ep.py",
        "        y = fp8_experts(BY_NAME[activation][0](h), w2, offs)\n",
        "        y = grouped_gemm(BY_NAME[activation][0](h), w2, offs)\n",
        "the expert-parallel fp8 layer runs its down projection on the bf16 weights and activations",
        "tests/test_fast_ep_layer.py", ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "moe.ep_return_latest_order", "nmoe/fast/rdep/ep.py",
        "back = rdep_return(ctx.ex.fwd, dx_recv.contiguous(), ctx.sent)",
        "back = rdep_return(ctx.ex.fwd, dx_recv.contiguous())",
        "a dispatch's backward returns its gradient rows in the receive order of the group's latest dispatch "
        "(another MoE layer's), not its own forward's", TESTS, ("moe_layer",),
    ),
)
