"""Grouped GEMM fwd, nmoe (CuTeDSL sm_90a) vs torch._grouped_mm (bf16), same process: (T, H, I, E, K) rows
M = T*K routed uniform or Zipf(1.2); up N = 2I (K = H), down N = H (K = I). GPU time from CUDA-graph
replays; the _eager_call rows add host launch cost."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from conftest import baseline, capture, eager_call_ms, record, replay_median_ms
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
    offs = torch.tensor(_counts(m, e, routing)).cumsum(0).to(torch.int32).cuda()
    return x, w, offs, m, n, kk


@pytest.mark.parametrize("routing", ["uniform", "zipf1.2"])
@pytest.mark.parametrize("proj", ["up", "down"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "T{}_H{}_I{}_E{}_K{}".format(*c))
def test_bench_grouped_gemm_fwd(benchmark: Any, cfg: tuple[int, ...], proj: str, routing: str) -> None:
    from nmoe.fast.gemm import grouped_gemm

    x, w, offs, m, n, k = _operands(cfg, proj, routing)
    ours = functools.partial(grouped_gemm, x, w, offs)
    theirs = functools.partial(torch._grouped_mm, x, w.transpose(-2, -1), offs=offs)
    graph = capture(ours)
    ms = replay_median_ms(graph)
    base = baseline("torch._grouped_mm", theirs)
    flops = 2.0 * m * n * k
    nbytes = 2.0 * (m * k + w.numel() + m * n)
    t, h, i, e, topk = cfg
    shape = {"T": t, "H": h, "I": i, "E": e, "K": topk, "M": m, "N": n, "Kred": k}
    name = f"grouped_gemm_fwd_{proj}_{routing}"
    pick = None if base["ms"] is None else (str(base["name"]), float(base["ms"]))
    row = record(name, shape, ms, flops=flops, nbytes=nbytes, baseline=pick)
    row["baselines"] = [base]
    eager_ms, host_ms = eager_call_ms(ours)
    torch_ms, torch_host_ms = eager_call_ms(theirs)
    eager = record(f"{name}_eager_call", shape, eager_ms, flops=flops, nbytes=nbytes,
                   baseline=("torch._grouped_mm", torch_ms))
    eager.update(host_ms=host_ms, baseline_host_ms=torch_host_ms)
    benchmark.extra_info.update(row)

    def run() -> None:
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("act", ["swiglu", "relu2"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "T{}_H{}_I{}_E{}_K{}".format(*c))
def test_bench_grouped_gemm_act(benchmark: Any, cfg: tuple[int, ...], act: str) -> None:
    """Up projection with the activation fused into the epilogue vs the unfused nmoe composition."""
    from nmoe.fast import activation
    from nmoe.fast.gemm import grouped_gemm, grouped_gemm_act

    x, w, offs, m, n, k = _operands(cfg, "up", "uniform")
    fn = getattr(activation, act)
    graph = capture(functools.partial(grouped_gemm_act, x, w, offs, act))
    ms = replay_median_ms(graph)
    base = baseline("nmoe grouped_gemm + activation", lambda: fn(grouped_gemm(x, w, offs)))
    width = n // 2 if act == "swiglu" else n
    t, h, i, e, topk = cfg
    shape = {"T": t, "H": h, "I": i, "E": e, "K": topk, "M": m, "N": n, "Kred": k}
    pick = None if base["ms"] is None else (str(base["name"]), float(base["ms"]))
    row = record(f"grouped_gemm_act_{act}_up_uniform", shape, ms, flops=2.0 * m * n * k,
                 nbytes=2.0 * (m * k + w.numel() + m * n + m * width), baseline=pick)
    row["baselines"] = [base]
    benchmark.extra_info.update(row)

    def run() -> None:
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
