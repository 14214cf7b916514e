"""The ablation catalog of bench.ablate: each a named source edit (a stage left out, a knob forced) or an
ordered tuple of them, grouped into sets (gemm, gather, layer, fp8) that the runner times against the
unedited tree."""

from __future__ import annotations

from dataclasses import replace

from mutations.model import Mutation

KERNEL = "nmoe/fast/kernels/sm90/grouped_gemm.py"
EPILOGUE = "nmoe/fast/kernels/sm90/epilogue.py"
TILES = "nmoe/fast/kernels/sm90/tiles.py"
GLUE = "nmoe/fast/gemm/sm90.py"
LIMITS = "nmoe/fast/limits.py"
_BN128 = Mutation(
    "ablate.bn128", "nmoe/fast/gemm/sm90_kernels.py",
    "    return 256 if n % 256 == 0 else 128",
    "    return 128",
    "N tile 128 everywhere (deeper pipeline, more A re-reads)",
)
_PINGPONG = Mutation(
    "ablate.pingpong", LIMITS,
    "GEMM_PINGPONG_MAX_K: Final[int] = 1024\n", "GEMM_PINGPONG_MAX_K: Final[int] = 1 << 30\n",
    "the TMA-fed fwd and dgrad ping-pong at every K (each consumer warpgroup its own 128 x 192 tile, one's "
    "epilogue under the other's MMAs), against the default's cooperative 128 x bn tile above K = 1024",
)
_GATHER_STATIC = Mutation(
    "ablate.gather_static", LIMITS,
    "GEMM_GATHER_DYNAMIC: Final[bool] = True\n", "GEMM_GATHER_DYNAMIC: Final[bool] = False\n",
    "the gathering fwd and dgrad take every SM-count-th unit instead of each next one from a device counter "
    "as CTAs free up: CTAs sharing an expert's B boxes drift apart",
)
_FWD_DYNAMIC = Mutation(
    "ablate.fwd_dynamic", LIMITS,
    "GEMM_FWD_DYNAMIC: Final[bool] = False\n", "GEMM_FWD_DYNAMIC: Final[bool] = True\n",
    "the TMA-fed fwd and dgrad (cooperative and ping-pong) take each unit from a device counter as CTAs free "
    "up instead of every SM-count-th",
)
_PINGPONG_BN128 = Mutation(
    "ablate.pingpong_bn128", LIMITS,
    "GEMM_PINGPONG_BN: Final[int] = 192\n", "GEMM_PINGPONG_BN: Final[int] = 128\n",
    "ping-pong tiles 128 x 128 (five operand stages, two thirds of the MMAs per A read) instead of 128 x 192",
)
_GATHER_B_EVICT_LAST = Mutation(
    "ablate.gather_b_evict_last", LIMITS,
    "GEMM_GATHER_B_EVICT_LAST: Final[bool] = False\n", "GEMM_GATHER_B_EVICT_LAST: Final[bool] = True\n",
    "the gathering fwd/dgrad's B TMAs keep the expert's weights in L2 last",
)
_TMA_A_EVICT_FIRST = Mutation(
    "ablate.a_evict_first", LIMITS,
    "GEMM_A_EVICT_FIRST: Final[bool] = False\n", "GEMM_A_EVICT_FIRST: Final[bool] = True\n",
    "the TMA-fed fwd/dgrad's A TMAs evict A's rows from L2 first",
)
_TMA_B_EVICT_LAST = Mutation(
    "ablate.b_evict_last", LIMITS,
    "GEMM_B_EVICT_LAST: Final[bool] = False\n", "GEMM_B_EVICT_LAST: Final[bool] = True\n",
    "the TMA-fed fwd/dgrad's B TMAs keep the expert's weights in L2 last",
)
_WGRAD_STATIC = Mutation(
    "ablate.wgrad_static", LIMITS,
    "GEMM_WGRAD_DYNAMIC: Final[bool] = True\n", "GEMM_WGRAD_DYNAMIC: Final[bool] = False\n",
    "the TMA wgrad deals its heaviest-first list in static snake rounds instead of taking each next tile "
    "from a device counter",
)
_WGRAD_CLUSTER_TWO = Mutation(
    "ablate.wgrad_cluster_two", LIMITS,
    "GEMM_WGRAD_CLUSTER_M: Final[int] = 1\n", "GEMM_WGRAD_CLUSTER_M: Final[int] = 2\n",
    "the TMA wgrad in clusters of two CTAs on adjacent M tiles of one work item, each x box multicast to "
    "both (half the x box reads from L2), CTA 0 handing each dynamic item to the other through shared memory",
)
_WGRAD_CLUSTER_FOUR = replace(
    _WGRAD_CLUSTER_TWO, id="ablate.wgrad_cluster_four", replacement="GEMM_WGRAD_CLUSTER_M: Final[int] = 4\n",
    description="the same in clusters of four (a quarter of the x box reads; fewer where M tiles do not fill "
    "them)")
