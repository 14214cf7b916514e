"""Grouped GEMM forward, nmoe (CuTeDSL sm_90a) vs torch._grouped_mm (bf16, cuBLAS) in the same process.

Shapes (T, H, I, E, K): rows M = T*K routed uniformly or Zipf(1.2)-skewed; up projection N = 2I (K = H), down
projection N = H (K = I). Floor: 2*M*N*K FLOPs at the measured dense bf16 ceiling, or the bytes moved.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import cuda_median_ms, record
from torch import Tensor

CONFIGS = ((32768, 4096, 1024, 128, 8), (24576, 1536, 256, 128, 8), (32768, 4096, 512, 256, 8))


def _counts(m: int, e: int, routing: str) -> list[int]:
    if routing == "uniform":
        return [m // e + (1 if i < m % e else 0) for i in range(e)]
    p = [1.0 / (i + 1) ** 1.2 for i in range(e)]
    c = [int(m * q / sum(p)) for q in p]
    c[0] += m - sum(c)
    return c


def _operands(cfg: tuple[int, ...], proj: str, routing: str) -> tuple[Tensor, Tensor, Tensor, int, int, int]:
    t, h, i, e, k = cfg
    m = t * k
    n, kk = (2 * i, h) if proj == "up" else (h, i)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, kk, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(e, n, kk, device="cuda", dtype=torch.bfloat16, generator=g) * kk**-0.5
    counts = torch.tensor(_counts(m, e, routing))
    offs = counts.cumsum(0).to(torch.int32).cuda()
    return x, w, offs, m, n, kk


@pytest.mark.parametrize("routing", ["uniform", "zipf1.2"])
@pytest.mark.parametrize("proj", ["up", "down"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "T{}_H{}_I{}_E{}_K{}".format(*c))
def test_bench_grouped_gemm_fwd(benchmark: Any, cfg: tuple[int, ...], proj: str, routing: str) -> None:
    from nmoe.fast.gemm import grouped_gemm

    x, w, offs, m, n, k = _operands(cfg, proj, routing)
    wt = w.transpose(-2, -1)
    ours = cuda_median_ms(lambda: grouped_gemm(x, w, offs))
    theirs = cuda_median_ms(lambda: torch._grouped_mm(x, wt, offs=offs))
    flops = 2.0 * m * n * k
    nbytes = 2.0 * (m * k + w.numel() + m * n)
    t, h, i, e, topk = cfg
    row = record(f"grouped_gemm_fwd_{proj}_{routing}",
                 {"T": t, "H": h, "I": i, "E": e, "K": topk, "M": m, "N": n, "Kred": k},
                 ours, flops=flops, nbytes=nbytes, baseline=("torch._grouped_mm", theirs))
    benchmark.extra_info.update(row)

    def run() -> None:
        grouped_gemm(x, w, offs)
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
