"""Grouped GEMM fwd with fp8 experts on sm_90a (e4m3, x 1x128 / w 128x128 e8m0 scales) vs the nmoe bf16 kernel
on the same (T, H, I, E, K) shapes in the same process; operands from the fast quantizers. GPU time from
CUDA-graph replays. Floor: the FLOPs at the measured bf16 dense ceiling (fp8 peak is twice that)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from conftest import baseline, capture, record, replay_median_ms
from test_bench_gemm import CONFIGS, _operands


@pytest.mark.parametrize("routing", ["uniform", "zipf1.2"])
@pytest.mark.parametrize("proj", ["up", "down"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "T{}_H{}_I{}_E{}_K{}".format(*c))
def test_bench_grouped_gemm_fp8_fwd(benchmark: Any, cfg: tuple[int, ...], proj: str, routing: str) -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma fp8 grouped GEMM is an sm_90a kernel")
    from nmoe.fast import formats
    from nmoe.fast.gemm import grouped_gemm, grouped_gemm_fp8

    x, w, offs, m, n, k = _operands(cfg, proj, routing)
    xq, xs = formats.quantize_mxfp8(x, 128)
    wq, ws = formats.quantize_mxfp8_weight(w)
    ours = functools.partial(grouped_gemm_fp8, xq, xs, wq, ws, offs)
    graph = capture(ours)
    ms = replay_median_ms(graph)
    base = baseline("nmoe grouped_gemm (bf16)", functools.partial(grouped_gemm, x, w, offs))
    t, h, i, e, topk = cfg
    shape = {"T": t, "H": h, "I": i, "E": e, "K": topk, "M": m, "N": n, "Kred": k}
    nbytes = m * k + wq.numel() + xs.numel() + ws.numel() + 2.0 * m * n
    pick = None if base["ms"] is None else (str(base["name"]), float(base["ms"]))
    row = record(f"grouped_gemm_fp8_fwd_{proj}_{routing}", shape, ms, flops=2.0 * m * n * k, nbytes=nbytes,
                 baseline=pick)
    row["baselines"] = [base]
    benchmark.extra_info.update(row)

    def run() -> None:
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