_DEAD_ROWS_MMA = Mutation(
    "ablate.dead_rows_mma", KERNEL,
    "            if e < n_groups and row0 + wg_row < g_end and const_expr(k_tiles > 0):\n",
    "            if e < n_groups and const_expr(k_tiles > 0):\n",
    "fwd/dgrad warpgroups whose rows of a tile all lie past its group's end (a ragged group's last tile, a "
    "cluster's tile past the end) still issue their wgmmas, on rows never stored: what skipping them buys",
)
_PINGPONG_FULL_TAIL = Mutation(
    "ablate.pingpong_full_tail", KERNEL,
    "                if const_expr(pingpong) and g_end - row0 <= BM // 2:\n",
    "                if const_expr(pingpong) and g_end - row0 <= 0:\n",
    "a ping-pong tile whose live rows fit its first 64 still issues the wgmmas of all 128 rows",
)
_WGRAD_DEFERRED = Mutation(
    "ablate.wgrad_deferred", LIMITS,
    "GEMM_WGRAD_DEFERRED: Final[bool] = False\n", "GEMM_WGRAD_DEFERRED: Final[bool] = True\n",
    "the TMA wgrad holds each finished tile's bf16 subtiles in registers and sends one under each K box of "
    "the next tile's wgmmas, instead of storing them all before that tile starts",
)
_MASKED_STORES = Mutation(
    "ablate.masked_stores", EPILOGUE,
    "    tma_ok = rows_valid >= BM and cols_valid >= bn\n",
    "    tma_ok = rows_valid >= BM and cols_valid >= bn and rows_valid < 0\n",
    "full tiles leave through the masked per-thread stores instead of TMA",
)
_FWD_STORED_FIRST = Mutation(
    "ablate.fwd_stored_first", LIMITS,
    "GEMM_FWD_DEFERRED: Final[bool] = True\n", "GEMM_FWD_DEFERRED: Final[bool] = False\n",
    "the cooperative TMA-fed fwd and dgrad (K above the ping-pong's) store each finished tile before the "
    "next tile's wgmmas start, instead of holding it in registers and sending one subtile under each K box",
)
_GATHER_DEFERRED = Mutation(
    "ablate.gather_deferred", LIMITS,
    "GEMM_GATHER_DEFERRED: Final[bool] = False\n", "GEMM_GATHER_DEFERRED: Final[bool] = True\n",
    "the gathering up projection (with its fused activation) and dgrad hold each tile's bf16 h subtiles in "
    "registers and send one, with act(h), under each K box of the next tile's wgmmas",
)
_FP8_SERIAL = Mutation(
    "ablate.fp8_serial", LIMITS,
    "GEMM_FP8_OVERLAP: Final[bool] = True\n", "GEMM_FP8_OVERLAP: Final[bool] = False\n",
    "the fp8 fwd waits for each K block's wgmmas before promoting it instead of promoting it under the next "
    "block's wgmmas (two block accumulators)",
)
_GATHER_PINGPONG = Mutation(
    "ablate.gather_pingpong", LIMITS,
    "GEMM_GATHER_PINGPONG: Final[bool] = False\n", "GEMM_GATHER_PINGPONG: Final[bool] = True\n",
    "the gathering fwd and dgrad ping-pong (a tile per warpgroup, 128 wide with the fused activation, 192 "
    "without, so each A row is gathered more often) against the cooperative 128 x 256 tile",
)
_NO_PINGPONG = Mutation(
    "ablate.no_pingpong", LIMITS,
    "GEMM_PINGPONG_MAX_K: Final[int] = 1024\n", "GEMM_PINGPONG_MAX_K: Final[int] = 0\n",
    "the TMA-fed fwd and dgrad cooperative at every K: what ping-pong buys where K <= 1024",
)
ABLATIONS: tuple[Mutation, ...] = (
    _FWD_DYNAMIC,
    _PINGPONG_BN128,
    _TMA_A_EVICT_FIRST,
    _TMA_B_EVICT_LAST,
    Mutation(
        "ablate.no_tma_stores", EPILOGUE,
        "        if views.store_warp:\n            if const_expr(keep_h):\n",
        "        if views.store_warp and views.rows_valid < 0:\n            if const_expr(keep_h):\n",
        "full tiles skip their TMA stores: the output's share of the time under uniform routing",
    ),
    Mutation(
        "ablate.wgrad_no_epilogue", "nmoe/fast/kernels/sm90/grouped_gemm_wgrad.py",
        "        if write == 1:\n            if const_expr(deferred):",
        "        if write == 2:\n            if const_expr(deferred):",
        "timing only: the TMA wgrad's tiles skip their whole epilogue (staging, barriers, stores): the most "
        "that overlapping it with the next tile's MMAs could buy",
    ),
    Mutation(
        "ablate.wgrad_no_tail_mask", "nmoe/fast/kernels/sm90/grouped_gemm_wgrad.py",
        "    if valid < BK:\n        _zero_rows(s_a, stage, valid, BM, ctid)\n",
        "    if valid < 0:\n        _zero_rows(s_a, stage, valid, BM, ctid)\n",
        "timing only: a group's last K box keeps the next group's rows instead of zeroing them (16-byte "
        "shared stores, a proxy fence and a barrier per tile): what the tail mask costs, most under Zipf "
        "routing, where nearly every group ends inside a box",
    ),
    _MASKED_STORES,
    Mutation(
        "ablate.one_stage_less", TILES,
        "    return min(8, (SMEM_BYTES - epi_bytes - MAX_GROUPS * 4 - 2048) // stage_bytes)",
        "    return min(8, (SMEM_BYTES - epi_bytes - MAX_GROUPS * 4 - 2048) // stage_bytes) - 1",
        "operand pipeline one stage shallower: how much depth matters",
    ),
    Mutation(
        "ablate.epi_n64", TILES,
        "EPI_N = 32\n", "EPI_N = 64\n",
        "the output leaves in 64-column subtiles: half the epilogue's barriers, one operand stage less at "
        "bn=256",
    ),
    Mutation(
        "ablate.epi_bufs4", TILES,
        "EPI_BUFS = 2\n", "EPI_BUFS = 4\n",
        "four output subtile buffers, so no subtile waits for an earlier store to leave shared memory; one "
        "operand stage less at bn=256",
    ),
    _BN128,
    _PINGPONG,
    _NO_PINGPONG,
    _WGRAD_STATIC,
    _WGRAD_DEFERRED,
    _WGRAD_CLUSTER_TWO,
    _DEAD_ROWS_MMA,
    _PINGPONG_FULL_TAIL,
    _WGRAD_CLUSTER_FOUR,
    _FWD_STORED_FIRST,
    Mutation(
        "ablate.cluster_one", LIMITS,
        "GEMM_CLUSTER_M: Final[int] = 2\n", "GEMM_CLUSTER_M: Final[int] = 1\n",
        "fwd and dgrad CTAs run alone, each loading its whole B box (no cluster, no multicast): what sharing "
        "B across a 2-CTA cluster buys",
    ),
)
WGRAD_GATHER = "nmoe/fast/kernels/sm90/grouped_wgrad_gather.py"
CHUNKLOAD = "nmoe/fast/kernels/sm90/chunkload.py"
# The gathering producers' landing (commit_stage and land_all), and the same two with each thread's copies
# arriving on their stage's barrier by themselves.
_LANDING = (
    "    cute.arch.cp_async_commit_group()\n"
    "    if state.count - floor >= lag:\n"
    "        cute.arch.cp_async_wait_group(lag)\n"
    "        cute.arch.fence_proxy(\"async.shared\", space=\"cta\")\n"
    "        back = state.index - lag\n"
    "        if back < 0:\n"
    "            back = back + stages\n"
    "        _land(mainloop, back)\n"
)
_NOINC = (
    "    cute.arch.cp_async_mbarrier_arrive_noinc(\n"
    "        cast(pipeline.MbarrierArray, mainloop.sync_object_full).get_barrier(state.index))\n"
)
_LAND_ALL = (
    "\n\n@cute.jit\ndef land_all(mainloop: pipeline.PipelineTmaAsync, state: Any, lag: Constexpr[int],\n"
    "             stages: Constexpr[int], floor: Int32 | int = 0) -> None:\n"
    "    \"\"\"After the producer's last stage (`state` past it): land the up to `lag` stages still in "
    "flight.\"\"\"\n"
)
_LANDING += _LAND_ALL + (
    "    cute.arch.cp_async_wait_group(0)\n"
    "    cute.arch.fence_proxy(\"async.shared\", space=\"cta\")\n"
    "    for i in range(dsl_min(state.count - floor, lag)):\n"
    "        _land(mainloop, (state.index + (stages - 1) - i) % stages)\n"
)
_NOINC += _LAND_ALL + "    cute.arch.cp_async_commit_group()\n    cute.arch.cp_async_wait_group(0)\n"
_GATHER_NOINC = Mutation(
    "ablate.gather_noinc", CHUNKLOAD, _LANDING, _NOINC,
    "timing only (no proxy fence): each gathering thread's copies arrive on the stage's barrier when they "
    "land (cp.async.mbarrier.arrive.noinc), so no producer thread ever waits on its own copies",
)
_OLD_PRODUCER = Mutation(
    "ablate.gather_wgrad_old_producer", LIMITS,
    "GEMM_WGRAD_GATHER_LEAN: Final[bool] = True\n", "GEMM_WGRAD_GATHER_LEAN: Final[bool] = False\n",
    "the gathered wgrad's producer as before produce_wgrad_lean: 64-bit sources shuffled, selected and added "
    "per chunk, each chunk's shared offset swizzled in the loop",
)
_WGRAD_GATHER_DYNAMIC = Mutation(
    "ablate.gather_wgrad_dynamic", LIMITS,
    "GEMM_WGRAD_GATHER_DYNAMIC: Final[bool] = False\n", "GEMM_WGRAD_GATHER_DYNAMIC: Final[bool] = True\n",
    "the gathered wgrads take each tile of the heaviest-first list from a device counter (producer warp 0 "
    "hands it to the other producer warps and the consumers) instead of static snake rounds, so the CTAs on "
    "one expert's rows stay together",
)
_UP_WGRAD_GATHERED = Mutation(
    "ablate.layer_up_wgrad_gathered", LIMITS, "GEMM_WGRAD_GATHER_X_MAX_N: Final[int] = 512\n",
    "GEMM_WGRAD_GATHER_X_MAX_N: Final[int] = 1 << 30\n",
    "the up projection's wgrad reads x's rows by index (on its M side, dw stored transposed) at every up "
    "width N, not only at N <= 512: no copies of x",
)
_ZERO_CHUNK_READS = (
    replace(_OLD_PRODUCER, id="ablate.gather_wgrad_zero_chunk_reads",
            description="the old producer whose pad rows and rows past the group read the one 16-byte zero "
            "chunk (16 source bytes) instead of landing zero-filled with none: the producer as it was"),
    Mutation("ablate.gather_wgrad_zero_chunk_reads_b", WGRAD_GATHER, "state.index)) * 2), size)",
             "state.index)) * 2), Int32(16))", ""),
)
_WGRAD_REGS = (
    Mutation("ablate.gather_wgrad_regs_48", WGRAD_GATHER,
             '        cute.arch.setmaxregister_decrease(PRODUCER_REGS)\n        if const_expr(side == "b"):',
             '        cute.arch.setmaxregister_decrease(48)\n        if const_expr(side == "b"):',
             "the gathered wgrad's producer warpgroup at 48 registers and every wgrad's consumers at 224 "
             "(the pool is 384 x 168): at 40 ptxas spills 8-20 bytes in the gathering producers, at 48 / "
             "224 nothing, and the TMA wgrads' consumers do not spill at 224"),
    Mutation("ablate.gather_wgrad_regs_48_consumers", "nmoe/fast/kernels/sm90/grouped_gemm_wgrad.py",
             "    cute.arch.setmaxregister_increase(CONSUMER_REGS)\n",
             "    cute.arch.setmaxregister_increase(224)\n", ""),
)
SWIGLU = "nmoe/fast/kernels/swiglu.py"
_QUOTIENT = "        s[j] = unit_quotient(num[j], add_rn(1.0, ef[j]))\n"
_ACT_IEEE_DIV = Mutation(
    "ablate.gather_act_ieee_div", SWIGLU, _QUOTIENT, "        s[j] = num[j] / add_rn(1.0, ef[j])\n",
    "the swiglu's sigmoid quotient (fused, standalone and in the expert rows' backward) by div.rn.f32, its "
    "range check and slow-path call included, instead of that division's fast path alone: the same bits",
)
_GATHER_LAG_TWO = Mutation(
    "ablate.gather_lag_two", LIMITS, "GEMM_GATHER_LAG: Final[int] = 1\n", "GEMM_GATHER_LAG: Final[int] = 2\n",
    "the gathering producers land each stage two stages after issuing it (a stage more in flight, one fewer "
    "landed ahead of the consumers; stages - 2 at 256-wide tiles, the lag before c251dcb's A/B)",
)
GATHER_ABLATIONS: tuple[Mutation, ...] = (
    Mutation(
        "ablate.gather_no_fence", CHUNKLOAD,
        "        cute.arch.cp_async_wait_group(lag)\n"
        "        cute.arch.fence_proxy(\"async.shared\", space=\"cta\")\n",
        "        cute.arch.cp_async_wait_group(lag)\n",
        "the producers land a stage without the proxy fence (timing only: the fence is what orders "
        "cp.async's generic writes before wgmma's async reads): what the fence costs",
    ),
    Mutation(
        "ablate.gather_wgrad_bn128", GLUE,
        "    bn = pick_bn(kk)\n    n_ctas, split = _wgrad_grid(",
        "    bn = 128\n    n_ctas, split = _wgrad_grid(",
        "the gathered wgrad in 128-wide tiles: five operand stages (landing lag 3) instead of three (lag 1), "
        "at twice the re-reads of the TMA operand",
    ),
    _GATHER_LAG_TWO,
    Mutation(
        "ablate.gather_no_mma", KERNEL,
        "    for kb in range_constexpr(K_BLOCKS):\n        a = t_ra[",
        "    for kb in range_constexpr(0):\n        a = t_ra[",
        "timing only: the consumers issue no wgmma (every kernel, gathered or not), so each variant runs at "
        "its producer's pace: whether loading A, not the MMAs, sets the gathered kernels' time",
    ),
    Mutation(
        "ablate.gather_wgrad_no_copies", WGRAD_GATHER,
        "            copy_chunk(g, chunk_at(",
        "            if r < -1:\n                copy_chunk(g, chunk_at(",
        "timing only: the gathered wgrad producer issues no cp.async (lookups, shuffles and the landing "
        "protocol stay)",
    ),
    _OLD_PRODUCER,
    _WGRAD_GATHER_DYNAMIC,
    Mutation(
        "ablate.gather_cache_all", CHUNKLOAD,
        "cp.async.cg.shared.global", "cp.async.ca.shared.global",
        "every gathering producer's cp.async allocates in L1 (.ca) instead of bypassing it (.cg): whether "
        "the bypass path limits the copies",
    ),
    _GATHER_NOINC,
    Mutation(
        "ablate.gather_unit_weights", "bench/ablate.py",
        "    w = (torch.randn(e, 2 * i, h, device=\"cuda\", generator=gen) * h**-0.5).to(torch.bfloat16)\n",
        "    w = torch.randn(e, 2 * i, h, device=\"cuda\", dtype=torch.bfloat16, generator=gen)\n",
        "up weights at unit normal (h ~ N(0, H)) instead of the layer's init scale (std H^-1/2, h ~ "
        "N(0, 1)): what the gates' magnitude costs the fused activation (H200: up to 1.83x)",
    ),
    Mutation(
        "ablate.gather_act_no_exp", SWIGLU,
        "    e = cute.math.exp(-cute.math.absf(gv))  # type: ignore[attr-defined]\n",
        "    e = cute.math.absf(gv)  # type: ignore[attr-defined]\n",
        "timing only: the fused (and standalone) swiglu takes |g| for exp(-|g|): what expf costs",
    ),
    Mutation(
        "ablate.gather_act_no_div", SWIGLU, _QUOTIENT, "        s[j] = num[j] * add_rn(1.0, ef[j])\n",
        "timing only: the fused (and standalone) swiglu multiplies by 1 + e instead of dividing: what the "
        "division costs",
    ),
    _ACT_IEEE_DIV,
    _GATHER_DEFERRED,
    replace(_MASKED_STORES, id="ablate.gather_lsu_stores",
            description="every tile's h and act(h) leave by per-thread 16-byte stores (the LSU) instead of "
            "TMA: whether the epilogue's TMA stores queue on the SM's TMA unit ahead of B's loads"),
    _GATHER_B_EVICT_LAST,
    _GATHER_STATIC,
    _GATHER_PINGPONG,
    replace(_BN128, id="ablate.gather_bn128",
            description="every grouped GEMM in 128-wide N tiles: six operand stages instead of four, at "
            "twice the re-reads of A: whether more stages in flight pace the gathering producer"),
    Mutation(
        "ablate.gather_act_no_compute", EPILOGUE,
        "    r_bits.store(bits)\n", "    r_bits.fill(0)\n",
        "timing only: the fused-activation epilogue stages and stores zeros as act(h) instead of computing "
        "it: what the activation's arithmetic costs",
    ),
    Mutation(
        "ablate.gather_act_no_a_tma", EPILOGUE,
        "            if const_expr(act_by_tma(n, act)):\n"
        "                cute.copy(epi.act_tma_atom, views.b_sa[(None, buf)], "
        "views.b_ga[(None, (0, sub))])\n",
        "",
        "timing only: the fused-activation epilogue computes and stages act(h) but never stores it to global "
        "memory: what its TMA store costs",
    ),
)
MOE = "nmoe/fast/moe.py"


