"""A pool of W spawned ranks that run RDEP jobs together: the SPMD half of parity, tests and the bench.

Each rank builds a group per job, runs its part on its GPU (shared or its own) and sends CPU results back.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from nmoe.fast.rdep.group import RdepGroup, RdepShape, rdep_dispatch, rdep_return

JOB_TIMEOUT_S = 420.0
"""A job's limit, first-call compiles included; kept below a 10-minute device command."""
POLL_S = 1.0


@dataclass(frozen=True)
class Job:
    """One collective job: `kind` names a function of JOBS, or is a module-level function (group, *args);
    Pool.run takes args per rank, a rank gets (its args,)."""

    kind: str | Callable[..., dict[str, Any]]
    shape: RdepShape
    args: tuple[Any, ...]


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's bytes in rank order over the default process group (gloo or NCCL): how IPC handles
    travel when a group opens."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, data)
    return [bytes(o) for o in out]


def dispatch_job(group: RdepGroup, x: Tensor, ids: Tensor) -> dict[str, Tensor]:
    """This rank's receive batch cut to n_recv, plus the tail it must leave marked (row_id, eid = -1)."""
    recv = rdep_dispatch(group, x.to(group.device), ids.to(group.device))
    group.sync_check()
    n = int(recv.n_recv.item())
    return {"x": recv.x[:n].cpu(), "row_id": recv.row_id[:n].cpu(), "local_eid": recv.local_eid[:n].cpu(),
            "counts": recv.counts.cpu(), "tail_row_id": recv.row_id[n:].cpu(),
            "tail_local_eid": recv.local_eid[n:].cpu()}


def roundtrip_job(group: RdepGroup, x: Tensor, ids: Tensor, y: Tensor, poison: bool) -> dict[str, Tensor]:
    """Dispatch, then return y (one row per received row, in receive order); `poison` fills the return
    window with NaN first, so a slot nobody writes shows."""
    got = dispatch_job(group, x, ids)
    n = got["row_id"].numel()
    if poison:
        group.outs.view(torch.uint8).fill_(255)
        torch.cuda.synchronize(group.device)
    dist.barrier()
    s = group.shape
    yfull = torch.zeros(s.capacity, s.hidden, dtype=s.dtype, device=group.device)
    m = min(n, y.shape[0])
    yfull[:m] = y[:m].to(group.device)
    out = rdep_return(group, yfull)  # even with a bad y, so that no peer waits for this rank's rows
    group.sync_check()
    if y.shape[0] != n:
        raise ValueError(f"rdep_return: rank {group.rank} received {n} rows but y has {y.shape[0]}; pass one "
                         "output row per received row")
    return {**got, "out": out.cpu().clone()}


def stall_job(group: RdepGroup, x: Tensor, ids: Tensor) -> dict[str, Tensor]:
    """Rank 0 dispatches while every other rank stays silent: rank 0 must time out naming rank 1."""
    if group.rank == 0:
        return dispatch_job(group, x, ids)
    return {}


JOBS: dict[str, Callable[..., dict[str, Tensor]]] = {"dispatch": dispatch_job, "roundtrip": roundtrip_job,
                                                     "stall": stall_job}


def _worker(rank: int, world: int, device: int, port: int, inq: Any, outq: Any) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=JOB_TIMEOUT_S))
    dev = torch.device("cuda", device)
    healthy = True
    while True:
        job = inq.get()
        if job is None:
            break
        if not healthy:
            outq.put((rank, "error", "this rank's CUDA context failed in an earlier job"))
            outq.put((rank, "done", False))
            continue
        group = None
        try:
            group = RdepGroup(job.shape, rank, dev, all_gather_bytes)
            dist.barrier()
            fn = JOBS[job.kind] if isinstance(job.kind, str) else job.kind
            outq.put((rank, "ok", fn(group, *job.args[0])))
        except Exception as e:
            outq.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
        try:
            dist.barrier()
            if group is not None:
                group.close()
            torch.cuda.synchronize(dev)
        except Exception:
            healthy = False  # a trapped kernel leaves this context unusable; stay alive until closed
        outq.put((rank, "done", healthy))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankError(RuntimeError):
    """A rank's job raised; the message is that rank's error (e.g. the capacity overflow's numbers)."""


