"""nmoe.fast.moe.moe_layer on an sm_90a GPU: routing bitwise to the spec, output and every gradient against
float64 autograd of the same routing, and forward+backward captured in one CUDA graph equal to eager."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import Tensor

from nmoe.config import ModelConfig
from nmoe.layout import MoEParams
from nmoe.reference.moe import moe_layer as spec_layer
from parity.ops.moe import _moe_in

gpu = pytest.mark.gpu
T, D, E, K, INTER = 256, 256, 8, 2, 128
TOL = 2e-2
"""Normwise relative error of bf16 results against float64: a few bf16 roundings (2^-8) on each path."""


def _sm90() -> None:
    from nmoe.fast import runtime
    if runtime.require_arch(torch.empty(1, device="cuda")) != "sm_90a":
        pytest.skip("the fast MoE layer's backward GEMMs are sm_90a kernels")


def _cfg(activation: str, shared: int, dtype: str, score: str, align: int = 128,
         groups: tuple[int, int] = (1, 1)) -> ModelConfig:
    return ModelConfig(tokenizer="none", vocab_size=64, dim=D, moe_inter_dim=INTER, n_routed_experts=E,
                       n_activated_experts=K, n_shared_experts=shared, route_scale=2.5, permute_align=align,
                       activation=activation, score_func=score, expert_dtype=dtype,
                       n_expert_groups=groups[0], n_limited_groups=groups[1])


def _params(cfg: ModelConfig, seed: int, device: str) -> tuple[Tensor, MoEParams]:
    g = torch.Generator().manual_seed(seed)
    s, up = cfg.n_shared_experts, (2 if cfg.activation == "swiglu" else 1) * INTER

    def rn(*shape: int, scale: float = 1.0) -> Tensor:
        t = (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(device)
        return t.requires_grad_()

    w_up, sh_up = rn(E, up, D, scale=D**-0.5), rn(up * s, D, scale=D**-0.5) if s else None
    sw = cfg.activation == "swiglu"
    bias = (0.05 * torch.randn(E, generator=g)).to(device)
    p = MoEParams(router_w=rn(E, D, scale=D**-0.5), router_bias=bias,
                  w2=rn(E, D, INTER, scale=INTER**-0.5), w13=w_up if sw else None, w1=None if sw else w_up,
                  shared_w13=sh_up if sw else None, shared_w1=None if sw else sh_up,
                  shared_w2=rn(D, INTER * s, scale=(INTER * s) ** -0.5) if s else None)
    return rn(T, D), p


def _leaves(x: Tensor, p: MoEParams) -> list[Tensor]:
    return [t for t in (x, p.router_w, p.w13, p.w1, p.w2, p.shared_w13, p.shared_w1, p.shared_w2)
            if t is not None]


def _oracle(x: Tensor, p: MoEParams, cfg: ModelConfig, ids: Tensor,
            dout: Tensor) -> tuple[Tensor, list[Tensor]]:
    """float64 autograd of the layer with the routing fixed to ids."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in _leaves(x, p)]
    names = [n for n in ("router_w", "w13", "w1", "w2", "shared_w13", "shared_w1", "shared_w2")
             if getattr(p, n) is not None]
    p64 = replace(p, **dict(zip(names, leaves[1:], strict=True)))
    logits = leaves[0] @ p64.router_w.T
    scores = torch.sigmoid(logits) if cfg.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
    picked = scores.gather(1, ids.cpu())
    out = _moe_in(leaves[0], p64, cfg, picked / picked.sum(-1, keepdim=True), ids.cpu(), torch.float64)
    return out.detach(), list(torch.autograd.grad(out, leaves, dout.cpu().double()))


def _wgrad_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """The wgrads' sources at this file's I = 128: "gathered" as shipped (dout's and x's rows by index),
    "copied" / "spilled" dout's copies as at I > 256, "x_copied" x's copies as at N > 512."""
    from nmoe.fast import limits
    if path in ("copied", "spilled"):
        monkeypatch.setattr(limits, "GEMM_WGRAD_GATHER_DY_MAX_K", 0)
        monkeypatch.setattr(limits, "GEMM_DGRAD_SPILL", path == "spilled")
    if path == "x_copied":
        monkeypatch.setattr(limits, "GEMM_WGRAD_GATHER_X_MAX_N", 0)


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.detach().cpu().double() - b).norm() / b.norm().clamp_min(1e-30))


