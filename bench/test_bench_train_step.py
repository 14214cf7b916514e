"""One moonlet training step (forward, backward, grad clip, AdamW, router bias update) at 2 x 4096 tokens, the
shape issue #14 measured, on the fast path and, in the same run, on the plain-torch baseline
(bench/torchbase.py: bf16 compute over fp32 masters, cuDNN SDPA, torch._grouped_mm experts, chunked CE,
torch's fused AdamW); tokens/s and MFU counted as the trainer counts them. One more profiled step of the
fast model gives the row's `breakdown` (bench/stepprofile.py): GPU time per op family and phase, each GEMM
family's FLOP floor and AdamW's byte floor beside it. Then the same model steps with its forward and
backward replayed as one CUDA graph (train.cuda_graph): the `graph_*` fields.

FLOP floor: nmoe.train.loop.flops_per_token (6 x active matmul parameters, experts scaled by k/E, embedding
lookup excluded, plus causal attention) x tokens, against the bf16 dense ceiling measured in the same run;
MFU is against stepstats.peak_flops (989 TFLOP/s dense bf16 on H100/H200), as the trainer's MFU column.
The two models run one after the other (each holds ~70 GB of parameters, grads and AdamW state).
NMOE_BENCH_TRAIN_BATCH sets the batch, NMOE_BENCH_TRAIN_PARAM_DTYPE the fast model's train.param_dtype,
NMOE_BENCH_TRAIN_STATE_DTYPE its train.optim_state_dtype.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import torch
from conftest import ceilings, cuda_median_ms, record
from stepprofile import (
    fast_step,
    graphed_step,
    one_microbatch,
    profile_step,
    random_batch,
    trainer_model,
    with_floors,
)
from torchbase import TorchMoonlet

from nmoe.config import Config

BATCH = int(os.environ.get("NMOE_BENCH_TRAIN_BATCH", "2"))
# train.param_dtype of the fast model when set ("fp32" or "bf16"); unset, the config's (moonlet: bf16).
PARAM_DTYPE = os.environ.get("NMOE_BENCH_TRAIN_PARAM_DTYPE", "")
# train.optim_state_dtype when set ("fp32" or "bf16": AdamW's moments); unset, the config's.
STATE_DTYPE = os.environ.get("NMOE_BENCH_TRAIN_STATE_DTYPE", "")
STEP_WARMUP, STEP_REPS = 3, 10


def _timed(step: Callable[[], None]) -> tuple[float, float]:
    """(median ms of warm steps, peak GB allocated), then the model's memory is handed back."""
    from nmoe.train.stepstats import memory_stats

    torch.cuda.reset_peak_memory_stats()
    ms = cuda_median_ms(step, warmup=STEP_WARMUP, reps=STEP_REPS)
    peak = memory_stats(torch.device("cuda", torch.cuda.current_device()))["mem/max_allocated_gb"]
    return ms, peak


def _torch_step_ms(cfg: Config) -> tuple[float, float]:
    """The baseline's step; its model and optimizer go out of scope on return, and the caller frees them."""
    model = TorchMoonlet(cfg.model, torch.device("cuda"), seed=cfg.train.seed)
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr_dense, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay_dense, fused=True)
    inputs, targets = random_batch(cfg)

    def step() -> None:
        model(inputs, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _timed(step)


def test_bench_train_step_moonlet(benchmark: Any) -> None:
    from nmoe.train.loop import flops_per_token
    from nmoe.train.stepstats import peak_flops

    dtype = [f"--train.param_dtype={PARAM_DTYPE}"] if PARAM_DTYPE else []
    dtype += [f"--train.optim_state_dtype={STATE_DTYPE}"] if STATE_DTYPE else []
    cfg = one_microbatch(BATCH, *dtype)  # the baseline steps one microbatch
    base_ms, base_peak = _torch_step_ms(cfg)
    gc.collect()
    torch.cuda.empty_cache()
    b, s = cfg.data.batch_size, cfg.data.seq_len
    model, opt = trainer_model(cfg)
    inputs, targets = random_batch(cfg)
    step = fast_step(model, opt, cfg, inputs, targets)

    ms, peak_gb = _timed(step)
    parts = profile_step(step)
    opt.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    graph_ms, graph_peak_gb = _timed(graphed_step(model, opt, cfg, inputs, targets))
    fpt, peak = flops_per_token(model, cfg), peak_flops(torch.device("cuda", torch.cuda.current_device()))
    n = b * s
    shape = {"B": b, "S": s, "param_dtype": cfg.train.param_dtype,
             "optim_state_dtype": cfg.train.optim_state_dtype}
    row = record("train_step_moonlet", shape, ms,
                 flops=fpt * n, baseline=("torch_moonlet", base_ms))
    for key, step_ms, gb in (("", ms, peak_gb), ("torch_", base_ms, base_peak), ("graph_", graph_ms,
                                                                                  graph_peak_gb)):
        row[f"{key}tokens_per_s"] = n / (step_ms * 1e-3)
        row[f"{key}mfu"] = None if peak is None else fpt * n / (step_ms * 1e-3) / peak
        row[f"{key}peak_mem_gb"] = gb
    row["flops_per_token"] = fpt
    row["peak_flops"] = peak
    row["graph_ms"] = graph_ms
    row["timing"] = ("eager, CUDA events around the whole step (host syncs of clip and optimizer included); "
                     "graph_*: forward and backward replayed as one CUDA graph (train.cuda_graph), the rest "
                     "eager")
    row["breakdown"] = with_floors(parts, model, cfg, n, ceilings())
    benchmark.extra_info.update(row)

    def run() -> None:
        step()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=2, iterations=1, warmup_rounds=0)
