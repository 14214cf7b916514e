"""The power cap in a timing: the MoE layer's fwd+bwd and a same-FLOP mm (`--what up_wgrad`: its up wgrad,
gathered and copy-fed) cold and back-to-back, beside nvidia-smi's SM clock, power and throttle reasons.
`python -m bench.clocks --out F.json [--config N] [--what W] [--routing R --align A]`; SonicMoE: sonicpeer."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SMI_QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
SMI_PERIOD_MS = 20
IDLE_S = 3.0
COLD_TRIALS = 3


def parse_smi(lines: Iterable[str]) -> list[tuple[float, float, float, str]]:
    """(unix seconds, SM MHz, watts, throttle reasons) per `nvidia-smi --query-gpu=SMI_QUERY` csv line."""
    from datetime import datetime

    rows = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5 or not parts[1].replace(".", "").isdigit():
            continue
        t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, float(parts[1]), float(parts[2]), parts[4]))
    return rows


def window(samples: Sequence[tuple[float, float, float, str]],
           spans: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Median SM clock and power of the samples inside any of the (start, end) spans, and the throttle
    reasons seen there."""
    inside = [s for s in samples if any(a <= s[0] <= b for a, b in spans)]
    if not inside:
        return {"samples": 0, "sm_mhz": None, "power_w": None, "throttle_reasons": []}
    return {"samples": len(inside), "sm_mhz": statistics.median(s[1] for s in inside),
            "power_w": statistics.median(s[2] for s in inside),
            "throttle_reasons": sorted({s[3] for s in inside})}


def _series(fn: Callable[[], object], calls: int) -> list[float]:
    import torch

    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(calls)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in events]


def _probe(fn: Callable[[], object], flops: float,
           calls: int) -> tuple[dict[str, Any], list[tuple[str, float, float]]]:
    """Cold single calls after idle pauses, then `calls` back-to-back: the timings, and the host spans."""
    cold, spans = [], []
    for _ in range(COLD_TRIALS):
        time.sleep(IDLE_S)
        t0 = time.time()
        cold.append(_series(fn, 1)[0])
        spans.append(("cold", t0, time.time()))
    time.sleep(IDLE_S)
    t0 = time.time()
    held = _series(fn, calls)
    spans.append(("sustained", t0 + (time.time() - t0) / 2, time.time()))
    late = statistics.median(held[calls // 2:])
    row = {"cold_ms": cold, "sustained_ms": held, "cold_median_ms": statistics.median(cold),
           "sustained_median_ms": late, "slowdown": late / statistics.median(cold),
           "cold_tflops": flops / statistics.median(cold) / 1e9, "sustained_tflops": flops / late / 1e9}
    return row, spans


def clocked(steps: dict[str, Callable[[], object]], flops: float, calls: int,
            log: Path) -> dict[str, Any]:
    """_probe each step under nvidia-smi sampled into `log`; each row gains `clocks`, the median SM clock,
    power and throttle reasons over its cold calls and over the later half of its back-to-back ones."""
    rows: dict[str, Any] = {}
    spans: dict[str, list[tuple[str, float, float]]] = {}
    with log.open("w") as f:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits",
                                "-lms", str(SMI_PERIOD_MS)], stdout=f)
        try:
            for name, step in steps.items():
                rows[name], spans[name] = _probe(step, flops, calls)
        finally:
            time.sleep(0.5)
            smi.terminate()
            smi.wait()
    samples = parse_smi(log.read_text().splitlines())
    for name, row in rows.items():
        row["clocks"] = {kind: window(samples, [(t0, t1) for k_, t0, t1 in spans[name] if k_ == kind])
                         for kind in ("cold", "sustained")}
    return rows


def write(out: Path, command: str, cfg: Sequence[int], flops: float, rows: dict[str, Any],
          **extra: Any) -> None:
    """The clocks document (provenance, shape, flops, rows) at `out`, and one line per row on stdout."""
    from nmoe.provenance import provenance

    doc = {"provenance": provenance(command), "shape": dict(zip(("T", "H", "I", "E", "K"), cfg, strict=True)),
           "flops": flops, **extra, "idle_s": IDLE_S, "smi_period_ms": SMI_PERIOD_MS,
           "note": "cold: one call after an idle pause; sustained: the median of the later half of "
                   "back-to-back calls, clocks sampled over that half", "rows": rows}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for name, row in rows.items():
        print(f"{name}: cold {row['cold_median_ms']:.2f} ms, sustained {row['sustained_median_ms']:.2f} ms "
              f"(x{row['slowdown']:.3f}); clocks {row['clocks']}")


def _layer_steps(cfg: Sequence[int]) -> tuple[float, dict[str, Callable[[], object]], dict[str, Any]]:
    """The MoE layer's fwd+bwd and one cuBLAS mm of its FLOPs, each a captured graph's replay."""
    import torch
    from conftest import capture
    from torchbase import LAYER_ALIGN, layer_flops, layer_inputs

    from nmoe.fast.moe import moe_layer

    t, h = cfg[0], cfg[1]
    mc, prm, x, leaves = layer_inputs(tuple(cfg), "uniform", LAYER_ALIGN)
    dout = torch.randn(t, h, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    dout = dout.to(torch.bfloat16)
    flops = layer_flops(tuple(cfg), "fwd_bwd")
    n = 8192
    a = torch.randn(round(flops / (2 * n * n)), n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    steps: dict[str, Callable[[], object]] = {
        "moe_layer_fwd_bwd": lambda: torch.autograd.grad(moe_layer(x, prm, mc)[0], leaves, dout),
        "cublas_mm_same_flops": lambda: a @ b,
    }
    graphs = {name: capture(step).replay for name, step in steps.items()}
    return flops, graphs, {"mm_shape": [a.shape[0], n, n], "align": LAYER_ALIGN, "timing": "cuda_graph"}


def _up_wgrad_steps(cfg: Sequence[int], routing: str,
                    align: int) -> tuple[float, dict[str, Callable[[], object]], dict[str, Any]]:
    """gatherprobe.wgrad_calls on the named routing and align (by default the inputs gatherprobe gives ncu),
    each a graph replay."""
    from conftest import capture
    from gatherprobe import wgrad_calls

    calls, flops = wgrad_calls(tuple(cfg), routing, align)
    graphs = {f"up_wgrad_{name}": capture(call).replay for name, call in calls.items()}
    return flops, graphs, {"routing": routing, "align": align, "timing": "cuda_graph"}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.clocks", description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--config", type=int, default=0)
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--what", choices=("layer", "up_wgrad"), default="layer")
    p.add_argument("--routing", default="uniform", help="up_wgrad: a gatherprobe routing")
    p.add_argument("--align", type=int, default=0, help="up_wgrad: permute's align (default: the layer's)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    from torchbase import LAYER_ALIGN, LAYER_CONFIGS

    cfg = LAYER_CONFIGS[args.config]
    if args.what == "layer":
        flops, steps, extra = _layer_steps(cfg)
    else:
        flops, steps, extra = _up_wgrad_steps(cfg, args.routing, args.align or LAYER_ALIGN)
    rows = clocked(steps, flops, args.calls, args.out.with_suffix(".smi.csv"))
    write(args.out, "python -m bench.clocks " + " ".join(argv or sys.argv[1:]), cfg, flops, rows, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
