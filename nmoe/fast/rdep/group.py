"""Per-rank RDEP: rows written straight into the owner's receive window, in the spec's order.

No host sync: counts travel between ranks on the device; overflow and a silent peer land in a status word.
"""

# The spec (nmoe/reference/rdep.py) simulates all W ranks in one call; here each rank calls rdep_dispatch
# and rdep_return with its own x and ids (parity/spmd.py adapts the two signatures).

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.dispatch import _copy_shape, permute
from nmoe.fast.limits import MAX_EXPERTS, MAX_RANKS, VEC_BYTES
from nmoe.fast.op import Kernel
from nmoe.fast.rdep.window import Exchange, Status, Window, open_window

EPOCH_WORDS = 3  # dispatch calls, return calls, error lock (nmoe/fast/kernels/rdep.py)
DISPATCH = Kernel("nmoe.fast.kernels.rdep", "rdep_dispatch",
                  lambda km, unit, vec, ids64: km.dispatch_args(unit, vec, ids64))
RETURN = Kernel("nmoe.fast.kernels.rdep", "rdep_return", lambda km, unit, vec: km.return_args(unit, vec))
_OVERFLOW, _TIMEOUT, _BAD_ROW = 1, 2, 3
_PHASES = {0: "counts", 1: "rows", 2: "return"}


@dataclass(frozen=True)
class RdepShape:
    """What every rank of a group agrees on: ranks, experts, tokens per rank, top-k, row width and dtype,
    receive capacity in rows, and how long a kernel waits for a silent peer."""

    world: int
    n_experts: int
    tokens: int
    top_k: int
    hidden: int
    dtype: torch.dtype
    capacity: int
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.world <= MAX_RANKS:
            raise ValueError(f"rdep: world={self.world} must lie in [1, {MAX_RANKS}]")
        if self.n_experts % self.world or not 1 <= self.n_experts <= MAX_EXPERTS:
            raise ValueError(f"rdep: n_experts={self.n_experts} must be a multiple of world={self.world} in "
                             f"[1, {MAX_EXPERTS}]")
        if self.tokens < 1 or self.top_k < 1 or self.hidden < 1 or self.capacity < 1:
            raise ValueError(f"rdep: tokens={self.tokens}, top_k={self.top_k}, hidden={self.hidden} and "
                             f"capacity={self.capacity} must be >= 1")
        if self.world * self.tokens * self.top_k >= 2**31 or self.capacity >= 2**31:
            raise ValueError("rdep: W*T*K and capacity must stay below 2^31 (int32 row indices); split the "
                             "batch")
        if self.timeout_s <= 0:
            raise ValueError(f"rdep: timeout_s={self.timeout_s} must be > 0")

    @property
    def n_local(self) -> int:
        return self.n_experts // self.world

    @property
    def row_bytes(self) -> int:
        return self.hidden * torch.empty(0, dtype=self.dtype).element_size()


