"""sm_90a gathered wgrad whose token-major side lands by row TMA (one box per row and 64-element swizzle run,
since MN-major tiles put a row's runs in separate atoms), pad rows as TMA's zero fill; consumers and the
static deal are the cp.async kernel's. Import after runtime.import_cutlass("sm_90a")."""

from __future__ import annotations

from typing import Any, cast

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.base_dsl.ast_helpers import const_expr, range_constexpr
from cutlass.base_dsl.typing import Constexpr
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.typing import Pointer

from nmoe.fast.kernels.sm90.grouped_gemm import PRODUCER_REGS, THREADS, cta_setup, cta_start
from nmoe.fast.kernels.sm90.grouped_gemm_gather import _source_row, arm_stage
from nmoe.fast.kernels.sm90.grouped_gemm_wgrad import (
    Units,
    _wgrad_tile,
    by_side,
    consume_wgrad,
    gathered_setup,
    n_rounds,
    plan_units,
    pointer,
    side_tiles,
    snake_tile,
    stages_for,
)
from nmoe.fast.limits import GEMM_BK as BK
from nmoe.fast.limits import GEMM_BM as BM

RUN = 64
"""bf16 elements of one 128-byte swizzle row: the widest box a 128-byte-swizzled TMA lands."""


def run_layout(layout: cute.ComposedLayout) -> cute.ComposedLayout:
    """One token row's RUN-element run of an MN-major operand tile under the tile's 128-byte swizzle: TMA
    swizzles by shared address, so a run landing at its 128-byte line takes the whole-tile box's place."""
    out: cute.ComposedLayout = cute.make_composed_layout(layout.inner, 0,
                                                         cute.make_layout((RUN, 1), stride=(1, RUN)))
    return out


@cute.jit
def _copy_run(atom: cute.CopyAtom, tma_src: cute.Tensor, src: Int32, run: Int32, dst: Int32,
              t_run: cute.ComposedLayout, bar: Any) -> None:
    """TMA of source row src's run-th RUN columns into the 128-byte line at shared byte dst."""
    s_run = cute.make_tensor(cute.make_ptr(BFloat16, dst, cute.AddressSpace.smem, assumed_align=128), t_run)
    g_run = cute.local_tile(tma_src, (RUN, 1), (run, src))
    t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_run, 0, 2),
                                     cute.group_modes(g_run, 0, 2))
    cute.copy(atom, t_g, t_s, tma_bar_ptr=bar)


