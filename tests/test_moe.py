"""moe_layer against a float64 oracle written here: a dense per-token loop over the selected experts."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import Tensor

from nmoe.config import ModelConfig
from nmoe.layout import MoEParams
from nmoe.reference.moe import expert_gemm, ffn, moe_layer

BF = torch.bfloat16


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny CPU ops lose more to intra-op thread contention on shared cores than they gain."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cfg(**kw: object) -> ModelConfig:
    base: dict[str, object] = dict(
        tokenizer="none", vocab_size=64, dim=32, moe_inter_dim=16, n_routed_experts=8,
        n_activated_experts=2, n_shared_experts=1, route_scale=2.5, permute_align=4,
    )
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def _make(cfg: ModelConfig, t: int, seed: int) -> tuple[Tensor, MoEParams]:
    g = torch.Generator().manual_seed(seed)
    d, e, i, s = cfg.dim, cfg.n_routed_experts, cfg.moe_inter_dim, cfg.n_shared_experts
    up = 2 * i if cfg.activation == "swiglu" else i

    def r(*shape: int, std: float) -> Tensor:
        return (torch.randn(*shape, generator=g) * std).to(BF).requires_grad_()

    x = r(t, d, std=1.0)
    sw = cfg.activation == "swiglu"
    w_up, shared_up = r(e, up, d, std=d**-0.5), (r(up * s, d, std=d**-0.5) if s else None)
    p = MoEParams(
        router_w=r(e, d, std=d**-0.5),
        router_bias=torch.randn(e, generator=g) * 0.05,
        w2=r(e, d, i, std=i**-0.5),
        w13=w_up if sw else None, w1=None if sw else w_up,
        shared_w13=shared_up if sw else None, shared_w1=None if sw else shared_up,
        shared_w2=r(d, i * s, std=(i * s) ** -0.5) if s else None,
    )
    return x, p


def _act64(h: Tensor, activation: str) -> Tensor:
    if activation == "swiglu":
        gate, up = h[..., 0::2], h[..., 1::2]
        return gate / (1.0 + torch.exp(-gate)) * up
    return torch.clamp(h, min=0.0) ** 2


def _select(biased: Tensor, cfg: ModelConfig) -> tuple[list[int], float]:
    """Chosen experts for one token, and the margin between the last chosen and the first rejected."""
    e, gsz = cfg.n_routed_experts, cfg.n_routed_experts // cfg.n_expert_groups
    allowed = list(range(e))
    margin = math.inf
    if cfg.n_expert_groups > 1:
        gscore = []
        for gi in range(cfg.n_expert_groups):
            vals = sorted((float(v) for v in biased[gi * gsz:(gi + 1) * gsz]), reverse=True)
            gscore.append(vals[0] + vals[1])
        order = sorted(range(cfg.n_expert_groups), key=lambda gi: (-gscore[gi], gi))
        kept = order[:cfg.n_limited_groups]
        if len(order) > len(kept):
            margin = gscore[kept[-1]] - gscore[order[len(kept)]]
        allowed = [ex for gi in sorted(kept) for ex in range(gi * gsz, (gi + 1) * gsz)]
    ranked = sorted(allowed, key=lambda ex: (-float(biased[ex]), ex))
    chosen = ranked[:cfg.n_activated_experts]
    if len(ranked) > len(chosen):
        margin = min(margin, float(biased[chosen[-1]]) - float(biased[ranked[len(chosen)]]))
    return chosen, margin


def oracle(
    x: Tensor, p: MoEParams, cfg: ModelConfig, route_scale: float | None = None, shared: bool = True
) -> tuple[Tensor, Tensor, Tensor, float]:
    """fp64 out [T,D], weights [T,K], ids [T,K] and the smallest routing margin over tokens."""
    scale = cfg.route_scale if route_scale is None else route_scale
    xd = x.double()
    logits = xd @ p.router_w.double().T
    scores = 1.0 / (1.0 + torch.exp(-logits)) if cfg.score_func == "sigmoid" else torch.softmax(logits, -1)
    biased = scores + p.router_bias.double()
    w_up = p.w13 if p.w13 is not None else p.w1
    s_up = p.shared_w13 if p.shared_w13 is not None else p.shared_w1
    assert w_up is not None
    rows, ws, ids, margin = [], [], [], math.inf
    for t in range(x.shape[0]):
        chosen, m = _select(biased[t].detach(), cfg)
        margin = min(margin, m)
        picked = torch.stack([scores[t, ex] for ex in chosen])
        wt = picked / picked.sum()
        acc = torch.zeros(cfg.dim, dtype=torch.float64)
        for j, ex in enumerate(chosen):
            a = _act64(w_up[ex].double() @ xd[t], cfg.activation)
            acc = acc + wt[j] * (p.w2[ex].double() @ a)
        row = scale * acc
        if shared and s_up is not None:
            assert p.shared_w2 is not None
            row = row + p.shared_w2.double() @ _act64(s_up.double() @ xd[t], cfg.activation)
        rows.append(row)
        ws.append(wt)
        ids.append(chosen)
    return torch.stack(rows), torch.stack(ws), torch.tensor(ids, dtype=torch.int64), margin


def _close(out: Tensor, ref: Tensor, rel: float = 2e-2) -> None:
    torch.testing.assert_close(out.double(), ref, rtol=rel, atol=rel * float(ref.abs().max()))


def _rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _leaves(x: Tensor, p: MoEParams) -> dict[str, Tensor]:
    out = {"x": x}
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        if v is not None and v.requires_grad:
            out[f.name] = v
    return out


def _grads(x: Tensor, p: MoEParams, loss: Tensor) -> dict[str, Tensor]:
    leaves = _leaves(x, p)
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"activation": "relu2"},
        {"score_func": "softmax", "n_shared_experts": 0},
        {"n_expert_groups": 4, "n_limited_groups": 2, "n_activated_experts": 3, "n_shared_experts": 2},
        {"permute_align": 1, "n_activated_experts": 1},
    ],
)
def test_moe_matches_fp64_oracle(kw: dict[str, object]) -> None:
    cfg = _cfg(**kw)
    x, p = _make(cfg, 13, seed=1)
    out, routing = moe_layer(x, p, cfg)
    ref, w_ref, ids_ref, margin = oracle(x, p, cfg)
    assert margin > 1e-4, "test data must route unambiguously"
    assert out.dtype == BF and out.shape == x.shape
    assert torch.equal(routing.ids, ids_ref)
    torch.testing.assert_close(routing.weights.double(), w_ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(routing.counts, torch.bincount(ids_ref.flatten(), minlength=cfg.n_routed_experts))
    _close(out, ref.detach())


def test_moe_backward_matches_fp64_oracle() -> None:
    cfg = _cfg(n_expert_groups=2, n_limited_groups=1, n_shared_experts=2)
    x, p = _make(cfg, 11, seed=2)
    r = torch.randn(11, cfg.dim, generator=torch.Generator().manual_seed(9))
    out, _ = moe_layer(x, p, cfg)
    got = _grads(x, p, (out.float() * r).sum())
    ref, *_ = oracle(x, p, cfg)
    want = _grads(x, p, (ref * r.double()).sum())
    assert set(got) == {"x", "router_w", "w2", "w13", "shared_w13", "shared_w2"}
    for name in got:
        assert got[name].dtype == BF
        assert _rel_err(got[name], want[name]) < 1.5e-2, name


@settings(max_examples=8, deadline=None)
@given(
    t=st.integers(1, 12),
    e=st.sampled_from([4, 8]),
    k=st.integers(1, 3),
    shared=st.integers(0, 2),
    align=st.sampled_from([1, 3, 8]),
    act=st.sampled_from(["swiglu", "relu2"]),
    seed=st.integers(0, 2**16),
)
def test_moe_oracle_property(t: int, e: int, k: int, shared: int, align: int, act: str, seed: int) -> None:
    cfg = _cfg(n_routed_experts=e, n_activated_experts=min(k, e), n_shared_experts=shared,
               permute_align=align, activation=act, dim=16, moe_inter_dim=8)
    x, p = _make(cfg, t, seed)
    ref, _, ids_ref, margin = oracle(x, p, cfg)
    assume(margin > 1e-4)
    out, routing = moe_layer(x, p, cfg)
    assert torch.equal(routing.ids, ids_ref)
    _close(out, ref.detach())


def test_sep_router_scale_in_weights() -> None:
    cfg = _cfg(route_scale=2.5)
    x, p = _make(cfg, 9, seed=3)
    ref, w_ref, _, _ = oracle(x, p, cfg)
    ref_unscaled, *_ = oracle(x, p, cfg, route_scale=1.0)
    ref, ref_unscaled, w_ref = ref.detach(), ref_unscaled.detach(), w_ref.detach()
    correct_sum, mutated_sum = w_ref.sum(-1), cfg.route_scale * w_ref.sum(-1)
    assert float((correct_sum - mutated_sum).abs().min()) > 1.0
    assert float((ref - ref_unscaled).abs().max()) > 0.2 * float(ref.abs().max())
    out, routing = moe_layer(x, p, cfg)
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(9), rtol=0, atol=1e-6)
    _close(out, ref)


def test_sep_moe_shared_expert_dropped() -> None:
    cfg = _cfg(n_shared_experts=1)
    x, p = _make(cfg, 9, seed=4)
    ref, *_ = oracle(x, p, cfg)
    ref_dropped, *_ = oracle(x, p, cfg, shared=False)
    ref, ref_dropped = ref.detach(), ref_dropped.detach()
    assert float((ref - ref_dropped).abs().max()) > 0.2 * float(ref.abs().max())
    out, _ = moe_layer(x, p, cfg)
    _close(out, ref)


@pytest.mark.parametrize(("dtype", "lo", "hi"), [("fp8", 0.02, 0.12), ("nvfp4", 0.12, 0.45)])
def test_quantized_experts_within_format_error(dtype: str, lo: float, hi: float) -> None:
    """Quantization really happens in this format (bf16 error here is ~0.004, fp8 ~0.07, nvfp4 ~0.24):
    the error lies above lo and below hi; gradients are straight-through, so they carry the same error."""
    cfg = _cfg(dim=128, moe_inter_dim=128, n_routed_experts=4, n_shared_experts=1, expert_dtype=dtype)
    x, p = _make(cfg, 6, seed=5)
    ref, _, ids_ref, margin = oracle(x, p, cfg)
    assert margin > 1e-4
    out, routing = moe_layer(x, p, cfg)
    assert torch.equal(routing.ids, ids_ref)
    err = _rel_err(out, ref.detach())
    assert lo < err < hi, err
    r = torch.randn(6, 128, generator=torch.Generator().manual_seed(1))
    got = _grads(x, p, (out.float() * r).sum())
    want = _grads(x, p, (ref * r.double()).sum())
    for name in got:
        assert torch.isfinite(got[name]).all() and _rel_err(got[name], want[name]) < 2 * hi, name


def test_dense_ffn_helper_matches_oracle() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 16, generator=g).to(BF)
    w13 = (torch.randn(24, 16, generator=g) * 0.25).to(BF)
    w2 = (torch.randn(16, 12, generator=g) * 0.3).to(BF)
    ref = torch.stack([w2.double() @ _act64(w13.double() @ x[t].double(), "swiglu") for t in range(5)])
    _close(ffn(x, w13, w2, "swiglu", "bf16"), ref)


def test_moe_deterministic() -> None:
    cfg = _cfg()
    x, p = _make(cfg, 10, seed=7)
    a, _ = moe_layer(x, p, cfg)
    b, _ = moe_layer(x, p, cfg)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_moe_input_errors() -> None:
    cfg = _cfg()
    x, p = _make(cfg, 4, seed=8)
    with pytest.raises(ValueError, match=r"x must be bf16 \[T, 32\]"):
        moe_layer(x.float(), p, cfg)
    with pytest.raises(ValueError, match=r"x must be bf16"):
        moe_layer(x[None], p, cfg)
    with pytest.raises(ValueError, match=r"w1 is set but activation is 'swiglu'; set w13 instead"):
        moe_layer(x, dataclasses.replace(p, w1=p.w13), cfg)
    with pytest.raises(ValueError, match=r"shared_w13 is set but activation is 'relu2'; set shared_w1"):
        moe_layer(x, dataclasses.replace(p, w13=None, w1=p.w2), dataclasses.replace(cfg, activation="relu2"))
    with pytest.raises(ValueError, match=r"w2 has shape \(8, 16, 32\), expected \(8, 32, 16\)"):
        moe_layer(x, dataclasses.replace(p, w2=p.w2.transpose(1, 2)), cfg)
    with pytest.raises(ValueError, match=r"shared_w2 has shape None, expected \(32, 16\)"):
        moe_layer(x, dataclasses.replace(p, shared_w2=None), cfg)
    with pytest.raises(ValueError, match=r"router_bias must be fp32"):
        moe_layer(x, dataclasses.replace(p, router_bias=p.router_bias.double()), cfg)
    with pytest.raises(ValueError, match=r"w2 weight must be bf16"):
        moe_layer(x, dataclasses.replace(p, w2=p.w2.float()), cfg)
    with pytest.raises(ValueError, match=r"expert_dtype 'fp16' unknown"):
        expert_gemm(x, p.w2, torch.tensor([4] * 8, dtype=torch.int32), "fp16")


def test_an_expert_shard_is_checked_against_its_local_count() -> None:
    from nmoe.layout import check_moe_params

    cfg = _cfg()
    x, p = _make(cfg, 4, seed=8)
    assert p.w13 is not None
    shard = dataclasses.replace(p, w13=p.w13[2:4], w2=p.w2[2:4])
    up, _ = check_moe_params(x, shard, cfg, n_local=2)
    assert up.shape[0] == 2
    with pytest.raises(ValueError, match=r"w13 has shape \(2, 32, 32\), expected \(4, 32, 32\).*4 experts "
                       r"on this rank"):
        check_moe_params(x, shard, cfg, n_local=4)
    with pytest.raises(ValueError, match=r"expected \(8, "):
        check_moe_params(x, shard, cfg)
