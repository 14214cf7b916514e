"""Where a training step's GPU time goes: one profiled step, its kernels grouped into the ops of the model
(attention, expert GEMMs, dense GEMMs, cross-entropy, optimizer, ...) and its phases (forward, backward,
clip, optimizer). Used by bench/test_bench_train_step.py; the grouping is pure and tested on the CPU."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
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
    ("cross_entropy_rows", r"ce_fwd"),
    ("adamw", r"adamw"),
    ("dense_gemm", r"gemm|nvjet|xmma|cutlass|cublas|sm90_|sm100_"),
    ("norms_reductions", r"reduce|norm|multi_tensor"),
    ("copy_cast_elementwise", r"memcpy|memset|copy|cat|elementwise|fill|index|gather|scatter|unrolled"
                              r"|vectorized|where"),
)
PHASES: tuple[str, ...] = ("forward", "backward", "clip", "optimizer", "bias_update")


def categorize(kernel: str) -> str:
    low = kernel.lower()
    for name, pattern in CATEGORIES:
        if re.search(pattern, low):
            return name
    return "other"


def breakdown(kernels: Iterable[tuple[str, float]], phases: Mapping[str, float], step_ms: float,
              top: int = 60) -> dict[str, Any]:
    """kernels: (name, device ms) per launch; phases: device ms per phase. Shares are of the summed kernel
    time; `busy` is that sum over the step's wall time (below 1: the GPU waited on the host)."""
    per_name: dict[str, list[float]] = {}
    for name, ms in kernels:
        per_name.setdefault(name, []).append(ms)
    total = sum(sum(v) for v in per_name.values())
    cats: dict[str, dict[str, float]] = {}
    for name, times in per_name.items():
        c = cats.setdefault(categorize(name), {"ms": 0.0, "launches": 0})
        c["ms"] += sum(times)
        c["launches"] += len(times)
    for c in cats.values():
        c["share"] = c["ms"] / total if total else 0.0
    ranked = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "step_ms": step_ms,
        "kernel_ms": total,
        "busy": total / step_ms if step_ms else 0.0,
        "phases_ms": {p: phases.get(p, 0.0) for p in PHASES},
        "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1]["ms"])),
        "top_kernels": [{"name": n[:160], "category": categorize(n), "ms": sum(t), "launches": len(t)}
                        for n, t in ranked],
    }


def kernel_times(events: Iterable[Any]) -> list[tuple[str, float]]:
    """(name, device ms) of each kernel, memcpy or memset among profiler events; the device-side copies of
    user annotations (record_function ranges such as Optimizer.step) are spans, not work, and are left out."""
    from torch.autograd import DeviceType

    return [(e.name, e.time_range.elapsed_us() / 1e3) for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def profile_step(step: Callable[[Callable[[str], AbstractContextManager[Any]]], None]) -> dict[str, Any]:
    """Run `step(phase)` once under torch.profiler, `phase(name)` marking each phase with CUDA events on the
    current stream (the backward's kernels launch from autograd's thread, which profiler ranges miss)."""
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
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        step(phase)
        end.record()
        torch.cuda.synchronize()
    phases: dict[str, float] = {}
    for name, begin, done in marks:
        phases[name] = phases.get(name, 0.0) + begin.elapsed_time(done)
    return breakdown(kernel_times(prof.events()), phases, start.elapsed_time(end))
