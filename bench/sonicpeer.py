"""SonicMoE on the MoE layer rows, in its own process (it pins another CuTeDSL): `python bench/sonicpeer.py
--out FILE` with SonicMoE's site on PYTHONPATH; `nmoe bench` with NMOE_BENCH_PEER=FILE puts each row beside
ours. Same weights, x, dout and routing as bench/test_bench_moe.py; the routing is given, not timed, and on
uniform rows (router bias zero: its softmax top-k picks our sigmoid's experts) also its own router, timed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stepprofile import profile_step
from torchbase import LAYER_ALIGN, LAYER_CONFIGS, layer_flops, layer_inputs, router_topk_torch

from nmoe.layout import MoEParams

WARMUP, REPS = 3, 10
GOAL_VS_PEER = 1.1
ROUTINGS = ("uniform", "zipf")
PASSES = ("fwd", "fwd_bwd")
_RUN = ("peer", "version", "torch", "gpu")
"""What a results file says ran where, beside its rows."""


def row_key(name: str, shape: dict[str, int]) -> str:
    """How a peer row finds ours: the row name and its (T, H, I, E, K)."""
    return name + "|" + ",".join(f"{k}={shape[k]}" for k in ("T", "H", "I", "E", "K"))


def find_row(path: Path, name: str, shape: dict[str, int]) -> dict[str, Any] | None:
    """The peer's row for (name, shape) in a results file of this script, without its lookup key."""
    rows = {r["key"]: r for r in json.loads(path.read_text())["rows"]}
    found = rows.get(row_key(name, shape))
    return None if found is None else {k: v for k, v in found.items() if k != "key"}


def vs_peer(peer: dict[str, Any], ms: float, single_ms: float, mem_gib: float, goal: bool,
            pass_: str) -> dict[str, Any]:
    """Speedups over SonicMoE under matched timing: sustained (back-to-back calls per sample, our rows' ms)
    and single (one call per sample, the peer's ms); on its configs the goal needs both, and for fwd_bwd the
    extra peak memory (the issue's memory goal is one fwd+bwd's)."""
    held = peer.get("sustained_ms")
    out: dict[str, Any] = {"sustained": None if held is None else held / ms}
    out.update(single_call=peer["ms"] / single_ms, memory_ratio=mem_gib / peer["peak_extra_GiB"])
    if goal:
        mem_ok = pass_ != "fwd_bwd" or out["memory_ratio"] <= 1
        met = None if held is None else min(out["sustained"], out["single_call"]) >= GOAL_VS_PEER and mem_ok
        out["goal"] = {"min_speedup": GOAL_VS_PEER, "max_memory_ratio": 1.0 if pass_ == "fwd_bwd" else None,
                       "met": met}
    return out


def peer_name(routing: str, pass_: str, with_router: bool) -> str:
    """The row name of a peer case; with_router rows route by the peer's own router (uniform only)."""
    return f"moe_layer_{pass_}_{routing}" + ("_with_router" if with_router else "")


