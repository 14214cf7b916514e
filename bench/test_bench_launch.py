"""Host time of one eager fast-op call against torch._grouped_mm's, the two interleaved in one run.

Tiny shapes keep the GPU ahead of the host, so N back-to-back eager calls timed on the host (one sync at the
end) give the host cost per call: argument checks, output allocation, launcher lookup and the launch itself.
Each sample times our N calls and then the baseline's N calls, so host noise (another process, a clock change)
hits both alike; the verdict is the median over samples of our time / the baseline's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import append_row

pytestmark = pytest.mark.gpu

CALLS = 200
SAMPLES = 15
BASELINE = "torch._grouped_mm"


def _calls_us(step: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def host_us_vs(step: Callable[[], object], ref: Callable[[], object], calls: int = CALLS,
               samples: int = SAMPLES) -> tuple[float, float, float]:
    """(ours, baseline, ours / baseline): medians over `samples` of the host µs per call of `calls`
    back-to-back eager calls, ours then the baseline's in each sample; the ratio is taken per sample."""
    for fn in (step, ref):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    ours, base = [], []
    for _ in range(samples):
        ours.append(_calls_us(step, calls))
        base.append(_calls_us(ref, calls))
    ratios = [a / b for a, b in zip(ours, base, strict=True)]
    return statistics.median(ours), statistics.median(base), statistics.median(ratios)


def _gemm_inputs(m: int, n: int, k: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    offs = torch.full((e,), m // e, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    return x, w, offs


def _row(name: str, shape: dict[str, int], step: Callable[[], object], ref: Callable[[], object],
         **extra: Any) -> None:
    ours_us, ref_us, ratio = host_us_vs(step, ref)
    append_row({"name": name, "shape": shape, "ms": ours_us / 1e3, "host_us": ours_us,
                "baseline": {"name": BASELINE, "ms": ref_us / 1e3, "host_us": ref_us},
                "host_ratio": ratio, "speedup": 1 / ratio, "within_budget": ratio <= 1.0,
                "timing": f"host perf_counter over {CALLS} eager calls, ours and {BASELINE} interleaved per "
                          f"sample, medians of {SAMPLES} samples (host_ratio: median of per-sample ratios)",
                **extra})


def test_bench_eager_host_time() -> None:
    """relu2 (small op) and grouped_gemm (large op) eager host µs per call vs torch._grouped_mm."""
    from nmoe.fast import gemm
    from nmoe.fast.activation import relu2

    shape = {"M": 256, "N": 128, "K": 128, "E": 4}
    x, w, offs = _gemm_inputs(shape["M"], shape["N"], shape["K"], shape["E"])
    wt = w.transpose(-2, -1)

    def ref() -> object:
        return torch._grouped_mm(x, wt, offs=offs)

    tiny = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    _row("eager_host_relu2", {"T": 8, "D": 64}, lambda: relu2(tiny), ref)
    _row("eager_host_grouped_gemm", shape, lambda: gemm.grouped_gemm(x, w, offs), ref)
    xg = x.detach().requires_grad_()
    _row("eager_host_grouped_gemm_autograd", shape, lambda: gemm.grouped_gemm(xg, w, offs), ref,
         note="input requires grad: the call records the backward (the op's autograd.Function)")


def test_bench_eager_host_breakdown() -> None:
    """Where relu2's host time goes: allocation, a torch op's dispatch+launch floor, the bare launcher, the
    glue without the FastOp wrapper; each row is interleaved with torch._grouped_mm like the rows above."""
    from nmoe.fast import activation, runtime

    x, w, offs = _gemm_inputs(256, 128, 128, 4)
    wt = w.transpose(-2, -1)

    def ref() -> object:
        return torch._grouped_mm(x, wt, offs=offs)

    tiny = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(tiny)
    device, arch = runtime.device_arch(tiny)
    launch = activation.RELU2_FWD.launcher(arch, dtype="bfloat16", vec=8)
    shape = {"T": 8, "D": 64}
    parts: dict[str, Any] = {
        "torch_empty_like": lambda: torch.empty_like(tiny),
        "torch_neg": lambda: torch.neg(tiny),
        "relu2_launcher_only": lambda: launch(device, tiny.data_ptr(), out.data_ptr(), tiny.numel()),
        "relu2_glue_without_wrapper": lambda: activation._relu2_impl(tiny),
    }
    for name, step in parts.items():
        _row(f"eager_host_part_{name}", shape, step, ref,
             note="component of eager_host_relu2, to locate host time")
