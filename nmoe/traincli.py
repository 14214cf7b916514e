"""`nmoe train CONFIG`: read and check the config, build the model it names, train, exit non-zero unless
the run completed or stopped. The spec model is built here, never in nmoe/train, and only when the config
says train.model = "reference" (device = "cpu"); the fast model needs an sm_90a/sm_100a GPU."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Final

import torch
import torch.distributed as dist
from torch import nn

from nmoe.config import Config, ConfigError, load_config
from nmoe.data.prep import PrepError
from nmoe.fast.arch import arch_of
from nmoe.train.checkpoint import CheckpointError
from nmoe.train.data import DataError
from nmoe.train.loop import TrainResult, train
from nmoe.train.optim import OptimSteps

GPU_NEEDED: Final[str] = (
    "needs an NVIDIA GPU with sm_90a (H100/H200) or sm_100a (B200) and a CUDA build of torch, since "
    "train.model = \"fast\" trains with the CuTeDSL fast path"
)
CPU_HINT: Final[str] = 'a CPU run of the spec model needs train.device = "cpu" and train.model = "reference"'


def gpu_problem() -> str | None:
    """Why this machine cannot run the fast path, or None."""
    if not torch.cuda.is_available():
        return f"{GPU_NEEDED}; found no CUDA device (torch {torch.__version__})"
    cap = torch.cuda.get_device_capability()
    if arch_of(cap) is None:
        return f"{GPU_NEEDED}; found {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})"
    return None


def build_model(cfg: Config, rank: int = 0, world: int = 1) -> nn.Module:
    """The spec model on the CPU, or the fast model built on the current GPU in train.param_dtype; with
    train.expert_parallel it holds this rank's experts and opens its RDEP exchange (collective)."""
    model: nn.Module
    if cfg.train.model == "reference":
        from nmoe.reference.model import Model as SpecModel

        if cfg.train.param_dtype != "fp32":
            raise ValueError(f"train.param_dtype = {cfg.train.param_dtype!r}: the spec model keeps fp32 "
                             "params; set it to \"fp32\" or train the fast model (train.model = \"fast\")")
        model = SpecModel(cfg.model, seed=cfg.train.seed, ce_chunk=cfg.train.ce_chunk)
        return model
    from nmoe.fast.model import Model, ep_shape
    from nmoe.fast.rdep.ep import Exchange
    from nmoe.fast.rdep.spmd import all_gather_bytes
    from nmoe.sharding import ExpertShard

    t = cfg.train
    shard = ExpertShard(rank, world) if t.expert_parallel else None
    fast = Model(cfg.model, seed=t.seed, ce_chunk=t.ce_chunk, param_dtype=t.param_dtype, shard=shard)
    if shard is not None:
        tokens = cfg.data.batch_size * cfg.data.seq_len
        shape = ep_shape(cfg.model, tokens, world, t.ep_capacity, t.ep_timeout_s)
        ex = Exchange.open(shape, rank, torch.device("cuda", torch.cuda.current_device()), all_gather_bytes)
        fast.attach_exchange(ex)
        if rank == 0:
            gib = (ex.fwd.layout.nbytes + ex.slots.layout.nbytes) / 2**30
            print(f"nmoe train: experts sharded over {world} ranks ({shape.n_local} each); RDEP windows "
                  f"{gib:.2f} GiB per rank, receive capacity {shape.capacity} rows", file=sys.stderr)
    return fast


def optim_steps(cfg: Config) -> OptimSteps:
    """The step functions train.model names: the spec's for "reference" (CPU), else the fast path's."""
    if cfg.train.model == "reference":
        from nmoe.reference.optim import adamw_step as ref_adamw
        from nmoe.reference.optim import muon_step as ref_muon

        return OptimSteps(adamw=ref_adamw, muon=ref_muon)
    from nmoe.fast.optim import adamw_step, muon_step

    return OptimSteps(adamw=adamw_step, muon=muon_step)


def exit_code(result: TrainResult) -> int:
    """0 for completed or stopped (max steps reached); 128 + signal when interrupted; 1 otherwise."""
    if result.status in ("completed", "stopped"):
        return 0
    if result.status == "interrupted" and result.signum is not None:
        return 128 + result.signum
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: nmoe train CONFIG [--section.key=value ...]\n\n" + (__doc__ or "").strip())
        return 0 if args else 2
    try:
        cfg = load_config(args[0], overrides=args[1:])
    except ConfigError as e:
        print(f"nmoe train: {e}", file=sys.stderr)
        return 2
    if cfg.train.model == "fast":
        problem = gpu_problem()
        if problem is not None:
            print(f"nmoe train: {problem}; {CPU_HINT}", file=sys.stderr)
            return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        if cfg.train.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cfg.train.device == "cuda" else "gloo")
    try:
        model = build_model(cfg, rank, world)
        result = train(cfg, model, steps=optim_steps(cfg), device=cfg.train.device, rank=rank, world=world)
        close = getattr(model, "close_exchange", None)
        if close is not None:
            close()
    except (CheckpointError, DataError, PrepError) as e:
        print(f"nmoe train: {e}", file=sys.stderr)
        return 1
    finally:
        if world > 1:
            dist.destroy_process_group()
    if rank == 0:
        print(f"nmoe train: {result.status} at step {result.step} ({result.tokens:,} tokens); checkpoint "
              f"{result.checkpoint}; run {result.run_id}")
    return exit_code(result)
