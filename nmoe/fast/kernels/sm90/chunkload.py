"""The gathering producers' 16-byte cp.async chunk loads into 128-byte-swizzled operand stages, and their
landing on a TMA pipeline's full barriers beside the operand warp 0 loads by TMA. Import after
nmoe.fast.runtime.import_cutlass("sm_90a")."""

from __future__ import annotations

from typing import Any, cast

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.base_dsl.typing import Constexpr
from cutlass.cutlass_dsl.cutlass import min as dsl_min

from nmoe.fast.kernels.prims import dsl_user_op
from nmoe.fast.kernels.sm90.gatherplan import PRODUCER_THREADS
from nmoe.fast.kernels.sm90.grouped_gemm import copy_b
from nmoe.fast.kernels.sm90.tiles import VEC


@cute.jit
def arm_stage(mainloop: pipeline.PipelineTmaAsync, state: Any, warp_idx: Int32, tma_atom: cute.CopyAtom,
              src: cute.Tensor, dst: cute.Tensor, cm: Constexpr[int] = 1, policy: Constexpr[int] = 0) -> None:
    """A gathering producer's stage: every thread waits for it to be free; warp 0 arms its barrier and
    TMA-loads the operand that is not gathered (its 1/cm share, multicast over the cluster)."""
    if warp_idx == 0:
        mainloop.producer_acquire(state)
        copy_b(tma_atom, src, dst, mainloop.producer_get_barrier(state), cm, policy)
    else:
        mainloop.sync_object_empty.wait(state.index, state.phase)


SWIZZLE_PERIOD = 1024
"""Bytes after which the 128-byte swizzle repeats: swizzled(a + j * SWIZZLE_PERIOD) = swizzled(a) + j * it."""


def swizzled(byte: Any) -> Any:
    """128-byte swizzle of a byte offset from a 1024-byte aligned base: 16-byte chunk ^= 128-byte row % 8
    (what TMA writes and wgmma reads for these layouts); of a device Int32 or, while tracing, a Python int."""
    out: Any = byte ^ (((byte >> 7) & 7) << 4)
    return out


