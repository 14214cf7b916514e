"""nmoe.fast.rdep against the spec's rdep, run SPMD: W spawned ranks (sharing GPU 0 unless
NMOE_RDEP_PLACEMENT=distinct), each dispatching and returning its own rows; bitwise per rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from torch import Tensor

from nmoe.fast import rdep as fast
from nmoe.fast.rdep.group import Layout
from nmoe.reference import rdep as ref
from parity import spmd

gpu = pytest.mark.gpu


def _routes(w: int, n_local: int, t: int, k: int, kind: str, seed: int) -> tuple[list[Tensor], list[Tensor]]:
    """bf16 rows and ids [T,K] per rank: distinct experts per token, uniform or Zipf-skewed."""
    g = torch.Generator().manual_seed(seed)
    e = w * n_local
    weight = torch.ones(e, dtype=torch.float64)
    if kind == "zipf":
        weight = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 1.5
    xs = [torch.randn(t, 40, generator=g).to(torch.bfloat16) for _ in range(w)]
    ids = [torch.multinomial(weight.expand(t, e), k, replacement=False, generator=g) for _ in range(w)]
    return xs, ids


def _need(ids: list[Tensor], n_experts: int) -> int:
    owner = torch.cat([i.reshape(-1) for i in ids]) // (n_experts // len(ids))
    return int(torch.bincount(owner, minlength=len(ids)).max())


def _bits(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.uint8)


def _assert_dispatch(xs: list[Tensor], ids: list[Tensor], e: int, cap: int) -> None:
    got = spmd.rdep_dispatch(xs, ids, e, cap)
    want = ref.rdep_dispatch(xs, ids, e, cap)
    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g.row_id, w.row_id), f"rank {r} row_id"
        assert torch.equal(g.local_eid, w.local_eid), f"rank {r} local_eid"
        assert torch.equal(g.counts, w.counts), f"rank {r} counts"
        assert torch.equal(_bits(g.x), _bits(w.x)), f"rank {r} x"


def _assert_return(xs: list[Tensor], ids: list[Tensor], e: int, seed: int) -> None:
    t, k = ids[0].shape
    recvs = ref.rdep_dispatch(xs, ids, e, _need(ids, e))
    g = torch.Generator().manual_seed(seed)
    ys = [torch.randn(rc.row_id.numel(), xs[0].shape[1], generator=g).to(torch.bfloat16) for rc in recvs]
    got = spmd.rdep_return(ys, recvs, t, k)
    want = ref.rdep_return(ys, recvs, t, k)
    for r, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(_bits(a), _bits(b)), f"rank {r} returned rows"


# ------------------------------------------------------------------ CPU


def test_kernel_specs_cover_both_archs() -> None:
    assert {s.op for s in fast.KERNELS} == {"rdep_dispatch", "rdep_return"}
    for s in fast.KERNELS:
        assert set(s.expect) == set(s.forbid) == {"sm_90a", "sm_100a"}


@pytest.mark.heavy
def test_kernels_compile_without_gpu() -> None:
    for arch, rows in compile_rows("nmoe.fast.rdep").items():
        assert_rows_ok(rows, arch, len(fast.KERNELS))


def test_shape_is_checked() -> None:
    with pytest.raises(ValueError, match="multiple of world"):
        fast.RdepShape(world=3, n_experts=8, tokens=4, top_k=2, hidden=8, dtype=torch.bfloat16, capacity=8)
    with pytest.raises(ValueError, match="timeout_s"):
        fast.RdepShape(world=2, n_experts=8, tokens=4, top_k=2, hidden=8, dtype=torch.bfloat16, capacity=8,
                       timeout_s=0.0)


def test_window_regions_are_aligned_and_disjoint() -> None:
    s = fast.RdepShape(world=4, n_experts=12, tokens=7, top_k=3, hidden=5, dtype=torch.bfloat16, capacity=33)
    lay = Layout.of(s)
    starts = [lay.x, lay.row, lay.out, lay.cnt, lay.flag, lay.nbytes]
    sizes = [33 * 10, 33 * 8, 2 * 7 * 3 * 10, 2 * 4 * 12 * 4, 3 * 4 * 8]
    assert all(a % 16 == 0 for a in starts)
    assert all(starts[i] + sizes[i] <= starts[i + 1] for i in range(5))


def test_routes_of_inverts_the_spec_dispatch() -> None:
    xs, ids = _routes(3, 2, 5, 2, "uniform", 0)
    recvs = ref.rdep_dispatch(xs, ids, 6, _need(ids, 6))
    assert all(torch.equal(a, b) for a, b in zip(spmd.routes_of(recvs, 5, 2), ids, strict=True))


def _kernel_constants() -> dict[str, int]:
    """Module-level int constants of nmoe/fast/kernels/rdep.py, read without importing cutlass."""
    import ast
    from pathlib import Path

    import nmoe.fast.rdep

    path = Path(nmoe.fast.rdep.__file__).parents[1] / "kernels" / "rdep.py"
    found: dict[str, int] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple | ast.Constant):
            names = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for n, v in zip(names, values, strict=True):
                if isinstance(n, ast.Name) and isinstance(v, ast.Constant) and isinstance(v.value, int):
                    found[n.id] = v.value
    return found


def test_glue_constants_match_the_kernels() -> None:
    from nmoe.fast.rdep import group, window

    k = _kernel_constants()
    codes = (group._OVERFLOW, group._TIMEOUT, group._BAD_ROW)
    assert codes == (k["OVERFLOW"], k["TIMEOUT"], k["BAD_ROW"])
    assert group.EPOCH_WORDS == k["EPOCH_WORDS"] == k["E_LOCK"] + 1
    phases = group._PHASES
    assert phases == {k["FLAG_COUNTS"]: "counts", k["FLAG_ROWS"]: "rows", k["FLAG_RETURN"]: "return"}
    assert max(k["ST_CODE"], k["ST_A"], k["ST_B"], k["ST_C"]) < window.STATUS_WORDS


class _Words:
    def __init__(self, *words: int) -> None:
        self.words = words

    def read(self) -> tuple[int, ...]:
        return (*self.words, 0, 0, 0, 0)


@pytest.mark.parametrize(("words", "message"), [
    ((0, 0, 0, 0), None),
    ((1, 3, 90, 80), "rank 3 would receive 90 rows but capacity is 80; raise capacity to at least 90"),
    ((2, 1, 0, 7), r"rank 0 timed out after 1.0 s waiting for rank 1 \(counts phase of call 7\)"),
    ((2, 2, 2, 4), r"waiting for rank 2 \(return phase of call 4\)"),
    ((3, 5, -1, 48), r"received row 5 holds row_id -1 outside \[0, 48\)"),
])
def test_check_raises_what_the_status_words_say(words: tuple[int, ...], message: str | None) -> None:
    from nmoe.fast.rdep.group import RdepGroup

    g = object.__new__(RdepGroup)
    g.rank, g.status = 0, _Words(*words)  # type: ignore[assignment]
    g.shape = fast.RdepShape(world=4, n_experts=4, tokens=4, top_k=3, hidden=8, dtype=torch.bfloat16,
                             capacity=80, timeout_s=1.0)
    if message is None:
        g.check()
        return
    with pytest.raises(RuntimeError, match=message):
        g.check()


class _FakeDriver:
    """The driver calls open_window and Window.close make, on cuda.bindings' real handle structs."""

    def __init__(self, own: int, fail_open: bool = False) -> None:
        import cuda.bindings.driver as real

        self.real, self.own, self.fail_open = real, own, fail_open
        self.CUipcMemHandle, self.CUipcMem_flags = real.CUipcMemHandle, real.CUipcMem_flags
        self.opened: dict[int, tuple[bytes, int]] = {}
        self.closed: list[int] = []
        self.freed: list[int] = []

    def _ok(self, *rest: object) -> tuple[object, ...]:
        return (self.real.CUresult.CUDA_SUCCESS, *rest)

    def cuMemAlloc(self, n: int) -> tuple[object, ...]:
        return self._ok(self.real.CUdeviceptr(self.own))

    def cuMemsetD8(self, p: int, v: int, n: int) -> tuple[object, ...]:
        return self._ok()

    def cuCtxSynchronize(self) -> tuple[object, ...]:
        return self._ok()

    def cuIpcGetMemHandle(self, p: int) -> tuple[object, ...]:
        import ctypes

        h = self.CUipcMemHandle()
        ctypes.memmove(h.getPtr(), bytes([int(p) % 251]) * 64, 64)
        return self._ok(h)

    def cuIpcOpenMemHandle(self, h: object, flags: int) -> tuple[object, ...]:
        import ctypes

        data = ctypes.string_at(h.getPtr(), 64)  # type: ignore[attr-defined]
        if self.fail_open:
            return (self.real.CUresult.CUDA_ERROR_INVALID_VALUE, self.real.CUdeviceptr(0))
        addr = 0x1000 * (data[0] + 1)
        self.opened[addr] = (data, flags)
        return self._ok(self.real.CUdeviceptr(addr))

    def cuIpcCloseMemHandle(self, p: int) -> tuple[object, ...]:
        self.closed.append(int(p))
        return self._ok()

    def cuMemFree(self, p: int) -> tuple[object, ...]:
        self.freed.append(int(p))
        return self._ok()


