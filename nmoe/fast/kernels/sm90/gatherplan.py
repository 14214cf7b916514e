"""The sm_90a gathering producers' plans in plain Python, no cutlass import: which lane looks up which row of
a stage, and how many stages a producer leaves in flight before it lands one. The kernels trace them; CPU
tests check them in any process."""

from __future__ import annotations

from typing import Any

from nmoe.fast.limits import GEMM_BK as BK
from nmoe.fast.limits import GEMM_BM as BM
from nmoe.fast.limits import GEMM_GATHER_LAG, VEC_BYTES

PRODUCER_THREADS = 128


def gather_lag(stages: int, lag: int = GEMM_GATHER_LAG) -> int:
    """Stages a gathering producer leaves in flight before it lands its oldest (GEMM_GATHER_LAG): at most
    stages - 2, since the slot it acquires next is freed only once the consumers have read the stage after the
    one it holds."""
    if stages < 3:
        raise ValueError(f"a gathering producer needs 3 or more pipeline stages, got {stages}")
    deepest = stages - 2
    if not 1 <= lag <= deepest:
        raise ValueError(f"GEMM_GATHER_LAG = {lag}: a gathering producer with {stages} stages lands its "
                         f"copies 1 to {deepest} stages behind (more stands the pipeline still); set it so")
    return lag


def queued_lag(stages: int, depth: int, lag: int = GEMM_GATHER_LAG) -> int:
    """gather_lag for a producer fed by a tile queue of `depth` units: each unit it may run ahead holds a
    stage or lands all (chunkload.land_pending), so its stages in flight land before the queue fills."""
    lag = gather_lag(stages, lag)
    if lag > depth:
        raise ValueError(f"a dynamic gathering producer with {stages} stages lands each {lag} later, more "
                         f"than its tile queue's {depth} units: it could fill the queue before they land")
    return lag


def gather_lanes(per_row: int) -> tuple[int, int, int]:
    """(q, rows per warp, chunks per thread) of the gathered wgrad box: a warp copies q rows per chunk
    instruction and looks up its 16 distinct rows of a stage once, one lane each, not once per chunk."""
    if 32 % per_row or BK * per_row % PRODUCER_THREADS:
        raise ValueError(f"gathered wgrad: {per_row} chunks per box row do not tile a warp")
    return 32 // per_row, BK // 4, BK * per_row // PRODUCER_THREADS


def own_row(lane: Any, warp: Any, q: int) -> Any:
    """The box row (of the stage's BK) whose source lane `lane` of producer warp `warp` looks up."""
    j = lane % (BK // 4)
    return warp * q + j % q + 4 * q * (j // q)


def source_lane(i: int, lane: Any, per_row: int, q: int) -> Any:
    """The lane holding the source of chunk i's row for `lane`: row ptid // per_row + 4 q i."""
    return i * q + lane // per_row


ROW_CHUNKS = BK * 2 // VEC_BYTES
"""16-byte chunks of one bf16 A row's K box: the threads of a copying producer that share a row."""
ROWS_PER_THREAD = BM * ROW_CHUNKS // PRODUCER_THREADS
"""Rows of an A tile each copying thread copies one chunk of, PRODUCER_THREADS // ROW_CHUNKS apart."""


def copied_row(ptid: Any, i: int) -> Any:
    """The tile row of a copying producer thread's i-th chunk (its column is ptid % ROW_CHUNKS)."""
    return ptid // ROW_CHUNKS + PRODUCER_THREADS // ROW_CHUNKS * i


def copied_lookup(ptid: Any) -> Any:
    """The tile row whose token thread ptid looks up: its row group's ptid % ROW_CHUNKS-th."""
    return copied_row(ptid, ptid % ROW_CHUNKS)


def copied_lane(lane: Any, i: int) -> Any:
    """The lane holding the token of `lane`'s i-th row: the one of its eight that looked it up."""
    return lane - lane % ROW_CHUNKS + i
