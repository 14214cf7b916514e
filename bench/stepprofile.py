"""Where a training step's GPU time goes: one profiled step, its kernels grouped into the ops of the model
(attention, expert GEMMs, dense GEMMs, cross-entropy, optimizer, ...) and its phases (forward, backward,
clip, optimizer). Used by bench/test_bench_train_step.py; the grouping is pure and tested on the CPU.

`python -m bench.stepprofile CONFIG [--section.key=value ...] --out FILE` profiles one eager step of the fast
model at a config's own batch and train.grad_accum (the bench's step runs one microbatch of 2 x 4096 beside
the torch baseline) and writes the breakdown with each GEMM family's FLOP floor and AdamW's byte floor, under
the run's provenance."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

# First match wins: the project's own kernels and FlashAttention before the generic cuBLAS/torch names.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention", r"flash|fmha|attention"),
    ("expert_gemm", r"grouped_gemm|grouped_wgrad"),
    ("routing", r"router_topk|expert_counts|bias_update"),
    ("dispatch_combine", r"fill_slot|tile_count|scan_kernel|rank_kernel|spread_rows|scatter_rows|check_seen"
                         r"|combine_"),
    ("activation", r"swiglu|relu2"),
    ("rmsnorm", r"rmsnorm"),
    ("rope", r"rope_kernel"),
    ("mla_assembly", r"mla_k_kernel|mla_kv_grad_kernel"),
    ("embedding", r"embed_bwd_kernel"),
    ("cross_entropy_rows", r"ce_fwd"),
    ("adamw", r"adamw"),
    ("dense_gemm", r"gemm|nvjet|xmma|cutlass|cublas|sm90_|sm100_"),
    ("norms_reductions", r"reduce|norm|multi_tensor"),
    ("copy_cast_elementwise", r"memcpy|memset|copy|cat|elementwise|fill|index|gather|scatter|unrolled"
                              r"|vectorized|where"),
)
PHASES: tuple[str, ...] = ("forward", "backward", "clip", "optimizer", "bias_update")
MOONLET = Path(__file__).resolve().parents[1] / "configs" / "moonlet.toml"


def categorize(kernel: str) -> str:
    low = kernel.lower()
    for name, pattern in CATEGORIES:
        if re.search(pattern, low):
            return name
    return "other"


def breakdown(kernels: Iterable[tuple[str, float]], phases: Mapping[str, float], step_ms: float,
              top: int = 60, calls: int = 1) -> dict[str, Any]:
    """kernels: (name, device ms) per launch over `calls` steps; phases: device ms per phase. Times are per
    step; shares are of the summed kernel time, `busy` that sum over the wall time (below 1: host waits)."""
    per_name: dict[str, list[float]] = {}
    for name, ms in kernels:
        per_name.setdefault(name, []).append(ms / calls)
    step_ms /= calls
    total = sum(sum(v) for v in per_name.values())
    cats: dict[str, dict[str, float]] = {}
    for name, times in per_name.items():
        c = cats.setdefault(categorize(name), {"ms": 0.0, "launches": 0})
        c["ms"] += sum(times)
        c["launches"] += len(times) // calls
    for c in cats.values():
        c["share"] = c["ms"] / total if total else 0.0
    ranked = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "calls": calls,
        "step_ms": step_ms,
        "kernel_ms": total,
        "busy": total / step_ms if step_ms else 0.0,
        "phases_ms": {p: phases.get(p, 0.0) / calls for p in PHASES},
        "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1]["ms"])),
        "top_kernels": [{"name": n[:160], "category": categorize(n), "ms": sum(t),
                         "launches": len(t) // calls} for n, t in ranked],
    }


def kernel_times(events: Iterable[Any]) -> list[tuple[str, float]]:
    """(name, device ms) of each kernel, memcpy or memset among profiler events; the device-side copies of
    user annotations (record_function ranges such as Optimizer.step) are spans, not work, and are left out."""
    from torch.autograd import DeviceType

    return [(e.name, e.time_range.elapsed_us() / 1e3) for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def profile_step(step: Callable[[Callable[[str], AbstractContextManager[Any]]], None],
                 sources: bool = False, calls: int = 1) -> dict[str, Any]:
    """Run `step(phase)` once under torch.profiler (it runs `calls` steps: times are per step), `phase(name)`
    marking each phase with CUDA events on the current stream (autograd's thread escapes profiler ranges).
    sources: also record shapes and stacks, and list where the small kernels come from (op_sources)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    marks: list[tuple[str, Any, Any]] = []

    @contextmanager
    def phase(name: str) -> Iterator[None]:
        begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        done.record()
        marks.append((name, begin, done))

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=sources,
                 with_stack=sources) as prof:
        start.record()
        step(phase)
        end.record()
        torch.cuda.synchronize()
    phases: dict[str, float] = {}
    for name, begin, done in marks:
        phases[name] = phases.get(name, 0.0) + begin.elapsed_time(done)
    out = breakdown(kernel_times(prof.events()), phases, start.elapsed_time(end), calls=calls)
    if sources:
        out["sources"] = op_rows(launch_records(prof.events()))
    return out