class Pool:
    """W spawned ranks on `devices` (one entry per rank; repeats share a GPU), kept for many jobs."""

    def __init__(self, devices: Sequence[int]) -> None:
        ctx = mp.get_context("spawn")
        self.world = len(devices)
        self.devices = tuple(devices)
        self.inq = [ctx.Queue() for _ in devices]
        self.outq = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, self.world, d, port, self.inq[r], self.outq),
                                  daemon=True) for r, d in enumerate(devices)]
        self.broken = False
        for p in self.procs:
            p.start()

    def run(self, job: Job) -> list[dict[str, Tensor]]:
        """Every rank's result, in rank order; raises RankError with the lowest failing rank's message. A
        rank that dies, stalls past JOB_TIMEOUT_S or ends with a failed CUDA context breaks the pool."""
        if self.broken:
            raise RankError("rdep pool: broken by an earlier job; start a new Pool")
        if len(job.args) != self.world:
            raise ValueError(f"rdep pool: job has args for {len(job.args)} ranks, the pool has {self.world}")
        for q, a in zip(self.inq, job.args, strict=True):
            q.put(Job(job.kind, job.shape, (a,)))
        got: dict[int, tuple[str, Any]] = {}
        done: dict[int, bool] = {}
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while len(done) < self.world:
            try:
                rank, status, value = self.outq.get(timeout=POLL_S)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if r not in done and not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.terminate()
                    why = f"ranks {dead} died" if dead else f"no answer in {JOB_TIMEOUT_S} s"
                    raise RankError(f"rdep pool: {why}; answers so far {self._summary(got)}") from None
                continue
            except Exception as e:  # a result whose sender died before it was unpickled
                self.terminate()
                raise RankError(f"rdep pool: reading a rank's answer failed ({e})") from e
            if status == "done":
                done[rank] = bool(value)
                if not value:  # a trapped rank: peers still waiting on it only time out, so stop now
                    break
            else:
                got[rank] = (status, value)
        if not all(done.values()):
            self.terminate()
        errors = sorted((r, v) for r, (s, v) in got.items() if s == "error")
        if errors:
            raise RankError(f"rank {errors[0][0]}: {errors[0][1]}")
        if self.broken:
            bad = [r for r, h in done.items() if not h]
            raise RankError(f"rdep pool: ranks {bad} ended with a failed CUDA context; answers so far "
                            f"{self._summary(got)}")
        return [got[r][1] for r in range(self.world)]

    @staticmethod
    def _summary(got: dict[int, tuple[str, Any]]) -> str:
        told = [f"rank {r}: {v if s == 'error' else s}" for r, (s, v) in sorted(got.items())]
        return "; ".join(told) or "none"

    def terminate(self) -> None:
        """Kill every rank now (a wedged rank may never read its queue); the pool takes no more jobs."""
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)

    def close(self) -> None:
        if self.broken:
            self.terminate()
            return
        for q in self.inq:
            q.put(None)
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
        self.broken = True


def placement(world: int, kind: str) -> list[int]:
    """GPU per rank: 'shared' puts every rank on GPU 0; 'distinct' one GPU each (needs W GPUs)."""
    if kind == "shared":
        return [0] * world
    if kind == "distinct":
        if torch.cuda.device_count() < world:
            raise ValueError(f"rdep: placement 'distinct' needs {world} GPUs, found "
                             f"{torch.cuda.device_count()}")
        return list(range(world))
    raise ValueError(f"rdep: placement must be 'shared' or 'distinct', got {kind!r}")
