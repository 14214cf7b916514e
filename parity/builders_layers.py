"""Input builders for layer-level contracts: norm, rope, MLA, cross-entropy, optimizers, MoE layer."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity.builders import I, S, _big, reduce_fill
from parity.inputs import (
    Inputs,
    Params,
    adversarial_fill,
    dt,
    randint,
    randn,
    space,
    uniform,
    with_adv,
)

# ----------------------------------------------------------------------------------------------------------
# norm, rope


def space_norm(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 512 if big else 16),
        D=_big(big, [1, 8, 64, 136], [512, 2048, 7168]),
        eps=S([1e-6, 1e-5]),
        scale=S([1.0, 30.0, 1e-3]),
    )


def make_rmsnorm(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = with_adv(p, adv, **({"T": 1} if adv == "single_token" else {}))
    dtype, t, d = dt(q["dtype"]), q["T"], q["D"]
    x = reduce_fill(randn([t, d], dtype, g, float(q["scale"])), adv, g)
    w = (1.0 + randn([d], torch.float64, g, 0.1)).to(dtype)
    return Inputs((x, w, float(q["eps"])), shape={"T": t, "D": d}, dtype=q["dtype"])


def make_rmsnorm_bwd(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = with_adv(p, adv, **({"T": 1} if adv == "single_token" else {}))
    dtype, t, d = dt(q["dtype"]), q["T"], q["D"]
    x = reduce_fill(randn([t, d], dtype, g, float(q["scale"])), adv, g)
    w = (1.0 + randn([d], torch.float64, g, 0.1)).to(dtype)
    dy = randn([t, d], dtype, g)
    return Inputs((dy, x, w, float(q["eps"])), shape={"T": t, "D": d}, dtype=q["dtype"])


def space_rope(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        B=I(1, 4 if big else 2),
        S=I(1, 512 if big else 12),
        D=_big(big, [2, 8, 64], [64, 128]),
        heads=I(1, 16 if big else 3),
        span=S([1.0, 100.0, 1e4]),
    )


def cos_sin(s: int, d: int, span: float, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin [S, D/2] of random fp32 angles, each rounded once from float64."""
    ang = uniform([s, d // 2], g, -span, span).to(torch.float32).to(torch.float64)
    return torch.cos(ang).to(torch.float32), torch.sin(ang).to(torch.float32)


def make_rope(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = with_adv(p, adv, **({"S": 1} if adv == "single_token" else {}))
    dtype, b, h, s, d = dt(q["dtype"]), q["B"], q["heads"], q["S"], q["D"]
    x = adversarial_fill(randn([b, h, s, d], dtype, g, 3.0), adv, g)
    cos, sin = cos_sin(s, d, float(q["span"]), g)
    return Inputs((x, cos, sin), shape={"B": b, "H": h, "S": s, "D": d}, dtype=q["dtype"])


# ----------------------------------------------------------------------------------------------------------
# attention, loss, optimizers, MoE layer


def rope_tables(s: int, d: int, theta: float = 10000.0) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin [S, D/2] of fp32 angles pos * theta^(-2i/D), each rounded once from float64."""
    freq = (1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).to(torch.float32)
    ang = torch.outer(torch.arange(s, dtype=torch.float32), freq).to(torch.float64)
    return torch.cos(ang).to(torch.float32), torch.sin(ang).to(torch.float32)


def space_mla(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    if big:
        return space(
            B=I(1, 2),
            S=S([128, 512]),
            dim=S([512, 1024]),
            heads=S([4, 8]),
            q_lora=S([0, 256]),
            kv_lora=S([128]),
            d_nope=S([64]),
            d_rope=S([32]),
            d_v=S([64]),
        )
    return space(
        B=I(1, 2),
        S=I(1, 10),
        dim=S([16, 32]),
        heads=I(1, 2),
        q_lora=S([0, 8]),
        kv_lora=S([8]),
        d_nope=S([4, 8]),
        d_rope=S([2, 4]),
        d_v=S([4, 8]),
    )


def make_mla_attention(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    from nmoe.reference.attention import MLAParams

    q = with_adv(p, adv, **({"S": 1} if adv == "single_token" else {}))
    dtype = dt(q["dtype"])
    b, s, dim, nh = q["B"], q["S"], q["dim"], q["heads"]
    rq, rkv, dn, dr, dv = q["q_lora"], q["kv_lora"], q["d_nope"], q["d_rope"], q["d_v"]

    def lin(out: int, inp: int) -> Tensor:
        return randn([out, inp], dtype, g, 1.0 / math.sqrt(inp))

    def norm_w(n: int) -> Tensor:
        return (1.0 + randn([n], torch.float64, g, 0.1)).to(dtype)

    qk = nh * (dn + dr)
    params = MLAParams(
        wkv_a=lin(rkv + dr, dim),
        kv_norm=norm_w(rkv),
        wkv_b=lin(nh * (dn + dv), rkv),
        wo=lin(dim, nh * dv),
        wq=lin(qk, dim) if rq == 0 else None,
        wq_a=lin(rq, dim) if rq else None,
        q_norm=norm_w(rq) if rq else None,
        wq_b=lin(qk, rq) if rq else None,
    )
    x = randn([b, s, dim], dtype, g)
    if adv == "zero":
        x = torch.zeros_like(x)
    elif adv == "max":
        x = randn([b, s, dim], dtype, g, 30.0)
    cos, sin = rope_tables(s, dr)
    scale = (dn + dr) ** -0.5
    shape = {
        "B": b,
        "S": s,
        "dim": dim,
        "heads": nh,
        "q_lora": rq,
        "kv_lora": rkv,
        "d_nope": dn,
        "d_rope": dr,
        "d_v": dv,
    }
    return Inputs((x, params, cos, sin, nh, dn, dr, dv, scale, 1e-6), shape=shape, dtype=q["dtype"])


def space_ce(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    if big:
        return space(
            T=S([256, 1024]),
            D=S([512, 1024]),
            V=S([8192, 32768]),
            chunk=S([256, 4096]),
            ignore=S([0.0, 0.2]),
            scale=S([1.0, 4.0]),
            dloss=S([1.0, 0.5]),
        )
    return space(
        T=I(1, 16),
        D=S([8, 32]),
        V=S([5, 64, 300]),
        chunk=S([1, 3, 4096]),
        ignore=S([0.0, 0.3]),
        scale=S([1.0, 4.0]),
        dloss=S([1.0, 0.5]),
    )


def _ce_inputs(
    p: Params, g: torch.Generator, adv: str | None
) -> tuple[Tensor, Tensor, Tensor, dict[str, int]]:
    q = with_adv(p, adv, **({"T": 1} if adv == "single_token" else {}))
    dtype, t, dd, v = dt(q["dtype"]), q["T"], q["D"], q["V"]
    h = randn([t, dd], dtype, g, float(q["scale"]) * (40.0 if adv == "max" else 1.0))
    if adv == "zero":
        h = torch.zeros_like(h)
    w = randn([v, dd], dtype, g, 1.0 / math.sqrt(dd))
    targets = randint(0, v, [t], g)
    drop = uniform([t], g) < float(q["ignore"])
    if adv == "all_ignored":
        drop = torch.ones(t, dtype=torch.bool)
    targets = torch.where(drop, -100, targets)
    return h, w, targets, {"T": t, "D": dd, "V": v, "chunk": int(q["chunk"])}


def make_cross_entropy(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    h, w, targets, shape = _ce_inputs(p, g, adv)
    return Inputs((h, w, targets, -100, shape["chunk"]), shape=shape, dtype=p["dtype"])


def make_cross_entropy_bwd(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    h, w, targets, shape = _ce_inputs(p, g, adv)
    return Inputs((float(p["dloss"]), h, w, targets, -100, shape["chunk"]), shape=shape, dtype=p["dtype"])


def space_adamw(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        R=I(1, 4096 if big else 16),
        C=_big(big, [1, 8, 33], [1024, 7168]),
        step=S([1, 10, 1000]),
        lr=S([1e-3, 3e-4, 0.02]),
        beta2=S([0.95, 0.999]),
        wd=S([0.0, 0.1]),
    )


def make_adamw(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = with_adv(p, adv, **({"R": 1, "C": 1} if adv == "single_token" else {}))
    shape = [q["R"], q["C"]]
    par = randn(shape, torch.float32, g, 0.02)
    grad = randn(shape, torch.float32, g, 1e-2)
    m = randn(shape, torch.float32, g, 1e-2)
    v = (randn(shape, torch.float64, g, 1e-2) ** 2).to(torch.float32)
    if adv == "zero":
        grad, m, v = torch.zeros_like(grad), torch.zeros_like(m), torch.zeros_like(v)
    elif adv == "denormal":
        grad = randn(shape, torch.float32, g, 1e-20)
    args = (par, grad, m, v, int(q["step"]), float(q["lr"]), 0.9, float(q["beta2"]), 1e-8, float(q["wd"]))
    return Inputs(args, shape={"R": q["R"], "C": q["C"], "step": int(q["step"])}, dtype="fp32")


def space_muon(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        E=S([0, 2]),
        R=I(2, 1024 if big else 12),
        C=I(2, 2048 if big else 16),
        lr=S([0.02, 1e-3]),
        wd=S([0.0, 0.1]),
        nesterov=st.booleans(),
    )


def make_muon(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    shape = ([p["E"]] if p["E"] else []) + [p["R"], p["C"]]
    par = randn(shape, torch.float32, g, 0.02)
    grad = randn(shape, torch.float32, g, 1e-2)
    buf = randn(shape, torch.float32, g, 1e-2)
    if adv == "zero":
        grad, buf = torch.zeros_like(grad), torch.zeros_like(buf)
    args = (par, grad, buf, float(p["lr"]), 0.95, float(p["wd"]), bool(p["nesterov"]), 5)
    return Inputs(args, shape={"E": p["E"], "R": p["R"], "C": p["C"]}, dtype="fp32")


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
    from nmoe.config import ModelConfig
    from nmoe.reference.moe import MoEParams

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
    params = MoEParams(
        router_w=randn([e, dd], bf, g, dd**-0.5),
        router_bias=bias,
        w2=randn([e, dd, i], bf, g, i**-0.5),
        w13=w_up if act == "swiglu" else None,
        w1=None if act == "swiglu" else w_up,
        shared_w13=sh_up if act == "swiglu" else None,
        shared_w1=None if act == "swiglu" else sh_up,
        shared_w2=randn([dd, i * s], bf, g, (i * s) ** -0.5) if s else None,
    )
    x = randn([t, dd], bf, g)
    if adv == "zero":
        x = torch.zeros_like(x)
    shape = {"T": t, "D": dd, "E": e, "k": k, "I": i, "shared": s}
    return Inputs((x, params, cfg), shape=shape, dtype="bf16", meta={"activation": act})
