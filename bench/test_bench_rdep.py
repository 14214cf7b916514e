"""RDEP dispatch and return per rank, and end-to-end dispatch (routing -> rows at the owner, expert-sorted)
against the torch pipeline (permute -> count exchange -> NCCL all_to_all_single -> sort), same run.

W spawned ranks; NMOE_RDEP_PLACEMENT=shared (default) puts them all on GPU 0, where the W processes
time-slice one GPU: those rows say one_gpu and measure the protocol, not NVLink, and NCCL (which refuses
two ranks on one GPU) gives no baseline. =distinct puts one rank per GPU. Bytes per rank: dispatch sends
T*K rows of 2H bytes (+8 for the row_id), return sends back the rows it received. The floor uses the HBM
copy ceiling, which a peer write never beats; peer bandwidth is the GBps field.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import REPS, WARMUP, append_row, record
from torch import Tensor

WORLD = int(os.environ.get("NMOE_RDEP_BENCH_WORLD", "2"))
CONFIGS = ((4096, 8, 2048, 64),)  # (T per rank, K, H, E)


def _none() -> None:
    return None


def _median_ms(step: Callable[[], object], reps: int, before: Callable[[], object] = _none,
               after: Callable[[], object] = _none) -> float:
    """CUDA-event median of `step` on this rank; each rep runs before(), a barrier of all ranks, the timed
    step, then after() (dispatch and return must alternate)."""
    times = []
    for _ in range(reps):
        before()
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        after()
    return statistics.median(times)


def torch_pipeline(x: Tensor, ids: Tensor, n_experts: int, world: int, nccl: Any) -> Tensor:
    """permute (stable sort by expert) -> count exchange -> all_to_all_single of rows -> sort by local
    expert at the owner; the split sizes need one host sync."""
    k = ids.shape[1]
    n_local = n_experts // world
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x[order // k]
    counts = torch.bincount(flat, minlength=n_experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=nccl)
    send = counts.view(world, n_local).sum(1)
    recv = recv_counts.view(world, n_local).sum(1)
    splits = torch.stack([send, recv]).cpu()
    got = torch.empty(int(splits[1].sum()), x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_to_all_single(got, rows, splits[1].tolist(), splits[0].tolist(), group=nccl)
    local = torch.repeat_interleave(torch.arange(n_local, device=x.device).repeat(world), recv_counts)
    return got[torch.argsort(local, stable=True)]


def bench_job(group: Any, x: Tensor, ids: Tensor, nccl_ok: bool) -> dict[str, Any]:
    """Runs on every rank: warm-up, then dispatch, return and (with NCCL) the torch pipeline, timed."""
    from nmoe.fast.rdep import rdep_dispatch, rdep_return

    s = group.shape
    x, ids = x.to(group.device), ids.to(group.device)
    y = torch.randn(s.capacity, s.hidden, device=group.device).to(s.dtype)

    def dispatch() -> None:
        rdep_dispatch(group, x, ids)

    def ret() -> None:
        rdep_return(group, y)

    for _ in range(WARMUP):
        dispatch()
        ret()
    group.sync_check()
    dispatch_ms = _median_ms(dispatch, REPS, after=ret)
    return_ms = _median_ms(ret, REPS, before=dispatch)
    group.sync_check()
    recv = rdep_dispatch(group, x, ids)
    group.sync_check()
    n_recv = int(recv.n_recv.item())
    out: dict[str, Any] = {"dispatch_ms": dispatch_ms, "return_ms": return_ms, "n_recv": n_recv,
                           "torch_ms": None, "torch_check": None}
    if nccl_ok:
        nccl = dist.new_group(backend="nccl")
        want = torch_pipeline(x, ids, s.n_experts, s.world, nccl)
        out["torch_check"] = bool(torch.equal(want.view(torch.int16), recv.x[:n_recv].view(torch.int16)))
        rdep_return(group, y)
        for _ in range(WARMUP):
            torch_pipeline(x, ids, s.n_experts, s.world, nccl)
        out["torch_ms"] = _median_ms(lambda: torch_pipeline(x, ids, s.n_experts, s.world, nccl), REPS)
    else:
        rdep_return(group, y)
    group.sync_check()
    return out


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "T{}_K{}_H{}_E{}".format(*c))
def test_bench_rdep(cfg: tuple[int, int, int, int]) -> None:
    from nmoe.fast.rdep import RdepShape, spmd

    t, k, h, e = cfg
    kind = os.environ.get("NMOE_RDEP_PLACEMENT", "shared")
    devices = spmd.placement(WORLD, kind)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(t, h, generator=g).to(torch.bfloat16) for _ in range(WORLD)]
    ids = [torch.multinomial(torch.ones(t, e), k, generator=g) for _ in range(WORLD)]
    owner = torch.cat([i.reshape(-1) for i in ids]) // (e // WORLD)
    need = int(torch.bincount(owner, minlength=WORLD).max())
    shape = RdepShape(world=WORLD, n_experts=e, tokens=t, top_k=k, hidden=h, dtype=torch.bfloat16,
                      capacity=need)
    nccl_ok = len(set(devices)) == WORLD
    pool = spmd.Pool(devices)
    try:
        args = tuple((xs[r], ids[r], nccl_ok) for r in range(WORLD))
        outs: list[dict[str, Any]] = pool.run(spmd.Job(bench_job, shape, args))
    finally:
        pool.close()
    dims = {"W": WORLD, "T": t, "K": k, "H": h, "E": e}
    one_gpu = not nccl_ok
    row_bytes = 2 * h
    for r, o in enumerate(outs):
        sent = t * k * (row_bytes + 8)
        back = o["n_recv"] * row_bytes
        extra = {"rank": r, "one_gpu": one_gpu, "placement": kind}
        base = None if o["torch_ms"] is None else ("torch_permute_a2a_sort", float(o["torch_ms"]))
        row = record(f"rdep_dispatch_rank{r}", dims, o["dispatch_ms"], nbytes=sent, baseline=base)
        row.update(extra, GBps=sent / (o["dispatch_ms"] * 1e-3) / 1e9, torch_check=o["torch_check"])
        if base is None:
            row["baseline_missing"] = ("NCCL refuses two ranks on one GPU" if one_gpu else "not measured")
        row = record(f"rdep_return_rank{r}", dims, o["return_ms"], nbytes=back)
        row.update(extra, GBps=back / (o["return_ms"] * 1e-3) / 1e9)
        both = (sent + back) / ((o["dispatch_ms"] + o["return_ms"]) * 1e-3) / 1e9
        append_row({"name": f"rdep_dispatch_return_rank{r}", "shape": dims, "GBps": both, **extra})
        assert o["torch_check"] in (None, True), f"rank {r}: RDEP rows differ from the torch pipeline's"
