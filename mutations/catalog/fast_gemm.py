"""gemm.fast_*: defects in the sm_90a CuTeDSL grouped GEMM kernels (GPU host only) and their glue."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/kernels/sm90/grouped_gemm.py"
EPILOGUE = "nmoe/fast/kernels/sm90/epilogue.py"
TILES = "nmoe/fast/kernels/sm90/tiles.py"
WGRAD = "nmoe/fast/kernels/sm90/grouped_gemm_wgrad.py"
WGRAD_GATHER = "nmoe/fast/kernels/sm90/grouped_wgrad_gather.py"
CHUNKLOAD = "nmoe/fast/kernels/sm90/chunkload.py"
TILEQUEUE = "nmoe/fast/kernels/sm90/tilequeue.py"
PLAN = "nmoe/fast/kernels/sm90/gatherplan.py"
GATHER = "nmoe/fast/kernels/sm90/grouped_gemm_gather.py"
TESTS = "tests/test_fast_gemm.py"
ACT_TESTS = "tests/test_fast_gemm_act.py"
GATHER_TESTS = "tests/test_fast_gemm_gather.py"
SCHEDULE_TESTS = "tests/test_fast_wgrad_schedule.py"
ACC_TESTS = "tests/test_fast_wgrad_accumulate.py"
TRANSPOSED_TESTS = "tests/test_fast_wgrad_transposed.py"
WGRAD_DYNAMIC_TESTS = "tests/test_fast_wgrad_gather_dynamic.py"
QUEUE_TESTS = "tests/test_fast_gather_queue.py"

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "gemm.fast_zero_chunk_made_in_capture", "nmoe/fast/gemm/sm90.py",
        '        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():',
        "        if False:",
        "the gathering GEMMs' zero chunk is first made inside a CUDA graph capture, where it holds zeros "
        "only once the graph replays (eager calls read garbage for pad rows)",
        tests=(f"{GATHER_TESTS}::test_zero_chunk_is_made_eagerly_never_inside_a_capture",),
    ),
    sep_mutation(
        "gemm.fast_accumulate_bf16", FILE,
        "        warpgroup.wait_group(1)\n",
        "        warpgroup.wait_group(0)\n"
        "        acc.store(acc.load().to(BFloat16).to(Float32))\n",
        "accumulator rounded to bf16 after every K tile", TESTS, ("grouped_gemm",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_pingpong_acc_order_flat", EPILOGUE,
        "        epi.r_f[v] = epi.t_rs_acc[epi.order[sub * size_sub + v]]",
        "        epi.r_f[v] = epi.t_rs_acc[sub * size_sub + v]",
        "the epilogue stages the retiled accumulator in its flat order, as if it listed the subtiles one "
        "after another (true of the cooperative tile, not of a ping-pong warpgroup's two 64-row halves)",
        "tests/test_fast_gemm_pingpong.py", ("grouped_gemm",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_pingpong_turns_dropped", FILE,
        "            if turn > 0 and const_expr(pingpong):\n                other_done.arrive_and_wait()\n",
        "",
        "ping-pong warpgroups start their mainloops without waiting for the other's (its arrive stays): a "
        "parity wait on a stage one fill ahead passes early",
        "tests/test_fast_gemm_pingpong.py", ("grouped_gemm",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_skip_last_k_tile", FILE,
        "    return (k + BK - 1) // BK\n", "    return (k - 1) // BK\n",
        "the last (possibly partial) K tile is never multiplied", TESTS, ("grouped_gemm",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_group_boundary_off_by_one", FILE,
        "        end = dsl_min(dsl_max(s_offs[e], Int32(0)), m_rows)",
        "        end = dsl_min(dsl_max(s_offs[e] - 1, Int32(0)), m_rows)",
        "each group's last row is given to the next group's expert", TESTS, ("grouped_gemm",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_tail_not_zeroed", FILE,
        "    end = m_rows\n    if e < n_groups:", "    end = Int32(0)\n    if e < n_groups:",
        "rows past offs[-1] keep stale output instead of zeros", TESTS, ("grouped_gemm",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_ragged_n_dropped", EPILOGUE,
        "cols_valid = n - n_tile * bn", "cols_valid = (n // bn - n_tile) * bn",
        "columns of a ragged last N tile are never stored", TESTS, ("grouped_gemm",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_epilogue_act_swapped", EPILOGUE,
        "        hf.store(h.to(Float32))\n",
        "        for v in range_constexpr(total):\n            hf[v] = r_ha[v ^ 1].to(Float32)\n",
        "the fused swiglu epilogue takes silu of the up column and multiplies the gate (gate/up swapped)",
        ACT_TESTS, ("grouped_gemm_act",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_act_staged_wrong_buffer", EPILOGUE,
        "        s_bits[(coord[0], coord[1] // ratio, buf)] = ",
        "        s_bits[(coord[0], coord[1] // ratio, (buf + 1) % EPI_BUFS)] = ",
        "the fused epilogue stages act(h) in the other buffer than its TMA store reads, so each full tile's "
        "act subtile leaves with its neighbour's values", ACT_TESTS, ("grouped_gemm_act",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_accumulate_stores", TILES,
        "    op = cpasync.CopyReduceBulkTensorTileS2GOp() if accumulate else "
        "cpasync.CopyBulkTensorTileS2GOp()\n",
        "    op = cpasync.CopyBulkTensorTileS2GOp()\n",
        "the accumulating wgrad's full tiles leave by a plain TMA store, overwriting the gradient they add "
        "to",
        ACC_TESTS, ("grouped_gemm_wgrad",),
    ),
    sep_mutation(
        "gemm.fast_wgrad_gathered_add_stores", WGRAD_GATHER,
        "    m_dw, tma_atom_d, tma_d = dw_out(pdw, n_groups, n, k, k, n, accumulate)\n",
        "    m_dw, tma_atom_d, tma_d = dw_out(pdw, n_groups, n, k, k, n)\n",
        "the gathered wgrad adding into dw stores its full tiles by plain TMA, overwriting the gradient it "
        "adds to",
        ACC_TESTS, ("grouped_gemm_wgrad",),
    ),
    sep_mutation(
        "gemm.fast_wgrad_accumulate_cut_tile_stores", EPILOGUE,
        "                        _add_chunk(epi.t_s_sd[(None, i, j, buf)], t_s_gd[(None, i, j)])\n",
        "                        cute.copy(epi.s2g_atom, epi.t_s_sd[(None, i, j, buf)], "
        "t_s_gd[(None, i, j)])\n",
        "the accumulating wgrad's tiles cut by n or k are stored chunk by chunk over the gradient they add "
        "to",
        ACC_TESTS, ("grouped_gemm_wgrad",),
    ),
    sep_mutation(
        "gemm.fast_wgrad_mask_dropped", WGRAD,
        "    if valid < BK:\n", "    if valid < 0:\n",
        "wgrad sums the next group's rows into a group's last K box", TESTS, ("grouped_gemm_wgrad",),
        device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_mask_last_chunk_kept", WGRAD,
        "    per_row = rows // VEC\n", "    per_row = rows // VEC - 1\n",
        "the wgrad's 16-byte tail mask skips each row's last chunk: where both operands keep one, the next "
        "group's rows reach dw", TESTS, ("grouped_gemm_wgrad",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_deferred_subtile_skipped", FILE,
        "            emit_held(held, p_row0, p_tile, p_end, p_on, _kt, _kt + 1)\n",
        "            emit_held(held, p_row0, p_tile, p_end, p_on, _kt + 1, _kt + 2)\n",
        "the deferred epilogue (fwd, dgrad and wgrad share the K loop) sends subtile kt + 1 under K box kt: "
        "subtile 1 of a held tile never leaves", "tests/test_fast_gemm_deferred.py",
        ("grouped_gemm", "grouped_gemm_dgrad", "grouped_gemm_wgrad"), device="gpu",
    ),
    Mutation(
        "gemm.fast_deferred_tile_end_wait_one", FILE,
        "        emit_held(held, p_row0, p_tile, p_end, p_on, Int32(k_tiles), Int32(subs))\n"
        "    if const_expr(issue):\n        warpgroup.wait_group(0)\n",
        "        emit_held(held, p_row0, p_tile, p_end, p_on, Int32(k_tiles), Int32(subs))\n"
        "    if const_expr(issue):\n        warpgroup.wait_group(1)\n",
        "a tile's last K box is left in flight when its accumulator is held: ptxas must inject the wait "
        "itself (C7517), and the schedule is no longer the one written",
        tests=("tests/test_fast_gemm_deferred.py::test_deferred_kernels_keep_their_wgmmas_pipelined",),
    ),
    Mutation(
        "gemm.fast_deferred_act_hoisted", EPILOGUE,
        "_act_bits(_pinned(part), HELD_ACT_VALUES, p.act)", "_act_bits(part, HELD_ACT_VALUES, p.act)",
        "the deferred epilogue computes act(h) from the held registers directly: LLVM hoists every held "
        "subtile's activation out of the K loop into one serial batch before it (and spills it)",
        tests=("tests/test_fast_gemm_deferred.py::test_deferred_act_is_computed_under_the_k_box_that_sends_it",),
    ),
    sep_mutation(
        "gemm.fast_gather_deferred_act_chunk_misplaced", EPILOGUE,
        "                                   c // ratio, HELD_ACT_VALUES // ratio)\n",
        "                                   0, HELD_ACT_VALUES // ratio)\n",
        "a held subtile's act(h) chunks are all staged at the subtile's first outputs: its other outputs "
        "leave with what an earlier subtile staged there", "tests/test_fast_gemm_deferred.py",
        ("grouped_gemm_act",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_order_ties_collide", WGRAD,
        "            if e_j - s_j == end - start and j < i:\n                rank += 1\n", "",
        "the wgrad ranks groups by rows alone: equal groups share a rank, another rank's group is never "
        "computed", SCHEDULE_TESTS, ("grouped_gemm_wgrad",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_last_round_dropped", WGRAD,
        "    return cast(Int32, (total + n_ctas - 1) // n_ctas)\n",
        "    return cast(Int32, total // n_ctas)\n",
        "the wgrad deals whole rounds only: the tiles of a partial last round are never computed",
        SCHEDULE_TESTS, ("grouped_gemm_wgrad",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_split_partial_dropped", WGRAD,
        "        for c in range(splits):\n", "        for c in range(1, splits):\n",
        "the CTA finishing a split group's tile sums every chunk's partial but the first",
        SCHEDULE_TESTS, ("grouped_gemm_wgrad",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_split_order_reversed", WGRAD,
        "acc[v] = acc[v] + m_ws[(v, ctid, (first_slice + c) * slice_stride + local)]",
        "acc[v] = acc[v] + m_ws[(v, ctid, (first_slice + splits - 1 - c) * slice_stride + local)]",
        "a split group's chunk partials are summed last chunk first (still deterministic, other bits)",
        SCHEDULE_TESTS, ("grouped_gemm_wgrad",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_cols_ld_ignored", WGRAD,
        "    m_d = cute.make_tensor(pdw, cute.make_layout(((n_groups - 1) * gs + n, k), stride=(ld, 1)))",
        "    m_d = cute.make_tensor(pdw, cute.make_layout(((n_groups - 1) * gs + n, k), stride=(k, 1)))",
        "a column chunk of a wide dw is stored with its own width as the row pitch", SCHEDULE_TESTS,
        ("grouped_gemm_wgrad",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_cols_offset_dropped", "nmoe/fast/gemm/sm90.py",
        "(dw[:, row0:row0 + n, col0:col0 + k],)", "(dw[:, row0:row0 + n, :k],)",
        "every column chunk is stored from dw's first column", SCHEDULE_TESTS, ("grouped_gemm_wgrad",),
        device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_rows_group_stride_ignored", WGRAD,
        "store_tile(epi, tma_d, m_d, m_d, e * gs + m_tile * BM, n_tile, e * gs + n, k, bn,",
        "store_tile(epi, tma_d, m_d, m_d, e * n + m_tile * BM, n_tile, e * n + n, k, bn,",
        "a row chunk of a taller dw stores group e from row e * n, not e * (dw's rows)", SCHEDULE_TESTS,
        ("grouped_gemm_wgrad",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_cluster_rank_dropped", FILE,
        "    return local - m_unit * n_tiles_n, g_start + (m_unit * cm + rank) * BM\n",
        "    return local - m_unit * n_tiles_n, g_start + m_unit * cm * BM\n",
        "both CTAs of a cluster take the unit's first M tile: the second tile's rows are never computed",
        TESTS, ("grouped_gemm",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_act_only_act_store_dropped", EPILOGUE,
        "            if const_expr(act_by_tma(n, act)):\n"
        "                cute.copy(epi.act_tma_atom, views.b_sa[(None, buf)], "
        "views.b_ga[(None, (0, sub))])\n",
        "            if const_expr(act_by_tma(n, act) and keep_h):\n"
        "                cute.copy(epi.act_tma_atom, views.b_sa[(None, buf)], "
        "views.b_ga[(None, (0, sub))])\n",
        "the act-only epilogue (keep_h False) drops act(h)'s TMA store along with h's: full tiles of a are "
        "never written", GATHER_TESTS, ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_gather_unswizzled", CHUNKLOAD,
        "    out: Any = byte ^ (((byte >> 7) & 7) << 4)\n", "    out: Any = byte\n",
        "the gathered wgrad's chunks written without the 128-byte swizzle the tensor cores read",
        GATHER_TESTS, ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_gather_token_lane", PLAN,
        "    return lane - lane % ROW_CHUNKS + i\n",
        "    return lane - lane % ROW_CHUNKS + (i + 1) % ROW_CHUNKS\n",
        "the gathering producer's row p // 8 + 16 i takes the token looked up for row p // 8 + 16 (i + 1)",
        GATHER_TESTS, ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_gather_pad_rows_read", GATHER,
        "        sizes[i] = sel(t >= 0, 16, 0)\n", "        sizes[i] = Int32(16)\n",
        "the gathering producer reads pad rows and rows past the group as token 0's row instead of zeros",
        GATHER_TESTS, ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_gather_k_tail_unmasked", GATHER,
        "                        size = size & live\n", "                        size = size\n",
        "the gathering producer reads the last K box's columns past K (the next token's row), not zeros",
        GATHER_TESTS, ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_dgrad_spill_unswizzled", GATHER,
        "    at = swizzled_bases(cast(Pointer, s_a.iterator).toint(), "
        "a_outer((copied_row(wtid, 0), c, 0)) * 2, steps)\n",
        "    at = {r: cast(Pointer, s_a.iterator).toint() + a_outer((copied_row(wtid, 0), c, 0)) * 2 + r "
        "for r in sorted({st % 1024 for st in steps})}\n",
        "the spilling dgrad reads each row chunk of the stage unswizzled (chunk c at c, not c ^ row % 8)",
        GATHER_TESTS, ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_dgrad_spill_box_owner_fixed", GATHER,
        "            owner = sel(kt % n_tiles == n_tile, 1, 0) if n_tiles > 1 else 1\n",
        "            owner = sel(kt % n_tiles == 0, 1, 0) if n_tiles > 1 else 1\n",
        "every N tile of the spilling dgrad stores the K boxes N tile 0 owns (kt % n_tiles == 0), none the "
        "others: their columns of the copy are never written",
        GATHER_TESTS, ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_dgrad_spill_k_tail_unmasked", GATHER,
        "            tail = sel(kt * BK + c < k, 1, 0) if k % BK else 1\n", "            tail = 1\n",
        "the spilling dgrad stores the last K box's chunks past K, over the next row's first columns",
        GATHER_TESTS, ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_gather_row_off_by_one", CHUNKLOAD,
        "            t = Int32(Uint32(s) // Uint32(top_k))\n",
        "            t = Int32(Uint32(s + 1) // Uint32(top_k))\n",
        "the cp.async gathering producers (the wgrad's, the fwd/dgrad's rows) read slot + 1's token's row",
        GATHER_TESTS, ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_transposed_tile_swapped", EPILOGUE,
        "(BM, bn), (m_tile, n_tile))", "(BM, bn), (n_tile, m_tile))",
        "the transposed wgrad sends tile (m, n) to the box of tile (n, m)", TRANSPOSED_TESTS, ("moe_layer",),
        device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_transposed_group_stride", WGRAD,
        "stride=(1, n, n * k))", "stride=(1, n, n * k - n))",
        "the transposed wgrad places group e's dw^T e * n elements early, over the previous group's last "
        "column", TRANSPOSED_TESTS, ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_gather_dynamic_split_counter", WGRAD_GATHER,
        "        counter = u.n_groups * u.tiles_per_group\n", "        counter = u.n_groups * 0\n",
        "the dynamic gathered wgrad takes its tiles from the first split counter (group 0's first tile's "
        "chunk count) instead of its own: where that tile is split, grabs and chunk counts collide",
        WGRAD_DYNAMIC_TESTS, ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_gather_queued_no_landing", CHUNKLOAD,
        "    land_all(mainloop, state, lag, stages, floor)\n    out: Int32 = Int32(state.count)\n",
        "    out: Int32 = Int32(floor)\n",
        "a queue-fed cp.async producer hands units with no stages on without landing the stages in flight: "
        "its queue fills while the consumers wait for them, and the kernel never returns",
        QUEUE_TESTS, ("grouped_gemm_act", "grouped_gemm_wgrad")),
    sep_mutation(
        "gemm.fast_wgrad_gather_pad_rows_read", WGRAD_GATHER,
        "            if r >= 0:\n                size = live\n",
        "            size = live\n",
        "pad rows (slot -1) and rows past the group read token 0's row instead of landing zeros",
        GATHER_TESTS, ("moe_layer",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_gather_lanes_unspread", PLAN,
        "    return warp * q + j % q + 4 * q * (j // q)\n",
        "    return warp * q + j % q + q * (j // q)\n",
        "the gathered wgrad's lanes look up rows q apart instead of 4q (the warps' stride), so a chunk's "
        "shuffled source is another row's", SCHEDULE_TESTS, ("grouped_gemm_wgrad",),
    ),
    sep_mutation(
        "gemm.fast_gather_lag_too_deep", PLAN,
        "    deepest = stages - 2\n", "    deepest = stages - 1\n",
        "the gathering producers may land a stage one stage later than the deepest lag that finishes, so the "
        "slot they wait for is freed only after a stage they have not landed: the pipeline stands still",
        GATHER_TESTS, ("grouped_gemm_act",),
    ),
    sep_mutation(
        "gemm.fast_dead_rows_off_by_one", FILE,
        "            if e < n_groups and row0 + wg_row < g_end and const_expr(k_tiles > 0):\n",
        "            if e < n_groups and row0 + wg_row + 1 < g_end and const_expr(k_tiles > 0):\n",
        "a warpgroup whose rows of a tile hold one live row counts it dead: that row skips its wgmmas and "
        "leaves as zero", "tests/test_fast_gemm_dead_rows.py", ("grouped_gemm",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_dead_rows_emit_at_once", FILE,
        "p_row0, p_tile, p_end, p_on, k_tiles, subs, deferred, issue=False)\n",
        "p_row0, p_tile, p_end, p_on, k_tiles, subs, False, issue=False)\n"
        "                if const_expr(deferred):\n"
        "                    emit_held(held, p_row0, p_tile, p_end, p_on, Int32(0), Int32(subs))\n",
        "a dead warpgroup sends its held subtiles all at once, after its stages: its partner waits on the "
        "epilogue barrier under a stage the dead one must free first, and the launch never returns",
        "tests/test_fast_gemm_dead_rows.py", ("grouped_gemm",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_pingpong_half_off_by_one", FILE,
        "                if const_expr(pingpong) and g_end - row0 <= BM // 2:\n",
        "                if const_expr(pingpong) and g_end - row0 <= BM // 2 + 1:\n",
        "a ping-pong tile with 65 live rows takes the first-half wgmmas alone: its row 64 leaves as zero",
        "tests/test_fast_gemm_dead_rows.py", ("grouped_gemm",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_grab_skips", TILEQUEUE,
        "t = Int32(cute.arch.atomic_add(ptr, Int32(1), sem=\"acq_rel\", scope=\"gpu\"))",
        "t = Int32(cute.arch.atomic_add(ptr, Int32(2), sem=\"acq_rel\", scope=\"gpu\"))",
        "the dynamic wgrad's tile counter steps by two: every other tile of the list is never computed",
        "tests/test_fast_wgrad_dynamic.py", ("grouped_gemm_wgrad",), device="gpu",
    ),
    Mutation(
        "gemm.fast_dynamic_counter_from_one", "nmoe/fast/gemm/sm90.py",
        "    count = torch.zeros(1, dtype=torch.int32, device=device)\n",
        "    count = torch.ones(1, dtype=torch.int32, device=device)\n",
        "a dynamic fwd/dgrad's unit counter starts at 1: unit 0 (the first group's first M tile) is never "
        "computed, gathering or TMA-fed",
        tests=("tests/test_fast_gemm_gather_dynamic.py::test_sep_gemm_fast_gather_dynamic_counter_from_one",
               "tests/test_fast_gemm_fwd_dynamic.py::test_sep_gemm_fast_fwd_dynamic_counter_from_one"),
        device="gpu", contracts=("moe_layer", "grouped_gemm"),
    ),
    sep_mutation(
        "gemm.fast_wgrad_cluster_rank_dropped", WGRAD,
        "        m_tile = m_unit * u.cm + rank\n", "        m_tile = m_unit * u.cm\n",
        "every CTA of a wgrad cluster takes its work item's first M tile: the others are never computed",
        "tests/test_fast_wgrad_cluster.py", ("grouped_gemm_wgrad",), device="gpu",
    ),
    sep_mutation(
        "gemm.fast_wgrad_cluster_x_same_half", WGRAD,
        "    t_sb, t_gb = cpasync.tma_partition(tma_atom_b, rank, cute.make_layout(u.cm), s_b_flat,",
        "    t_sb, t_gb = cpasync.tma_partition(tma_atom_b, 0, cute.make_layout(u.cm), s_b_flat,",
        "every CTA of a wgrad cluster multicasts the first half of the x box: the second never arrives",
        "tests/test_fast_wgrad_cluster.py", ("grouped_gemm_wgrad",), device="gpu",
    ),
)
