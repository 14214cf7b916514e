"""One moonlet training step on the fast path (forward, backward, grad clip, optimizer, router bias update)
at 2 x 4096 tokens, the shape issue #14 measured; tokens/s and MFU counted as the trainer counts them.

FLOP floor: nmoe.train.loop.flops_per_token (6 x active matmul parameters, experts scaled by k/E, embedding
lookup excluded, plus causal attention) x tokens, against the bf16 dense ceiling measured in the same run;
MFU is against stepstats.peak_flops (989 TFLOP/s dense bf16 on H100/H200), as the trainer's MFU column.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from conftest import cuda_median_ms, record

from nmoe.config import load_config

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "moonlet.toml"
BATCH = int(os.environ.get("NMOE_BENCH_TRAIN_BATCH", "2"))
STEP_WARMUP, STEP_REPS = 3, 10


def test_bench_train_step_moonlet(benchmark: Any) -> None:
    from nmoe.fast.model import Model
    from nmoe.train.loop import flops_per_token
    from nmoe.train.optim import build_optimizer, clip_grad_norm
    from nmoe.train.stepstats import memory_stats, peak_flops
    from nmoe.traincli import optim_steps

    cfg = load_config(CONFIG, env={}, overrides=[f"--data.batch_size={BATCH}"])
    b, s = cfg.data.batch_size, cfg.data.seq_len
    model = Model(cfg.model, seed=cfg.train.seed, param_dtype=cfg.train.param_dtype)
    model.train()
    opt = build_optimizer(model, cfg.optim, optim_steps(cfg))
    params = [p for g in opt.param_groups for p in g["params"]]
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1), device="cuda", generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        loss = model(inputs, targets)
        loss.backward()
        clip_grad_norm(params, cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_bias(model.router_counts())

    torch.cuda.reset_peak_memory_stats()
    ms = cuda_median_ms(step, warmup=STEP_WARMUP, reps=STEP_REPS)
    dev = torch.device("cuda", torch.cuda.current_device())
    fpt, peak = flops_per_token(model, cfg), peak_flops(dev)
    n = b * s
    row = record("train_step_moonlet", {"B": b, "S": s}, ms, flops=fpt * n)
    row["tokens_per_s"] = n / (ms * 1e-3)
    row["flops_per_token"] = fpt
    row["mfu"] = None if peak is None else fpt * n / (ms * 1e-3) / peak
    row["peak_flops"] = peak
    row["peak_mem_gb"] = memory_stats(dev)["mem/max_allocated_gb"]
    row["timing"] = "eager, CUDA events around the whole step (host syncs of clip and optimizer included)"
    benchmark.extra_info.update(row)

    def run() -> None:
        step()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=2, iterations=1, warmup_rounds=0)
