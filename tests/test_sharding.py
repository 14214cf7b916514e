"""Expert parallelism's CPU side: the shard of each rank, gradient reduction and norm over ranks, the model's
sharded construction (same weights whatever the world size), the exchange's size and the config refusals."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from nmoe import sharding
from nmoe.config import Config, ConfigError, ModelConfig, TrainConfig, load_config
from nmoe.sharding import ExpertShard

REPO = Path(__file__).resolve().parent.parent


def _tiny(*extra: str) -> ModelConfig:
    return load_config(REPO / "configs" / "tiny.toml", env={},
                       overrides=["--model.tokenizer=none", "--model.vocab_size=512", *extra]).model


def test_shard_rows_and_refusals() -> None:
    assert ExpertShard(1, 4).rows(8) == slice(2, 4) and ExpertShard(0, 1).rows(3) == slice(0, 3)
    with pytest.raises(ValueError, match=r"n_routed_experts \(6\) divisible by 4"):
        ExpertShard(0, 4).rows(6)
    with pytest.raises(ValueError, match=r"rank 2 must lie in \[0, world=2\)"):
        ExpertShard(2, 2)
    p = nn.Parameter(torch.zeros(2, 3))
    assert sharding.shard_of(p) is None and sharding.full_numel(p) == 6
    sharding.mark(p, ExpertShard(1, 4))
    assert sharding.shard_of(p) == ExpertShard(1, 4) and sharding.full_numel(p) == 24
    q = nn.Parameter(torch.zeros(1))
    assert sharding.checkpoint_keys([("a.w", p), ("b", q)]) == {"a.w": "a.w@experts1of4"}


def test_sep_sharding_expert_grads_all_reduced() -> None:
    shared, expert = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    shared.grad, expert.grad = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 6.0])
    sharding.mark(expert, ExpertShard(0, 2))
    reduced: list[int] = []

    def all_reduce_sum(t: Tensor) -> None:
        reduced.append(t.numel())
        t.mul_(2.0)  # a world of 2 ranks holding the same gradient

    sharding.reduce_grads([shared, expert], 2, all_reduce_sum)
    assert reduced == [3]
    assert shared.grad.tolist() == [1.0, 2.0, 3.0] and expert.grad.tolist() == [2.0, 3.0]


def test_sep_sharding_expert_norm_local() -> None:
    """Rank 0 holds replicated grad (3, 4) and expert grad (12); the other rank's expert grad is (5): the
    global norm is |(3, 4, 12, 5)| = sqrt(194), not this rank's |(3, 4, 12)| = 13."""
    from nmoe.train.optim import clip_scale

    rep, own = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    rep.grad, own.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    sharding.mark(own, ExpertShard(0, 2))
    local, overall = 13.0, math.sqrt(194.0)
    assert abs(local - overall) > 0.5, "the two norms differ"

    def all_reduce_sum(t: Tensor) -> None:
        t.add_(25.0)  # the other rank's squared expert norm

    assert float(clip_scale([rep, own], 0.0, all_reduce_sum)[0]) == pytest.approx(overall, rel=1e-6)
    assert float(clip_scale([rep, own], 0.0)[0]) == pytest.approx(local, rel=1e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_model_holds_slices_of_the_same_weights(world: int) -> None:
    """Every rank draws the whole expert stacks and keeps its rows: W ranks start from one model's weights."""
    from nmoe import modeldef
    from nmoe.reference.model import OPS

    cfg = _tiny("--model.n_routed_experts=8")
    cpu = torch.device("cpu")
    whole = dict(modeldef.Model(cfg, OPS, 3, 64, -100, cpu, torch.float32).named_parameters())
    for r in range(world):
        shard = ExpertShard(r, world)
        part = modeldef.Model(cfg, OPS, 3, 64, -100, cpu, torch.float32, shard)
        got = dict(part.named_parameters())
        assert got.keys() == whole.keys()
        for name, p in got.items():
            if sharding.shard_of(p) is not None:
                assert name.endswith(("w_up", "w2")) and sharding.shard_of(p) == shard
                assert torch.equal(p, whole[name][shard.rows(8)]), name
            else:
                assert torch.equal(p, whole[name]), name
    with pytest.raises(ValueError, match="divisible by 3"):
        modeldef.Model(cfg, OPS, 3, 64, -100, cpu, torch.float32, ExpertShard(0, 3))


def test_flops_count_every_ranks_experts() -> None:
    from nmoe.config import Config
    from nmoe.fast import model as fast_model
    from nmoe.train.loop import flops_parts

    cfg = Config(model=_tiny("--model.n_routed_experts=8"))
    whole = flops_parts(fast_model.Model(cfg.model, device="meta"), cfg)
    half = flops_parts(fast_model.Model(cfg.model, device="meta", shard=ExpertShard(1, 2)), cfg)
    assert half == whole and whole["expert"] > 0


def test_exchange_shape_and_attach_refusals() -> None:
    from nmoe.fast import model as fast_model
    from nmoe.fast.rdep.group import RdepShape

    cfg = _tiny("--model.n_routed_experts=8")
    s = fast_model.ep_shape(cfg, 100, 2, 1.5, 30.0)
    k = cfg.n_activated_experts
    assert (s.world, s.n_experts, s.tokens, s.top_k, s.hidden, s.capacity, s.timeout_s) == (
        2, 8, 100, k, cfg.dim, math.ceil(1.5 * 100 * k), 30.0)
    assert fast_model.ep_shape(cfg, 100, 2, 5.0, 30.0).capacity == 2 * 100 * k  # no rank can receive more
    with pytest.raises(ValueError, match=r"train\.ep_capacity"):
        fast_model.ep_shape(cfg, 100, 2, 0.0, 30.0)
    m = fast_model.Model(cfg, device="meta", shard=ExpertShard(0, 2))

    def ex(rank: int, shape: RdepShape) -> fast_model.Exchange:
        return SimpleNamespace(fwd=SimpleNamespace(rank=rank, shape=shape))  # type: ignore[return-value]

    with pytest.raises(ValueError, match=r"exchange of rank 1 of 2, model shard"):
        m.attach_exchange(ex(1, s))
    with pytest.raises(ValueError, match="does not fit the model"):
        m.attach_exchange(ex(0, fast_model.ep_shape(_tiny("--model.n_routed_experts=16"), 100, 2, 1.0, 1.0)))
    with pytest.raises(ValueError, match="build the model with shard"):
        fast_model.Model(cfg, device="meta").attach_exchange(ex(0, s))
    m.attach_exchange(ex(0, s))
    assert all(moe.ops.moe_layer is not fast_model.OPS.moe_layer for moe in m.moe_layers())


def test_expert_parallel_config_refusals() -> None:
    with pytest.raises(ConfigError, match=r'set train\.model = "fast"'):
        TrainConfig(device="cpu", model="reference", expert_parallel=True)
    assert TrainConfig(expert_parallel=True, cuda_graph=True).cuda_graph
    with pytest.raises(ConfigError, match="ep_capacity"):
        TrainConfig(ep_capacity=0.0)
    fp8 = _tiny("--model.expert_dtype=fp8", "--model.dim=128", "--model.moe_inter_dim=128")
    assert Config(model=fp8, train=TrainConfig(expert_parallel=True)).train.expert_parallel
    with pytest.raises(ConfigError, match=r'set model\.expert_dtype = "bf16" or "fp8"'):
        nvfp4 = _tiny("--model.expert_dtype=nvfp4", "--model.dim=128", "--model.moe_inter_dim=128")
        Config(model=nvfp4, train=TrainConfig(expert_parallel=True))