def _up(n: int) -> int:
    return -(-n // VEC_BYTES) * VEC_BYTES


@dataclass(frozen=True)
class Layout:
    """Byte offsets of the window regions (see nmoe/fast/kernels/rdep.py)."""

    x: int
    row: int
    out: int
    cnt: int
    flag: int
    nbytes: int

    @classmethod
    def of(cls, s: RdepShape) -> Layout:
        x = 0
        row = _up(x + s.capacity * s.row_bytes)
        out = _up(row + s.capacity * 8)
        cnt = _up(out + 2 * s.tokens * s.top_k * s.row_bytes)
        flag = _up(cnt + 2 * s.world * s.n_experts * 4)
        return cls(x, row, out, cnt, flag, _up(flag + 3 * s.world * 8))


@dataclass(frozen=True)
class Received:
    """This rank's receive batch: rows [0, n_recv) of x, row_id and local_eid are the spec's RdepRecv, in
    its order; later rows are unspecified (row_id and local_eid -1). Views valid until this rank's next
    rdep_dispatch (peers write the next batch only after it); returns read row_id and n_recv from here."""

    x: Tensor
    row_id: Tensor
    local_eid: Tensor
    counts: Tensor
    n_recv: Tensor

    def kept(self) -> Sent:
        """Copies of what a return of this batch reads, so it can be answered after later dispatches."""
        return Sent(self.row_id.clone(), self.n_recv.clone())


@dataclass(frozen=True)
class Sent:
    """A dispatch's receive order: row_id int64 [capacity] and n_recv int32 [1], owned by the caller (one
    group serves every MoE layer: a layer's backward returns into the order of its own forward)."""

    row_id: Tensor
    n_recv: Tensor


class RdepGroup:
    """One rank's side of an RDEP group: its IPC window, the peers' windows, and the device state."""

    def __init__(self, shape: RdepShape, rank: int, device: torch.device, exchange: Exchange) -> None:
        if not 0 <= rank < shape.world:
            raise ValueError(f"rdep: rank {rank} is outside [0, {shape.world})")
        self.shape = shape
        self.rank = rank
        self.device = device = torch.device("cuda", torch.device(device).index or 0)
        self.arch = runtime.require_arch(torch.empty(0, device=device))
        self.layout = Layout.of(shape)
        self.window: Window = open_window(self.layout.nbytes, device, rank, exchange)
        self.status = Status(device)
        s, lay = shape, self.layout
        win = self.window.view()
        self.recv_x = win[lay.x:lay.x + s.capacity * s.row_bytes].view(s.dtype).view(s.capacity, s.hidden)
        self.recv_row = win[lay.row:lay.row + s.capacity * 8].view(torch.int64)
        n = s.tokens * s.top_k
        self.outs = win[lay.out:lay.out + 2 * n * s.row_bytes].view(s.dtype).view(2, s.tokens, s.top_k,
                                                                                 s.hidden)
        self.peers = torch.tensor(self.window.bases, dtype=torch.int64, device=device)
        self.epoch = torch.zeros(EPOCH_WORDS, dtype=torch.int64, device=device)
        self.doff = torch.zeros(s.n_experts, dtype=torch.int32, device=device)
        self.local = torch.zeros(2, dtype=torch.int32, device=device)
        self.recv_counts = torch.zeros(s.n_local, dtype=torch.int64, device=device)
        self.local_eid = torch.full((s.capacity,), -1, dtype=torch.int64, device=device)
        self.no_x = torch.empty(s.tokens, 0, dtype=s.dtype, device=device)
        self.limit_ns = int(s.timeout_s * 1e9)
        # Host count of rdep_return calls: its parity names the buffer the kernel writes and the caller gets,
        # so a CUDA graph replays the buffers it captured.
        self.returns = 0

    def check(self) -> None:
        """Raise the first error a kernel reported; a plain host read, no sync. The trainer calls it where
        it already syncs (reading the loss); every dispatch and return call it on entry."""
        code, a, b, c, *_ = self.status.read()
        if code == _OVERFLOW:
            raise RuntimeError(f"rdep_dispatch: rank {a} would receive {b} rows but capacity is {c}; raise "
                               f"capacity to at least {b}")
        if code == _TIMEOUT:
            raise RuntimeError(f"rdep: rank {self.rank} timed out after {self.shape.timeout_s} s waiting for "
                               f"rank {a} ({_PHASES.get(b, b)} phase of call {c}); that rank stopped "
                               "answering")
        if code == _BAD_ROW:
            raise RuntimeError(f"rdep_return: received row {a} holds row_id {b} outside [0, {c}); pass the "
                               "recv of this group's last dispatch")

    def sync_check(self) -> None:
        """Wait for this rank's stream, then check: where an error must surface before going on. A trap
        (timeout, bad row_id) surfaces as the CUDA error; the status word says which rank and why."""
        try:
            torch.cuda.current_stream(self.device).synchronize()
        except RuntimeError:
            self.check()
            raise
        self.check()

    def close(self) -> None:
        """Free the windows; every rank must have passed a barrier after its last RDEP call."""
        self.window.close()
        self.status.close()


def _unit(row_bytes: int, *ptrs: int) -> tuple[str, int, int]:
    unit, vec, width = _copy_shape(row_bytes, *ptrs)
    return unit, vec, row_bytes // width


def rdep_dispatch(group: RdepGroup, x: Tensor, ids: Tensor) -> Received:
    """Send this rank's slots (t, k) to the rank owning expert ids[t, k]; returns what this rank received:
    rows ordered by (local expert, source rank, t, k) with row_id = ((src*T)+t)*K+k."""
    s = group.shape
    group.check()
    if x.shape != (s.tokens, s.hidden) or x.dtype != s.dtype or x.device != group.device:
        raise ValueError(f"rdep_dispatch: x must be {s.dtype} [{s.tokens},{s.hidden}] on {group.device}, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    if ids.shape != (s.tokens, s.top_k) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rdep_dispatch: ids must be int32/int64 [{s.tokens},{s.top_k}], got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    xc, idc = x.contiguous(), ids.contiguous()
    sorted_slots = permute(group.no_x, idc, s.n_experts, 1)
    lay = group.layout
    unit, vec, row_vecs = _unit(s.row_bytes, xc.data_ptr())
    launch = DISPATCH.launcher(group.arch, unit=unit, vec=vec, ids64=idc.dtype == torch.int64)
    launch(group.device.index, xc.data_ptr(), idc.data_ptr(), sorted_slots.slot.data_ptr(),
           sorted_slots.counts.data_ptr(), sorted_slots.offs.data_ptr(), group.peers.data_ptr(),
           group.epoch.data_ptr(), group.doff.data_ptr(), group.local.data_ptr(),
           group.recv_counts.data_ptr(), group.local_eid.data_ptr(), group.window.own + lay.row,
           s.tokens * s.top_k, s.top_k, s.world, group.rank, s.n_experts, s.n_local, s.capacity, row_vecs,
           lay.x, lay.row, lay.cnt, lay.flag, group.limit_ns, group.status.device)
    return Received(group.recv_x, group.recv_row, group.local_eid, group.recv_counts, group.local[1:2])


def rdep_return(group: RdepGroup, y: Tensor, sent: Sent | None = None) -> Tensor:
    """Send received row p's output y[p] back to its source slot; returns this rank's [T, K, H], valid
    until its next rdep_return (calls alternate two buffers). Every row_id comes back exactly once. `sent`
    names the dispatch answered (Received.kept()); None means the group's last one."""
    s = group.shape
    group.check()
    if y.shape != (s.capacity, s.hidden) or y.dtype != s.dtype or y.device != group.device:
        raise ValueError(f"rdep_return: y must be {s.dtype} [{s.capacity},{s.hidden}] (one row per receive "
                         f"slot) on {group.device}, got {y.dtype} {tuple(y.shape)} on {y.device}")
    rows, n_recv = (group.recv_row, group.local[1:2]) if sent is None else (sent.row_id, sent.n_recv)
    want = ((s.capacity,), torch.int64, group.device, (1,), torch.int32, group.device)
    if (rows.shape, rows.dtype, rows.device, n_recv.shape, n_recv.dtype, n_recv.device) != want:
        raise ValueError("rdep_return: sent must hold int64 row_id [capacity] and int32 n_recv [1] on "
                         f"{group.device}; pass Received.kept() of this group's dispatch")
    yc, rows, n_recv = y.contiguous(), rows.contiguous(), n_recv.contiguous()
    lay = group.layout
    unit, vec, row_vecs = _unit(s.row_bytes, yc.data_ptr())
    launch = RETURN.launcher(group.arch, unit=unit, vec=vec)
    buf = (group.returns + 1) % 2
    launch(group.device.index, yc.data_ptr(), n_recv.data_ptr(), rows.data_ptr(), group.peers.data_ptr(),
           group.epoch.data_ptr(), s.tokens * s.top_k, s.world, group.rank, s.capacity, row_vecs, lay.out,
           lay.flag, group.limit_ns, group.status.device, buf)
    group.returns += 1
    return group.outs[buf]


# printf stages its arguments with st.local, so only ld.local (a spill read back) is forbidden.
def _spec(name: str, kernel: Kernel, expect: tuple[str, ...], **spec: object) -> runtime.KernelSpec:
    return runtime.portable_spec(
        name.split("_v")[0], name, kernel.compiler(**spec),
        (r"\bld\.acquire\.sys\.global\.b64\b", r"\bst\.release\.sys\.global\.b64\b",
         r"\bfence\.acq_rel\.sys\b", r"%globaltimer\b", r"\btrap;", *expect),
        (r"\bld\.local\b",))


_LD128 = r"\bld\.global(\.nc)?\.v4\.(b|u|s)32\b"
_ST128 = r"\bst\.global\.v4\.(b|u|s)32\b"

KERNELS: tuple[runtime.KernelSpec, ...] = (
    _spec("rdep_dispatch_v128", DISPATCH, (_LD128, _ST128, r"\batom\.global(\.gpu)?\.cas\.b64\b"),
          unit="i32", vec=4, ids64=True),
    _spec("rdep_dispatch_v32_ids32", DISPATCH, (r"\bld\.global(\.nc)?\.(b|u|s)32\b",), unit="i32", vec=1,
          ids64=False),
    _spec("rdep_return_v128", RETURN, (_LD128, _ST128), unit="i32", vec=4),
)