_PDL = Mutation(
    "ablate.layer_pdl", LIMITS, "FAST_PDL: Final[bool] = False\n", "FAST_PDL: Final[bool] = True\n",
    "every fast kernel launched under programmatic dependent launch, waiting for the grid before it as its "
    "first step, so its launch overlaps that grid's tail",
)


def _as_layer(m: Mutation) -> Mutation:
    """A kernel ablation timed as the MoE layer: ablate.X becomes ablate.layer_X."""
    return replace(m, id=m.id.replace("ablate.", "ablate.layer_", 1))


LAYER_ABLATIONS: tuple[Mutation, ...] = (
    replace(_WGRAD_DEFERRED, id="ablate.layer_wgrad_deferred",
            description="the layer's wgrads (both column-chunked TMA wgrads) with the deferred epilogue"),
    replace(_GATHER_DEFERRED, id="ablate.layer_gather_deferred",
            description="the layer's gathering up projection (swiglu fused) and down-projection dgrad with "
            "the deferred epilogue"),
    Mutation(
        "ablate.layer_up_chunks_wide", MOE,
        "                dw_up = _expert_wgrad(dh, x, slot, row_of, offs, \"x\", dh.shape[1], w_up)\n",
        "                dw_up = _expert_wgrad(dh, x, slot, row_of, offs, \"x\", 2 * dh.shape[1], w_up)\n",
        "the up wgrad copies x's columns in chunks twice as wide as dh (half the launches, twice the "
        "transient copy)",
    ),
    Mutation("ablate.layer_dgrad_spill_tile0", "nmoe/fast/kernels/sm90/grouped_gemm_gather.py",
             "            owner = sel(kt % n_tiles == n_tile, 1, 0) if n_tiles > 1 else 1\n",
             "            owner = sel(n_tile == 0, 1, 0) if n_tiles > 1 else 1\n",
             "the spilling down dgrad's N tile 0 stores every K box's rows (its CTAs alone carry the copy's "
             "stores), instead of box kt from N tile kt % n_tiles"),
    _PDL,
    Mutation("ablate.layer_dgrad_no_spill", LIMITS, "GEMM_DGRAD_SPILL: Final[bool] = True\n",
             "GEMM_DGRAD_SPILL: Final[bool] = False\n",
             "at I above GEMM_WGRAD_GATHER_DY_MAX_K the down wgrad reads copies of dout's column chunks made "
             "by copy passes after the down dgrad, instead of the whole copy the dgrad writes from the rows "
             "it gathered"),
    *(Mutation(f"ablate.layer_down_wgrad_{what}", LIMITS, "GEMM_WGRAD_GATHER_DY_MAX_K: Final[int] = 256\n",
               f"GEMM_WGRAD_GATHER_DY_MAX_K: Final[int] = {to}\n", "the down projection's wgrad " + how)
      for what, to, how in (
          ("copied", 0, "by TMA over the permuted copy of dout the down dgrad writes, at every I, instead of "
           "reading dout's rows by index as it loads (cp.async) at I <= 256"),
          ("gathered", 1 << 30, "reads dout's rows by index at every I, not only at I <= 256"))),
    _UP_WGRAD_GATHERED,
    Mutation("ablate.layer_up_wgrad_copied", LIMITS, "GEMM_WGRAD_GATHER_X_MAX_N: Final[int] = 512\n",
             "GEMM_WGRAD_GATHER_X_MAX_N: Final[int] = 0\n",
             "the up projection's wgrad by TMA over permuted copies of x's column chunks at every up width "
             "N, instead of reading x's rows by index at N <= 512"),
    Mutation("ablate.layer_up_wgrad_on_n", LIMITS, "GEMM_WGRAD_GATHER_X_ON_M: Final[bool] = True\n",
             "GEMM_WGRAD_GATHER_X_ON_M: Final[bool] = False\n",
             "where the up wgrad gathers x (N <= 512), x's rows on its N side and dw in w's layout, instead "
             "of on its M side with dw stored transposed"),
    Mutation(
        "ablate.layer_align128", "bench/ablate.py",
        "    mc, p, x, leaves = layer_inputs(cfg, routing, LAYER_ALIGN)\n",
        "    mc, p, x, leaves = layer_inputs(cfg, routing, 128)\n",
        "permute_align 128 instead of 8: every group fills whole 128-row tiles (no partial tile, no wgrad "
        "tail mask), while the sync-free row bound T K + E (align - 1) that sizes every [rows, *] buffer "
        "grows (E = 256: 32512 pad rows instead of 1792)",
    ),
    Mutation(
        "ablate.layer_up_copied", MOE,
        "            p, row_of = permute_rows(x.new_empty(t, 0), ids, e, align)\n"
        "            a, h = sm90.grouped_gemm_act_gathered(x, p.slot, k, w_up, p.offs, cfg.activation, "
        "keep_h=grad)\n",
        "            p, row_of = permute_rows(x, ids, e, align)\n"
        "            a, h = sm90.grouped_gemm_act_h(p.xp, w_up, p.offs, cfg.activation)\n",
        "the up projection from permute's [R, H] copy of x by TMA instead of gathering x's rows as it loads: "
        "what the fusion costs in time (its copy is transient, freed after the forward's up projection)",
    ),
    Mutation(
        "ablate.layer_down_chunks_a_wide", MOE,
        "            dw2 = _expert_wgrad(dout, aw, slot, row_of, offs, \"dy\", h.shape[1], w2, dyp)\n",
        "            dw2 = _expert_wgrad(dout, aw, slot, row_of, offs, \"dy\", aw.shape[1], w2, dyp)\n",
        "the down wgrad copies dout's columns in chunks as wide as a (I) instead of dh (2I for swiglu): "
        "twice the launches, each with a skewed routing's tail",
    ),
    _as_layer(_NO_PINGPONG),
    replace(_MASKED_STORES, id="ablate.layer_lsu_stores",
            description="every grouped GEMM's full tiles leave by per-thread stores instead of TMA, timed as "
            "the layer"),
    *map(_as_layer, (_WGRAD_STATIC, _WGRAD_CLUSTER_TWO, _DEAD_ROWS_MMA, _PINGPONG_FULL_TAIL, _PINGPONG,
                     _TMA_A_EVICT_FIRST, _TMA_B_EVICT_LAST, _GATHER_B_EVICT_LAST,
                     _GATHER_STATIC, _FWD_DYNAMIC, _PINGPONG_BN128, _GATHER_PINGPONG, _GATHER_LAG_TWO)),
    replace(_ACT_IEEE_DIV, id="ablate.layer_act_ieee_div"),
)
# Ablations of more than one edit, applied in order; the first names the variant and says what it measures.

