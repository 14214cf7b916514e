"""Optimizer plumbing vs float64 oracles written here: AdamW, Muon/NS5, WSD, clipping, param groups."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from nmoe.config import OptimConfig, ScheduleConfig
from nmoe.reference.optim import adamw_step, muon_step
from nmoe.train.optim import (
    OptimSteps,
    build_optimizer,
    build_param_groups,
    clip_scale,
    is_muon_param,
    param_kind,
    wsd_factor,
)

SPEC = OptimSteps(adamw=adamw_step, muon=muon_step)

class RefShaped(nn.Module):
    """Parameter names and shapes laid out like the DeepSeek-shaped model (one dense, one MoE block)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(50, 8))
        self.layers = nn.ModuleList([nn.Module(), nn.Module()])
        for i, blk in enumerate(self.layers):
            blk.attn_norm = nn.Parameter(torch.ones(8))
            blk.attn = nn.Module()
            blk.attn.wq_a = nn.Parameter(torch.randn(6, 8))
            blk.attn.q_norm = nn.Parameter(torch.ones(6))
            blk.attn.wkv_b = nn.Parameter(torch.randn(12, 4))
            blk.ffn = nn.Module()
            if i == 0:
                blk.ffn.w13 = nn.Parameter(torch.randn(16, 8))
                blk.ffn.w2 = nn.Parameter(torch.randn(8, 8))
            else:
                blk.ffn.router_w = nn.Parameter(torch.randn(4, 8))
                blk.ffn.w_up = nn.Parameter(torch.randn(4, 6, 8))
                blk.ffn.w2 = nn.Parameter(torch.randn(4, 8, 3))
                blk.ffn.shared_up = nn.Parameter(torch.randn(6, 8))
        self.norm = nn.Parameter(torch.ones(8))
        self.head = nn.Parameter(torch.randn(50, 8))


def test_param_kinds_on_model_names() -> None:
    m = RefShaped()
    kinds = {n: param_kind(n, p) for n, p in m.named_parameters()}
    assert kinds["layers.1.ffn.router_w"] == "router"
    assert kinds["layers.1.ffn.w_up"] == kinds["layers.1.ffn.w2"] == "expert"
    assert kinds["layers.0.ffn.w2"] == kinds["layers.1.ffn.shared_up"] == kinds["embed"] == "dense"
    assert param_kind("model.layers.3.mlp.gate.weight", torch.zeros(4, 4)) == "router"
    assert param_kind("model.layers.3.mlp.gate_proj.weight", torch.zeros(4, 4)) == "dense"
    assert param_kind("moe.experts.0.w1", torch.zeros(4, 4)) == "expert"
    params = dict(m.named_parameters())
    assert is_muon_param("layers.0.attn.wq_a", params["layers.0.attn.wq_a"])
    assert not is_muon_param("layers.0.attn.q_norm", params["layers.0.attn.q_norm"])
    assert not is_muon_param("head", m.head)


def test_groups_carry_separate_lr_and_wd() -> None:
    cfg = OptimConfig(name="muon", lr_dense=1e-3, lr_router=2e-3, lr_expert=3e-3, weight_decay_dense=0.1,
                      weight_decay_router=0.0, weight_decay_expert=0.05)
    groups = build_param_groups(RefShaped(), cfg)
    by = {(g["kind"], g["algo"], g["params"][0].dim() >= 2): g for g in groups}
    muon = by[("dense", "muon", True)]
    assert sorted(muon["names"]) == ["layers.0.attn.wkv_b", "layers.0.attn.wq_a", "layers.1.attn.wkv_b",
                                     "layers.1.attn.wq_a"]
    assert muon["lr"] == 1e-3 and muon["weight_decay"] == 0.1
    nodecay = by[("dense", "adamw", False)]
    assert all(p.dim() == 1 for p in nodecay["params"]) and nodecay["weight_decay"] == 0.0
    router = by[("router", "adamw", True)]
    assert router["names"] == ["layers.1.ffn.router_w"] and router["lr"] == 2e-3
    expert = by[("expert", "adamw", True)]
    assert expert["names"] == ["layers.1.ffn.w_up", "layers.1.ffn.w2"]
    assert expert["lr"] == 3e-3 and expert["weight_decay"] == 0.05
    n = sum(len(g["params"]) for g in groups)
    assert n == len(list(RefShaped().parameters()))
    opt = build_optimizer(RefShaped(), cfg, SPEC)
    opt.set_lr_factor(0.5)
    assert [g["lr"] for g in opt.param_groups] == [g["base_lr"] * 0.5 for g in opt.param_groups]