def _given_routing(x: torch.Tensor, p: MoEParams, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of a row's routing from its router weight and bias, as ours routes it (not timed)."""
    with torch.no_grad():
        return router_topk_torch(x.float() @ p.router_w.float().T, p.router_bias, k)


def _step(cfg: tuple[int, ...], routing: str, pass_: str, with_router: bool) -> Callable[[], object]:
    """SonicMoE's layer on the row's inputs, given the row's routing or (with_router) routing by its own
    softmax top-k router, whose weight then gets a gradient as ours does: forward, or forward and backward."""
    if with_router and routing != "uniform":
        raise ValueError(f"sonicpeer: its router has no bias, so it can route only the uniform rows, not "
                         f"{routing!r}")
    from sonicmoe import moe_general_routing_inputs, moe_TC_softmax_topk_layer
    from sonicmoe.enums import ActivationType

    t, h, _, e, k = cfg
    _, p, x, _ = layer_inputs(cfg, routing, LAYER_ALIGN)
    assert p.w13 is not None
    w1, w2 = p.w13.permute(1, 2, 0), p.w2.permute(1, 2, 0)
    dout = torch.randn(t, h, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    dout = dout.to(torch.bfloat16).contiguous()
    stream = torch.cuda.current_stream().cuda_stream
    inference = pass_ == "fwd"
    run: Callable[[], tuple[torch.Tensor, ...]]
    if with_router:
        leaves = [x, p.router_w, p.w13, p.w2]
        run = partial(moe_TC_softmax_topk_layer, x, p.router_w, w1, None, w2, None, k, stream,
                      ActivationType.SWIGLU, inference)
    else:
        weights, ids = _given_routing(x, p, k)
        scores = weights.reshape(-1).contiguous()
        tokens = torch.arange(t, device="cuda", dtype=torch.int32).repeat_interleave(k)
        experts = ids.reshape(-1).to(torch.int32)
        leaves = [x, p.w13, p.w2]
        run = partial(moe_general_routing_inputs, x, scores, tokens, experts, w1, None, w2, None, e, stream,
                      ActivationType.SWIGLU, inference)

    def step() -> object:
        if pass_ == "fwd":
            with torch.no_grad():
                return run()[0]
        return torch.autograd.grad(run()[0], leaves, dout)

    return step


def _row(cfg: tuple[int, ...], routing: str, pass_: str, with_router: bool) -> dict[str, Any]:
    from conftest import cuda_median_ms, peak_extra_bytes, sustained_ms  # bench/conftest.py, beside this

    t, h, i, e, k = cfg
    step = _step(cfg, routing, pass_, with_router)
    ms = cuda_median_ms(step, warmup=WARMUP, reps=REPS)
    held = sustained_ms(step)
    flops = layer_flops(cfg, pass_)
    shape = {"T": t, "H": h, "I": i, "E": e, "K": k}
    how = ("moe_TC_softmax_topk_layer routing by its own router (router logits, top-k and their backward "
           "timed)" if with_router else "moe_general_routing_inputs with the rows' routing given (router not "
           "timed)")
    return {"key": row_key(peer_name(routing, pass_, with_router), shape),
            "name": "sonicmoe_with_router" if with_router else "sonicmoe", "ms": ms,
            "tflops": flops / (ms * 1e-3) / 1e12,
            "sustained_ms": held, "sustained_tflops": flops / (held * 1e-3) / 1e12,
            "peak_extra_GiB": peak_extra_bytes(step) / 2**30, "timing": "eager",
            "breakdown": profile_step(lambda phase: step()),
            "note": f"{how}; ms: median of {REPS} warm calls, one per L2-flushed sample; sustained_ms: "
                    "back-to-back calls per sample, as our rows' ms; breakdown: one profiled call's kernels, "
                    "as our rows'"}


def wgrad_probe(cfg: tuple[int, ...]) -> None:
    """SonicMoE's up-projection wgrad (x gathered on M, its own call) on the row's uniform routing: warm
    calls, then one inside the NVTX range "probe", for ncu --nvtx --nvtx-include probe/."""
    from conftest import nvtx_probe  # bench/conftest.py, beside this
    from sonicmoe.functional.backward import _up_projection_backward_weight

    t, _, i, e, k = cfg
    _, p, x, _ = layer_inputs(cfg, "uniform", LAYER_ALIGN)
    _, ids = _given_routing(x, p, k)
    experts = ids.reshape(-1)
    rows = (torch.argsort(experts, stable=True) // k).to(torch.int32)
    offs = torch.zeros(e + 1, dtype=torch.int32, device="cuda")
    offs[1:] = torch.bincount(experts, minlength=e).cumsum(0)
    dh = torch.randn(t * k, 2 * i, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    dh = dh.to(torch.bfloat16)
    dw1 = torch.empty_like(p.w13.detach().permute(1, 2, 0))
    x = x.detach()
    nvtx_probe(partial(_up_projection_backward_weight, x, dw1, dh, offs, rows, True))


def clock_probe(cfg: tuple[int, ...], out: Path, calls: int, command: str) -> None:
    """SonicMoE's fwd+bwd on the row's uniform routing (given) as bench.clocks times ours, but eager: cold
    calls after idle pauses and back-to-back ones, beside nvidia-smi's SM clock, power and throttling."""
    import sonicmoe
    from clocks import clocked, write  # bench/clocks.py, beside this

    step = _step(cfg, "uniform", "fwd_bwd", False)
    step()
    torch.cuda.synchronize()
    flops = layer_flops(cfg, "fwd_bwd")
    rows = clocked({"sonicmoe_fwd_bwd": step}, flops, calls, out.with_suffix(".smi.csv"))
    write(out, command, cfg, flops, rows, peer=f"sonicmoe {sonicmoe.__version__}", timing="eager")


def _write(out: Path, doc: dict[str, Any]) -> None:
    out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    print(f"sonicpeer: wrote {out}: {len(doc['rows'])} rows")


def merge(parts: list[Path], out: Path) -> int:
    """One results file from the per-config processes' files; they must agree on what ran where."""
    docs = [json.loads(p.read_text()) for p in parts]
    for p, d in zip(parts[1:], docs[1:], strict=True):
        if any(d[k] != docs[0][k] for k in _RUN):
            raise SystemExit(f"sonicpeer --merge: {p} ran {[d[k] for k in _RUN]}, {parts[0]} "
                             f"{[docs[0][k] for k in _RUN]}; merge only one peer's runs on one GPU")
    rows = [r for d in docs for r in d["rows"]]
    keys = [r["key"] for r in rows]
    if len(set(keys)) != len(keys):
        raise SystemExit(f"sonicpeer --merge: a row appears twice in {[str(p) for p in parts]}")
    _write(out, {**{k: docs[0][k] for k in _RUN}, "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sonicpeer", description=__doc__)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--config", type=int, action="append", choices=range(len(LAYER_CONFIGS)),
                    help="time layer config I (repeatable; default: all, SonicMoE's three first); each "
                    "compiles for minutes, so one process per config can compile them side by side")
    ap.add_argument("--go", type=Path, help="compile every row first, then time only once this file exists "
                    "(so the minutes of compilation can overlap other work and the timing cannot)")
    ap.add_argument("--merge", type=Path, nargs="+", help="write these results' rows (one process per "
                    "--config, same peer and GPU) into --out as one file, timing nothing")
    ap.add_argument("--wgrad-probe", type=int, choices=range(len(LAYER_CONFIGS)), help="run SonicMoE's "
                    "up-projection wgrad on config I under the NVTX range 'probe' (for ncu) and time nothing")
    ap.add_argument("--clocks", type=int, choices=range(len(LAYER_CONFIGS)), help="time SonicMoE's "
                    "fwd+bwd on config I cold and back-to-back beside nvidia-smi's clocks, as python -m "
                    "bench.clocks does ours, into --out")
    ap.add_argument("--calls", type=int, default=60, help="with --clocks: back-to-back calls")
    args = ap.parse_args(argv)
    if args.wgrad_probe is not None:
        wgrad_probe(LAYER_CONFIGS[args.wgrad_probe])
        return 0
    if args.out is None:
        ap.error("--out is required unless --wgrad-probe")
    if args.merge:
        return merge(args.merge, args.out)
    if args.clocks is not None:
        clock_probe(LAYER_CONFIGS[args.clocks], args.out, args.calls,
                    "bench/sonicpeer.py " + " ".join(sys.argv[1:] if argv is None else argv))
        return 0
    import sonicmoe

    configs = [LAYER_CONFIGS[i] for i in args.config] if args.config else LAYER_CONFIGS
    cases = [(cfg, r, p, own) for cfg in configs for r in ROUTINGS for p in PASSES
             for own in ((False, True) if r == "uniform" else (False,))]
    t0 = time.monotonic()
    if args.go is not None:
        for case in cases:
            _step(*case)()
            torch.cuda.synchronize()
            print(f"sonicpeer: compiled {case} at {time.monotonic() - t0:.0f} s", flush=True)
        torch.cuda.empty_cache()
        print("sonicpeer: compiled; waiting for", args.go, flush=True)
        while not args.go.exists():
            time.sleep(1)
    rows = []
    for case in cases:
        rows.append(_row(*case))
        print(f"sonicpeer: {case} {rows[-1]['ms']:.3f} ms at {time.monotonic() - t0:.0f} s", flush=True)
    run = ("sonicmoe", sonicmoe.__version__, torch.__version__, torch.cuda.get_device_name())
    _write(args.out, {**dict(zip(_RUN, run, strict=True)), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