SMALL = ("copy_cast_elementwise", "norms_reductions", "other")
"""The families whose kernels come from many places: op_sources names each launch's op and caller."""


def launch_records(events: Iterable[Any]) -> list[tuple[str, str, str, float]]:
    """(op, input shapes, caller, device ms) per kernel of a SMALL family: the CPU op that launched it and,
    as caller, the first nmoe/ frame of its own or its ancestors' stacks, else the autograd node it ran in."""
    out = []
    for e in events:
        for k in getattr(e, "kernels", ()) or ():
            if categorize(k.name) not in SMALL:
                continue
            caller, node = "", ""
            at: Any = e
            while at is not None and not caller:
                frames = [f for f in (getattr(at, "stack", None) or []) if "nmoe/" in f]
                caller = frames[0] if frames else ""
                if not node and str(at.name).startswith("autograd::engine::evaluate_function"):
                    node = str(at.name).split(": ", 1)[-1]
                at = getattr(at, "cpu_parent", None)
            out.append((str(e.name), str(getattr(e, "input_shapes", "")), caller or node, k.duration / 1e3))
    return out


def op_rows(records: Iterable[tuple[str, str, str, float]], top: int = 40) -> list[dict[str, Any]]:
    """Records summed per (op, shapes, caller), largest device time first."""
    acc: dict[tuple[str, str, str], list[float]] = {}
    for op, shapes, caller, ms in records:
        acc.setdefault((op, shapes, caller), []).append(ms)
    ranked = sorted(acc.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"op": op, "shapes": shapes[:200], "caller": caller[:200], "ms": sum(t), "launches": len(t)}
            for (op, shapes, caller), t in ranked]


Phase = Callable[[str], AbstractContextManager[Any]]


def no_phase(name: str) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


def one_microbatch(batch: int, *overrides: str) -> Any:
    """moonlet's config at `batch` sequences and train.grad_accum 1: the step the benches time."""
    from nmoe.config import load_config

    return load_config(MOONLET, env={}, overrides=[f"--data.batch_size={batch}", "--train.grad_accum=1",
                                                    *overrides])


def trainer_model(cfg: Any) -> tuple[Any, Any]:
    """(model, optimizer) as `nmoe train` builds them (traincli.build_model), the model in train mode."""
    from nmoe.train.optim import STATE_DTYPES, build_optimizer
    from nmoe.traincli import build_model, optim_steps

    model = build_model(cfg)
    model.train()
    states = STATE_DTYPES[cfg.train.optim_state_dtype]
    return model, build_optimizer(model, cfg.optim, optim_steps(cfg), states)


