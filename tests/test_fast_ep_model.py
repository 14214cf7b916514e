"""Expert parallelism end to end on the GPU: the fast model with its routed experts (bf16 or fp8) sharded over
W ranks (W processes sharing one GPU, one RDEP exchange for every MoE layer) gives one process's loss and
gradients on the same global batch; train() over RDEP resumes and runs graphed steps bit for bit like its
unbroken eager run; `nmoe train` under torchrun on two GPUs logs one GPU's losses."""

# Bounds: the EP layer's output equals the one-process layer's bit for bit (tests/test_fast_rdep.py); what
# differs is the batch split (per-rank CE means averaged, dense GEMMs of half the rows, gradient sums over
# ranks in another order), a few fp32/bf16 roundings: loss within 2^-10 relative, each gradient tensor
# within 2^-6 (the moe_layer EP bound) in L2.

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from nmoe.config import ModelConfig, load_config

REPO = Path(__file__).resolve().parent.parent
gpu = pytest.mark.gpu
LOSS_REL, GRAD_REL = 2.0**-10, 2.0**-6


def _cfg(dtype: str = "bf16") -> ModelConfig:
    return load_config(REPO / "configs" / "tiny-gpu.toml", env={}, overrides=[
        "--model.tokenizer=none", "--model.vocab_size=4096", "--model.n_layers=3",
        f"--model.expert_dtype={dtype}"]).model


def _rel(a: Tensor, b: Tensor) -> float:
    return float(torch.linalg.vector_norm(a.double() - b.double()) /
                 torch.linalg.vector_norm(b.double()).clamp(min=1e-30))


def ep_model_job(group: Any, cfg: ModelConfig, tokens: Tensor) -> dict[str, Any]:
    """This rank's half of the batch through its shard, gradients reduced over ranks as the trainer does,
    against one process holding every expert on the whole batch."""
    import torch.distributed as dist

    from nmoe.fast.model import Model
    from nmoe.fast.rdep.ep import Exchange, slot_shape
    from nmoe.fast.rdep.group import RdepGroup
    from nmoe.fast.rdep.spmd import all_gather_bytes
    from nmoe.sharding import ExpertShard, reduce_grads, shard_of
    from nmoe.train.optim import clip_scale

    rank, world, dev = group.rank, group.shape.world, group.device
    slots = RdepGroup(slot_shape(group.shape), rank, dev, all_gather_bytes)

    def all_reduce_sum(t: Tensor) -> None:
        dist.all_reduce(t)

    try:
        model = Model(cfg, seed=7, device=dev, shard=ExpertShard(rank, world))
        model.attach_exchange(Exchange(group, slots))
        b = tokens.shape[0] // world
        tok = tokens[rank * b:(rank + 1) * b].to(dev)
        loss = model(tok[:, :-1], tok[:, 1:])
        loss.backward()
        model.check_exchange()
        params = list(model.parameters())
        reduce_grads(params, world, all_reduce_sum)
        norm = clip_scale(params, 0.0, all_reduce_sum)[0]
        mean = loss.detach().float().clone()
        all_reduce_sum(mean)
        group.sync_check()
        slots.sync_check()

        one = Model(cfg, seed=7, device=dev)
        whole = tokens.to(dev)
        ref = one(whole[:, :-1], whole[:, 1:])
        ref.backward()
        ref_norm = clip_scale(list(one.parameters()), 0.0)[0]
        ref_grads = {n: p.grad for n, p in one.named_parameters()}
        errs = {}
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            want = ref_grads[name]
            assert want is not None, name
            s = shard_of(p)
            errs[name] = _rel(p.grad, want if s is None else want[s.rows(want.shape[0])])
        return {"loss": float(mean) / world, "ref_loss": float(ref.detach()), "norm": float(norm),
                "ref_norm": float(ref_norm), "errs": errs}
    finally:
        dist.barrier()
        slots.close()


