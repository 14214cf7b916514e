"""loader -> model -> loss -> backward -> clip -> step -> router bias -> metrics -> checkpoint.
`nmoe train` builds the fast-path model, so it needs an sm_90a/sm_100a GPU; `train()` accepts any model
with forward(tokens, targets) -> loss (or logits), which is how the CPU tests drive it."""

from __future__ import annotations

import math
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from nmoe.config import Config, ConfigError, load_config
from nmoe.fast.arch import arch_of
from nmoe.train import checkpoint as ckpt
from nmoe.train.data import build_loader
from nmoe.train.metrics import (
    ExperimentsDB,
    MetricsWriter,
    memory_stats,
    new_run_id,
    peak_flops,
    router_stats,
)
from nmoe.train.optim import build_optimizer, clip_grad_norm, param_kind, wsd_factor

GPU_NEEDED: Final[str] = (
    "needs an NVIDIA GPU with sm_90a (H100/H200) or sm_100a (B200) and a CUDA build of torch, since it "
    "trains with the CuTeDSL fast path"
)

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


def default_loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    """model(tokens, targets) may return the mean loss itself or logits [B,S,V] (fp32 CE taken here)."""
    out: Tensor = model(inputs, targets)
    if out.dim() == 0:
        return out
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), targets.reshape(-1))


def flops_per_token(model: nn.Module, cfg: Config) -> float:
    """6·(active matmul params, experts scaled by k/E, embedding lookup excluded) + causal attention."""
    m = cfg.model
    active = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed" in name:
            continue
        share = m.n_activated_experts / m.n_routed_experts if param_kind(name, p) == "expert" else 1.0
        active += p.numel() * share
    attn = 3.0 * m.n_layers * cfg.data.seq_len * m.n_heads * (m.qk_head_dim + m.v_head_dim)
    return 6.0 * active + attn


def gpu_problem() -> str | None:
    """Why this machine cannot run the fast path, or None."""
    if not torch.cuda.is_available():
        return f"{GPU_NEEDED}; found no CUDA device (torch {torch.__version__})"
    cap = torch.cuda.get_device_capability()
    if arch_of(cap) is None:
        return f"{GPU_NEEDED}; found {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})"
    return None


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


def _router_names(model: nn.Module) -> list[str]:
    return [n.rsplit(".", 1)[0] if "." in n else "model" for n, _ in model.named_buffers()
            if n.endswith("router_bias")]


def _router_biases(model: nn.Module) -> list[Tensor]:
    return [b for n, b in model.named_buffers() if n.endswith("router_bias")]


