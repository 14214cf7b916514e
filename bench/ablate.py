"""Where grouped-GEMM and MoE-layer time goes: each ablation of bench.ablations (named source edits) is timed
in its own copy of the tree against the unedited baseline of the same run. Compiles run in parallel,
timings one at a time. Usage (GPU): python -m bench.ablate [--set SET] --out FILE.json."""

from __future__ import annotations

import argparse
import faulthandler
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from bench.ablations import SETS, variants_of
from mutations.execute import child_env, copy_tree
from mutations.model import apply

ROOT = Path(__file__).resolve().parents[1]
PASSES = ("fwd", "dgrad", "wgrad")
LAYER_PASSES = ("fwd", "fwd_bwd")
SHAPES: tuple[tuple[int, int, int, int, int], ...] = (
    (32768, 4096, 1024, 128, 8), (24576, 1536, 256, 128, 8), (32768, 4096, 512, 256, 8),
)


PROGRESS_ENV = "NMOE_ABLATE_PROGRESS"
ROW_TIMEOUT_ENV = "NMOE_ABLATE_ROW_TIMEOUT"


def _note(what: str) -> None:
    """Appends `what` under the copy's name to the run's progress file: a hung kernel's row shows there. With
    a row timeout the child exits, its stacks dumped, if the row outlasts it (a kernel wait never returns)."""
    if path := os.environ.get(PROGRESS_ENV):
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {Path.cwd().name} {what}\n")
    if seconds := os.environ.get(ROW_TIMEOUT_ENV):
        faulthandler.dump_traceback_later(float(seconds), exit=True)


def _problems() -> list[tuple[str, int, int, int, int]]:
    """(label, M, N, K, E) of the up (N = 2I, K = H) and down (N = H, K = I) projections, uniform routing."""
    out = []
    for t, h, i, e, k in SHAPES:
        out.append((f"up T={t} H={h} I={i} E={e}", t * k, 2 * i, h, e))
        out.append((f"down T={t} H={h} I={i} E={e}", t * k, h, i, e))
    return out


ROUTINGS = ("uniform", "zipf1.2")


def _offs(m: int, e: int, routing: str = "uniform") -> Any:
    """Group ends of m rows over e experts, sized as the grouped GEMM bench routes them."""
    import torch

    from bench.gemmplan import routed_counts

    return torch.tensor(routed_counts(m, e, routing), dtype=torch.int64).cumsum(0).to(torch.int32).cuda()


def _time(pass_: str, m: int, n: int, k: int, e: int, compile_only: bool, routing: str = "uniform") -> float:
    """One pass of the problem: fwd x[m,k] w[e,n,k]; dgrad dy[m,n] w; wgrad dy x."""
    import torch

    from bench.conftest import capture, replay_median_ms
    from nmoe.fast import gemm

    offs = _offs(m, e, routing)

    fn, (shape_a, shape_b) = {"fwd": (gemm.grouped_gemm, ((m, k), (e, n, k))),
                              "dgrad": (gemm.grouped_gemm_dgrad, ((m, n), (e, n, k))),
                              "wgrad": (gemm.grouped_gemm_wgrad, ((m, n), (m, k)))}[pass_]
    a, b = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in (shape_a, shape_b))
    _note(f"{pass_} {routing} m={m} n={n} k={k} e={e}")
    if compile_only:
        fn(a, b, offs)
        torch.cuda.synchronize()
        return 0.0
    return replay_median_ms(capture(lambda: fn(a, b, offs)))