_FP8_PER_SUBTILE = Mutation(
    "ablate.fp8_per_subtile_stores", LIMITS,
    "GEMM_FP8_TILE_AT_ONCE: Final[bool] = True\n", "GEMM_FP8_TILE_AT_ONCE: Final[bool] = False\n",
    "the fp8 fwd's staged tile leaves subtile by subtile, a barrier pair and a TMA store group each (eight "
    "consumer barriers a tile instead of two)",
)
_FP8_TWO_SUBTILES = Mutation(
    "ablate.fp8_two_subtiles", LIMITS,
    "GEMM_FP8_STAGED_TILE: Final[bool] = True\n", "GEMM_FP8_STAGED_TILE: Final[bool] = False\n",
    "the fp8 fwd stages two output subtiles (one operand stage more) instead of the whole tile, so its "
    "consumers wait on the tile's stores before the next tile's MMAs",
)

COMPOUNDS: dict[str, tuple[tuple[Mutation, ...], ...]] = {
    "gather": (_WGRAD_REGS, _ZERO_CHUNK_READS,
               (replace(_GATHER_DEFERRED, id="ablate.gather_deferred_lsu_stores",
                        description="the gathering kernels hold each tile's h in registers and send "
                        "one subtile, with act(h), under each K box of the next tile by per-thread stores"),
                replace(_MASKED_STORES, id="ablate.gather_deferred_lsu_stores_b"))),
    "layer": (tuple(replace(m, id=m.id.replace("gather_", "layer_")) for m in _WGRAD_REGS),
              (Mutation("ablate.layer_routing_before", "nmoe/fast/kernels/router.py",
                        "    key = _order_key(v)\n", "    for off in (16, 8, 4, 2, 1):\n"
                        "        ov, oi, os_ = _bfly(v, off), _bfly(i, off), _bfly(s, off)\n"
                        "        take = _beats(ov, oi, v, i)\n"
                        "        v, i, s = _sel_f(take, ov, v), sel(take, oi, i), _sel_f(take, os_, s)\n"
                        "    return i, s\n    key = _order_key(v)\n",
                        "the routing as before: each pick's warp argmax a 5-step butterfly of (value, id, "
                        "score) shuffles, not two integer reductions; permute's row-copy kernel launched "
                        "with no columns to copy; row_of rebuilt from slot by four torch kernels"),
               Mutation("ablate.layer_routing_before_launch", "nmoe/fast/dispatch.py", "copies=h > 0)",
                        "copies=True)", ""),
               Mutation("ablate.layer_routing_before_rows", MOE, "        offs, slot = p.offs, p.slot\n",
                        "        offs, slot = p.offs, p.slot\n        row_of = torch.zeros(t * k + 1, "
                        "dtype=torch.int32, device=x.device).index_copy_(0, torch.where(slot >= 0, slot, "
                        "t * k), torch.arange(slot.shape[0], dtype=torch.int32, device=x.device))"
                        "[:t * k].view(t, k)\n", "")),
              (replace(_OLD_PRODUCER, id="ablate.layer_wgrad_old_producer"),),
              (replace(_UP_WGRAD_GATHERED, id="ablate.layer_up_wgrad_gathered_dynamic",
                       description="layer_up_wgrad_gathered with every gathered wgrad's tiles from the "
                       "device counter (GEMM_WGRAD_GATHER_DYNAMIC): what the dynamic schedule adds to x on "
                       "M"),
               replace(_WGRAD_GATHER_DYNAMIC, id="ablate.layer_up_wgrad_gathered_dynamic_b",
                       description="")),
              tuple(replace(m, id=m.id.replace("gather_", "layer_")) for m in _ZERO_CHUNK_READS),
              (replace(_GATHER_B_EVICT_LAST, id="ablate.layer_evict_all",
                       description="every fwd/dgrad TMA's weights evict-last, the TMA-fed rows evict-first"),
               replace(_TMA_A_EVICT_FIRST, id="ablate.layer_evict_all_a"),
               replace(_TMA_B_EVICT_LAST, id="ablate.layer_evict_all_tma_b"))),
    "gemm": ((replace(_TMA_A_EVICT_FIRST, id="ablate.evict_both",
                      description="a_evict_first and b_evict_last together"),
              replace(_TMA_B_EVICT_LAST, id="ablate.evict_both_b")),
             # The wgrad's TMA stores cost as much overlapped as not (H200: skipping them 1.04-1.07x, staging
             # the tile so they drain under the next MMAs 0.96-1.01x), as if they held up the operand TMAs.
             (replace(_WGRAD_DEFERRED, id="ablate.wgrad_deferred_lsu_stores",
                      description="the TMA wgrad sends each held subtile under the next tile's K boxes by "
                      "per-thread 16-byte stores (the LSU), not by TMA: whether its stores slow the wgrad by "
                      "queueing on the TMA unit ahead of the operand loads"),
              replace(_MASKED_STORES, id="ablate.wgrad_deferred_lsu_stores_b")),),
    "fp8": ((_FP8_TWO_SUBTILES, replace(_FP8_PER_SUBTILE, id="ablate.fp8_two_subtiles_b")),),
}
"""Ablations of several edits, named by their first."""