def adamw_oracle(p: np.ndarray, grads: list[np.ndarray], lr: float, b1: float, b2: float, eps: float,
                 wd: float) -> np.ndarray:
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


def test_adamw_matches_float64_oracle() -> None:
    cfg = OptimConfig(lr_dense=1e-2, weight_decay_dense=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    lin = nn.Linear(5, 3, bias=False)
    p0 = lin.weight.detach().double().numpy().copy()
    opt = build_optimizer(lin, cfg, SPEC)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(3, 5, generator=gen) for _ in range(4)]
    for g in grads:
        lin.weight.grad = g.clone()
        opt.step()
    want = adamw_oracle(p0, [g.double().numpy() for g in grads], 1e-2, 0.9, 0.95, 1e-8, 0.1)
    np.testing.assert_allclose(lin.weight.detach().double().numpy(), want, rtol=2e-6, atol=1e-7)
    assert int(opt.named_state()["weight"]["step"]) == 4


def ns5_oracle(g: np.ndarray, steps: int) -> np.ndarray:
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    out: np.ndarray = x.T if g.shape[0] > g.shape[1] else x
    return out


@pytest.mark.parametrize("shape", [(4, 6), (7, 3)])
def test_muon_matches_float64_oracle(shape: tuple[int, int]) -> None:
    cfg = OptimConfig(name="muon", lr_dense=0.02, weight_decay_dense=0.01, muon_momentum=0.95,
                      muon_ns_steps=5)
    m = nn.Module()
    m.attn = nn.Module()
    m.attn.wo = nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(2)))
    p = m.attn.wo.detach().double().numpy().copy()
    opt = build_optimizer(m, cfg, SPEC)
    assert opt.param_groups[0]["algo"] == "muon"
    buf = np.zeros_like(p)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        g = torch.randn(*shape, generator=gen)
        m.attn.wo.grad = g.clone()
        opt.step()
        gd = g.double().numpy()
        buf = 0.95 * buf + gd
        upd = ns5_oracle(gd + 0.95 * buf, 5)
        p = p * (1 - 0.02 * 0.01) - 0.02 * 0.2 * math.sqrt(max(shape)) * upd
    np.testing.assert_allclose(m.attn.wo.detach().double().numpy(), p, rtol=1e-4, atol=1e-5)


def test_wsd_hand_values() -> None:
    s = ScheduleConfig(warmup_tokens=100, total_tokens=1000, decay_fraction=0.2, min_lr_ratio=0.1)
    cases = {0: 0.0, 50: 0.5, 100: 1.0, 800: 1.0, 900: 0.55, 1000: 0.1, 5000: 0.1}
    for tokens, want in cases.items():
        assert wsd_factor(tokens, s) == pytest.approx(want, abs=1e-12), tokens
    flat = ScheduleConfig(warmup_tokens=0, total_tokens=10, decay_fraction=0.0, min_lr_ratio=0.1)
    assert wsd_factor(0, flat) == wsd_factor(10, flat) == wsd_factor(99, flat) == 1.0


def test_clip_scale_leaves_grads_and_names_the_factor() -> None:
    a, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    a.grad, b.grad = torch.tensor([3.0]), torch.tensor([4.0])
    norm, scale = clip_scale([a, b], 1.0)
    assert norm.dim() == 0 and float(norm) == pytest.approx(5.0)
    assert (float(a.grad), float(b.grad)) == (3.0, 4.0), "the gradients are left as they are"
    assert scale is not None and scale.dim() == 0 and scale.dtype == torch.float32
    assert float(scale) == float(np.float32(1.0 / (5.0 + 1e-6)))
    assert clip_scale([a, b], 0.0)[1] is None and float(clip_scale([a, b], 0.0)[0]) == pytest.approx(5.0)
    norm, scale = clip_scale([a, b], 5.0)
    assert float(norm) == 5.0 and scale is not None and float(scale) == 1.0
    assert float(clip_scale([a, b], 4.5)[1]) == float(np.float32(4.5 / (5.0 + 1e-6)))  # type: ignore[arg-type]


