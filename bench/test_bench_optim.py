"""Optimizer steps: AdamW over a 1B-parameter fp32 state vs torch._fused_adamw_ in the same run, and one Muon
step (Newton-Schulz 5 on bf16 tensor cores) of a moonlet-sized attention projection.

AdamW bytes floor per parameter: read p, g, m, v (4 B each, fp32 grads), write p, m, v = 28 B. As a trainer
runs it (bf16 grads, bf16 param written, clip factor): 28 B with fp32 moments, 20 B with bf16 moments.
Muon FLOP floor per NS iteration on an m x n matrix (m <= n): X X^T 2m^2n, A A 2m^3, B X 2m^2n.
"""

from __future__ import annotations

from typing import Any

import torch
from conftest import cuda_median_ms, record

N_PARAMS = 1 << 30
MUON_SHAPE = (2048, 3072)


def test_bench_adamw_1b(benchmark: Any) -> None:
    from nmoe.fast import optim as fo
    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(N_PARAMS, device="cuda", generator=g) * 0.02
    grad = torch.randn(N_PARAMS, device="cuda", generator=g) * 1e-2
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    step = torch.tensor(1.0, device="cuda")

    def fast() -> None:
        fo.adamw_step(p, grad, m, v, 10, 1e-3, 0.9, 0.95, 1e-8, 0.1)

    def fused() -> None:
        torch._fused_adamw_([p], [grad], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.95,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)

    ms, base_ms = cuda_median_ms(fast), cuda_median_ms(fused)
    row = record("adamw_step", {"params": N_PARAMS}, ms, nbytes=28.0 * N_PARAMS,
                 baseline=("torch._fused_adamw_", base_ms))
    row.update(timing="eager", gbps=28.0 * N_PARAMS / (ms * 1e-3) / 1e9)
    benchmark.extra_info.update(row)
    benchmark.pedantic(lambda: (fast(), torch.cuda.synchronize()), rounds=3, iterations=1, warmup_rounds=1)


def test_bench_adamw_bf16_moments(benchmark: Any) -> None:
    """The trainer's step with bf16 moments against the same step with fp32 moments, in the same run."""
    from nmoe.fast import optim as fo
    from nmoe.train.optim import STEP_BYTES
    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(N_PARAMS, device="cuda", generator=g) * 0.02
    grad = (torch.randn(N_PARAMS, device="cuda", generator=g) * 1e-2).bfloat16()
    low = p.bfloat16()
    scale = torch.tensor(0.5, device="cuda")
    states = {dt: tuple(torch.zeros(N_PARAMS, device="cuda", dtype=dt) for _ in range(2))
              for dt in (torch.float32, torch.bfloat16)}

    def step(dt: torch.dtype) -> None:
        fo.adamw_step(p, grad, *states[dt], 10, 1e-3, 0.9, 0.95, 1e-8, 0.1, scale, low)

    ms, base_ms = cuda_median_ms(lambda: step(torch.bfloat16)), cuda_median_ms(lambda: step(torch.float32))
    nbytes = float(STEP_BYTES["bf16"] * N_PARAMS)
    row = record("adamw_step_bf16_moments", {"params": N_PARAMS}, ms, nbytes=nbytes,
                 baseline=(f"adamw_step, fp32 moments ({STEP_BYTES['fp32']} B/param)", base_ms))
    row.update(timing="eager", gbps=nbytes / (ms * 1e-3) / 1e9)
    benchmark.extra_info.update(row)
    benchmark.pedantic(lambda: (step(torch.bfloat16), torch.cuda.synchronize()), rounds=3, iterations=1,
                       warmup_rounds=1)


def test_bench_muon_step(benchmark: Any) -> None:
    from nmoe.fast import optim as fo
    rows, cols = MUON_SHAPE
    g = torch.Generator(device="cuda").manual_seed(1)
    p = torch.randn(MUON_SHAPE, device="cuda", generator=g) * 0.02
    grad = torch.randn(MUON_SHAPE, device="cuda", generator=g) * 1e-2
    buf = torch.zeros_like(p)
    lo, hi = min(rows, cols), max(rows, cols)
    flops = 5 * (4.0 * lo * lo * hi + 2.0 * lo**3)
    ms = cuda_median_ms(lambda: fo.muon_step(p, grad, buf, 0.02, 0.95, 0.1))
    row = record("muon_step", {"rows": rows, "cols": cols, "ns_steps": 5}, ms, flops=flops)
    row.update(timing="eager")
    benchmark.extra_info.update(row)
    benchmark.pedantic(lambda: (fo.muon_step(p, grad, buf, 0.02, 0.95, 0.1), torch.cuda.synchronize()),
                       rounds=3, iterations=1, warmup_rounds=1)
