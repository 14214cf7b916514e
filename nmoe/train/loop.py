"""loader -> model -> loss -> backward -> clip -> step -> router bias -> metrics -> checkpoint.
`train()` takes the model it is handed (forward(tokens, targets) -> loss or logits); `nmoe train`
(nmoe/traincli.py) builds it, so this package never imports the spec."""

from __future__ import annotations

import contextlib
import math
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from nmoe.accumulate import adding_to_grads
from nmoe.config import Config
from nmoe.sharding import full_numel, reduce_grads
from nmoe.train import checkpoint as ckpt
from nmoe.train.data import Loader, build_loader
from nmoe.train.graphstep import GraphedStep
from nmoe.train.metrics import ExperimentsDB, new_run_id
from nmoe.train.metricstore import MetricsWriter
from nmoe.train.optim import (
    STATE_DTYPES,
    OptimSteps,
    TrainOptimizer,
    build_optimizer,
    clip_scale,
    param_kind,
    wsd_factor,
)
from nmoe.train.stepstats import memory_stats, peak_flops, router_stats

HEARTBEAT_S: Final[float] = 60.0
StepHook = Callable[[int, float], None]
LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]


@dataclass
class TrainResult:
    run_id: str
    status: str
    step: int
    tokens: int
    losses: list[float] = field(default_factory=list)
    checkpoint: Path | None = None
    resumed_from: Path | None = None
    signum: int | None = None


def default_loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    """model(tokens, targets) may return the mean loss itself or logits [B,S,V] (fp32 CE taken here)."""
    out: Tensor = model(inputs, targets)
    if out.dim() == 0:
        return out
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), targets.reshape(-1))


def flops_parts(model: nn.Module, cfg: Config) -> dict[str, float]:
    """FLOPs per token by kind: 6·expert matmul params·k/E, 6·other matmul params (embedding lookup
    excluded), causal attention."""
    m = cfg.model
    parts = {"expert": 0.0, "dense": 0.0}
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed" in name:
            continue
        if param_kind(name, p) == "expert":
            parts["expert"] += 6.0 * full_numel(p) * m.n_activated_experts / m.n_routed_experts
        else:
            parts["dense"] += 6.0 * p.numel()
    parts["attention"] = 3.0 * m.n_layers * cfg.data.seq_len * m.n_heads * (m.qk_head_dim + m.v_head_dim)
    return parts


def flops_per_token(model: nn.Module, cfg: Config) -> float:
    """6·(active matmul params, experts scaled by k/E, embedding lookup excluded) + causal attention."""
    return sum(flops_parts(model, cfg).values())


