"""Checkpoints: DCP round trip without a process group, RNG capture, atomic `latest`, pruning, refusals."""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from nmoe import sharding
from nmoe.config import Config, OptimConfig, from_dict
from nmoe.reference.optim import adamw_step, muon_step
from nmoe.sharding import ExpertShard
from nmoe.train import checkpoint as ckpt
from nmoe.train.optim import OptimSteps, TrainOptimizer, build_optimizer

SPEC = OptimSteps(adamw=adamw_step, muon=muon_step)


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Parameter(torch.randn(6, 4, generator=g))
        self.norm = nn.Parameter(torch.ones(4))
        self.router_bias: torch.Tensor
        self.register_buffer("router_bias", torch.randn(3, generator=g))


def trained(seed: int, cfg: Config) -> tuple[Net, TrainOptimizer]:
    net = Net(seed)
    opt = build_optimizer(net, cfg.optim, SPEC)
    for i in range(3):
        loss = (net.lin.sum(0) * net.norm).pow(2).sum() * (i + 1)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    return net, opt


def make_cfg(tmp: Path, **optim: object) -> Config:
    return from_dict({"checkpoint": {"dir": str(tmp / "ck"), "keep_last": 2},
                      "optim": {"lr_dense": 0.01, **optim}}, env={})


def save(
    cfg: Config, net: Net, opt: TrainOptimizer, step: int, loader: dict[str, object] | None = None
) -> Path:
    return ckpt.save(cfg.checkpoint.dir, step=step, tokens=step * 64, model=net, optimizer=opt,
                     loader_state=loader or {"global_seq": step}, cfg=cfg, run_id="r1",
                     keep_last=cfg.checkpoint.keep_last)


def test_round_trip_without_process_group(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    cfg = make_cfg(tmp_path)
    net, opt = trained(0, cfg)
    path = save(cfg, net, opt, 10, {"global_seq": 40, "swrr": [0.25, -0.25]})
    assert ckpt.latest(cfg.checkpoint.dir) == path
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 10 and meta["tokens"] == 640 and len(meta["fingerprint"]) == 64
    assert "git_sha" in meta and "git_dirty" in meta
    other, other_opt = Net(99), build_optimizer(Net(99), cfg.optim, SPEC)
    other_opt = build_optimizer(other, cfg.optim, SPEC)
    r = ckpt.load(path, model=other, optimizer=other_opt, cfg=cfg)
    assert (r.step, r.tokens, r.run_id) == (10, 640, "r1")
    assert r.loader_state == {"global_seq": 40, "swrr": [0.25, -0.25]}
    for (n, a), (_, b) in zip(net.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    want, got = opt.named_state(), other_opt.named_state()
    assert want.keys() == got.keys() == {"lin", "norm"}
    for name in want:
        for key in want[name]:
            assert torch.equal(want[name][key], got[name][key]), (name, key)


def test_bf16_params_round_trip_with_their_fp32_masters(tmp_path: Path) -> None:
    """train.param_dtype = "bf16": the checkpoint holds the bf16 params and, in the optimizer state, the fp32
    masters that carry the bits the params dropped; both load back exactly."""
    cfg = make_cfg(tmp_path)
    net = Net(0).to(torch.bfloat16)
    opt = build_optimizer(net, cfg.optim, SPEC)
    for i in range(3):
        ((net.lin.sum(0) * net.norm).float().pow(2).sum() * (i + 1)).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    path = save(cfg, net, opt, 3)
    other = Net(9).to(torch.bfloat16)
    other_opt = build_optimizer(other, cfg.optim, SPEC)
    ckpt.load(path, model=other, optimizer=other_opt, cfg=cfg)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), other.state_dict().values(),
                                                  strict=True))
    want, got = opt.named_state(), other_opt.named_state()
    assert want["lin"]["master"].dtype == torch.float32
    assert not torch.equal(want["lin"]["master"], net.lin.float()), "the master holds bits the param drops"
    for name in want:
        assert want[name].keys() == got[name].keys()
        for key in want[name]:
            assert torch.equal(want[name][key], got[name][key]), (name, key)