@dsl_user_op
def copy_chunk(g: Int64, s_addr: Int32, src_bytes: Int32, *, loc: Any = None, ip: Any = None) -> None:
    """16-byte cp.async.cg (bypassing L1: each gathered chunk is read once per stage) from global byte address
    g to shared s_addr, reading src_bytes of it (16, or 0: zeros land and nothing is read)."""
    operands = [Int32(s_addr).ir_value(loc=loc, ip=ip), Int64(g).ir_value(loc=loc, ip=ip),
                Int32(src_bytes).ir_value(loc=loc, ip=ip)]
    llvm.inline_asm(None, operands, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r",
                    has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def spill_chunk(s_addr: Int32, g: Int64, on: Int32, *, loc: Any = None, ip: Any = None) -> None:
    """16 bytes of a landed stage from shared s_addr to global byte address g where on != 0 (else nothing):
    a gathered row written back out in permuted order."""
    operands = [Int32(s_addr).ir_value(loc=loc, ip=ip), Int64(g).ir_value(loc=loc, ip=ip),
                Int32(on).ir_value(loc=loc, ip=ip)]
    llvm.inline_asm(None, operands, "{ .reg .pred p; .reg .b32 a, b, c, d; setp.ne.b32 p, $2, 0; "
                    "@p ld.shared.v4.b32 {a, b, c, d}, [$0]; @p st.global.v4.b32 [$1], {a, b, c, d}; }",
                    "r,l,r", has_side_effects=True, loc=loc, ip=ip)


@cute.jit
def _land(mainloop: pipeline.PipelineTmaAsync, index: Int32) -> None:
    cute.arch.mbarrier_arrive(cast(pipeline.MbarrierArray, mainloop.sync_object_full).get_barrier(index))


@cute.jit
def commit_stage(mainloop: pipeline.PipelineTmaAsync, state: Any, lag: Constexpr[int],
                 stages: Constexpr[int], floor: Int32 | int = 0) -> None:
    """Commit this thread's copies of the stage `state` names; from the `lag`-th stage past `floor` (the
    count at the last land_pending) on, land the stage issued `lag` before it: wait, fence, arrive."""
    cute.arch.cp_async_commit_group()
    if state.count - floor >= lag:
        cute.arch.cp_async_wait_group(lag)
        cute.arch.fence_proxy("async.shared", space="cta")
        back = state.index - lag
        if back < 0:
            back = back + stages
        _land(mainloop, back)


@cute.jit
def land_all(mainloop: pipeline.PipelineTmaAsync, state: Any, lag: Constexpr[int],
             stages: Constexpr[int], floor: Int32 | int = 0) -> None:
    """After the producer's last stage (`state` past it): land the up to `lag` stages still in flight."""
    cute.arch.cp_async_wait_group(0)
    cute.arch.fence_proxy("async.shared", space="cta")
    for i in range(dsl_min(state.count - floor, lag)):
        _land(mainloop, (state.index + (stages - 1) - i) % stages)


@cute.jit
def land_pending(mainloop: pipeline.PipelineTmaAsync, state: Any, lag: Constexpr[int],
                 stages: Constexpr[int], floor: Int32) -> Int32:
    """A dynamic producer at a unit with no stages: land what is in flight now (returns the new floor). Else
    it could hand units on until its queue is full while the consumers wait for stages only it lands."""
    land_all(mainloop, state, lag, stages, floor)
    out: Int32 = Int32(state.count)
    return out


def chunk_offsets(g_outer: Any, per_row: int, q: int, n_chunks: int, stages: int) -> tuple[list[int], int]:
    """(chunk i's byte step from a thread's first chunk, a stage's bytes) of g_outer(column, row, stage),
    static; checked while tracing: for every producer thread and stage, its swizzled base at the step's
    residue mod SWIZZLE_PERIOD plus whole periods of step and stage is the chunk's swizzled offset."""
    offsets = [g_outer((0, 4 * q * i, 0)) for i in range(n_chunks)] + [g_outer((0, 0, 1))]
    if not all(isinstance(o, int) for o in offsets) or offsets[-1] * 2 % SWIZZLE_PERIOD:
        raise ValueError(f"gathering producer: shared offsets {offsets} are not static, or a stage is not "
                         "whole swizzle periods")
    steps, stage_bytes = [o * 2 for o in offsets[:-1]], offsets[-1] * 2
    for ptid in range(PRODUCER_THREADS):
        c, r0 = ptid % per_row * VEC, ptid // per_row
        first = g_outer((c, r0, 0)) * 2
        for i, step in enumerate(steps):
            res = step % SWIZZLE_PERIOD
            for st in (0, stages - 1):
                want = swizzled(g_outer((c, r0 + 4 * q * i, st)) * 2)
                if swizzled(first + res) + step - res + st * stage_bytes != want:
                    raise ValueError(f"gathering producer: thread {ptid} chunk {i} stage {st} lands at "
                                     f"{want}, not at its base plus whole swizzle periods")
    return steps, stage_bytes


def swizzled_bases(s_base: Any, first: int | Any, steps: list[int]) -> dict[int, Any]:
    """A thread's swizzled shared address at each residue mod SWIZZLE_PERIOD of its chunk steps (from
    chunk_offsets), its first chunk at unswizzled byte `first` of the stage ring at s_base."""
    return {r: s_base + swizzled(first + r) for r in sorted({st % SWIZZLE_PERIOD for st in steps})}


def chunk_at(bases: dict[int, Any], step: int, s_stage: Any) -> Any:
    """The shared address of the chunk `step` bytes past a thread's first, in the stage s_stage bytes in:
    its residue's swizzled base plus whole periods, a constant the copy takes as an immediate."""
    res = step % SWIZZLE_PERIOD
    return bases[res] + s_stage + (step - res)


@cute.jit
def token_at(m_slot: cute.Tensor, row: Int32, end: Int32, top_k: Any) -> Int32:
    """Permuted row `row`'s token, slot // top_k (slot < 2^31: its low word), or -1 for a pad row and a row
    past the group's end."""
    t = Int32(-1)
    if row < end:
        s = Int32(m_slot[row])
        if s >= 0:
            t = Int32(Uint32(s) // Uint32(top_k))
    return t