def _allreduce_grads(params: Sequence[Tensor]) -> None:
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def train(
    cfg: Config,
    model: nn.Module,
    *,
    device: str | torch.device | None = None,
    max_steps: int | None = None,
    loss_fn: LossFn = default_loss,
    on_step: StepHook | None = None,
    rank: int = 0,
    world: int = 1,
    progress: bool = True,
) -> TrainResult:
    """Train until schedule.total_tokens (or `max_steps` total steps), resuming from checkpoint.dir/latest.

    Always leaves a checkpoint of the last step done; SIGTERM/SIGINT stop cleanly at a step boundary.
    """
    dev = torch.device(device if device is not None else cfg.train.device)
    _seed_all(cfg.train.seed + rank)
    model.to(dev)
    model.train()
    optimizer = build_optimizer(model, cfg.optim)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    loader = build_loader(cfg.data.dataset_dir, cfg.data.mixture, seq_len=cfg.data.seq_len,
                          batch_size=cfg.data.batch_size, seed=cfg.data.seed, prefetch=cfg.data.prefetch,
                          rank=rank, world=world,
                          vocab_size=cfg.model.vocab_size)
    step = tokens = 0
    run_id = new_run_id(cfg.train.run_name)
    resumed_from = ckpt.latest(cfg.checkpoint.dir)
    if resumed_from is not None:
        r = ckpt.load(resumed_from, model=model, optimizer=optimizer, cfg=cfg, rank=rank, world=world)
        loader.load_state_dict(r.loader_state)
        step, tokens, run_id = r.step, r.tokens, r.run_id
    total_steps = -(-cfg.schedule.total_tokens // loader.tokens_per_step)
    end_step = total_steps if max_steps is None else min(max_steps, total_steps)
    db = ExperimentsDB(cfg.metrics.db_path) if rank == 0 else None
    if db is not None:
        db.start_run(run_id, cfg, world=world, resumed=resumed_from is not None)
    writer = MetricsWriter(cfg.metrics.dir, run_id, rank)
    writer.truncate_after(step)
    has_router = hasattr(model, "router_counts") and hasattr(model, "update_router_bias")
    router_names = _router_names(model)
    fpt, peak = flops_per_token(model, cfg), peak_flops(dev)
    result = TrainResult(run_id, "running", step, tokens, resumed_from=resumed_from)
    saved_step = step if resumed_from is not None else -1
    tty = progress and sys.stderr.isatty()
    t_start, steps_run = time.perf_counter(), 0

    def save() -> Path:
        return ckpt.save(cfg.checkpoint.dir, step=step, tokens=tokens, model=model, optimizer=optimizer,
                         loader_state=loader.state_dict(), cfg=cfg, run_id=run_id,
                         keep_last=cfg.checkpoint.keep_last, rank=rank, world=world)

    try:
        with _StopFlag() as stop:
            while step < end_step and stop.signum is None:
                t0 = time.perf_counter()
                batch = next(loader)
                tokens_after = tokens + loader.tokens_per_step
                optimizer.set_lr_factor(wsd_factor(tokens_after, cfg.schedule))
                inputs = batch.inputs.to(dev, non_blocking=True)
                targets = batch.targets.to(dev, non_blocking=True)
                loss = loss_fn(model, inputs, targets)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"loss is {float(loss)} at step {step + 1}; lower the learning "
                                             "rate or inspect the batch (first global sequence "
                                             f"{batch.first_seq})")
                loss.backward()  # type: ignore[no-untyped-call]
                if world > 1:
                    _allreduce_grads(params)
                grad_norm = clip_grad_norm(params, cfg.optim.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                counts: list[Tensor] = []
                if has_router:
                    counts = [c.clone() for c in model.router_counts()]  # type: ignore[operator]
                    if world > 1:
                        for c in counts:
                            dist.all_reduce(c)
                    model.update_router_bias(counts)  # type: ignore[operator]
                step, tokens = step + 1, tokens_after
                loss_value = float(loss.detach())
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                dt = time.perf_counter() - t0
                steps_run += 1
                result.losses.append(loss_value)
                tok_s = loader.tokens_per_step / dt
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
                            f"{tok_s:,.0f} tok/s {1e3 * dt:.0f} ms/step ETA {_fmt_eta(eta)}")
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
            if saved_step != step:
                result.checkpoint, saved_step = save(), step
            elif result.checkpoint is None:
                result.checkpoint = ckpt.latest(cfg.checkpoint.dir)
            if stop.signum is not None:
                result.status = "interrupted"
            else:
                result.status = "completed" if step >= total_steps else "stopped"
    except BaseException:
        result.status = "failed"
        raise
    finally:
        if tty:
            sys.stderr.write("\n")
        loader.close()
        writer.flush()
        result.step, result.tokens = step, tokens
        if db is not None:
            db.finish_run(run_id, result.status, step)
            db.close()
    return result


def _build_fast_model(cfg: Config) -> nn.Module:
    try:
        from nmoe.fast.model import Model  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        raise RuntimeError(f"the fast-path model nmoe.fast.model.Model is not available ({e}); `nmoe train` "
                           "needs it (the reference model is for CPU tests only)") from e
    model: nn.Module = Model(cfg.model)
    return model


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: nmoe train CONFIG [--section.key=value ...]\n\n" + (__doc__ or "").strip())
        return 0 if args else 2
    problem = gpu_problem()
    if problem is not None:
        print(f"nmoe train: {problem}. CPU runs of the loop exist only as tests "
              "(python -m pytest tests/test_train_loop.py).", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args[0], overrides=args[1:])
    except ConfigError as e:
        print(f"nmoe train: {e}", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        result = train(cfg, _build_fast_model(cfg), device="cuda", rank=rank, world=world)
    finally:
        if world > 1:
            dist.destroy_process_group()
    print(f"nmoe train: {result.status} at step {result.step} ({result.tokens:,} tokens); checkpoint "
          f"{result.checkpoint}; run {result.run_id}")
    return 0
