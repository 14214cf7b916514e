"""MLA attention: ratio contract against a bf16 torch baseline; ref64 is the spec on fp64 inputs.

Why ratio(2) and not a fixed bound: the fast path rounds q, k, v, the probabilities and every projection
to bf16 (up to 2^-8 relative each), and how that propagates through softmax depends on the score spread; the
same math in bf16 torch ops (the FlashAttention test's baseline) carries the same roundings and more, so
twice its max-norm error from the float64 spec, plus one bf16 ULP of max|ref64|, bounds any correct bf16
implementation, while a masking, scaling or rope defect moves the output by far more
(tests/test_fast_attention.py shows it for each catalogued mutant).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity.entry import (
    RATIO2_BF16,
    OpEntry,
)
from parity.inputs import (
    I,
    Inputs,
    Params,
    S,
    dt,
    randn,
    space,
    with_adv,
)


def rope_tables(s: int, d: int, theta: float = 10000.0) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin [S, D/2] of fp32 angles pos * theta^(-2i/D), each rounded once from float64."""
    freq = (1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).to(torch.float32)
    ang = torch.outer(torch.arange(s, dtype=torch.float32), freq).to(torch.float64)
    return torch.cos(ang).to(torch.float32), torch.sin(ang).to(torch.float32)


def space_mla(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    """Head dims (nope, rope, v) flash-attn-4 runs on both archs: multiples of 8, q/k and v up to 128, or
    DeepSeek-V3's (128, 64, 128), whose q/k head dim is 192."""
    if big:
        return space(
            B=I(1, 2),
            S=S([128, 512, 1000]),
            dim=S([512, 1024]),
            heads=S([4, 8]),
            q_lora=S([0, 256]),
            kv_lora=S([128, 512]),
            head_dims=S([(64, 32, 64), (128, 64, 128)]),
        )
    return space(
        B=I(1, 2),
        S=I(1, 40),
        dim=S([16, 32]),
        heads=I(1, 2),
        q_lora=S([0, 8]),
        kv_lora=S([8]),
        head_dims=S([(8, 8, 8), (16, 8, 16), (8, 16, 24)]),
    )


def make_mla_attention(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    from nmoe.layout import MLAParams

    q = with_adv(p, adv, **({"S": 1} if adv == "single_token" else {}))
    dtype = dt(q["dtype"])
    b, s, dim, nh = q["B"], q["S"], q["dim"], q["heads"]
    rq, rkv = q["q_lora"], q["kv_lora"]
    dn, dr, dv = q["head_dims"]

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


def mla_lowprec(inp: Inputs) -> Tensor:
    """The FlashAttention-style baseline: the same MLA math with every torch op in x.dtype (bf16)."""
    x, p, cos, sin, nh, dn, dr, dv, scale, eps = inp.args
    lp = x.dtype
    b, s, _ = x.shape

    def lin(t: Tensor, w: Tensor) -> Tensor:
        return t @ w.to(lp).T

    def rms(t: Tensor, w: Tensor) -> Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.to(lp)

    def rot(t: Tensor) -> Tensor:
        c_, s_ = cos[:s].to(lp), sin[:s].to(lp)
        t0, t1 = t[..., 0::2], t[..., 1::2]
        return torch.stack((t0 * c_ - t1 * s_, t0 * s_ + t1 * c_), dim=-1).flatten(-2)

    q = lin(x, p.wq) if p.wq is not None else lin(rms(lin(x, p.wq_a), p.q_norm), p.wq_b)
    q = q.view(b, s, nh, dn + dr).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [dn, dr], dim=-1)
    c_kv, k_pe = torch.split(lin(x, p.wkv_a), [p.kv_norm.shape[0], dr], dim=-1)
    kv = lin(rms(c_kv, p.kv_norm), p.wkv_b).view(b, s, nh, dn + dv).transpose(1, 2)
    k_nope, v = torch.split(kv, [dn, dv], dim=-1)
    scores = (q_nope @ k_nope.mT + rot(q_pe) @ rot(k_pe.unsqueeze(1)).mT) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    o = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, nh * dv)
    return lin(o, p.wo)


ENTRIES: list[OpEntry] = [
    OpEntry(
        name="mla_attention",
        module="attention",
        fn="mla_attention",
        space=space_mla,
        make=make_mla_attention,
        contract=RATIO2_BF16,
        oracle=None,
        adversarial=("zero", "single_token", "max"),
        ref64=True,
        lowprec=mla_lowprec,
        note="ref64 = the spec on fp64 inputs; baseline = the same math in bf16 torch ops",
    ),
]