@cute.jit
def produce_wgrad_rows(mainloop: pipeline.PipelineTmaAsync, tma_atom: cute.CopyAtom, m_t: cute.Tensor,
                       run_atom: cute.CopyAtom, tma_src: cute.Tensor, t_run: cute.ComposedLayout,
                       m_slot: cute.Tensor, top_k: Int32, src_rows: Int32, s_t: cute.Tensor, s_g: cute.Tensor,
                       g_outer: cute.Layout, u: Units, bidx: Int32, n_ctas: Int32, warp_idx: Int32,
                       ptid: Int32, bn: Constexpr[int], side: Constexpr[str], stages: Constexpr[int]) -> None:
    """Warp 0 arms each stage and TMA-loads the permuted side; warp w loads stage rows [16 w, 16 w + 16),
    each row's source looked up a stage ahead by one lane and shuffled to the warp, one row TMA per run."""
    s_t_flat = cute.group_modes(s_t, 0, 2)
    g_base = cast(Pointer, s_g.iterator).toint()
    runs = (bn if const_expr(side == "b") else BM) // RUN
    per_warp = BK // 4
    lane = ptid % 32
    first = (ptid // 32) * per_warp
    src = cute.make_rmem_tensor(1, Int32)
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    for rnd in range(n_rounds(u.total, n_ctas)):
        t = snake_tile(rnd, bidx, n_ctas)
        if t < u.total:
            _, m_tile, n_tile, start, end, _, _, _ = _wgrad_tile(u, t)
            t_st, t_gt, col0 = side_tiles(tma_atom, m_t, s_t_flat, side, start, m_tile, n_tile, bn)
            run0 = col0 // RUN
            src[0] = _source_row(m_slot, start + first + lane, end, top_k, src_rows)
            for kt in range((end - start + BK - 1) // BK):
                here = src[0]
                src[0] = _source_row(m_slot, start + (kt + 1) * BK + first + lane, end, top_k, src_rows)
                arm_stage(mainloop, state, warp_idx, tma_atom, t_gt[(None, kt)], t_st[(None, state.index)])
                bar = mainloop.producer_get_barrier(state)
                for i in range_constexpr(per_warp):
                    row = cute.arch.shuffle_sync(here, i)
                    for j in range_constexpr(runs):
                        _copy_run(run_atom, tma_src, row, run0 + j,
                                  g_base + g_outer((j * RUN, first + i, state.index)) * 2, t_run, bar)
                state.advance()
    if warp_idx == 0:
        mainloop.producer_tail(state)


@cute.kernel
def grouped_wgrad_rows_kernel(
    tma_atom: cute.CopyAtom, m_t: cute.Tensor, run_atom: cute.CopyAtom, tma_src: cute.Tensor,
    m_slot: cute.Tensor, top_k: Int32, src_rows: Int32, tma_atom_d: cute.CopyAtom, tma_d: cute.Tensor,
    m_d: cute.Tensor, m_offs: cute.Tensor, m_ws: cute.Tensor, m_count: cute.Tensor, m_rows: Int32,
    n_groups: Int32, thresh: Int32, split_rows: Int32, tiled_mma: cute.TiledMma,
    a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout, d_layout: cute.ComposedLayout,
    t_run: cute.ComposedLayout,
    n: Constexpr[int], k: Constexpr[int], bn: Constexpr[int], side: Constexpr[str], stages: Constexpr[int],
) -> None:
    tidx, bidx, n_ctas, warp_idx = cta_start((tma_atom, run_atom, tma_atom_d))
    s_offs, s_a, s_b, s_d, mainloop = cta_setup(m_offs, n_groups, BFloat16, a_layout, b_layout, d_layout,
                                                stages, tables=3)
    u = plan_units(s_offs, n_groups, m_rows, thresh, split_rows, tidx, n, k, bn)
    if warp_idx < 4:
        cute.arch.setmaxregister_decrease(PRODUCER_REGS)
        s_t, s_g, g_outer = by_side(side, s_a, s_b, a_layout, b_layout)
        produce_wgrad_rows(mainloop, tma_atom, m_t, run_atom, tma_src, t_run, m_slot, top_k, src_rows, s_t,
                           s_g, g_outer, u, bidx, n_ctas, warp_idx, tidx, bn, side, stages)
    else:
        consume_wgrad(mainloop, tiled_mma, s_a, s_b, s_d, u, m_ws, m_count, tma_atom_d, tma_d, m_d, tidx,
                      warp_idx, bidx, n_ctas, n, k, bn, stages, n)


@cute.jit
def grouped_wgrad_rows_host(
    pt: Pointer, psrc: Pointer, pslot: Pointer, pdw: Pointer, poffs: Pointer, pws: Pointer, pcount: Pointer,
    top_k: Int32, src_rows: Int32, m_rows: Int32, n_groups: Int32, n_ctas: Int32, thresh: Int32,
    split_rows: Int32, ws_tiles: Int32, stream: cuda.CUstream, n: Constexpr[int], k: Constexpr[int],
    bn: Constexpr[int], side: Constexpr[str],
) -> None:
    """The gathered wgrad's result (side "b": x[slot // top_k] beside pt = dy [R, n]; side "a":
    dy[slot // top_k] beside pt = x [R, k]) with the token-major side [src_rows, width] loaded by row TMA."""
    stages = stages_for(bn)
    (m_dw, tma_atom_d, tma_d, m_offs, m_slot, m_ws, m_count, tiled_mma, a_layout, b_layout, d_layout,
     tma_atom, tma_t) = gathered_setup(pt, pdw, poffs, pslot, pws, pcount, m_rows, n_groups, ws_tiles, n, k,
                                       bn, side, stages)
    width = k if const_expr(side == "b") else n
    m_src = cute.make_tensor(psrc, cute.make_layout((width, src_rows), stride=(1, width)))
    t_run = run_layout(b_layout if const_expr(side == "b") else a_layout)
    run_atom, tma_src = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m_src, t_run, (RUN, 1))
    grouped_wgrad_rows_kernel(
        tma_atom, tma_t, run_atom, tma_src, m_slot, top_k, src_rows, tma_atom_d, tma_d, m_dw, m_offs, m_ws,
        m_count, m_rows, n_groups, thresh, split_rows, tiled_mma, a_layout, b_layout, d_layout, t_run, n, k,
        bn, side, stages,
    ).launch(grid=[n_ctas, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=1, stream=stream)


def compile_args_rows(n: int, k: int, bn: int, side: str) -> tuple[Any, tuple[Any, ...]]:
    if side not in ("a", "b"):
        raise ValueError(f"gathered wgrad side {side!r}: 'a' (dy token-major) or 'b' (x token-major)")
    ptrs = (pointer(BFloat16, 0), pointer(BFloat16, 0), pointer(Int64, 0, 8), pointer(BFloat16, 0),
            pointer(Int32, 0, 4), pointer(Float32, 0), pointer(Int32, 0, 4))
    return grouped_wgrad_rows_host, (*ptrs, *(Int32(0) for _ in range(8)), cuda.CUstream(0), n, k, bn, side)