@gpu
@pytest.mark.parametrize(("w", "dtype"), [(2, "bf16"), (4, "bf16"), (2, "fp8")], ids=["W2", "W4", "W2_fp8"])
def test_ep_model_matches_one_process_on_the_same_batch(w: int, dtype: str) -> None:
    from nmoe.fast.model import ep_shape
    from nmoe.fast.rdep import spmd as ranks
    from parity import spmd

    cfg = _cfg(dtype)
    b, s = 2, 128
    tokens = torch.randint(0, cfg.vocab_size, (w * b, s + 1), generator=torch.Generator().manual_seed(3))
    shape = ep_shape(cfg, b * s, w, float(w), 60.0)
    outs = spmd.pool(w).run(ranks.Job(ep_model_job, shape, tuple((cfg, tokens) for _ in range(w))))
    for r, o in enumerate(outs):
        print(f"rank {r}: loss {o['loss']:.6f} (one process {o['ref_loss']:.6f}), norm {o['norm']:.5f} "
              f"({o['ref_norm']:.5f}), worst grad {max(o['errs'].items(), key=lambda kv: kv[1])}")
        assert abs(o["loss"] - o["ref_loss"]) <= LOSS_REL * o["ref_loss"], f"rank {r} loss"
        assert abs(o["norm"] - o["ref_norm"]) <= GRAD_REL * o["ref_norm"], f"rank {r} grad norm"
        bad = {n: e for n, e in o["errs"].items() if e > GRAD_REL}
        assert not bad, f"rank {r}: gradients beyond {GRAD_REL}: {bad}"


_STEP = re.compile(r"step (\d+)/\d+ loss ([0-9.]+)")


def _losses(err: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in _STEP.finditer(err)}


@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs: NCCL refuses two ranks on one GPU (the one-GPU EP check is above)")
def test_torchrun_two_gpus_expert_parallel_logs_one_gpus_losses(tmp_path: Path) -> None:
    """Same global batch (2 ranks x 4 sequences against 1 rank x 8): the first steps' losses agree."""
    from nmoe.data import prep

    data = tmp_path / "data"
    assert prep.main(["--out", str(data), "--workers", "1", "--no-progress"]) == 0
    common = [f"--data.dataset_dir={data}", "--data.seq_len=256", "--train.log_every=1",
              "--checkpoint.every_steps=0", f"--metrics.db_path={tmp_path / 'experiments.sqlite'}",
              "--schedule.warmup_tokens=8192", "--schedule.total_tokens=10240"]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    runs = {}
    for name, launch, extra in (
        ("one", [sys.executable, "-m", "nmoe.cli"], ["--data.batch_size=8"]),
        ("two", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "nmoe.cli"],
         ["--data.batch_size=4", "--train.expert_parallel=true", "--train.ep_capacity=2.0"]),
    ):
        args = [*launch, "train", str(REPO / "configs" / "tiny-gpu.toml"), *common, *extra,
                f"--checkpoint.dir={tmp_path / name / 'ckpt'}", f"--train.run_name={name}",
                f"--metrics.dir={tmp_path / name / 'metrics'}"]
        p = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = _losses(p.stderr)
    print(runs)
    assert len(runs["one"]) == 5 and runs["one"].keys() <= runs["two"].keys()
    for step in (1, 2, 3):
        a, b = runs["one"][step], runs["two"][step]
        assert abs(a - b) <= 2.0**-8 * a, f"step {step}: one GPU {a}, two GPUs {b}"


EP_STEPS = 6


def _ep_train_cfg(tmp: Path, data: Path, name: str, steps: int, *extra: str) -> Any:
    tokens = 2 * 2 * 256
    return load_config(REPO / "configs" / "tiny-gpu.toml", env={}, overrides=[
        f"--data.dataset_dir={data}", f"--checkpoint.dir={tmp / name / 'ckpt'}", "--train.log_every=2",
        f"--metrics.db_path={tmp / name / 'experiments.sqlite'}", f"--metrics.dir={tmp / name / 'metrics'}",
        "--checkpoint.every_steps=0", "--data.seq_len=256", "--data.batch_size=2",
        "--train.expert_parallel=true",
        f"--schedule.warmup_tokens={4 * tokens}", f"--schedule.total_tokens={steps * tokens}", *extra,
    ])


Run = tuple[str, int, tuple[str, ...]]
"""(name, steps to stop after, config overrides) of one train() call; runs of one name continue its
checkpoints, so a second run of a name resumes the first."""