def test_clip_scale_of_accumulated_microbatches() -> None:
    """Grads holding the sum of 2 microbatch means (3, 4 twice over): the step's norm is 5, the scale the
    clip factor of 5 over 2, and exactly 1/2 where nothing clips or max_norm is off."""
    a, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    a.grad, b.grad = torch.tensor([6.0]), torch.tensor([8.0])
    norm, scale = clip_scale([a, b], 1.0, accum=2)
    assert float(norm) == pytest.approx(5.0)
    assert scale is not None and float(scale) == float(np.float32(1.0 / (5.0 + 1e-6)) / 2)
    for max_norm in (5.0, 0.0):
        norm, scale = clip_scale([a, b], max_norm, accum=2)
        assert float(norm) == pytest.approx(5.0) and scale is not None and float(scale) == 0.5
    assert clip_scale([a, b], 0.0, accum=1)[1] is None
    with pytest.raises(ValueError, match="accum = 0"):
        clip_scale([a, b], 1.0, accum=0)


def test_optimizer_step_folds_the_clip_factor() -> None:
    """Stepping with the factor equals stepping on gradients multiplied by it in fp32 (the old in-place clip),
    bit for bit; the factor is not 1 here, so dropping it changes the params."""
    cfg = OptimConfig()
    made = []
    for fold in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        model(torch.randn(16, 8)).square().sum().backward()
        params = list(model.parameters())
        scale = clip_scale(params, 0.5)[1]
        assert scale is not None and float(scale) < 1.0, "the norm exceeds max_norm"
        opt = build_optimizer(model, cfg, SPEC)
        if fold:
            opt.set_grad_scale(scale)
        else:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale)
        opt.step()
        made.append([p.detach().clone() for p in params])
    assert all(torch.equal(x, y) for x, y in zip(*made, strict=True))


def test_optimizer_refuses_params_it_has_no_master_for() -> None:
    with pytest.raises(ValueError, match="fp32 masters"):
        build_optimizer(nn.Linear(2, 2).to(torch.float16), OptimConfig(), SPEC)


@pytest.mark.parametrize("algo", ["adamw", "muon"])
def test_bf16_params_step_their_fp32_masters(algo: str) -> None:
    """A bf16 param's fp32 master steps exactly as an fp32 param fed the same (bf16) gradients, and the param
    is the master rounded once to bf16 after every step; the master, not the param, is what steps next."""
    cfg = OptimConfig(name=algo)
    torch.manual_seed(1)
    ref = nn.Module()
    ref.attn = nn.Linear(8, 6, bias=False)
    low = nn.Module()
    low.attn = nn.Linear(8, 6, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        ref.attn.weight.copy_(low.attn.weight.float())
    opt_ref, opt_low = build_optimizer(ref, cfg, SPEC), build_optimizer(low, cfg, SPEC)
    master = opt_low.state[low.attn.weight]["master"]
    assert master.dtype == torch.float32 and torch.equal(master, ref.attn.weight)
    for k in range(3):
        g = torch.randn(6, 8, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
        low.attn.weight.grad, ref.attn.weight.grad = g, g.float()
        opt_ref.step()
        opt_low.step()
        assert torch.equal(master, ref.attn.weight), k
        assert torch.equal(low.attn.weight, master.to(torch.bfloat16)), k
    assert not torch.equal(master, low.attn.weight.float()), "the master keeps bits the bf16 param drops"


def test_bf16_moments_are_the_adamw_state_and_step_as_the_spec_rounds_them() -> None:
    """optim_state_dtype = "bf16": AdamW's exp_avg / exp_avg_sq are bf16 (Muon's buffer is refused by the
    config); each step equals the spec's step on the same bf16 moments, which it stores rounded."""
    torch.manual_seed(2)
    model = nn.Linear(8, 6)
    opt = build_optimizer(model, OptimConfig(), SPEC, torch.bfloat16)
    w = model.weight
    st = opt.state[w]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
    p, m, v = w.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()
    for k in range(3):
        g = torch.randn(6, 8, generator=torch.Generator().manual_seed(k))
        w.grad, model.bias.grad = g, torch.zeros(6)
        opt.step()
        c = opt.cfg
        adamw_step(p, g, m, v, k + 1, opt.param_groups[0]["lr"], c.beta1, c.beta2, c.eps,
                   opt.param_groups[0]["weight_decay"])
        assert torch.equal(w, p) and torch.equal(st["exp_avg"], m) and torch.equal(st["exp_avg_sq"], v)
    assert bool(st["exp_avg"].ne(0).any())
    with pytest.raises(ValueError, match=r"torch\.float32 or torch\.bfloat16"):
        build_optimizer(model, OptimConfig(), SPEC, torch.float16)