def random_batch(cfg: Any) -> tuple[Any, Any]:
    """(inputs, targets) [B, S] of uniform random token ids at the config's batch, drawn on the GPU."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    b, s = cfg.data.batch_size, cfg.data.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1), device="cuda", generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def fast_step(model: Any, opt: Any, cfg: Any, inputs: Any, targets: Any) -> Callable[..., None]:
    """The trainer's eager step as phases: train.grad_accum forwards and backwards on one batch (the first
    writes the gradients, the rest add to them), clip, optimizer (grads freed), bias update."""
    from nmoe.accumulate import adding_to_grads
    from nmoe.train.optim import clip_scale

    params = [p for g in opt.param_groups for p in g["params"]]
    accum = cfg.train.grad_accum

    def step(phase: Phase = no_phase) -> None:
        for micro in range(accum):
            with phase("forward"):
                loss = model(inputs, targets)
            with phase("backward"), adding_to_grads(micro > 0):
                loss.backward()
        with phase("clip"):
            opt.set_grad_scale(clip_scale(params, cfg.optim.grad_clip, accum=accum)[1])
        with phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        with phase("bias_update"):
            model.update_router_bias(model.router_counts())

    return step


def graphed_step(model: Any, opt: Any, cfg: Any, inputs: Any, targets: Any) -> Callable[[], None]:
    """The trainer's step under train.cuda_graph (one microbatch): forward and backward replayed as one CUDA
    graph, clip, optimizer and bias update eager. Every .grad must be None when it is made (capture)."""
    from nmoe.train.graphstep import GraphedStep
    from nmoe.train.optim import clip_scale

    params = [p for g in opt.param_groups for p in g["params"]]
    graphed = GraphedStep(model, lambda m, x, y: m(x, y), inputs, targets)

    def step() -> None:
        graphed(inputs, targets)
        opt.set_grad_scale(clip_scale(params, cfg.optim.grad_clip)[1])
        opt.step()
        model.update_router_bias(model.router_counts())

    return step


def with_floors(parts: dict[str, Any], model: Any, cfg: Any, tokens: int,
                ceil: Mapping[str, float]) -> dict[str, Any]:
    """Each GEMM family's FLOP floor (flops_parts, the MFU accounting; shared experts run in the grouped
    kernels, so their FLOPs move from dense to expert) and AdamW's byte floor in the moments' dtype."""
    from nmoe.train.loop import flops_parts
    from nmoe.train.optim import STEP_BYTES

    kinds = flops_parts(model, cfg)
    shared = sum(6.0 * p.numel() for name, p in model.named_parameters() if "shared_" in name)
    flops = {"expert_gemm": kinds["expert"] + shared, "dense_gemm": kinds["dense"] - shared,
             "attention": kinds["attention"]}
    for cat, f in flops.items():
        parts["categories"].setdefault(cat, {"ms": 0.0, "launches": 0, "share": 0.0})
        parts["categories"][cat]["floor_ms"] = f * tokens / (ceil["bf16_dense_TFLOPs"] * 1e12) * 1e3
    every = sum(p.numel() for p in model.parameters())
    parts["categories"].setdefault("adamw", {"ms": 0.0, "launches": 0, "share": 0.0})
    nbytes = STEP_BYTES[cfg.train.optim_state_dtype] * every
    parts["categories"]["adamw"]["floor_ms"] = nbytes / (ceil["hbm_copy_TBps"] * 1e12) * 1e3
    return parts


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stepprofile", description=__doc__)
    ap.add_argument("config")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--warmup", type=int, default=3, help="eager steps before the profiled one")
    ap.add_argument("--sources", action="store_true",
                    help="record shapes and stacks: where the copy, cast and reduction kernels come from")
    args, overrides = ap.parse_known_args(argv)
    import torch

    from bench.conftest import ceilings
    from nmoe.config import load_config
    from nmoe.provenance import provenance

    cfg = load_config(args.config, env={}, overrides=overrides)
    model, opt = trainer_model(cfg)
    b, s, accum = cfg.data.batch_size, cfg.data.seq_len, cfg.train.grad_accum
    step = fast_step(model, opt, cfg, *random_batch(cfg))
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    parts = with_floors(profile_step(step, args.sources), model, cfg, b * s * accum, ceilings())
    report = {"provenance": provenance(" ".join(["python -m bench.stepprofile", args.config, *overrides])),
              "config": str(args.config), "overrides": overrides, "shape": {"B": b, "S": s, "accum": accum},
              "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30, "breakdown": parts}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"step {parts['step_ms']:.1f} ms, kernels {parts['kernel_ms']:.1f} ms; wrote {args.out}")
    for name, c in parts["categories"].items():
        floor = c.get("floor_ms")
        print(f"  {name:24s} {c['ms']:9.2f} ms {c['launches']:6d} launches"
              + ("" if floor is None else f"  floor {floor:8.2f} ms"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
