"""Reference model: shapes, wiring, finite and bitwise-deterministic fwd/bwd, gradient flow, router bias."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from nmoe.config import ModelConfig, load_config
from nmoe.layout import MLAParams
from nmoe.reference.attention import mla_attention
from nmoe.reference.model import MLA, Block, DenseFFN, Model, MoE
from nmoe.reference.moe import moe_layer
from nmoe.reference.norm import rmsnorm

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
BF = torch.bfloat16


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny CPU ops lose more to intra-op thread contention on shared cores than they gain."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _small(**kw: str) -> ModelConfig:
    """tiny.toml with a synthetic 512-token vocab so the tests stay fast."""
    over = ["--model.tokenizer=none", "--model.vocab_size=512", *[f"--model.{k}={v}" for k, v in kw.items()]]
    return load_config(CONFIGS / "tiny.toml", env={}, overrides=over).model


def _tokens(cfg: ModelConfig, b: int, s: int, seed: int = 1) -> Tensor:
    return torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(seed))


def _bits(t: Tensor) -> Tensor:
    return t.detach().contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def test_tiny_config_forward_backward_finite_all_grads() -> None:
    cfg = load_config(CONFIGS / "tiny.toml", env={}).model
    model = Model(cfg, seed=0)
    tok = _tokens(cfg, 1, 12)
    loss = model(tok[:, :-1], tok[:, 1:])
    assert loss.dtype == torch.float32 and loss.dim() == 0 and torch.isfinite(loss)
    assert abs(float(loss.detach()) - torch.log(torch.tensor(float(cfg.vocab_size)))) < 0.5
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all() and bool(p.grad.abs().sum() > 0), name
    assert all(moe.router_bias.grad is None for moe in model.moe_layers())


def test_structure_and_param_dtypes() -> None:
    cfg = _small()
    model = Model(cfg)
    kinds = [type(blk.ffn) for blk in model.layers]
    assert kinds == [DenseFFN] * cfg.n_dense_layers + [MoE] * (cfg.n_layers - cfg.n_dense_layers)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    moe = model.moe_layers()[0]
    e, i, d = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim
    assert moe.w_up.shape == (e, 2 * i, d) and moe.w2.shape == (e, d, i)
    assert moe.shared_up is not None and moe.shared_up.shape == (2 * i * cfg.n_shared_experts, d)
    names = dict(model.named_parameters())
    assert "layers.1.ffn.router_bias" not in names and "layers.1.ffn.router_bias" in model.state_dict()
    assert "cos" not in model.state_dict()
    attn = model.layers[0].attn
    assert isinstance(attn, MLA) and attn.wq is None and attn.wq_a is not None


def test_init_deterministic_from_seed() -> None:
    cfg = _small()
    a, b, c = Model(cfg, seed=3), Model(cfg, seed=3), Model(cfg, seed=4)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), n
        assert not torch.equal(pa, pc) or bool((pa == 1).all()), n
    std = float(a.embed.detach().std())
    assert abs(std - cfg.init_std) < 0.1 * cfg.init_std


def _run(cfg: ModelConfig, seed: int) -> tuple[Tensor, dict[str, Tensor]]:
    model = Model(cfg, seed=seed)
    tok = _tokens(cfg, 2, 12)
    loss = model(tok[:, :-1], tok[:, 1:])
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_forward_backward_bitwise_deterministic() -> None:
    cfg = _small()
    l1, g1 = _run(cfg, 0)
    l2, g2 = _run(cfg, 0)
    assert torch.equal(_bits(l1), _bits(l2))
    assert g1.keys() == g2.keys() and len(g1) == len(list(Model(cfg).parameters()))
    for n in g1:
        assert torch.equal(_bits(g1[n]), _bits(g2[n])), n


@pytest.mark.parametrize(
    "kw",
    [{"q_lora_rank": "0", "activation": '"relu2"', "n_shared_experts": "0", "score_func": '"softmax"'},
     {"n_dense_layers": "0", "n_layers": "2", "n_expert_groups": "1", "n_limited_groups": "1"}],
)
def test_variants_grads_flow(kw: dict[str, str]) -> None:
    cfg = _small(**kw)
    model = Model(cfg)
    tok = _tokens(cfg, 1, 10)
    loss = model(tok[:, :-1], tok[:, 1:])
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and bool(p.grad.abs().sum() > 0), name
    if cfg.q_lora_rank == 0:
        attn = model.layers[0].attn
        assert isinstance(attn, MLA) and attn.wq is not None and attn.wq_a is None


def test_loss_is_cross_entropy_of_logits() -> None:
    cfg = _small()
    model = Model(cfg, seed=5)
    tok = _tokens(cfg, 2, 9)
    inp, tgt = tok[:, :-1], tok[:, 1:].clone()
    tgt[0, :3] = -100
    with torch.no_grad():
        logits = model(inp)
        loss = model(inp, tgt)
    assert logits.shape == (2, 9, cfg.vocab_size) and logits.dtype == torch.float32
    lp = torch.log_softmax(logits.double(), dim=-1)
    kept = tgt != -100
    ref = -lp[kept].gather(1, tgt[kept][:, None]).mean()
    assert abs(float(loss) - float(ref)) < 1e-5
    model.ce_chunk = 5
    with torch.no_grad():
        assert abs(float(model(inp, tgt)) - float(ref)) < 1e-5


def test_hidden_wiring_matches_manual_composition() -> None:
    """pre-norm residual blocks: h += attn(norm(h)); h += ffn(norm(h)); final norm. Norm weights are drawn
    apart first (init makes them all ones), so a block normed with the wrong weight shows."""
    cfg = _small()
    model = Model(cfg, seed=6)
    tok = _tokens(cfg, 2, 7)[:, :-1]
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
        got = model.hidden(tok)
        h = model.embed[tok].to(BF)
        for li, blk in enumerate(model.layers):
            assert isinstance(blk, Block)
            at = blk.attn
            assert isinstance(at, MLA)
            bf = {n: p.to(BF) for n, p in at.named_parameters()}
            p = MLAParams(wkv_a=bf["wkv_a"], kv_norm=bf["kv_norm"], wkv_b=bf["wkv_b"], wo=bf["wo"],
                          wq_a=bf["wq_a"], q_norm=bf["q_norm"], wq_b=bf["wq_b"])
            x = rmsnorm(h, blk.attn_norm.to(BF), cfg.norm_eps)
            h = h + mla_attention(x, p, model.cos, model.sin, cfg.n_heads, cfg.qk_nope_head_dim,
                                  cfg.qk_rope_head_dim, cfg.v_head_dim, at.softmax_scale, cfg.norm_eps)
            x = rmsnorm(h, blk.ffn_norm.to(BF), cfg.norm_eps).reshape(-1, cfg.dim)
            if li < cfg.n_dense_layers:
                assert isinstance(blk.ffn, DenseFFN)
                f = blk.ffn(x)
                hh = x.double() @ blk.ffn.w13.to(BF).double().T
                ref_f = (torch.nn.functional.silu(hh[:, 0::2]) * hh[:, 1::2]) @ blk.ffn.w2.to(BF).double().T
                torch.testing.assert_close(f.double(), ref_f, rtol=3e-2, atol=3e-2 * float(ref_f.abs().max()))
            else:
                assert isinstance(blk.ffn, MoE)
                f, _ = moe_layer(x, blk.ffn.params(), cfg)
            h = h + f.reshape(h.shape)
        want = rmsnorm(h, model.norm.to(BF), cfg.norm_eps)
    assert torch.equal(_bits(got), _bits(want))


def test_router_bias_update() -> None:
    cfg = _small()
    model = Model(cfg)
    with pytest.raises(RuntimeError, match=r"no forward has run yet"):
        model.router_counts()
    tok = _tokens(cfg, 2, 12)
    model(tok[:, :-1])
    counts = model.router_counts()
    assert len(counts) == cfg.n_layers - cfg.n_dense_layers
    assert all(int(c.sum()) == 2 * 12 * cfg.n_activated_experts for c in counts)
    model.update_router_bias()
    for moe, c in zip(model.moe_layers(), counts, strict=True):
        mean = c.double().mean()
        want = torch.where(c < mean, 1.0, torch.where(c > mean, -1.0, 0.0)) * cfg.bias_update_rate
        torch.testing.assert_close(moe.router_bias.double(), want.double(), rtol=0, atol=1e-9)
    manual = [torch.zeros(cfg.n_routed_experts, dtype=torch.int64) for _ in counts]
    manual[0][0] = 5
    before = model.moe_layers()[0].router_bias.clone()
    model.update_router_bias(manual)
    assert float(model.moe_layers()[0].router_bias[0] - before[0]) == pytest.approx(-cfg.bias_update_rate)
    with pytest.raises(ValueError, match=r"got 1 count tensors for 2 MoE layers"):
        model.update_router_bias(manual[:1])


def test_model_input_errors() -> None:
    cfg = _small()
    model = Model(cfg)
    tok = _tokens(cfg, 1, 4)
    with pytest.raises(ValueError, match=r"tokens must be integer \[B, S\]"):
        model(tok.float())
    with pytest.raises(ValueError, match=r"sequence length 129 > model.max_seq_len=128"):
        model(torch.zeros(1, 129, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 512\)"):
        model(tok + 512)
    with pytest.raises(ValueError, match=r"targets \(1, 4\) must match tokens \(1, 5\)"):
        model(tok, tok[:, 1:])


def _held_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Tensors the modules keep as plain attributes, directly or in a dataclass (parameters and buffers
    aside)."""
    for mname, m in model.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, Tensor):
                yield f"{mname}.{k}", v
            elif dataclasses.is_dataclass(v) and not isinstance(v, type):
                for f in dataclasses.fields(v):
                    t = getattr(v, f.name)
                    if isinstance(t, Tensor):
                        yield f"{mname}.{k}.{f.name}", t


def test_sep_model_routing_graph_kept() -> None:
    """What the model keeps after a step carries no autograd graph: a kept one would hold the router's
    AccumulateGrad node, made on that step's stream, into the next step (and a CUDA graph capture fails)."""
    cfg = _small()
    model = Model(cfg)
    moe = model.moe_layers()[0]
    x = torch.randn(6, cfg.dim).to(BF).requires_grad_()
    _, routing = moe_layer(x, moe.params(), cfg)
    assert routing.weights.grad_fn is not None, "the routing a layer returns carries the router's graph"
    tok = _tokens(cfg, 2, 12)
    model(tok[:, :-1], tok[:, 1:]).backward()
    held = [name for name, t in _held_tensors(model) if t.grad_fn is not None]
    assert held == [], f"kept with their autograd graph: {held}"
    assert model.router_counts(), "and the step's routing counts are still there for the bias update"