def _fp8_rows(compile_only: bool) -> list[dict[str, Any]]:
    """The fp8 fwd (x 1x128, w 128x128 blocks, quantized before timing) of each problem, uniform and
    Zipf(1.2) routing (the grouped GEMM bench's group sizes)."""
    import torch

    from bench.conftest import capture, replay_median_ms
    from nmoe.constants import MXFP8_BLOCK_SM90
    from nmoe.fast import formats, gemm

    out = []
    for label, m, n, k, e in _problems():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
        xq, xs = formats.quantize_mxfp8(x, MXFP8_BLOCK_SM90)
        wq, ws = formats.quantize_mxfp8_weight(w)
        del x, w
        for routing in ROUTINGS:
            args = (xq, xs, wq, ws, _offs(m, e, routing))
            _note(f"fp8 fwd {routing} {label}")
            gemm.grouped_gemm_fp8(*args)
            torch.cuda.synchronize()
            if not compile_only:
                ms = replay_median_ms(capture(partial(gemm.grouped_gemm_fp8, *args)))
                out.append({"shape": f"fp8 fwd {routing} {label}", "ms": ms,
                            "tflops": 2.0 * m * n * k / ms / 1e9, "bn": 128})
    return out


def _gather_rows(t: int, h: int, i: int, e: int, k: int, compile_only: bool) -> list[dict[str, Any]]:
    """The up projection (swiglu; h kept, or gathered act(h) alone as the forward with no backward) and its
    x-side wgrad, uniform routing, weights at the layer's init scale: A gathered from x's token rows, from
    permute's copy in row order (in_order), or by TMA from the copy (copied; also on rows split evenly, no pad
    rows, as in the gemm bench); the wgrad also with x on the 128-wide M side (x_on_m: read 2I / 256 times
    instead of 2I / 128), its x^T @ dy as is or stored transposed as the layer needs it (x_on_m_t); and the
    down dgrad gathered from dout."""
    import torch

    from bench.conftest import capture, replay_median_ms
    from nmoe.fast.dispatch import permute
    from nmoe.fast.gemm import sm90

    align, gen = 128, torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h**-0.5).to(torch.bfloat16)
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices
    p = permute(x, ids, e, align)
    rows = p.slot.shape[0]
    in_order = torch.where(p.slot >= 0, torch.arange(rows, device="cuda") * k, -1)
    dh = torch.randn(rows, 2 * i, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_down = (torch.randn(e, h, i, device="cuda", generator=gen) * i**-0.5).to(torch.bfloat16)
    dy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    # The gemm bench's own act operands: rows split evenly, no pad rows.
    even = _offs(t * k, e)
    x_even = torch.randn(t * k, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    runs = {
        "up_gathered": lambda: sm90.grouped_gemm_act_gathered(x, p.slot, k, w, p.offs, "swiglu"),
        "up_in_order": lambda: sm90.grouped_gemm_act_gathered(p.xp, in_order, k, w, p.offs, "swiglu"),
        "up_copied": lambda: sm90.grouped_gemm_act_h(p.xp, w, p.offs, "swiglu"),
        "up_copied_even": lambda: sm90.grouped_gemm_act_h(x_even, w, even, "swiglu"),
        "up_gathered_act_only": lambda: sm90.grouped_gemm_act_gathered(x, p.slot, k, w, p.offs, "swiglu",
                                                                       keep_h=False),
        "wgrad_gathered": lambda: sm90.grouped_gemm_wgrad_gathered(dh, x, p.slot, k, p.offs),
        "wgrad_copied": lambda: sm90.grouped_gemm_wgrad(dh, p.xp, p.offs),
        "wgrad_gathered_x_on_m": lambda: sm90.grouped_gemm_wgrad_gathered(x, dh, p.slot, k, p.offs, "dy"),
        "wgrad_gathered_x_on_m_t": lambda: sm90.grouped_gemm_wgrad_gathered(dh, x, p.slot, k, p.offs,
                                                                            transposed=True),
        "wgrad_copied_x_on_m": lambda: sm90.grouped_gemm_wgrad(p.xp, dh, p.offs),
        "down_dgrad_gathered": lambda: sm90.grouped_gemm_dgrad_gathered(dy, p.slot, k, w_down, p.offs),
    }
    out = []
    for name, fn in runs.items():
        _note(f"{name} T={t} H={h} I={i} E={e}")
        fn()
        torch.cuda.synchronize()
        if not compile_only:
            ms = replay_median_ms(capture(fn))
            width = i if name.startswith("down") else 2 * i
            bn = sm90.schedule("up", width, h, gathered=not name.startswith("up_copied"))[0]
            m = t * k if name.endswith("_even") else rows
            out.append({"shape": f"{name} T={t} H={h} I={i} E={e}", "ms": ms,
                        "tflops": 2.0 * m * width * h / ms / 1e9, "bn": bn})
    return out


def _layer_step(cfg: tuple[int, ...], routing: str, pass_: str) -> Any:
    """One call of the fast MoE layer on the bench's seeded inputs (fwd under no_grad, or fwd+bwd)."""
    import torch

    from bench.torchbase import LAYER_ALIGN, layer_inputs
    from nmoe.fast.moe import moe_layer

    mc, p, x, leaves = layer_inputs(cfg, routing, LAYER_ALIGN)
    dout = torch.randn(cfg[0], cfg[1], device="cuda", dtype=torch.bfloat16)

    def step() -> Any:
        if pass_ == "fwd":
            with torch.no_grad():
                return moe_layer(x, p, mc)[0]
        return torch.autograd.grad(moe_layer(x, p, mc)[0], leaves, dout)

    return step


def _step_rows(compile_only: bool) -> list[dict[str, Any]]:
    """moonlet's training step at 2 x 4096 tokens as `nmoe train` runs it with train.cuda_graph: forward and
    backward replayed as one graph, clip, AdamW and the bias update eager (FLOPs as the trainer counts)."""
    import torch

    from bench.conftest import cuda_median_ms
    from bench.stepprofile import graphed_step, one_microbatch, random_batch, trainer_model
    from nmoe.train.loop import flops_per_token

    cfg = one_microbatch(2)
    model, opt = trainer_model(cfg)
    inputs, targets = random_batch(cfg)
    b, s = cfg.data.batch_size, cfg.data.seq_len
    shape = f"train_step moonlet B={b} S={s} graphed"
    _note(shape)
    step = graphed_step(model, opt, cfg, inputs, targets)
    step()
    torch.cuda.synchronize()
    if compile_only:
        return []
    ms = cuda_median_ms(step, warmup=3, reps=10)
    return [{"shape": shape, "ms": ms, "tflops": flops_per_token(model, cfg) * b * s / ms / 1e9, "bn": 0}]


def _picked(rows: Sequence[Any], configs: str) -> list[Any]:
    """The rows at the comma-separated indices of `configs` (all when empty), in its order."""
    if not configs:
        return list(rows)
    return [rows[int(i)] for i in configs.split(",")]


def _layer_rows(compile_only: bool, configs: str = "",
                passes: Sequence[str] = LAYER_PASSES) -> list[dict[str, Any]]:
    """The fast MoE layer's fwd and/or fwd+bwd per LAYER_CONFIGS row (those picked) and routing, as nmoe bench
    times it (CUDA graph replays of the bench's seeded inputs; FLOPs 6 T I H K and 18 T I H K)."""
    import torch

    from bench.conftest import capture, peak_extra_bytes, replay_median_ms
    from bench.torchbase import LAYER_CONFIGS, layer_flops

    out = []
    for cfg in _picked(LAYER_CONFIGS, configs):
        t, h, i, _, k = cfg
        for routing in ("uniform", "zipf"):
            for pass_ in passes:
                step = _layer_step(cfg, routing, pass_)
                _note(f"{pass_} {routing} T={t} H={h} I={i} K={k}")
                step()
                torch.cuda.synchronize()
                if not compile_only:
                    mem = peak_extra_bytes(step) / 2**30
                    ms = replay_median_ms(capture(step))
                    flops = layer_flops(cfg, pass_)
                    out.append({"shape": f"{pass_} {routing} T={t} H={h} I={i} K={k}", "ms": ms,
                                "tflops": flops / ms / 1e9, "bn": 0, "peak_extra_GiB": mem})
                del step
                torch.cuda.empty_cache()
    return out


def child(compile_only: bool, which: str, passes: Sequence[str] = PASSES,
          routings: Sequence[str] = ("uniform",), configs: str = "") -> None:
    from nmoe.fast.gemm.sm90 import pick_bn, schedule

    timed = {"layer": lambda: _layer_rows(compile_only, configs, passes),
             "fp8": lambda: _fp8_rows(compile_only), "step": lambda: _step_rows(compile_only),
             "gather": lambda: [r for shape in _picked(SHAPES, configs)
                                for r in _gather_rows(*shape, compile_only)]}
    if which in timed:
        for row in timed[which]():
            print(json.dumps(row), flush=True)
        return
    for label, m, n, k, e in _problems():
        for pass_, routing in itertools.product(passes, routings):
            ms = _time(pass_, m, n, k, e, compile_only, routing)
            if not compile_only:
                width = n if pass_ == "fwd" else k
                named = pass_ if routing == "uniform" else f"{pass_} {routing}"
                row = {"shape": f"{named} {label}", "ms": ms, "tflops": 2.0 * m * n * k / ms / 1e9,
                       "bn": pick_bn(k) if pass_ == "wgrad" else schedule(pass_, width, n + k - width)[0]}
                print(json.dumps(row), flush=True)


def _run(copy: Path, compile_only: bool, which: str, passes: str, routings: str,
         configs: str, progress: Path | None = None, row_timeout: float = 0) -> subprocess.Popen[str]:
    env = child_env(copy, "gpu", 2)
    env["NMOE_KERNEL_CACHE"] = str(copy.parent / ".kernels")
    if progress is not None:
        env[PROGRESS_ENV] = str(progress.resolve())
    if row_timeout > 0:
        env[ROW_TIMEOUT_ENV] = str(row_timeout)
    cmd = [sys.executable, "-m", "bench.ablate", "--child", "--set", which, "--passes", passes,
           "--routings", routings, "--configs", configs]
    cmd += ["--compile-only"] if compile_only else []
    return subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ablate", description=__doc__)
    p.add_argument("--out", type=Path, help="JSON file for the timings")
    p.add_argument("--only", default="", help="comma-separated ablation ids (default: all)")
    p.add_argument("--progress", type=Path,
                   help="file each child appends its copy's name and every row to as it starts the row, "
                   "compiling and timing (default: --out with suffix .progress), so a hung kernel is named")
    p.add_argument("--set", default="gemm", choices=tuple(SETS),
                   help="gemm: the TMA kernels' ablations; gather: the gathering up projection and wgrad; "
                   "layer: the fast MoE layer's choices, timed as the layer; fp8: the fp8 fwd's schedule; "
                   "step: moonlet's graphed training step (about 70 GB apiece: one compile child at a time)")
    p.add_argument("--passes", default="",
                   help="gemm set: comma-separated passes of fwd,dgrad,wgrad (default: all); layer set: of "
                   "fwd,fwd_bwd (default: both; fwd_bwd alone skips the no-grad forward's kernels)")
    p.add_argument("--routings", default="uniform",
                   help=f"gemm set: comma-separated group sizings of {ROUTINGS} (default: uniform)")
    p.add_argument("--configs", default="",
                   help="layer and gather sets: comma-separated indices of their rows (LAYER_CONFIGS, "
                   "SHAPES) to time (default: all), so a short run can time the deciding row first")
    p.add_argument("--jobs", type=int, default=0,
                   help="variants compiling at once after the baseline (default: all). The copies share "
                   "one content-keyed kernel cache, so the baseline compiles alone first and each variant "
                   "compiles only what it changes. The layer set runs each layer as it compiles, about "
                   "15 GiB of GPU memory apiece at its largest config: 4 fit an 80 GB card")
    p.add_argument("--row-timeout", type=float, default=600.0,
                   help="seconds a child may spend on one row, its compiles included, before it exits with "
                   "its stacks dumped and its copy's rows become an error (default: 600; 0: none), so a "
                   "variant whose kernel never returns costs that, not the run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if bad := sorted(set(args.routings.split(",")) - set(ROUTINGS)):
        p.error(f"--routings {bad} unknown; use some of {ROUTINGS}")
    allowed = LAYER_PASSES if args.set == "layer" else PASSES
    args.passes = args.passes or ",".join(allowed)
    if bad := sorted(set(args.passes.split(",")) - set(allowed)):
        p.error(f"--passes {bad} unknown to the {args.set} set; use some of {allowed}")
    if args.configs and not all(c.isdigit() for c in args.configs.split(",")):
        p.error(f"--configs {args.configs!r}: give comma-separated row indices, e.g. 0,2")
    if args.jobs < 0:
        p.error(f"--jobs {args.jobs}: give a positive count, or 0 for all variants at once")
    if args.set == "step" and args.jobs > 1:
        p.error(f"--jobs {args.jobs}: the step set's children hold a moonlet model each (~70 GB); use 1")
    if args.child:
        child(args.compile_only, args.set, args.passes.split(","), args.routings.split(","), args.configs)
        return 0
    progress = args.progress or (args.out.with_suffix(".progress") if args.out else None)
    catalog = variants_of(args.set)
    chosen = [v for v in catalog if not args.only or v[0].id in args.only.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="nmoe-ablate-"))
    copies: dict[str, Path] = {}
    variants = [("baseline", ()), *((v[0].id, v) for v in chosen), ("baseline_again", ())]
    for name, edits in variants:
        copy = tmp / name
        copy_tree(ROOT, copy)
        shutil.copytree(ROOT / "bench", copy / "bench",
                        ignore=shutil.ignore_patterns("results", "__pycache__"))
        for edit in edits:
            path = copy / edit.file
            path.write_text(apply(path.read_text(encoding="utf-8"), edit), encoding="utf-8")
        copies[name] = copy
    failed: dict[str, str] = {}
    names = list(copies)
    jobs = args.jobs or (1 if args.set == "step" else len(names))
    for wave in [names[:1], *(names[i:i + jobs] for i in range(1, len(names), jobs))]:
        compiling = [(n, _run(copies[n], True, args.set, args.passes, args.routings, args.configs, progress,
                              args.row_timeout)) for n in wave]
        failed |= {n: out for n, proc in compiling if (out := proc.communicate()[0]) and proc.returncode}
    rows: dict[str, Any] = {}
    for name, copy in copies.items():
        if name in failed:
            rows[name] = {"error": failed[name][-2000:], "timed": []}
            continue
        proc = _run(copy, False, args.set, args.passes, args.routings, args.configs, progress,
                    args.row_timeout)
        lines, timed = [], []
        for line in proc.stdout or ():
            lines.append(line)
            if line.startswith("{"):
                timed.append(json.loads(line))
                print(f"{name} {line}", end="", flush=True)
        proc.wait()
        failure = {"error": "".join(lines)[-2000:], "timed": timed}
        rows[name] = timed if timed and not proc.returncode else failure
    shutil.rmtree(tmp, ignore_errors=True)
    notes = {v[0].id: v[0].description for v in chosen}
    base = {r["shape"]: r["ms"] for r in rows["baseline"]} if isinstance(rows["baseline"], list) else {}
    for name, rs in rows.items():
        for r in rs if isinstance(rs, list) else []:
            ratio = base.get(r["shape"], float("nan")) / r["ms"]
            print(f"{name:26s} {r['shape']:40s} bn={r['bn']:3d} {r['tflops']:6.1f} TFLOP/s  "
                  f"x{ratio:.3f} vs baseline")
        if not isinstance(rs, list):
            print(f"{name}: failed\n{rs['error']}")
    if args.out:
        from nmoe.provenance import provenance

        args.out.write_text(json.dumps({"provenance": provenance(" ".join(["python -m bench.ablate",
                                        *(argv or sys.argv[1:])])), "notes": notes, "rows": rows}, indent=1))
    return 0 if all(isinstance(rs, list) for rs in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