def ep_train_job(group: Any, tmp: Path, data: Path, runs: tuple[Run, ...],
                 pair: tuple[str, str]) -> dict[str, Any]:
    """train() itself over 2 ranks with experts sharded (data + expert parallel), each run in a fresh model:
    every name's losses, run after run, and the state keys (weights, router biases) two names end apart on."""
    import torch.distributed as dist

    from nmoe.fast.model import Model, ep_shape
    from nmoe.fast.rdep.ep import Exchange, slot_shape
    from nmoe.fast.rdep.group import RdepGroup
    from nmoe.fast.rdep.spmd import all_gather_bytes
    from nmoe.sharding import ExpertShard
    from nmoe.train.loop import train
    from nmoe.traincli import optim_steps

    rank, world, dev = group.rank, group.shape.world, group.device
    slots = RdepGroup(slot_shape(group.shape), rank, dev, all_gather_bytes)
    try:
        ex = Exchange(group, slots)
        losses: dict[str, list[float]] = {}
        states: dict[str, dict[str, Tensor]] = {}
        for name, stop, extra in runs:
            cfg = _ep_train_cfg(tmp, data, name, EP_STEPS, *extra)
            t = cfg.train
            assert ep_shape(cfg.model, 2 * 256, world, t.ep_capacity, t.ep_timeout_s) == group.shape
            model = Model(cfg.model, seed=cfg.train.seed, device=dev, shard=ExpertShard(rank, world))
            model.attach_exchange(ex)
            res = train(cfg, model, steps=optim_steps(cfg), device=dev, max_steps=stop, rank=rank,
                        world=world, progress=False)
            losses[name] = losses.get(name, []) + res.losses
            if name in pair:
                states[name] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            dist.barrier()
        a, b = states[pair[0]], states[pair[1]]
        return {"losses": losses, "differ": sorted(k for k, v in a.items() if not torch.equal(v, b[k]))}
    finally:
        dist.barrier()
        slots.close()


def _ep_train(tmp: Path, runs: tuple[Run, ...], pair: tuple[str, str]) -> list[dict[str, Any]]:
    from nmoe.data import prep
    from nmoe.fast.model import ep_shape
    from nmoe.fast.rdep import spmd as ranks
    from parity import spmd

    data = tmp / "data"
    assert prep.main(["--out", str(data), "--workers", "1", "--no-progress"]) == 0
    cfg = _ep_train_cfg(tmp, data, "probe", EP_STEPS)
    shape = ep_shape(cfg.model, 2 * 256, 2, cfg.train.ep_capacity, cfg.train.ep_timeout_s)
    job = ranks.Job(ep_train_job, shape, ((tmp, data, runs, pair),) * 2)
    outs: list[dict[str, Any]] = spmd.pool(2).run(job)
    return outs


@gpu
def test_ep_training_over_two_ranks_resumes_bitwise(tmp_path: Path) -> None:
    """6 unbroken steps, and 3 steps, a checkpoint, then 3 more from it in a fresh model."""
    outs = _ep_train(tmp_path, (("full", 6, ()), ("split", 3, ()), ("split", 6, ())), ("full", "split"))
    for r, o in enumerate(outs):
        full, split = o["losses"]["full"], o["losses"]["split"]
        print(f"rank {r}: unbroken {full}, resumed {split}")
        assert len(full) == 6 and full[-1] < full[0], f"rank {r}: loss does not fall"
        assert split == full, f"rank {r}: the resumed run's losses differ from the unbroken run's"
        assert not o["differ"], f"rank {r}: differ after resume: {o['differ']}"
    assert outs[0]["losses"]["full"] == outs[1]["losses"]["full"], "a rank logs its own, not the global loss"


@gpu
@pytest.mark.parametrize("accum", [1, 2])
def test_graphed_ep_training_matches_eager_bitwise(tmp_path: Path, accum: int) -> None:
    """train.cuda_graph over RDEP (step 1 eager, then one capture and replays; with grad_accum 2 a second
    graph adds the second microbatch's gradients) logs the eager run's losses and ends on its weights."""
    acc = f"--train.grad_accum={accum}"
    runs = (("eager", EP_STEPS, (acc,)), ("graph", EP_STEPS, (acc, "--train.cuda_graph=true")))
    outs = _ep_train(tmp_path, runs, ("eager", "graph"))
    for r, o in enumerate(outs):
        eager, graph = o["losses"]["eager"], o["losses"]["graph"]
        print(f"rank {r}: eager {eager}, graphed {graph}")
        assert len(eager) == EP_STEPS // accum and graph == eager, f"rank {r}: graphed losses differ"
        assert not o["differ"], f"rank {r}: weights differ after graphed steps: {o['differ']}"
