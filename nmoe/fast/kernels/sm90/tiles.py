"""The sm_90a grouped GEMMs' CTA shape: warpgroups, register split, barrier ids, output subtiles and the
shared-memory sizing and layouts every kernel of the family is built from. Import only after
runtime.import_cutlass("sm_90a")."""

from __future__ import annotations

from typing import Any, NoReturn

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from nmoe.constants import ACT_H_COLUMNS
from nmoe.fast.kernels.sm90.gatherplan import PRODUCER_THREADS
from nmoe.fast.limits import GEMM_BK as BK
from nmoe.fast.limits import GEMM_BM as BM
from nmoe.fast.limits import GEMM_MAX_GROUPS as MAX_GROUPS

K_BLOCKS = BK // 16
WG_THREADS = PRODUCER_THREADS
CONSUMER_WGS = 2
CONSUMER_THREADS = CONSUMER_WGS * WG_THREADS
THREADS = WG_THREADS + CONSUMER_THREADS
PRODUCER_REGS = 40
CONSUMER_REGS = 232
EPI_BARRIER_ID = 1
# Ping-pong warpgroup wg arrives on ORDER_BARRIER_ID + wg when its unit's stages have all arrived, and the
# other waits on it before its own: mbarrier waits match phases by parity only, so no warpgroup may wait on a
# stage more than one fill ahead of the producer.
ORDER_BARRIER_ID = EPI_BARRIER_ID + CONSUMER_WGS
SMEM_BYTES = 232448
VEC = 8
# The output leaves through EPI_BUFS swizzled BM x EPI_N subtiles: small enough to leave room for a deeper
# operand pipeline, double-buffered so a subtile's TMA store overlaps the next one's stmatrix.
EPI_N = 32
EPI_BUFS = 2
EPI_SMEM_BYTES = BM * EPI_N * 2 * EPI_BUFS
STORE_WARP = 4
# Accumulator values per thread whose activation is computed in one batch (two cooperative subtiles, one
# ping-pong subtile): as much overlap as fits in registers without spilling.
ACT_VALUES = 32
# h columns per output column of each fused epilogue ("none": the plain GEMM).
EPILOGUES: dict[str, int] = {"none": 1, **ACT_H_COLUMNS}


# Ping-pong: each consumer warpgroup takes every other work unit, a whole BM x pingpong_bn(act) tile, so one's
# epilogue runs under the other's mainloop (the shared stage ring already orders their mainloops); each keeps
# its own output subtiles, barrier and storing warp. Cooperative: both split one BM x bn tile by rows.
def tile_wgs(pingpong: bool) -> int:
    """Consumer warpgroups that share one output tile."""
    return 1 if pingpong else CONSUMER_WGS


def epi_sets(pingpong: bool) -> int:
    """Output staging sets: one per warpgroup running an epilogue of its own."""
    return CONSUMER_WGS // tile_wgs(pingpong)


def epi_bufs(bn: int, staged: bool) -> int:
    """Output subtiles: EPI_BUFS, or (staged) a whole tile's, so the tile's TMA stores drain under the next
    tile's MMAs instead of holding the consumers, at the shared memory of about one operand stage."""
    return bn // EPI_N if staged else EPI_BUFS


def epi_smem_bytes(bn: int, staged: bool) -> int:
    """Shared memory of epi_bufs(bn, staged) bf16 BM x EPI_N output subtiles."""
    return BM * EPI_N * 2 * epi_bufs(bn, staged)