FP8_ABLATIONS: tuple[Mutation, ...] = (
    _FP8_SERIAL,
    replace(_TMA_A_EVICT_FIRST, id="ablate.fp8_a_evict_first",
            description="the fp8 fwd's A TMAs evict A's rows from L2 first"),
    replace(_TMA_B_EVICT_LAST, id="ablate.fp8_b_evict_last",
            description="the fp8 fwd's B TMAs keep the expert's weights in L2 last (the downs' short K reads "
            "each weight box for few MMAs)"),
    Mutation(
        "ablate.fp8_no_cluster", LIMITS,
        "GEMM_FP8_CLUSTER_M: Final[int] = 2\n", "GEMM_FP8_CLUSTER_M: Final[int] = 1\n",
        "the fp8 fwd at K <= GEMM_FP8_CLUSTER_MAX_K in CTAs alone, each loading all of its B boxes, "
        "instead of clusters of two M tiles sharing each B box by multicast",
    ),
    Mutation(
        "ablate.fp8_cluster_every_k", LIMITS,
        "GEMM_FP8_CLUSTER_MAX_K: Final[int] = 1024\n", "GEMM_FP8_CLUSTER_MAX_K: Final[int] = 1 << 30\n",
        "the fp8 fwd in clusters of two M tiles at every K, the up projections' long K included",
    ),
    Mutation(
        "ablate.fp8_no_epilogue", "nmoe/fast/kernels/sm90/grouped_gemm_fp8.py",
        "            _store(epi, tma_d,",
        "            if row0 < 0:\n"
        "                _store(epi, tma_d,",
        "timing only: the fp8 fwd's tiles skip their epilogue (staging, barriers, stores): the most that "
        "hiding it under the next tile's first K blocks could buy, most on the downs' four to eight blocks",
    ),
    replace(_MASKED_STORES, id="ablate.fp8_lsu_stores",
            description="the fp8 fwd's tiles leave by per-thread 16-byte stores instead of TMA: whether its "
            "stores queue on the SM's TMA unit ahead of the short-K downs' operand loads"),
    _FP8_PER_SUBTILE,
)
STEP_ABLATIONS: tuple[Mutation, ...] = (
    replace(_PDL, id="ablate.step_pdl", description=_PDL.description + ", timed as moonlet's graphed "
            "training step (norms, rope, cross-entropy and AdamW launched so too)"),
)
SETS: dict[str, tuple[Mutation, ...]] = {
    "gemm": ABLATIONS, "gather": GATHER_ABLATIONS, "layer": LAYER_ABLATIONS, "fp8": FP8_ABLATIONS,
    "step": STEP_ABLATIONS,
}


def variants_of(which: str) -> list[tuple[Mutation, ...]]:
    """The ablations of a set as edit sequences: a plain ablation is one edit."""
    return [*((a,) for a in SETS[which]), *COMPOUNDS.get(which, ())]
