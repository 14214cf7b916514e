"""gemm.fast_fp8_*: defects in the sm_90a fp8 grouped GEMM kernel (scales, promotion, K blocks); GPU only."""

from __future__ import annotations

from mutations.model import Mutation, sep_mutation

FILE = "nmoe/fast/kernels/sm90/grouped_gemm_fp8.py"
TESTS = "tests/test_fast_gemm_fp8.py"
OVERLAP_TESTS = "tests/test_fast_gemm_fp8_overlap.py"
CONTRACTS = ("grouped_gemm_fp8",)

MUTATIONS: tuple[Mutation, ...] = (
    sep_mutation(
        "gemm.fast_fp8_scale_wrong_operand", FILE,
        "                row_lo = dsl_min(row0 + t_c[((0, 0, 0), 0, 0)][0], m_rows - 1)\n"
        "                row_hi = dsl_min(row0 + t_c[((0, 1, 0), 0, 0)][0], m_rows - 1)\n",
        "                row_lo = dsl_min(row0 + t_c[((0, 0, 0), 0, 0)][1], m_rows - 1)\n"
        "                row_hi = dsl_min(row0 + t_c[((0, 1, 0), 0, 0)][1], m_rows - 1)\n",
        "the activation scale is looked up by the output column instead of the row", TESTS, CONTRACTS,
        device="gpu",
    ),
    sep_mutation(
        "gemm.fast_fp8_no_promotion", FILE,
        "    tiled_mma.set(warpgroup.Field.ACCUMULATE, False)\n",
        "    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)\n",
        "the per-block accumulator is never reset, so each block's scales multiply the running sum",
        TESTS, CONTRACTS, device="gpu",
    ),
    sep_mutation(
        "gemm.fast_fp8_skip_last_k_block", FILE,
        "    k_tiles = k // BK\n", "    k_tiles = k // BK - 1\n",
        "the last 128-wide K block (and its scales) is never multiplied", TESTS, CONTRACTS, device="gpu",
    ),
    sep_mutation(
        "gemm.fast_fp8_weight_scale_first_n_block", FILE,
        "_byte(m_ws, (n_tile, kt, e))", "_byte(m_ws, (0, kt, e))",
        "every N tile uses the weight scale of the expert's first 128 output columns", TESTS, CONTRACTS,
        device="gpu",
    ),
    sep_mutation(
        "gemm.fast_fp8_nan_scale_as_inf", FILE,
        "return Float32(i2f(sel(b == E8M0_NAN, F32_CANONICAL_NAN, e8m0_value_bits(b))))",
        "return Float32(i2f(e8m0_value_bits(b)))",
        "e8m0 byte 255 decodes as +Inf (b << 23) instead of NaN", TESTS, CONTRACTS, device="gpu",
    ),
    sep_mutation(
        "gemm.fast_fp8_overlap_next_scales", FILE,
        "    _promote(acc, prev, s_lo, s_hi)\n",
        "    _promote(acc, prev, *_block_scales(b_lo, b_hi, b_w))\n",
        "the overlapped schedule promotes each block but the last with the next block's scales",
        OVERLAP_TESTS, CONTRACTS, device="gpu",
    ),
    sep_mutation(
        "gemm.fast_fp8_staged_store_next_buffer", "nmoe/fast/kernels/sm90/epilogue.py",
        "                cute.copy(epi.tma_atom, views.b_sd[(None, buf)], views.b_gd[(None, (0, sub))])\n",
        "                cute.copy(epi.tma_atom, views.b_sd[(None, epi.buf0 + (sub + 1) % bufs)], "
        "views.b_gd[(None, (0, sub))])\n",
        "a staged tile's subtile store reads the next subtile's buffer, so it leaves with that subtile's "
        "values or an earlier tile's", OVERLAP_TESTS, CONTRACTS, device="gpu",
    ),
    sep_mutation(
        "gemm.fast_fp8_tile_at_once_first_buffer", "nmoe/fast/kernels/sm90/epilogue.py",
        "b_sd[(None, epi.buf0 + whole)]", "b_sd[(None, epi.buf0)]",
        "a staged tile leaving at once sends its first subtile's buffer to every subtile's columns",
        OVERLAP_TESTS, CONTRACTS, device="gpu",
    ),
    sep_mutation(
        "gemm.fast_fp8_cluster_b_slice_dropped", "nmoe/fast/kernels/sm90/grouped_gemm.py",
        "            t_sb, t_gb = cpasync.tma_partition(tma_atom_b, rank, cute.make_layout(cm), s_b_flat,\n",
        "            t_sb, t_gb = cpasync.tma_partition(tma_atom_b, 0, cute.make_layout(cm), s_b_flat,\n",
        "both CTAs of an fp8 M cluster load and multicast slice 0 of each B box: the other slice is never "
        "loaded", OVERLAP_TESTS, CONTRACTS, device="gpu",
    ),
    sep_mutation(
        "gemm.fast_fp8_overlap_tail_dropped", FILE,
        "    warpgroup.wait_group(0)\n    _promote(acc, bufs[(k_tiles - 1) % 2], s_lo, s_hi)\n",
        "    warpgroup.wait_group(0)\n",
        "the overlapped schedule waits for a tile's last K block but never promotes it", OVERLAP_TESTS,
        CONTRACTS, device="gpu",
    ),
)
