"""The MoE layer: routing from the router oracle, output against float64 math (ratio)."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity.compare import (
    BITWISE,
    U_FP32,
    Contract,
)
from parity.entry import (
    RATIO2_BF16,
    OpEntry,
)
from parity.inputs import (
    I,
    Inputs,
    Params,
    S,
    randn,
    space,
    with_adv,
)
from parity.ops.router import fp32_down, fp32_up, route_ids
from parity.oracles import (
    F64,
    Expect,
    d,
    fp32_dot_exact,
    sigmoid64,
)


def space_moe(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    if big:
        return space(
            T=S([256, 1024]),
            D=S([1024, 2048]),
            E=S([16, 64]),
            k=S([2, 6]),
            I=S([256, 512]),
            shared=S([0, 1]),
            activation=S(["swiglu", "relu2"]),
            score=S(["sigmoid", "softmax"]),
            route_scale=S([1.0, 2.5]),
            align=S([128]),
        )
    return space(
        T=I(1, 12),
        D=S([16, 32]),
        E=S([4, 8]),
        k=I(1, 3),
        I=S([8, 16]),
        shared=S([0, 1]),
        activation=S(["swiglu", "relu2"]),
        score=S(["sigmoid", "softmax"]),
        route_scale=S([1.0, 2.5]),
        align=S([1, 4]),
    )


def make_moe_layer(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    """x on the 2**-5 grid and router weights in {-1, 0, 1} * 2**-s: the router's fp32 sums are exact in any
    order, so fast and spec route alike (logit rounding is router_logits' contract); adv=ties: bias 0 and
    every other token 0, so its logits are exactly 0 and every expert ties."""
    from nmoe.config import ModelConfig
    from nmoe.layout import MoEParams

    q = with_adv(p, adv, **({"T": 1} if adv == "single_token" else {}), **({"k": 1} if adv == "k1" else {}))
    t, dd, e, k, i, s, act = q["T"], q["D"], q["E"], min(q["k"], q["E"]), q["I"], q["shared"], q["activation"]
    cfg = ModelConfig(
        tokenizer="none",
        vocab_size=64,
        dim=dd,
        moe_inter_dim=i,
        n_routed_experts=e,
        n_activated_experts=k,
        n_shared_experts=s,
        route_scale=float(q["route_scale"]),
        permute_align=int(q["align"]),
        activation=act,
        score_func=q["score"],
    )
    up = 2 * i if act == "swiglu" else i
    bf = torch.bfloat16
    w_up = randn([e, up, dd], bf, g, dd**-0.5)
    sh_up = randn([up * s, dd], bf, g, dd**-0.5) if s else None
    bias = randn([e], torch.float32, g, 0.05)
    if adv == "zipf":
        bias = -torch.log1p(torch.randperm(e, generator=g).to(torch.float32))
    elif adv == "ties":
        bias = torch.zeros_like(bias)
    step = 2.0 ** -round(math.log2(dd) / 2)
    router_w = (torch.randint(-1, 2, (e, dd), generator=g) * step).to(bf)
    params = MoEParams(
        router_w=router_w,
        router_bias=bias,
        w2=randn([e, dd, i], bf, g, i**-0.5),
        w13=w_up if act == "swiglu" else None,
        w1=None if act == "swiglu" else w_up,
        shared_w13=sh_up if act == "swiglu" else None,
        shared_w1=None if act == "swiglu" else sh_up,
        shared_w2=randn([dd, i * s], bf, g, (i * s) ** -0.5) if s else None,
    )
    x = (torch.round(randn([t, dd], F64, g) * 32).clamp(-127, 127) / 32).to(bf)
    if adv == "zero":
        x = torch.zeros_like(x)
    elif adv == "ties":
        x[::2] = 0.0
    shape = {"T": t, "D": dd, "E": e, "k": k, "I": i, "shared": s}
    return Inputs((x, params, cfg), shape=shape, dtype="bf16", meta={"activation": act})


def _act(h: Tensor, activation: str) -> Tensor:
    if activation == "swiglu":
        g, u = h[..., 0::2], h[..., 1::2]
        return g * torch.sigmoid(g) * u
    r = torch.where(h <= 0, torch.zeros_like(h), h)
    return r * r


def _moe_in(x: Tensor, p: Any, cfg: Any, weights: Tensor, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Routed experts, combine and shared experts with every op in `dtype`."""
    up = p.w13 if cfg.activation == "swiglu" else p.w1
    xd = x.to(dtype)
    t, k = ids.shape
    y = torch.zeros(t, k, x.shape[1], dtype=dtype)
    for e in range(cfg.n_routed_experts):
        ti, ki = torch.nonzero(ids == e, as_tuple=True)
        if ti.numel():
            a = _act(xd[ti] @ up[e].to(dtype).T, cfg.activation)
            y[ti, ki] = a @ p.w2[e].to(dtype).T
    scale = float(torch.tensor(cfg.route_scale, dtype=torch.float32))
    out: Tensor = (weights.to(dtype)[:, :, None] * y).sum(1) * scale
    sh_up = p.shared_w13 if cfg.activation == "swiglu" else p.shared_w1
    if sh_up is not None:
        out = out + _act(xd @ sh_up.to(dtype).T, cfg.activation) @ p.shared_w2.to(dtype).T
    return out


def moe_layer(inp: Inputs, c: Contract) -> list[Expect | None]:
    """Routes on its own: route_ids on fp32 bounds of the logits (float64 GEMM +- the fp32 forward-error
    bound), weights from float64 scores; the output is float64 math with a bf16 torch composition as the
    ratio baseline. Where rounding could change the routing, only determinism checks the case."""
    x, p, cfg = inp.args
    xd, wr = d(x), d(p.router_w)
    logits = xd @ wr.T
    rad = 0.0 if fp32_dot_exact(x, p.router_w) else (x.shape[1] + 2) * U_FP32 * (xd.abs() @ wr.abs().T)
    k, e = cfg.n_activated_experts, cfg.n_routed_experts
    lo, hi = fp32_down(logits - rad), fp32_up(logits + rad)
    ids = route_ids(lo, hi, p.router_bias, k, cfg.score_func, cfg.n_expert_groups, cfg.n_limited_groups)
    if ids is None:
        return [None, None, None, None]
    scores = sigmoid64(logits) if cfg.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
    picked = scores.gather(1, ids)
    weights = picked / picked.sum(-1, keepdim=True)
    out64 = _moe_in(x, p, cfg, weights, ids, F64)
    low = _moe_in(x, p, cfg, weights, ids, torch.bfloat16)
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    return [Expect(out64, lowprec=low), None, Expect(ids, exact=True), Expect(counts, exact=True)]


ENTRIES: list[OpEntry] = [
    OpEntry(
        name="moe_layer",
        module="moe",
        fn="moe_layer",
        space=space_moe,
        make=make_moe_layer,
        contract=RATIO2_BF16,
        oracle=moe_layer,
        output_names=("out", "weights", "ids", "counts"),
        output_contracts={1: BITWISE},
        adversarial=("zero", "ties", "single_token", "k1", "zipf"),
        note="bf16 experts; router inputs where fp32 sums are exact, so routing and weights are bitwise; "
        "output ratio(2) against a bf16 torch composition",
    ),
]