CASES = [("swiglu", 1, "bf16", "sigmoid"), ("relu2", 0, "bf16", "softmax"), ("swiglu", 0, "fp8", "softmax"),
         ("relu2", 1, "fp8", "sigmoid")]


@gpu
@pytest.mark.parametrize(("activation", "shared", "dtype", "score", "align", "groups", "down_wgrad"),
                         [(*c, 128, (1, 1), "gathered") for c in CASES]
                         + [("relu2", 1, "bf16", "sigmoid", 8, (4, 2), "gathered"),
                            ("swiglu", 1, "bf16", "sigmoid", 128, (1, 1), "copied"),
                            ("relu2", 0, "bf16", "sigmoid", 8, (1, 1), "spilled"),
                            ("swiglu", 1, "bf16", "sigmoid", 8, (1, 1), "x_copied")])
def test_moe_layer_values_and_grads(monkeypatch: pytest.MonkeyPatch, activation: str, shared: int, dtype: str,
                                    score: str, align: int, groups: tuple[int, int], down_wgrad: str) -> None:
    """Routing: the spec's top-k on the fast logits, bit for bit. Values and gradients: float64 autograd on
    the fast routing (bf16), and the spec layer on CPU where its own logits route alike (fp8 needs that).
    I = 128: the down wgrad gathers dout's rows, the up wgrad x's (on its M side, dw stored transposed);
    "copied" runs the TMA down wgrad on dout's copies, as at I > 256, "spilled" on the copy the down dgrad
    writes; "x_copied" runs the TMA up wgrad on x's copies, as at N > 512."""
    _sm90()
    _wgrad_path(monkeypatch, down_wgrad)
    from nmoe.fast.moe import moe_layer
    from nmoe.fast.router import router_logits
    from nmoe.reference.router import router_topk
    cfg = _cfg(activation, shared, dtype, score, align, groups)
    x, p = _params(cfg, 1, "cuda")
    out, r = moe_layer(x, p, cfg)
    with torch.no_grad():
        logits = router_logits(x, p.router_w).cpu()
    w_spec, ids_spec = router_topk(logits, p.router_bias.cpu(), K, score, *groups)
    assert torch.equal(r.ids.cpu(), ids_spec) and torch.equal(r.weights.detach().cpu(), w_spec)
    assert torch.equal(r.counts.cpu(), torch.bincount(ids_spec.reshape(-1), minlength=E))
    dout = torch.randn(T, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    got = torch.autograd.grad(out, _leaves(x, p), dout.cuda())
    if dtype == "bf16":
        out64, grads64 = _oracle(x, p, cfg, r.ids, dout)
        assert _rel(out, out64) < TOL
        for i, (g, g64) in enumerate(zip(got, grads64, strict=True)):
            assert _rel(g, g64) < TOL, f"grad {i} vs float64"
    xs, ps = _params(cfg, 1, "cpu")
    want, rs = spec_layer(xs, ps, cfg)
    if dtype == "bf16" and not torch.equal(rs.ids, r.ids.cpu()):
        return
    assert torch.equal(rs.ids, r.ids.cpu()), "fp8 is checked against the spec only: use a seed routing alike"
    assert _rel(out, want.detach().double()) < TOL
    spec = torch.autograd.grad(want, _leaves(xs, ps), dout)
    for i, (g, s) in enumerate(zip(got, spec, strict=True)):
        assert _rel(g, s.double()) < TOL, f"grad {i} vs spec"


@gpu
@pytest.mark.parametrize(("activation", "shared", "dtype", "score"), CASES[:3])
def test_moe_layer_fwd_bwd_one_cuda_graph(activation: str, shared: int, dtype: str, score: str) -> None:
    """Replays on new x (new routing) equal eager bit for bit: nothing in fwd or bwd syncs the host."""
    _sm90()
    from nmoe.fast.moe import moe_layer
    cfg = _cfg(activation, shared, dtype, score)
    x, p = _params(cfg, 2, "cuda")
    dout = torch.randn(T, D, device="cuda").to(torch.bfloat16)

    def step() -> tuple[Tensor, ...]:
        out, r = moe_layer(x, p, cfg)
        grads: Any = torch.autograd.grad(out, _leaves(x, p), dout)
        return (out.detach(), r.ids, r.counts, *grads)

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    seen = []
    for seed in (3, 4):
        x.data.copy_(torch.randn(T, D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for i, (g, e) in enumerate(zip(static, eager, strict=True)):
            assert torch.equal(g, e), f"output {i}, seed {seed}"
        seen.append(static[1].clone())
    assert not torch.equal(seen[0], seen[1]), "replays must see new routing"


@gpu
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_moe_layer_without_grad_keeps_no_h(activation: str) -> None:
    """No backward to come: the same output bit for bit, and the forward's peak holds no h [slots, N]."""
    _sm90()
    from nmoe.fast.moe import moe_layer
    cfg = _cfg(activation, 0, "bf16", "softmax")
    x, p = _params(cfg, 2, "cuda")
    peaks, outs = [], []
    for grad in (True, False):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.set_grad_enabled(grad):
            out, _ = moe_layer(x, p, cfg)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        outs.append(out.detach())
        del out
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    width = (2 if activation == "swiglu" else 1) * INTER
    slots = T * K
    assert peaks[0] - peaks[1] >= slots * width * 2, f"peak with grad {peaks[0]}, without {peaks[1]}"


@gpu
def test_moe_layer_eager_never_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even with the GEMMs' opt-in host offs check on, fwd+bwd run without one device-to-host sync (the
    warm-up compiles and loads every kernel first, so only the layer itself is watched)."""
    _sm90()
    from nmoe.fast.gemm import routing
    from nmoe.fast.moe import moe_layer
    monkeypatch.setattr(routing, "offs_check_enabled", lambda: True)
    cfg = _cfg("swiglu", 1, "bf16", "sigmoid")
    x, p = _params(cfg, 6, "cuda")
    dout = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    torch.autograd.grad(moe_layer(x, p, cfg)[0], _leaves(x, p), dout)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = moe_layer(x, p, cfg)
        grads = torch.autograd.grad(out, _leaves(x, p), dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(bool(torch.isfinite(g).all()) for g in grads)


@gpu
@pytest.mark.parametrize("down_wgrad", ["gathered", "copied", "spilled", "x_copied"])
def test_a_later_microbatch_adds_routed_wgrads_in_place_bit_for_bit(monkeypatch: pytest.MonkeyPatch,
                                                                    down_wgrad: str) -> None:
    """Inside adding_to_grads the routed experts' wgrads are added into their held .grad by the wgrad
    kernels' reduce-add (the down one gathered from dout's rows, on its copies or on the one the dgrad spills;
    the up one gathered from x's rows or on their copies): bit for bit autograd's bf16 add of the two
    microbatches' gradients, in the same tensors; every other one as autograd adds it."""
    _sm90()
    _wgrad_path(monkeypatch, down_wgrad)
    from nmoe.accumulate import adding_to_grads
    from nmoe.fast.moe import moe_layer
    cfg = _cfg("swiglu", 1, "bf16", "sigmoid")
    x, p = _params(cfg, 7, "cuda")
    leaves = _leaves(x, p)
    g = torch.Generator(device="cuda").manual_seed(3)
    douts = [torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
    each = [torch.autograd.grad(moe_layer(x, p, cfg)[0], leaves, d) for d in douts]
    want = [a + b for a, b in zip(*each, strict=True)]
    assert not torch.equal(want[2], each[0][2]) and not torch.equal(want[2], each[1][2])
    moe_layer(x, p, cfg)[0].backward(douts[0])
    assert p.w13 is not None
    held = [p.w13.grad, p.w2.grad]
    with adding_to_grads():
        moe_layer(x, p, cfg)[0].backward(douts[1])
    assert p.w13.grad is held[0] and p.w2.grad is held[1]
    for t, w in zip(leaves, want, strict=True):
        assert t.grad is not None and torch.equal(t.grad.view(torch.int16), w.view(torch.int16))