def test_window_maps_every_peer_handle_but_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from nmoe.fast.rdep import window

    drv = _FakeDriver(own=0x9000)
    monkeypatch.setattr(window, "_driver", lambda: drv)
    monkeypatch.setattr(window, "_bind", lambda device: None)
    sent: list[bytes] = []

    def exchange(mine: bytes) -> list[bytes]:
        sent.append(mine)
        return [bytes([5]) * 64, mine, bytes([7]) * 64]

    win = window.open_window(100, torch.device("cuda", 0), 1, exchange)
    assert sent == [bytes([0x9000 % 251]) * 64]
    assert win.bases == (0x6000, 0x9000, 0x8000) and win.own == 0x9000
    lazy = int(drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    assert drv.opened == {0x6000: (bytes([5]) * 64, lazy), 0x8000: (bytes([7]) * 64, lazy)}
    win.close()
    win.close()
    assert drv.closed == [0x6000, 0x8000] and drv.freed == [0x9000]


def test_window_names_the_peer_whose_handle_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from nmoe.fast.rdep import window

    drv = _FakeDriver(own=0x9000, fail_open=True)
    monkeypatch.setattr(window, "_driver", lambda: drv)
    monkeypatch.setattr(window, "_bind", lambda device: None)
    with pytest.raises(RuntimeError, match=r"cuIpcOpenMemHandle of rank 1 failed .*its own process"):
        window.open_window(100, torch.device("cuda", 0), 0, lambda mine: [mine, bytes(64)])


class _Proc:
    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.alive = False

    def join(self, timeout: float) -> None:
        return None


def _fake_pool(answers: list[tuple[int, str, object]], alive: tuple[bool, ...]) -> object:
    """A Pool whose ranks are stand-ins: `answers` already sit in its result queue."""
    import queue

    from nmoe.fast.rdep import spmd as ranks

    pool = object.__new__(ranks.Pool)
    pool.world, pool.broken = len(alive), False
    pool.inq = [queue.Queue() for _ in alive]
    pool.outq = queue.Queue()
    for a in answers:
        pool.outq.put(a)
    pool.procs = [_Proc(a) for a in alive]  # type: ignore[misc]
    return pool


def _job(world: int) -> object:
    from nmoe.fast.rdep import spmd as ranks

    shape = fast.RdepShape(world=world, n_experts=2, tokens=1, top_k=1, hidden=8, dtype=torch.bfloat16,
                           capacity=2)
    return ranks.Job("dispatch", shape, tuple(() for _ in range(world)))


def test_pool_fails_fast_when_a_rank_dies(monkeypatch: pytest.MonkeyPatch) -> None:
    from nmoe.fast.rdep import spmd as ranks

    monkeypatch.setattr(ranks, "POLL_S", 0.01)
    pool = _fake_pool([(0, "ok", {}), (0, "done", True)], (True, False))
    with pytest.raises(ranks.RankError, match=r"ranks \[1\] died; answers so far rank 0: ok"):
        pool.run(_job(2))  # type: ignore[attr-defined]
    assert pool.broken and not any(p.is_alive() for p in pool.procs)  # type: ignore[attr-defined]


def test_pool_breaks_when_a_rank_context_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    from nmoe.fast.rdep import spmd as ranks

    monkeypatch.setattr(ranks, "POLL_S", 0.01)
    answers = [(1, "error", "RuntimeError: rdep: rank 1 timed out"), (0, "ok", {}), (1, "done", False),
               (0, "done", True)]
    pool = _fake_pool(answers, (True, True))
    with pytest.raises(ranks.RankError, match="rank 1: RuntimeError: rdep: rank 1 timed out"):
        pool.run(_job(2))  # type: ignore[attr-defined]
    assert pool.broken  # type: ignore[attr-defined]
    with pytest.raises(ranks.RankError, match="broken by an earlier job"):
        pool.run(_job(2))  # type: ignore[attr-defined]


def test_pool_keeps_going_after_a_clean_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from nmoe.fast.rdep import spmd as ranks

    monkeypatch.setattr(ranks, "POLL_S", 0.01)
    answers = [(0, "error", "RuntimeError: capacity"), (1, "error", "RuntimeError: capacity"),
               (0, "done", True), (1, "done", True)]
    pool = _fake_pool(answers, (True, True))
    with pytest.raises(ranks.RankError, match="rank 0: RuntimeError: capacity"):
        pool.run(_job(2))  # type: ignore[attr-defined]
    assert not pool.broken  # type: ignore[attr-defined]


# ------------------------------------------------------------------ GPU

def _case_id(c: tuple[int, int, int, int, str]) -> str:
    return "W{}_nl{}_T{}_K{}_{}".format(*c)


CASES = [  # (W, n_local, T, K, routing)
    (2, 1, 1, 1, "uniform"),
    (2, 4, 64, 4, "uniform"),
    (2, 8, 200, 8, "zipf"),
    (4, 2, 33, 3, "uniform"),
    (4, 16, 128, 8, "zipf"),
    (1, 4, 17, 2, "uniform"),
]


@gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_dispatch_bitwise_vs_spec(case: tuple[int, int, int, int, str]) -> None:
    w, nl, t, k, kind = case
    xs, ids = _routes(w, nl, t, k, kind, 1)
    _assert_dispatch(xs, ids, w * nl, _need(ids, w * nl) + 3)


@gpu
def test_dispatch_int32_ids() -> None:
    xs, ids = _routes(2, 4, 50, 4, "uniform", 2)
    _assert_dispatch(xs, [i.to(torch.int32) for i in ids], 8, _need(ids, 8))


@gpu
def test_permute_of_zero_width_rows_sorts_slots() -> None:
    """rdep_dispatch sorts its slots with permute of a [T, 0] x: same counts, offs and slot as with rows."""
    from nmoe.fast.dispatch import permute

    _, ids = _routes(1, 16, 300, 4, "zipf", 16)
    x = torch.randn(300, 8).to(torch.bfloat16).cuda()
    for idc in (ids[0].cuda(), ids[0].to(torch.int32).cuda()):
        bare, full = permute(x[:, :0].contiguous(), idc, 16, 1), permute(x, idc, 16, 1)
        assert bare.xp.shape == (300 * 4, 0)
        for name in ("counts", "offs", "slot"):
            assert torch.equal(getattr(bare, name), getattr(full, name)), name


def rounds_job(group: object, xs: list[Tensor], ids: list[Tensor]) -> dict[str, list[Tensor]]:
    """Back-to-back rounds of one dispatch and two returns on one group, no host sync (peers run ahead, the
    counts and return buffers alternate): the returns send the received rows and twice them, so out[t, k]
    must be x[t], then 2 x[t]."""
    from nmoe.fast.rdep import rdep_dispatch, rdep_return
    from nmoe.fast.rdep.group import RdepGroup

    assert isinstance(group, RdepGroup)
    dev = group.device
    kept: list[list[Tensor]] = []
    for x, i in zip(xs, ids, strict=True):
        recv = rdep_dispatch(group, x.to(dev), i.to(dev))
        got = [t.clone() for t in (recv.x, recv.row_id, recv.local_eid, recv.counts, recv.n_recv)]
        once = rdep_return(group, recv.x.clone()).clone()
        kept.append([*got, once, rdep_return(group, recv.x * 2).clone()])
    group.sync_check()
    out: dict[str, list[Tensor]] = {k: [] for k in ("x", "row_id", "local_eid", "counts", "out", "out2")}
    for rx, rid, eid, cnt, n_recv, ret, ret2 in kept:
        n = int(n_recv.item())
        for k, v in zip(out, (rx[:n], rid[:n], eid[:n], cnt, ret, ret2), strict=True):
            out[k].append(v.cpu())
    return out


@gpu
@pytest.mark.parametrize("w", [2, 4], ids=["W2", "W4"])
def test_back_to_back_rounds_on_one_group(w: int) -> None:
    from nmoe.fast.rdep import spmd as ranks

    nl, t, k, n_rounds = 2, 40, 3, 4
    rounds = [_routes(w, nl, t, k, "zipf" if j % 2 else "uniform", 20 + j) for j in range(n_rounds)]
    cap = max(_need(ids, w * nl) for _, ids in rounds)
    shape = fast.RdepShape(world=w, n_experts=w * nl, tokens=t, top_k=k, hidden=40, dtype=torch.bfloat16,
                           capacity=cap)
    args = tuple(([xs[r] for xs, _ in rounds], [ids[r] for _, ids in rounds]) for r in range(w))
    outs = spmd.pool(w).run(ranks.Job(rounds_job, shape, args))
    for j, (xs, ids) in enumerate(rounds):
        want = ref.rdep_dispatch(xs, ids, w * nl, cap)
        for r, (o, wr) in enumerate(zip(outs, want, strict=True)):
            assert torch.equal(o["row_id"][j], wr.row_id), f"round {j} rank {r} row_id"
            assert torch.equal(o["local_eid"][j], wr.local_eid), f"round {j} rank {r} local_eid"
            assert torch.equal(o["counts"][j], wr.counts), f"round {j} rank {r} counts"
            assert torch.equal(_bits(o["x"][j]), _bits(wr.x)), f"round {j} rank {r} x"
            assert torch.equal(_bits(o["out"][j]), _bits(xs[r][:, None, :].expand(t, k, 40))), \
                f"round {j} rank {r} returned rows"
            twice = (xs[r].float() * 2).to(torch.bfloat16)[:, None, :].expand(t, k, 40)
            assert torch.equal(_bits(o["out2"][j]), _bits(twice)), f"round {j} rank {r} second return"


@gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_return_bitwise_vs_spec(case: tuple[int, int, int, int, str]) -> None:
    w, nl, t, k, kind = case
    xs, ids = _routes(w, nl, t, k, kind, 3)
    _assert_return(xs, ids, w * nl, 4)


@gpu
@pytest.mark.parametrize("w", [2, 4], ids=["W2", "W4"])
def test_overflow_raises_with_the_numbers(w: int) -> None:
    xs, ids = _routes(w, 2, 40, 2, "zipf", 5)
    need = _need(ids, 2 * w)
    with pytest.raises(RuntimeError, match=rf"would receive {need} rows but capacity is {need - 1}"):
        spmd.rdep_dispatch(xs, ids, 2 * w, need - 1)
    _assert_dispatch(xs, ids, 2 * w, need)


@gpu
def test_silent_peer_times_out_naming_the_rank() -> None:
    from nmoe.fast.rdep import spmd as ranks

    shape = fast.RdepShape(world=2, n_experts=4, tokens=8, top_k=2, hidden=40, dtype=torch.bfloat16,
                           capacity=32, timeout_s=1.0)
    xs, ids = _routes(2, 2, 8, 2, "uniform", 6)
    pool = ranks.Pool(ranks.placement(2, spmd.placement_kind()))
    try:
        with pytest.raises(ranks.RankError, match=r"rank 0 timed out .* waiting for rank 1 \(counts phase"):
            pool.run(ranks.Job("stall", shape, ((xs[0], ids[0]), (xs[1], ids[1]))))
    finally:
        pool.close()


# ------------------------------------------------------------------ separating tests of the GPU mutants


@gpu
def test_sep_rdep_fast_wrong_rank() -> None:
    xs, ids = _routes(2, 4, 64, 4, "uniform", 7)
    e = torch.cat([i.reshape(-1) for i in ids])
    assert bool(((e + 1) // 4 % 2 != e // 4).any()), "the data must route some slot to the other owner"
    _assert_dispatch(xs, ids, 8, 2 * 64 * 4)


@gpu
def test_sep_rdep_fast_order_broken() -> None:
    xs, ids = _routes(2, 2, 64, 2, "uniform", 8)
    per_block = torch.bincount(ids[0].reshape(-1), minlength=4)
    assert int(per_block.max()) >= 2, "some (source, expert) block must hold two rows to have an order"
    _assert_dispatch(xs, ids, 4, _need(ids, 4))


@gpu
def test_sep_rdep_fast_return_slot_reused() -> None:
    xs, ids = _routes(2, 4, 32, 4, "uniform", 9)
    slots = torch.arange(32 * 4)
    assert not torch.equal(slots // 2 * 2, slots), "reusing even slots must leave odd slots unwritten"
    _assert_return(xs, ids, 8, 10)


@gpu
def test_sep_rdep_fast_overflow_off_by_one() -> None:
    xs, ids = _routes(2, 2, 40, 2, "zipf", 11)
    need = _need(ids, 4)
    assert need > need - 1 and not need > need - 1 + 1, "capacity need-1 separates > from > +1"
    with pytest.raises(RuntimeError, match=rf"would receive {need} rows but capacity is {need - 1}"):
        spmd.rdep_dispatch(xs, ids, 4, need - 1)


# ------------------------------------------------------------------ expert parallelism over RDEP


class _OneRank:
    """RDEP of one rank holding one expert, on CPU: every other dispatch receives the slots in reverse, so
    a backward that answers the group's latest order instead of its own forward's shows."""

    def __init__(self, t: int, k: int) -> None:
        self.t, self.k, self.calls = t, k, 0
        self.last: fast.Received | None = None

    def dispatch(self, group: _OneRank, x: Tensor, ids: Tensor) -> fast.Received:
        n = self.t * self.k
        order = torch.arange(n) if self.calls % 2 == 0 else torch.arange(n).flip(0)
        self.calls += 1
        rows = x.repeat_interleave(self.k, 0)[order]
        self.last = fast.Received(rows, order.clone(), torch.zeros(n, dtype=torch.int64), torch.tensor([n]),
                                  torch.tensor([n], dtype=torch.int32))
        return self.last

    def ret(self, group: _OneRank, y: Tensor, sent: fast.Sent | None = None) -> Tensor:
        assert self.last is not None
        row_id = (self.last.row_id if sent is None else sent.row_id)
        out = torch.empty_like(y)
        out[row_id] = y
        return out.view(self.t, self.k, -1)


def test_sep_moe_ep_return_latest_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from nmoe.fast.rdep import ep

    t, k = 3, 2
    one = _OneRank(t, k)
    monkeypatch.setattr(ep, "rdep_dispatch", one.dispatch)
    monkeypatch.setattr(ep, "rdep_return", one.ret)
    ex = ep.Exchange(one, one)  # type: ignore[arg-type]
    x = torch.randn(t, 4, dtype=torch.float64, requires_grad=True)
    ids = torch.zeros(t, k, dtype=torch.int64)
    c = torch.arange(t * k, dtype=torch.float64)
    own, latest = c.view(t, k).sum(1), c.flip(0).view(t, k).sum(1)
    assert not torch.equal(own, latest), "the two receive orders give different gradients"
    rows, _, _ = ep.ep_dispatch(x, ids, ex)
    ep.ep_dispatch(x, ids, ex)  # another layer's dispatch reuses the group before this backward
    (rows * c[:, None]).sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, own[:, None].expand(t, 4))


def _with_slots(group: object, body: Any, *args: Any) -> Any:
    """body(group, slots, *args) with this rank's slot group (the backward's exchange) open around it; every
    rank passes the same barrier whatever raised, so one failing rank cannot stall the others."""
    import torch.distributed as dist

    from nmoe.fast.rdep import ep
    from nmoe.fast.rdep.group import RdepGroup
    from nmoe.fast.rdep.spmd import all_gather_bytes

    assert isinstance(group, RdepGroup)
    slots = RdepGroup(ep.slot_shape(group.shape), group.rank, group.device, all_gather_bytes)
    try:
        got = body(group, slots, *args)
    except BaseException:
        dist.barrier()
        raise
    dist.barrier()
    slots.close()
    return got


def ep_grad_job(group: object, x: Tensor, ids: Tensor, c: Tensor) -> dict[str, Tensor]:
    """On every rank: out = ep_return(2 * ep_dispatch(x)), loss = sum(c[t,k] * out[t,k,:]); out and dx."""
    got: dict[str, Tensor] = _with_slots(group, _ep_grad_rank, x, ids, c)
    return got


def _ep_grad_rank(group: Any, slots: Any, x: Tensor, ids: Tensor, c: Tensor) -> dict[str, Tensor]:
    from nmoe.fast.rdep import ep

    ex = ep.Exchange(group, slots)
    xd = x.to(group.device).requires_grad_()
    idd = ids.to(group.device)
    rows, _, _ = ep.ep_dispatch(xd, idd, ex)
    out = ep.ep_return(rows * 2, idd, ex)
    (out.float() * c.to(group.device)[:, :, None]).sum().backward()
    group.sync_check()
    slots.sync_check()
    assert xd.grad is not None
    return {"out": out.detach().cpu(), "dx": xd.grad.cpu()}


@gpu
@pytest.mark.parametrize("w", [2, 4], ids=["W2", "W4"])
def test_ep_dispatch_return_gradients(w: int) -> None:
    from nmoe.fast.rdep import spmd as ranks

    t, k, nl = 24, 3, 2
    xs, ids = _routes(w, nl, t, k, "uniform", 12)
    g = torch.Generator().manual_seed(13)
    cs = [torch.randint(-3, 4, (t, k), generator=g).float() for _ in range(w)]
    shape = fast.RdepShape(world=w, n_experts=w * nl, tokens=t, top_k=k, hidden=40, dtype=torch.bfloat16,
                           capacity=_need(ids, w * nl))
    outs = spmd.pool(w).run(ranks.Job(ep_grad_job, shape, tuple(zip(xs, ids, cs, strict=True))))
    for r, o in enumerate(outs):
        two_x = (xs[r].float() * 2).to(torch.bfloat16)
        assert torch.equal(_bits(o["out"]), _bits(two_x[:, None, :].expand(t, k, 40))), f"rank {r} out"
        want = (2 * cs[r].sum(1))[:, None].expand(t, 40).to(torch.bfloat16)
        assert torch.equal(_bits(o["dx"]), _bits(want)), f"rank {r} dx"


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def ep_routed_job(group: object, xs: list[Tensor], ids: list[Tensor], ws: list[Tensor], w_up: Tensor,
                  w2: Tensor, douts: list[Tensor]) -> dict[str, float | bool]:
    """This rank's ep_routed (its experts only) against one process running every rank's tokens through
    every expert with the same kernels (torch gather/scatter around them): out bitwise, gradients close."""
    got: dict[str, float | bool] = _with_slots(group, _ep_routed_rank, xs, ids, ws, w_up, w2, douts)
    return got


def _ep_routed_rank(group: Any, slots: Any, xs: list[Tensor], ids: list[Tensor], ws: list[Tensor],
                    w_up: Tensor, w2: Tensor, douts: list[Tensor]) -> dict[str, float | bool]:
    from nmoe.fast.combine import combine
    from nmoe.fast.gemm import grouped_gemm, grouped_gemm_act
    from nmoe.fast.rdep import ep

    dev, r, nl = group.device, group.rank, group.shape.n_local
    ex = ep.Exchange(group, slots)
    x = xs[r].to(dev).requires_grad_()
    wr = ws[r].to(dev).requires_grad_()
    up_l = w_up[r * nl:(r + 1) * nl].to(dev).requires_grad_()
    w2_l = w2[r * nl:(r + 1) * nl].to(dev).requires_grad_()
    out = ep.ep_routed(x, wr, ids[r].to(dev), up_l, w2_l, "swiglu", 2.5, None, ex)
    (out.float() * douts[r].to(dev)).sum().backward()
    group.sync_check()
    slots.sync_check()

    t, k = ids[0].shape
    xa = torch.cat(xs).to(dev).requires_grad_()
    wa = torch.cat(ws).to(dev).requires_grad_()
    up, dn = w_up.to(dev).requires_grad_(), w2.to(dev).requires_grad_()
    flat = torch.cat(ids).to(dev).reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=up.shape[0]), 0).to(torch.int32)
    y = grouped_gemm(grouped_gemm_act(xa[order // k], up, offs, "swiglu"), dn, offs)
    ref = combine(y[torch.argsort(order)].view(-1, k, y.shape[1]), wa, 2.5, None)
    (ref.float() * torch.cat(douts).to(dev)).sum().backward()
    mine = slice(r * t, (r + 1) * t)
    assert x.grad is not None and wr.grad is not None and up_l.grad is not None and w2_l.grad is not None
    assert xa.grad is not None and wa.grad is not None and up.grad is not None and dn.grad is not None
    got = {
        "out_bitwise": bool(torch.equal(_bits(out), _bits(ref[mine]))),
        "dx": _rel(x.grad, xa.grad[mine]), "dweights": _rel(wr.grad, wa.grad[mine]),
        "dw_up": _rel(up_l.grad, up.grad[r * nl:(r + 1) * nl]),
        "dw2": _rel(w2_l.grad, dn.grad[r * nl:(r + 1) * nl]),
    }
    return got


@gpu
@pytest.mark.parametrize("w", [2, 4], ids=["W2", "W4"])
def test_ep_routed_matches_one_process(w: int) -> None:
    from nmoe.fast.rdep import spmd as ranks

    t, k, nl, d, i = 48, 2, 2, 64, 32
    _, ids = _routes(w, nl, t, k, "zipf", 14)
    g = torch.Generator().manual_seed(15)
    xs = [torch.randn(t, d, generator=g).to(torch.bfloat16) for _ in range(w)]
    ws = [torch.rand(t, k, generator=g) + 0.1 for _ in range(w)]
    w_up = (torch.randn(w * nl, 2 * i, d, generator=g) / d**0.5).to(torch.bfloat16)
    w2 = (torch.randn(w * nl, d, i, generator=g) / i**0.5).to(torch.bfloat16)
    douts = [torch.randn(t, d, generator=g) for _ in range(w)]
    shape = fast.RdepShape(world=w, n_experts=w * nl, tokens=t, top_k=k, hidden=d, dtype=torch.bfloat16,
                           capacity=_need(ids, w * nl))
    args = tuple((xs, ids, ws, w_up, w2, douts) for _ in range(w))
    for r, o in enumerate(spmd.pool(w).run(ranks.Job(ep_routed_job, shape, args))):
        assert o["out_bitwise"], f"rank {r}: out differs from one process"
        for name in ("dx", "dweights", "dw_up", "dw2"):  # bf16 results: a few roundings of 2^-8
            assert float(o[name]) <= 2.0**-6, f"rank {r}: {name} max-norm relative error {o[name]}"


def moe_layer_ep_job(group: object, xs: list[Tensor], p: Any, cfg: Any,
                     douts: list[Tensor]) -> dict[str, float | bool]:
    """The whole fast moe_layer with this rank's expert shard over RDEP against one process running every
    rank's tokens through the unsharded layer: routing and out bitwise, gradients close (router and shared
    expert gradients summed over ranks, as the trainer's reduction does)."""
    got: dict[str, float | bool] = _with_slots(group, _moe_layer_ep_rank, xs, p, cfg, douts)
    return got


def _moe_layer_ep_rank(group: Any, slots: Any, xs: list[Tensor], p: Any, cfg: Any,
                       douts: list[Tensor]) -> dict[str, float | bool]:
    import dataclasses

    import torch.distributed as dist

    from nmoe.fast.moe import moe_layer
    from nmoe.fast.rdep import ep

    dev, r, nl = group.device, group.rank, group.shape.n_local
    full = {f.name: (None if getattr(p, f.name) is None else getattr(p, f.name).to(dev).requires_grad_(
        getattr(p, f.name).is_floating_point() and f.name != "router_bias")) for f in dataclasses.fields(p)}
    mine = {k: v for k, v in full.items()}
    for name in ("w13", "w1", "w2"):
        if full[name] is not None:
            mine[name] = full[name].detach()[r * nl:(r + 1) * nl].clone().requires_grad_()
    x = xs[r].to(dev).requires_grad_()
    out, routing = moe_layer(x, type(p)(**mine), cfg, ep.Exchange(group, slots))
    (out.float() * douts[r].to(dev)).sum().backward()
    group.sync_check()
    slots.sync_check()
    t = xs[0].shape[0]
    xa = torch.cat(xs).to(dev).requires_grad_()
    ref_full = {k: (None if v is None else v.detach().clone().requires_grad_(v.requires_grad))
                for k, v in full.items()}
    ref, ref_routing = moe_layer(xa, type(p)(**ref_full), cfg)
    (ref.float() * torch.cat(douts).to(dev)).sum().backward()
    rows = slice(r * t, (r + 1) * t)
    got: dict[str, float | bool] = {
        "out_bitwise": bool(torch.equal(_bits(out), _bits(ref[rows]))),
        "ids_equal": bool(torch.equal(routing.ids, ref_routing.ids[rows])),
        "weights_bitwise": bool(torch.equal(_bits(routing.weights), _bits(ref_routing.weights[rows]))),
    }
    assert x.grad is not None and xa.grad is not None
    got["dx"] = _rel(x.grad, xa.grad[rows])
    for name in ("w13", "w1", "w2"):
        if mine[name] is not None:
            g, want = mine[name].grad, ref_full[name].grad
            assert g is not None and want is not None
            got[f"d{name}"] = _rel(g, want[r * nl:(r + 1) * nl])
    for name in ("router_w", "shared_w13", "shared_w1", "shared_w2"):
        if mine[name] is not None:
            g, want = mine[name].grad, ref_full[name].grad
            assert g is not None and want is not None
            summed = g.float().cpu()
            dist.all_reduce(summed)
            got[f"d{name}"] = _rel(summed, want.float().cpu())
    return got


def _moe_ep_case(w: int, dtype: str = "bf16") -> tuple[list[Tensor], Any, Any, list[Tensor], Any]:
    """Router inputs on a grid where fp32 logit sums are exact, so every rank routes as the one process;
    fp8 experts take whole 128 x 128 weight blocks."""
    from nmoe.config import ModelConfig
    from nmoe.layout import MoEParams

    t, d, e, k, i = 64, 128, 4 * w, 2, 64 if dtype == "bf16" else 128
    cfg = ModelConfig(tokenizer="none", vocab_size=64, dim=d, moe_inter_dim=i, n_routed_experts=e,
                      n_activated_experts=k, n_shared_experts=1, route_scale=2.5, permute_align=8,
                      activation="swiglu", score_func="sigmoid", expert_dtype=dtype)
    g = torch.Generator().manual_seed(21)
    xs = [(torch.round(torch.randn(t, d, generator=g) * 32).clamp(-127, 127) / 32).to(torch.bfloat16)
          for _ in range(w)]
    bf = torch.bfloat16
    p = MoEParams(
        router_w=(torch.randint(-1, 2, (e, d), generator=g) * 2.0**-4).to(bf),
        router_bias=torch.randn(e, generator=g) * 0.05,
        w2=(torch.randn(e, d, i, generator=g) / i**0.5).to(bf),
        w13=(torch.randn(e, 2 * i, d, generator=g) / d**0.5).to(bf), w1=None,
        shared_w13=(torch.randn(2 * i, d, generator=g) / d**0.5).to(bf), shared_w1=None,
        shared_w2=(torch.randn(d, i, generator=g) / i**0.5).to(bf),
    )
    douts = [torch.randn(t, d, generator=g) for _ in range(w)]
    shape = fast.RdepShape(world=w, n_experts=e, tokens=t, top_k=k, hidden=d, dtype=bf, capacity=w * t * k)
    return xs, p, cfg, douts, shape


def _moe_ep_outcomes(w: int, xs: list[Tensor], p: Any, cfg: Any, douts: list[Tensor],
                     shape: Any) -> list[dict[str, float | bool]]:
    from nmoe.fast.rdep import spmd as ranks

    args = tuple((xs, p, cfg, douts) for _ in range(w))
    out: list[dict[str, float | bool]] = spmd.pool(w).run(ranks.Job(moe_layer_ep_job, shape, args))
    return out


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("w", [2, 4], ids=["W2", "W4"])
def test_moe_layer_over_rdep_matches_one_process(w: int, dtype: str) -> None:
    """fp8 experts too: rows are quantized per row at their owner as one process quantizes them."""
    for r, o in enumerate(_moe_ep_outcomes(w, *_moe_ep_case(w, dtype))):
        assert o["ids_equal"] and o["weights_bitwise"], f"rank {r}: routing differs from one process"
        assert o["out_bitwise"], f"rank {r}: out differs from one process"
        for name, err in o.items():
            if name.startswith("d"):  # bf16 results through different reduction orders
                assert float(err) <= 2.0**-6, f"rank {r}: {name} max-norm relative error {err}"


@gpu
def test_sep_moe_fast_ep_shared_dropped() -> None:
    """The shared expert's output on these tokens is far from zero, so a layer that leaves it out of the
    expert-parallel combine cannot match the one-process layer bit for bit."""
    xs, p, cfg, douts, shape = _moe_ep_case(2)
    h = xs[0].float() @ p.shared_w13.float().T
    shared = (torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]) @ p.shared_w2.float().T
    assert float(shared.abs().max()) > 0.1
    assert all(o["out_bitwise"] for o in _moe_ep_outcomes(2, xs, p, cfg, douts, shape))