def test_rng_states_are_restored(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    net, opt = trained(0, cfg)
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    path = save(cfg, net, opt, 1)
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    ckpt.load(path, model=net, optimizer=opt, cfg=cfg)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect


def test_keep_last_and_atomic_pointer(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    net, opt = trained(0, cfg)
    for step in (1, 2, 3, 3):
        save(cfg, net, opt, step)
    root = Path(cfg.checkpoint.dir)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert (root / "latest").read_text().strip() == "step_00000003"


def test_partial_save_is_invisible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_cfg(tmp_path)
    net, opt = trained(0, cfg)
    good = save(cfg, net, opt, 1)

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_fsync_json", crash)
    with pytest.raises(ckpt.CheckpointError, match="disk full"):
        save(cfg, net, opt, 2)
    assert ckpt.latest(cfg.checkpoint.dir) == good
    assert not ckpt.step_dir(Path(cfg.checkpoint.dir), 2).exists()


def test_changed_config_is_refused_with_keys(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    net, opt = trained(0, cfg)
    path = save(cfg, net, opt, 4)
    changed = make_cfg(tmp_path, lr_dense=0.5, beta2=0.99)
    with pytest.raises(ckpt.CheckpointConfigMismatch) as e:
        ckpt.load(path, model=net, optimizer=build_optimizer(net, changed.optim, SPEC), cfg=changed)
    assert e.value.keys == ["optim.beta2", "optim.lr_dense"]
    assert "optim.beta2, optim.lr_dense" in str(e.value) and "allow_fingerprint_change" in str(e.value)
    allowed = from_dict({"checkpoint": {"dir": cfg.checkpoint.dir, "keep_last": 2,
                                        "allow_fingerprint_change": True},
                         "optim": {"lr_dense": 0.5}}, env={})
    opt = build_optimizer(net, allowed.optim, SPEC)
    assert ckpt.load(path, model=net, optimizer=opt, cfg=allowed).step == 4


def test_dangling_pointer_and_shape_change_are_clear(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    net, opt = trained(0, cfg)
    path = save(cfg, net, opt, 1)
    wider = nn.Module()
    wider.lin = nn.Parameter(torch.zeros(7, 4))
    wider.norm = nn.Parameter(torch.ones(4))
    wider.register_buffer("router_bias", torch.zeros(3))
    changed = r"Size mismatch .*model\.lin\); the model shape or parameter names changed"
    with pytest.raises(ckpt.CheckpointError, match=changed):
        opt = build_optimizer(wider, OptimConfig(lr_dense=0.01), SPEC)
        ckpt.load(path, model=wider, optimizer=opt, cfg=cfg)
    (Path(cfg.checkpoint.dir) / "latest").write_text("step_00000077\n")
    with pytest.raises(ckpt.CheckpointError, match="missing or incomplete"):
        ckpt.latest(cfg.checkpoint.dir)
    assert ckpt.latest(tmp_path / "fresh") is None


def _distcp(path: Path) -> Path:
    (f,) = sorted(path.glob("*.distcp"))
    return f


def test_flipped_bytes_in_distcp_are_named_on_load(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    net, opt = trained(0, cfg)
    path = save(cfg, net, opt, 1)
    f = _distcp(path)
    data = bytearray(f.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4] = b"\xff\xff\xff\xff"
    f.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=rf"{f.name}: .*corrupt.*older step") as e:
        ckpt.load(path, model=Net(1), optimizer=build_optimizer(Net(1), cfg.optim, SPEC), cfg=cfg)
    assert "shape" not in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["distcp", ".metadata", "rank_00000.pt"])
def test_truncated_checkpoint_file_is_named_not_a_shape_change(tmp_path: Path, name: str) -> None:
    cfg = make_cfg(tmp_path)
    net, opt = trained(0, cfg)
    path = save(cfg, net, opt, 1)
    f = _distcp(path) if name == "distcp" else path / name
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ckpt.CheckpointError, match=rf"{f.name}: .*truncated.*older step") as e:
        ckpt.load(path, model=Net(1), optimizer=build_optimizer(Net(1), cfg.optim, SPEC), cfg=cfg)
    assert "shape" not in str(e.value) and "PytorchStreamReader" not in str(e.value)
    assert "\n" not in str(e.value)


def test_empty_latest_pointer_is_an_error_not_a_name(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    net, opt = trained(0, cfg)
    save(cfg, net, opt, 1)
    pointer = Path(cfg.checkpoint.dir) / "latest"
    pointer.write_text("\n")
    with pytest.raises(ckpt.CheckpointError, match=rf"{pointer} is empty; .*step_\*"):
        ckpt.latest(cfg.checkpoint.dir)


def test_full_disk_leaves_no_partial_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_cfg(tmp_path)
    net, opt = trained(0, cfg)
    good = save(cfg, net, opt, 1)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ckpt.CheckpointError, match=r"cannot write .*No space left.*step_00000001 is intact"):
        save(cfg, net, opt, 2)
    root = Path(cfg.checkpoint.dir)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    assert ckpt.latest(root) == good


def test_unwritable_dir_is_found_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint.dir {blocker / 'ck'}.*not writable"):
        ckpt.check_writable(blocker / "ck")


def test_second_trainer_on_one_dir_is_refused_naming_the_holder(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    holder = rf"{root} is in use by run first-run .*pid {os.getpid()}"
    with ckpt.DirLock(root, run="first-run"), pytest.raises(ckpt.CheckpointError, match=holder), \
            ckpt.DirLock(root, run="second"):
        pass
    with ckpt.DirLock(root, run="third"):
        pass


class ExpertNet(Net):
    """Net plus a [4, 3, 2] expert stack of which this rank holds rows [2*rank, 2*rank + 2)."""

    def __init__(self, seed: int, shard: ExpertShard) -> None:
        super().__init__(seed)
        full = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(seed + 1))
        self.w_up = nn.Parameter(full[shard.rows(4)].clone())
        sharding.mark(self.w_up, shard)


def _expert_rank(rank: int, port: int, tmp: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cfg = make_cfg(Path(tmp))
        shard = ExpertShard(rank, 2)
        net = ExpertNet(0, shard)
        opt = build_optimizer(net, cfg.optim, SPEC)
        ((net.w_up.sum() * (rank + 2)).pow(2) + net.lin.sum().pow(2)).backward()  # type: ignore[no-untyped-call]
        opt.step()
        path = ckpt.save(cfg.checkpoint.dir, step=1, tokens=64, model=net, optimizer=opt, keep_last=2,
                         loader_state={"global_seq": 1}, cfg=cfg, run_id="r1", rank=rank, world=2)
        fresh = ExpertNet(10, shard)
        fresh_opt = build_optimizer(fresh, cfg.optim, SPEC)
        ckpt.load(path, model=fresh, optimizer=fresh_opt, cfg=cfg, rank=rank, world=2)
        moments = fresh_opt.named_state()["w_up"]["exp_avg"], opt.named_state()["w_up"]["exp_avg"]
        out.put((rank, torch.equal(fresh.w_up, net.w_up), torch.equal(*moments),
                 torch.equal(fresh.lin, net.lin)))
    finally:
        dist.destroy_process_group()


def test_sep_checkpoint_expert_keys_shared(tmp_path: Path) -> None:
    """Two gloo ranks, each holding different experts under one parameter name: each resumes its own
    shard and its own optimizer moments (DCP keeps one rank's copy of a key that every rank saves)."""
    a, b = ExpertNet(0, ExpertShard(0, 2)), ExpertNet(0, ExpertShard(1, 2))
    assert not torch.equal(a.w_up, b.w_up), "the two ranks' experts differ"
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_expert_rank, args=(r, port, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert got == [(0, True, True, True), (1, True, True, True)]
    meta = json.loads((ckpt.latest(tmp_path / "ck") / "meta.json").read_text())  # type: ignore[operator]
    assert meta["expert_parallel"] is True


def test_expert_parallel_checkpoint_refuses_a_run_without_it(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    net, opt = trained(0, cfg)
    path = save(cfg, net, opt, 1)
    sharded = ExpertNet(0, ExpertShard(0, 1))
    with pytest.raises(ckpt.CheckpointError, match=r"same train\.expert_parallel"):
        ckpt.load(path, model=sharded, optimizer=build_optimizer(sharded, cfg.optim, SPEC), cfg=cfg)
