"""MoE routing ops, nmoe vs torch eager and torch.compile: router_topk, permute, unpermute.

Sigmoid scores, one expert group, align 8 (LAYER_ALIGN); M = T*K slots, R = padded_rows(M, E, 8)
= ceil((M + 7E) / 8) * 8 rows. Bytes floor, each tensor read or written once:
  router_topk reads logits [T,E] fp32, bias [E] fp32; writes weights [T,K] fp32, ids [T,K] int64:
    4TE + 4E + 12TK
  permute reads x [T,H] bf16 once per token, ids [T,K] int64; writes all of xp [R,H] bf16 (pad rows are
    zero), slot [R] int64, counts and offs [E] int32: 2TH + 8TK + 2RH + 8R + 8E
  unpermute reads slot [R] int64 and the M real rows of yp [R,H] bf16; writes y [T,K,H] bf16: 8R + 4MH
router_topk's operands fit in L2, so each of its graphs cycles through input copies totalling >= 256 MiB.

moe_layer (swiglu, sigmoid, no shared experts, align 8, bf16 experts) at (T, H, I, E, K): FLOPs counted as
SonicMoE counts them, forward 6*T*I*H*K, forward+backward 18*T*I*H*K; extra peak memory is the peak
allocation of one eager call above what was allocated before it (dout = randn). The baseline is the same
layer from torch ops with torch._grouped_mm for the experts, timed in the same run. Every layer row also
carries one profiled call's `breakdown` (bench/stepprofile.py): GPU time per kernel family and kernel, the
first place to look when a row misses SonicMoE's; and `breakdown_replayed`, the same per call over REPLAYS
back-to-back replays of the timed graph, so a kernel that slows down under sustained load shows which one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    REPLAYS,
    baseline,
    capture,
    cuda_median_ms,
    eager_call_ms,
    measure_op,
    mismatch,
    peak_extra_bytes,
    record,
    replay_median_ms,
    try_compile,
)
from sonicpeer import REPS as PEER_REPS
from sonicpeer import WARMUP as PEER_WARMUP
from sonicpeer import peer_name, vs_peer
from stepprofile import profile_step
from torch import Tensor
from torchbase import (
    LAYER_ALIGN,
    LAYER_CONFIGS,
    layer_flops,
    layer_inputs,
    permute_torch,
    router_topk_torch,
    torch_layer,
    unpermute_torch,
)

from nmoe.layout import padded_rows

CONFIGS = ((32768, 4096, 128, 8), (24576, 1536, 128, 8))
ROTATE_BYTES = 256 * 2**20


def _shape(cfg: tuple[int, ...], **more: int) -> dict[str, int]:
    return {**dict(zip(("T", "H", "E", "K"), cfg, strict=True)), **more}


def _ids(t: int, e: int, k: int) -> Tensor:
    g = torch.Generator(device="cuda").manual_seed(1)
    return torch.rand(t, e, device="cuda", generator=g).topk(k, dim=-1).indices


def _x(t: int, h: int) -> Tensor:
    g = torch.Generator(device="cuda").manual_seed(2)
    return torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)


def _compiled_step(compiled: Any, *args: Any) -> Any:
    if compiled is None:
        return None

    def step() -> None:
        compiled(*args)

    return step


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "T{}_H{}_E{}_K{}".format(*c))
def test_bench_router_topk(benchmark: Any, cfg: tuple[int, ...]) -> None:
    from nmoe.fast import router as fr
    t, _, e, k = cfg
    nbytes = 4.0 * t * e + 4.0 * e + 12.0 * t * k
    g = torch.Generator(device="cuda").manual_seed(0)
    n_copies = max(2, -(-ROTATE_BYTES // int(nbytes)))
    copies = [torch.randn(t, e, device="cuda", generator=g) for _ in range(n_copies)]
    bias = 0.01 * torch.randn(e, device="cuda", generator=g)
    compiled, note = try_compile(router_topk_torch, copies[0], bias, k)

    w_fast, ids_fast = fr.router_topk(copies[0], bias, k, "sigmoid")
    w_ref, ids_ref = router_topk_torch(copies[0], bias, k)
    same = (ids_fast == ids_ref).all(-1)
    agree = float(same.float().mean())
    checks = [f"ids agree on {agree:.5f} of rows (< 0.999)"] if agree < 0.999 else []
    msg = mismatch(w_fast[same], w_ref[same], rtol=1e-4, atol=1e-6)
    checks += [f"weights: {msg}"] if msg else []
    check = "; ".join(checks)

    def fast() -> None:
        for lg in copies:
            fr.router_topk(lg, bias, k, "sigmoid")

    def eager() -> None:
        for lg in copies:
            router_topk_torch(lg, bias, k)

    def comp() -> None:
        assert compiled is not None
        for lg in copies:
            compiled(lg, bias, k)

    measure_op(benchmark, "router_topk", _shape(cfg), nbytes, fast, eager, None if compiled is None else comp,
               note, calls=len(copies), score_func="sigmoid", n_groups=1, input_copies=len(copies),
               baseline_check=check or "ok")
    assert not check, f"router_topk: nmoe and torch.topk disagree ({check})"


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "T{}_H{}_E{}_K{}".format(*c))
def test_bench_permute(benchmark: Any, cfg: tuple[int, ...]) -> None:
    from nmoe.fast import dispatch as fd
    t, h, e, k = cfg
    x, ids = _x(t, h), _ids(t, e, k)
    rows = padded_rows(t * k, e, LAYER_ALIGN)
    args = (x, ids, e, LAYER_ALIGN)
    compiled, note = try_compile(permute_torch, *args)
    p = fd.permute(*args)
    want = permute_torch(*args)
    check = "; ".join(f"{name}: {msg}" for name, got, ref in zip(
        ("xp", "counts", "offs", "slot"), (p.xp, p.counts, p.offs, p.slot), want, strict=True)
        if (msg := mismatch(got, ref)) is not None)
    del p, want

    def fast() -> None:
        fd.permute(*args)

    def eager() -> None:
        permute_torch(*args)

    nbytes = 2.0 * t * h + 8.0 * t * k + 2.0 * rows * h + 8.0 * rows + 8.0 * e
    measure_op(benchmark, "permute", _shape(cfg, R=rows, align=LAYER_ALIGN), nbytes, fast, eager,
               _compiled_step(compiled, *args), note, baseline_check=check or "ok")
    assert not check, f"permute: nmoe and the torch baseline disagree ({check})"


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "T{}_H{}_E{}_K{}".format(*c))
def test_bench_unpermute(benchmark: Any, cfg: tuple[int, ...]) -> None:
    from nmoe.fast import dispatch as fd
    t, h, e, k = cfg
    p = fd.permute(_x(t, h), _ids(t, e, k), e, LAYER_ALIGN)
    rows = p.xp.shape[0]
    args = (p.xp, p.slot, t, k)
    compiled, note = try_compile(unpermute_torch, *args)
    check = mismatch(fd.unpermute(*args), unpermute_torch(*args))

    def fast() -> None:
        fd.unpermute(*args)

    def eager() -> None:
        unpermute_torch(*args)

    nbytes = 8.0 * rows + 4.0 * t * k * h
    measure_op(benchmark, "unpermute", _shape(cfg, R=rows, align=LAYER_ALIGN), nbytes, fast, eager,
               _compiled_step(compiled, *args), note, baseline_check=check or "ok")
    assert check is None, f"unpermute: nmoe and the torch baseline disagree ({check})"


def peer_row(name: str, shape: dict[str, int]) -> dict[str, Any] | None:
    """SonicMoE's row for (name, shape) from the results NMOE_BENCH_PEER names, if it is set (None also for a
    with-router row a results file from before those rows lacks)."""
    from sonicpeer import find_row

    path = os.environ.get("NMOE_BENCH_PEER")
    return None if not path else find_row(Path(path), name, shape)


@pytest.mark.parametrize("pass_", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("routing", ["uniform", "zipf"])
@pytest.mark.parametrize("cfg", LAYER_CONFIGS, ids=lambda c: "T{}_H{}_I{}_E{}_K{}".format(*c))
def test_bench_moe_layer(benchmark: Any, cfg: tuple[int, ...], routing: str, pass_: str) -> None:
    from nmoe.fast.moe import moe_layer
    t, h, _, e, k = cfg
    mc, p, x, leaves = layer_inputs(cfg, routing, LAYER_ALIGN)
    dout = torch.randn(t, h, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    dout = dout.to(torch.bfloat16)

    def fast() -> Any:
        if pass_ == "fwd":
            with torch.no_grad():
                return moe_layer(x, p, mc)[0]
        return torch.autograd.grad(moe_layer(x, p, mc)[0], leaves, dout)

    def torch_moe() -> Tensor:
        return torch_layer(x, p.router_w, p.router_bias, p.w13, p.w2, k, LAYER_ALIGN)

    def base() -> Any:
        if pass_ == "fwd":
            with torch.no_grad():
                return torch_moe()
        return torch.autograd.grad(torch_moe(), leaves, dout)

    with torch.no_grad():
        out, r = moe_layer(x, p, mc)
        got, want = out.float(), torch_moe().float()
        load = float(r.counts.max()) * e / (t * k)
    err = float((got - want).norm() / want.norm())
    del out, r, got, want
    check = f"relative error {err:.3g} against the torch layer (> 2e-2)" if err > 2e-2 else ""
    mem_fast, mem_base = peak_extra_bytes(fast), peak_extra_bytes(base)
    flops = layer_flops(cfg, pass_)
    graph = capture(fast)
    ms = replay_median_ms(graph)
    single_ms = cuda_median_ms(graph.replay, warmup=PEER_WARMUP, reps=PEER_REPS)
    eager_ms, host_ms = eager_call_ms(fast)
    torch_base = baseline("torch_grouped_mm", base)
    torch_base["tflops"] = None if torch_base["ms"] is None else flops / (torch_base["ms"] * 1e-3) / 1e12
    torch_base["peak_extra_GiB"] = mem_base / 2**30
    torch_base["eager_ms"], torch_base["eager_host_ms"] = eager_call_ms(base)
    shape = dict(zip(("T", "H", "I", "E", "K"), cfg, strict=True))
    pick = None if torch_base["ms"] is None else ("torch_grouped_mm", float(torch_base["ms"]))
    row = record(f"moe_layer_{pass_}_{routing}", shape, ms, flops=flops, baseline=pick)
    sonic = peer_row(peer_name(routing, pass_, False), shape)
    own = peer_row(peer_name(routing, pass_, True), shape) if routing == "uniform" else None
    if sonic is not None:
        sonic["eager_ms_ratio"] = sonic["ms"] / eager_ms
        row["vs_sonicmoe"] = vs_peer(sonic, ms, single_ms, mem_fast / 2**30, cfg in LAYER_CONFIGS[:3], pass_)
    if own is not None:
        row["vs_sonicmoe_with_router"] = vs_peer(own, ms, single_ms, mem_fast / 2**30, False, pass_)
    peers = [r for r in (sonic, own) if r is not None]
    row.update(routing=routing, max_over_mean_load=load, baselines=[torch_base, *peers],
               peak_extra_GiB=mem_fast / 2**30, single_call_ms=single_ms, eager_ms=eager_ms,
               eager_host_ms=host_ms, host_frac_of_gpu=host_ms / ms,
               sonicmoe="in baselines (its eager_ms_ratio is its time over our eager time)" if sonic else
               "not run: SonicMoE runs in its own process (bench/sonicpeer.py); set NMOE_BENCH_PEER to its "
               "results", baseline_check=check or "ok")
    row["breakdown"] = profile_step(lambda phase: fast())

    def replays(phase: Any) -> None:
        for _ in range(REPLAYS):
            graph.replay()

    row["breakdown_replayed"] = profile_step(replays, calls=REPLAYS)
    benchmark.extra_info.update(row)

    def run() -> None:
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    assert not check, check


@pytest.mark.parametrize("pass_", ["fwd", "wgrad"])
@pytest.mark.parametrize("cfg", LAYER_CONFIGS, ids=lambda c: "T{}_H{}_I{}_E{}_K{}".format(*c))
def test_bench_moe_up_gathered(benchmark: Any, cfg: tuple[int, ...], pass_: str) -> None:
    """The layer's up projection (fwd: h and act(h); wgrad: dw_up) reading x's rows by index, against
    permute's [R, H] copy then the TMA kernel, same run: what the gather buys in time and peak memory.
    FLOPs 2*R*2I*H over the padded rows R (pad rows are multiplied too)."""
    from nmoe.fast.dispatch import permute
    from nmoe.fast.gemm import sm90

    t, h, i, e, k = cfg
    _, p, x, _ = layer_inputs(cfg, "uniform", LAYER_ALIGN)
    assert p.w13 is not None
    x, w = x.detach(), p.w13.detach()
    ids = _ids(t, e, k)
    route = permute(x.new_empty(t, 0), ids, e, LAYER_ALIGN)
    rows = route.slot.shape[0]
    dh = torch.randn(rows, 2 * i, device="cuda", dtype=torch.bfloat16)
    if pass_ == "fwd":
        def gathered() -> object:
            return sm90.grouped_gemm_act_gathered(x, route.slot, k, w, route.offs, "swiglu")

        def copied() -> object:
            return sm90.grouped_gemm_act_h(permute(x, ids, e, LAYER_ALIGN).xp, w, route.offs, "swiglu")
    else:
        def gathered() -> object:
            return sm90.grouped_gemm_wgrad_gathered(dh, x, route.slot, k, route.offs)

        def copied() -> object:
            return sm90.grouped_gemm_wgrad(dh, permute(x, ids, e, LAYER_ALIGN).xp, route.offs)
    got, want = gathered(), copied()
    outs = zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
               strict=True)
    check = "; ".join(m for a, b in outs if (m := mismatch(a, b)) is not None) or "ok"
    del got, want
    ms = replay_median_ms(capture(gathered))
    base = baseline("permute copy + TMA kernel", copied)
    row = record(f"moe_up_gathered_{pass_}", _shape((t, h, e, k), I=i, R=rows), ms,
                 flops=2.0 * rows * 2 * i * h, baseline=("permute copy + TMA kernel", base["ms"]))
    row.update(check=check, peak_extra_gb=peak_extra_bytes(gathered) / 2**30,
               baseline_peak_extra_gb=peak_extra_bytes(copied) / 2**30)
    benchmark.extra_info.update(row)
    graph = capture(gathered)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=3, iterations=1,
                       warmup_rounds=1)
    assert check == "ok", f"moe_up_gathered_{pass_}: gathered and copied results differ ({check})"