def pipeline_stages(stage_bytes: int, epi_bytes: int = EPI_SMEM_BYTES) -> int:
    """Operand pipeline depth that fits next to the output staging, the offs table and the mbarriers."""
    return min(8, (SMEM_BYTES - epi_bytes - MAX_GROUPS * 4 - 2048) // stage_bytes)


def stages_for(bn: int, act: str = "none", pingpong: bool = False) -> int:
    sets = epi_sets(pingpong)
    return pipeline_stages((BM + bn) * BK * 2, sets * (EPI_SMEM_BYTES + act_smem_bytes(act)))


def act_cols(act: str) -> int:
    """Columns of an act(h) subtile: one per ratio h columns of the EPI_N-wide h subtile."""
    return EPI_N // EPILOGUES[act]


def act_smem_bytes(act: str) -> int:
    """act(h) leaves through its own EPI_BUFS subtiles of BM x act_cols, beside h's."""
    return 0 if act == "none" else BM * act_cols(act) * 2 * EPI_BUFS


def act_smem_layout(act: str, sets: int = 1) -> cute.Layout:
    """Row-major act(h) subtiles (32- or 64-byte rows, unswizzled): written by scalar stores, read by TMA."""
    cols = act_cols(act)
    layout: cute.Layout = cute.make_layout((BM, cols, EPI_BUFS * sets), stride=(cols, 1, BM * cols))
    return layout


def epi_smem_layout(sets: int = 1, bufs: int = EPI_BUFS, m_major: bool = False) -> cute.ComposedLayout:
    """Swizzled bf16 BM x EPI_N output subtiles, N contiguous, or M contiguous (m_major) for a tile that
    leaves transposed."""
    major = LayoutEnum.COL_MAJOR if m_major else LayoutEnum.ROW_MAJOR
    layout: cute.ComposedLayout = sm90_utils.make_smem_layout_epi(BFloat16, major, (BM, EPI_N), bufs * sets)
    return layout


def epi_tma(m_y: cute.Tensor, act: str = "none", accumulate: bool = False,
            m_major: bool = False) -> tuple[cute.CopyAtom, cute.Tensor]:
    """TMA store of one output subtile (of h, or with act given of act(h)); full tiles leave this way,
    asynchronously, tiles cut by a group end or the last N columns through masked per-thread stores.
    accumulate: a TMA reduce-add instead, y = bf16(y + subtile), what a bf16 add of the two would give."""
    if act == "none":
        layout: Any = cute.slice_(epi_smem_layout(m_major=m_major), (None, None, 0))
        cols = EPI_N
    else:
        layout, cols = cute.slice_(act_smem_layout(act), (None, None, 0)), act_cols(act)
    op = cpasync.CopyReduceBulkTensorTileS2GOp() if accumulate else cpasync.CopyBulkTensorTileS2GOp()
    atom, tensor = cpasync.make_tiled_tma_atom(op, m_y, layout, (BM, cols))
    return atom, tensor


def store_copy(bn: int, width: int, threads: int = CONSUMER_THREADS) -> tuple[cute.CopyAtom, cute.TiledCopy]:
    """Epilogue stores: a tile's epilogue threads tile the BM x bn h tile in 8-column chunks, each thread
    writing `width` contiguous bf16 of its chunk's output (8 for h and relu2, 4 for swiglu)."""
    chunks_n = bn // VEC
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=16 * width)
    tiled = cute.make_tiled_copy_tv(
        atom,
        cute.make_layout((threads // chunks_n, chunks_n), stride=(chunks_n, 1)),
        cute.make_layout((1, width)),
    )
    return atom, tiled


def check_pairing(bn: int, act: str, threads: int = CONSUMER_THREADS) -> None:
    """Trace-time proof over every epilogue thread and chunk that output element (r, c) is computed from h
    columns ratio*c .. ratio*c + ratio - 1 of row r (swiglu: the (gate, up) pair) through identity tensors."""
    ratio = EPILOGUES[act]
    _, h_copy = store_copy(bn, VEC, threads)
    _, a_copy = store_copy(bn, VEC // ratio, threads)
    h_id = cute.make_identity_tensor((BM, bn))
    a_id = cute.make_identity_tensor((BM, bn // ratio))

    def fail(what: str) -> NoReturn:
        raise RuntimeError(f"{act} epilogue pairing broken: {what}; rebuild both copies with store_copy")

    # A partition is its thread's base coordinate plus a thread-independent layout: check each half.
    h0 = h_copy.get_slice(0).partition_D(h_id)
    a0 = a_copy.get_slice(0).partition_D(a_id)
    if h0.shape[1:] != a0.shape[1:]:
        fail(f"h chunks {h0.shape} and output chunks {a0.shape} iterate differently")
    for t in range(threads):
        h = h_copy.get_slice(t).partition_D(h_id)
        a = a_copy.get_slice(t).partition_D(a_id)
        (hr, hc), (ar, ac) = h.iterator, a.iterator
        if str(h.layout) != str(h0.layout) or str(a.layout) != str(a0.layout) or (hr, hc) != (ar, ratio * ac):
            fail(f"thread {t} starts at h {(hr, hc)} and output {(ar, ac)}")
    for i in range(cute.size(h0, mode=[1])):
        for j in range(cute.size(h0, mode=[2])):
            for v in range(VEC // ratio):
                r, c = a0.layout((v, i, j))
                for p in range(ratio):
                    if tuple(h0.layout((ratio * v + p, i, j))) != (r, ratio * c + p):
                        fail(f"output offset {(r, c)} would read h offset {h0.layout((ratio * v + p, i, j))}")
