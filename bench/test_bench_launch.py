"""Host time of one eager fast-op call against torch._grouped_mm's, measured in the same run.

Tiny shapes keep the GPU ahead of the host, so N back-to-back eager calls timed on the host (one sync at the
end) give the host cost per call: argument checks, output allocation, launcher lookup and the launch itself.
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
SAMPLES = 7


def host_us_per_call(step: Callable[[], object], calls: int = CALLS, samples: int = SAMPLES) -> float:
    """Median over `samples` of the host time of `calls` back-to-back eager calls, per call, in µs."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def _gemm_inputs(m: int, n: int, k: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    offs = torch.full((e,), m // e, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    return x, w, offs


def _row(name: str, shape: dict[str, int], ours_us: float, ref_us: float, **extra: Any) -> None:
    append_row({"name": name, "shape": shape, "ms": ours_us / 1e3, "host_us": ours_us,
                "baseline": {"name": "torch._grouped_mm", "ms": ref_us / 1e3, "host_us": ref_us},
                "speedup": ref_us / ours_us, "within_budget": ours_us <= ref_us,
                "timing": f"host perf_counter over {CALLS} eager calls, median of {SAMPLES}", **extra})


def test_bench_eager_host_time() -> None:
    """relu2 (small op) and grouped_gemm (large op) eager host µs per call vs torch._grouped_mm."""
    from nmoe.fast import gemm
    from nmoe.fast.activation import relu2

    shape = {"M": 256, "N": 128, "K": 128, "E": 4}
    x, w, offs = _gemm_inputs(shape["M"], shape["N"], shape["K"], shape["E"])
    wt = w.transpose(-2, -1)
    ref_us = host_us_per_call(lambda: torch._grouped_mm(x, wt, offs=offs))
    tiny = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    _row("eager_host_relu2", {"T": 8, "D": 64}, host_us_per_call(lambda: relu2(tiny)), ref_us)
    _row("eager_host_grouped_gemm", shape, host_us_per_call(lambda: gemm.grouped_gemm(x, w, offs)), ref_us)
    xg = x.detach().requires_grad_()
    _row("eager_host_grouped_gemm_autograd", shape,
         host_us_per_call(lambda: gemm.grouped_gemm(xg, w, offs)), ref_us,
         note="input requires grad: the call goes through the torch dispatcher and records the backward")


def test_bench_eager_host_breakdown() -> None:
    """Where relu2's host time goes: allocation, a torch op's dispatch+launch floor, the bare launcher, the
    glue without the FastOp wrapper; each row stands beside torch._grouped_mm of the same run."""
    from nmoe.fast import activation, runtime

    x, w, offs = _gemm_inputs(256, 128, 128, 4)
    wt = w.transpose(-2, -1)
    ref_us = host_us_per_call(lambda: torch._grouped_mm(x, wt, offs=offs))
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
        _row(f"eager_host_part_{name}", shape, host_us_per_call(step), ref_us,
             note="component of eager_host_relu2, to locate host time")