class _StopFlag:
    """SIGTERM/SIGINT set a flag; the loop checkpoints at the next step boundary and returns."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.old: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self.old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def gpu_fields(values: dict[str, float]) -> str:
    """MFU and peak memory for the progress line, where the step measured them."""
    out = f" MFU {100 * values['mfu']:.1f}%" if "mfu" in values else ""
    if "mem/max_allocated_gb" in values:
        out += f" peak mem {values['mem/max_allocated_gb']:.1f} GiB"
    return out


def _router_names(model: nn.Module) -> list[str]:
    return [n.rsplit(".", 1)[0] if "." in n else "model" for n, _ in model.named_buffers()
            if n.endswith("router_bias")]


def _router_biases(model: nn.Module) -> list[Tensor]:
    return [b for n, b in model.named_buffers() if n.endswith("router_bias")]


def _all_reduce_sum(t: Tensor) -> None:
    dist.all_reduce(t)


def train(
    cfg: Config,
    model: nn.Module,
    *,
    steps: OptimSteps,
    device: str | torch.device | None = None,
    max_steps: int | None = None,
    loss_fn: LossFn = default_loss,
    on_step: StepHook | None = None,
    rank: int = 0,
    world: int = 1,
    progress: bool = True,
) -> TrainResult:
    """Train until schedule.total_tokens (or `max_steps` total steps), resuming from checkpoint.dir/latest.
    Always leaves a checkpoint of the last step done; SIGTERM/SIGINT stop cleanly at a step boundary."""
    # `steps` holds the optimizer's AdamW/Muon step functions (the fast path's, or the spec's on a CPU).
    dev = torch.device(device if device is not None else cfg.train.device)
    _seed_all(cfg.train.seed + rank)
    model.to(dev)
    model.train()
    optimizer = build_optimizer(model, cfg.optim, steps, STATE_DTYPES[cfg.train.optim_state_dtype])
    loader = build_loader(cfg.data.dataset_dir, cfg.data.mixture, seq_len=cfg.data.seq_len,
                          batch_size=cfg.data.batch_size, seed=cfg.data.seed, prefetch=cfg.data.prefetch,
                          rank=rank, world=world,
                          vocab_size=cfg.model.vocab_size)
    run_id = new_run_id(cfg.train.run_name)
    if world > 1:
        shared = [run_id]
        dist.broadcast_object_list(shared, src=0)
        run_id = str(shared[0])
    try:
        if rank == 0:
            ckpt.check_writable(cfg.checkpoint.dir, need_bytes=checkpoint_bytes(model))
        lock = ckpt.DirLock(cfg.checkpoint.dir, run=cfg.train.run_name)
        with lock if rank == 0 else contextlib.nullcontext():
            return _run(cfg, model, loader, optimizer, run_id, dev=dev, max_steps=max_steps, loss_fn=loss_fn,
                        on_step=on_step, rank=rank, world=world, progress=progress and rank == 0)
    finally:
        loader.close()


def checkpoint_bytes(model: nn.Module) -> int:
    """Room one checkpoint needs: parameters and buffers plus two fp32 optimizer moments per parameter."""
    params = sum(p.numel() * (p.element_size() + 8) for p in model.parameters())
    return params + sum(b.numel() * b.element_size() for b in model.buffers())


def _run(
    cfg: Config,
    model: nn.Module,
    loader: Loader,
    optimizer: TrainOptimizer,
    run_id: str,
    *,
    dev: torch.device,
    max_steps: int | None,
    loss_fn: LossFn,
    on_step: StepHook | None,
    rank: int,
    world: int,
    progress: bool,
) -> TrainResult:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    step = tokens = 0
    resumed_from = ckpt.latest(cfg.checkpoint.dir)
    if resumed_from is not None:
        r = ckpt.load(resumed_from, model=model, optimizer=optimizer, cfg=cfg, rank=rank, world=world)
        loader.load_state_dict(r.loader_state)
        step, tokens, run_id = r.step, r.tokens, r.run_id
    accum = cfg.train.grad_accum
    step_tokens = loader.tokens_per_step * accum
    total_steps = -(-cfg.schedule.total_tokens // step_tokens)
    end_step = total_steps if max_steps is None else min(max_steps, total_steps)
    writer = MetricsWriter(cfg.metrics.dir, run_id, rank)
    writer.truncate_after(step)
    has_router = hasattr(model, "router_counts") and hasattr(model, "update_router_bias")
    check_exchange: Callable[[], None] | None = getattr(model, "check_exchange", None)
    router_names = _router_names(model)

    def stacked_counts() -> Tensor:
        return torch.stack(model.router_counts())  # type: ignore[operator]

    fpt, peak = flops_per_token(model, cfg), peak_flops(dev)
    db = ExperimentsDB(cfg.metrics.db_path) if rank == 0 else None
    if db is not None:
        db.start_run(run_id, cfg, world=world, resumed=resumed_from is not None)
    result = TrainResult(run_id, "running", step, tokens, resumed_from=resumed_from)
    saved_step = step if resumed_from is not None else -1
    tty = progress and sys.stderr.isatty()
    t_start, steps_run = time.perf_counter(), 0
    beat = time.monotonic()
    graphed: GraphedStep | None = None

    def save() -> Path:
        return ckpt.save(cfg.checkpoint.dir, step=step, tokens=tokens, model=model, optimizer=optimizer,
                         loader_state=loader.state_dict(), cfg=cfg, run_id=run_id,
                         keep_last=cfg.checkpoint.keep_last, rank=rank, world=world)

    try:
        with _StopFlag() as stop:
            while step < end_step and stop.signum is None:
                t0 = time.perf_counter()
                tokens_after = tokens + step_tokens
                optimizer.set_lr_factor(wsd_factor(tokens_after, cfg.schedule))
                loss_sum: Tensor | None = None
                count_sum: Tensor | None = None
                first_seq = -1
                for micro in range(accum):
                    batch = next(loader)
                    if micro == 0:
                        first_seq = batch.first_seq
                    inputs = batch.inputs.to(dev, non_blocking=True)
                    targets = batch.targets.to(dev, non_blocking=True)
                    if cfg.train.cuda_graph and graphed is None and steps_run >= 1:
                        torch.cuda.empty_cache()
                        graphed = GraphedStep(model, loss_fn, inputs, targets, accumulate=accum > 1,
                                              extra=stacked_counts if has_router else None)
                    if graphed is not None:
                        loss, counts_now = graphed(inputs, targets, add=micro > 0)
                    else:
                        loss = loss_fn(model, inputs, targets)
                        with adding_to_grads(micro > 0):
                            loss.backward()  # type: ignore[no-untyped-call]
                        # A kept graph keeps its AccumulateGrad nodes, made on this stream, into a later
                        # capture.
                        loss = loss.detach()
                        counts_now = stacked_counts() if has_router else None
                    # Sums are new tensors: a graph's loss and counts are overwritten by its next replay.
                    loss_sum = loss.float() if loss_sum is None else loss_sum + loss.float()
                    if counts_now is not None:
                        count_sum = counts_now if count_sum is None else count_sum + counts_now
                assert loss_sum is not None
                if world > 1:
                    reduce_grads(params, world, _all_reduce_sum)
                norm, scale = clip_scale(params, cfg.optim.grad_clip, _all_reduce_sum if world > 1 else None,
                                         accum)
                optimizer.set_grad_scale(scale)
                mean_loss = loss_sum / accum
                if world > 1:
                    _all_reduce_sum(mean_loss)
                    mean_loss.div_(world)
                loss_value, grad_norm = torch.stack([mean_loss, norm.to(loss_sum.device)]).tolist()
                if check_exchange is not None:
                    check_exchange()
                if not math.isfinite(loss_value):
                    raise FloatingPointError(f"loss is {loss_value} at step {step + 1}; lower the learning "
                                             "rate or inspect the batch (first global sequence "
                                             f"{first_seq})")
                optimizer.step()
                if graphed is None:
                    optimizer.zero_grad(set_to_none=True)
                counts: list[Tensor] = []
                if count_sum is not None:
                    if world > 1:
                        count_sum = count_sum.clone()
                        dist.all_reduce(count_sum)
                    counts = list(count_sum.unbind(0))
                    model.update_router_bias(counts)  # type: ignore[operator]
                step, tokens = step + 1, tokens_after
                # No device sync here: the loss readback above already holds the host within a step of the
                # GPU, and the optimizer's kernels then hide this step's logging and the next batch's launch.
                dt = time.perf_counter() - t0
                steps_run += 1
                result.losses.append(loss_value)
                tok_s = step_tokens / dt
                values = {"loss": loss_value, "lr": optimizer.param_groups[0]["lr"], "grad_norm": grad_norm,
                          "tokens": float(tokens), "tokens_per_s": tok_s, "ms_per_step": 1e3 * dt}
                if peak is not None:
                    values["mfu"] = fpt * tok_s / world / peak
                if step % cfg.train.log_every == 0 or step == end_step:
                    values.update(memory_stats(dev))
                    if counts:
                        values.update(router_stats(router_names, counts, _router_biases(model)))
                writer.log(step, values)
                if progress and (tty or step % cfg.train.log_every == 0 or step == end_step):
                    elapsed = time.perf_counter() - t_start
                    eta = (end_step - step) * elapsed / steps_run
                    line = (f"step {step}/{end_step} loss {loss_value:.4f} lr {values['lr']:.2e} "
                            f"{tok_s:,.0f} tok/s {1e3 * dt:.0f} ms/step{gpu_fields(values)} "
                            f"ETA {_fmt_eta(eta)}")
                    sys.stderr.write(("\r" + line + "\033[K") if tty else line + "\n")
                if on_step is not None:
                    on_step(step, loss_value)
                every = cfg.checkpoint.every_steps
                if every and step % every == 0:
                    result.checkpoint, saved_step = save(), step
                if step % cfg.train.log_every == 0:
                    writer.flush()
                    if db is not None:
                        db.set_progress(run_id, step)
                        beat = time.monotonic()
                elif db is not None and time.monotonic() - beat > HEARTBEAT_S:
                    db.heartbeat(run_id)
                    beat = time.monotonic()
            if saved_step != step:
                result.checkpoint, saved_step = save(), step
            elif result.checkpoint is None:
                result.checkpoint = ckpt.latest(cfg.checkpoint.dir)
            if stop.signum is not None:
                result.status, result.signum = "interrupted", stop.signum
            else:
                result.status = "completed" if step >= total_steps else "stopped"
    except BaseException:
        result.status = "failed"
        raise
    finally:
        if tty:
            sys.stderr.write("\n")
        loader.close()
        result.step, result.tokens = step, tokens
        flush_error: Exception | None = None
        failing = result.status == "failed"
        try:
            writer.flush()
        except Exception as e:
            flush_error, result.status = e, "failed"
        finally:
            writer.close()
        if db is not None:
            db.finish_run(run_id, result.status, step)
            db.close()
        if flush_error is not None and not failing:
            raise flush_error
    return result
