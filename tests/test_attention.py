"""Spec tests of reference/attention.py against a naive per-token, per-head float64 MLA written here."""

import math
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from nmoe.layout import MLAParams
from nmoe.reference.attention import mla_attention, mla_softmax_scale
from nmoe.reference.rope import yarn_cos_sin

EPS = 1e-6


def gen(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def make_params(dim: int, h: int, dn: int, dr: int, dv: int, r_q: int, r_kv: int, seed: int) -> MLAParams:
    def w(out: int, inp: int, k: int) -> Tensor:
        return gen((out, inp), seed + k, inp**-0.5)

    q: dict[str, Tensor | None]
    if r_q:
        q_norm = 1.0 + 0.1 * gen((r_q,), seed + 2)
        q = {"wq_a": w(r_q, dim, 1), "q_norm": q_norm, "wq_b": w(h * (dn + dr), r_q, 3)}
    else:
        q = {"wq": w(h * (dn + dr), dim, 4)}
    return MLAParams(
        wkv_a=w(r_kv + dr, dim, 5),
        kv_norm=1.0 + 0.1 * gen((r_kv,), seed + 6),
        wkv_b=w(h * (dn + dv), r_kv, 7),
        wo=w(dim, h * dv, 8),
        **q,
    )


def naive_mla(
    x: Tensor,
    p: MLAParams,
    cos: Tensor,
    sin: Tensor,
    h: int,
    dn: int,
    dr: int,
    dv: int,
    scale: float,
    causal: bool = True,
) -> Tensor:
    """Token by token, head by head; rope as complex multiplication; softmax written out."""
    x = x.double()
    b_sz, s, dim = x.shape

    def rms(v: Tensor, w: Tensor) -> Tensor:
        return v / math.sqrt(float((v * v).sum()) / v.numel() + EPS) * w.double()

    def rot(v: Tensor, t: int) -> Tensor:
        z = torch.complex(v[0::2], v[1::2]) * torch.complex(cos[t].double(), sin[t].double())
        return torch.view_as_real(z).flatten()

    out = torch.zeros(b_sz, s, dim, dtype=torch.float64)
    r_kv = p.kv_norm.shape[0]
    for b in range(b_sz):
        qs, kns, kps, vs = [], [], [], []
        for t in range(s):
            xt = x[b, t]
            if p.wq is not None:
                qt = p.wq.double() @ xt
            else:
                assert p.wq_a is not None and p.q_norm is not None and p.wq_b is not None
                qt = p.wq_b.double() @ rms(p.wq_a.double() @ xt, p.q_norm)
            qs.append(qt.view(h, dn + dr))
            a = p.wkv_a.double() @ xt
            kps.append(rot(a[r_kv:], t))
            kv = (p.wkv_b.double() @ rms(a[:r_kv], p.kv_norm)).view(h, dn + dv)
            kns.append(kv[:, :dn])
            vs.append(kv[:, dn:])
        for i in range(s):
            heads = []
            for hh in range(h):
                q_pe = rot(qs[i][hh, dn:], i)
                js = range(i + 1) if causal else range(s)
                logits = [scale * (float(qs[i][hh, :dn] @ kns[j][hh]) + float(q_pe @ kps[j])) for j in js]
                top = max(logits)
                e = [math.exp(lg - top) for lg in logits]
                z = sum(e)
                o = torch.zeros(dv, dtype=torch.float64)
                for e_j, j in zip(e, js, strict=True):
                    o = o + (e_j / z) * vs[j][hh]
                heads.append(o)
            out[b, i] = p.wo.double() @ torch.cat(heads)
    return out


def to_dtype(p: MLAParams, dtype: torch.dtype) -> MLAParams:
    def c(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(dtype)

    return MLAParams(
        wkv_a=p.wkv_a.to(dtype),
        kv_norm=p.kv_norm.to(dtype),
        wkv_b=p.wkv_b.to(dtype),
        wo=p.wo.to(dtype),
        wq=c(p.wq),
        wq_a=c(p.wq_a),
        q_norm=c(p.q_norm),
        wq_b=c(p.wq_b),
    )


DIMS = {"n_heads": 2, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 3}


def run(x: Tensor, p: MLAParams, cos: Tensor, sin: Tensor, scale: float) -> Tensor:
    return mla_attention(x, p, cos, sin, softmax_scale=scale, norm_eps=EPS, **DIMS)


def tables(s: int) -> tuple[Tensor, Tensor]:
    return yarn_cos_sin(s, 4, 10000.0, 4.0, 4, 32.0, 1.0)


@pytest.mark.parametrize("r_q", [0, 6])
def test_matches_naive_float64(r_q: int) -> None:
    p = make_params(16, 2, 4, 4, 3, r_q, 5, seed=10 * r_q)
    cos, sin = tables(8)
    x = gen((2, 6, 16), 1)
    scale = mla_softmax_scale(8, 4.0, 1.0, 8, 4)
    y = run(x, p, cos, sin, scale)
    assert y.dtype == torch.float64 and y.shape == x.shape
    assert torch.allclose(y, naive_mla(x, p, cos, sin, 2, 4, 4, 3, scale), rtol=1e-10, atol=1e-12)


def test_fp32_and_bf16_outputs() -> None:
    p64 = make_params(16, 2, 4, 4, 3, 6, 5, seed=3)
    cos, sin = tables(5)
    x = gen((1, 5, 16), 2)
    want = naive_mla(x, p64, cos, sin, 2, 4, 4, 3, 0.3)
    p32 = to_dtype(p64, torch.float32)
    y32 = run(x.float(), p32, cos, sin, 0.3)
    assert y32.dtype == torch.float32
    assert torch.allclose(y32.double(), want, rtol=1e-5, atol=1e-5)
    y16 = run(x.bfloat16(), p32, cos, sin, 0.3)
    assert y16.dtype == torch.bfloat16
    want16 = naive_mla(x.bfloat16(), p32, cos, sin, 2, 4, 4, 3, 0.3)
    assert torch.allclose(y16.double(), want16, rtol=2**-7, atol=1e-3)


def test_causal_future_does_not_touch_past() -> None:
    p = make_params(16, 2, 4, 4, 3, 6, 5, seed=4)
    cos, sin = tables(7)
    x = gen((2, 7, 16), 5)
    x2 = x.clone()
    x2[:, 4:] += gen((2, 3, 16), 6)
    y, y2 = run(x, p, cos, sin, 0.4), run(x2, p, cos, sin, 0.4)
    assert torch.allclose(y[:, :4], y2[:, :4], rtol=0, atol=1e-13)
    assert not torch.allclose(y[:, 4:], y2[:, 4:], atol=1e-3)


def test_gradcheck_float64() -> None:
    p = make_params(6, 2, 2, 2, 2, 3, 3, seed=7)
    cos, sin = yarn_cos_sin(3, 2, 100.0, 1.0, 3, 32.0, 1.0)
    x = gen((1, 3, 6), 8).requires_grad_()
    assert p.wq_a is not None and p.q_norm is not None and p.wq_b is not None
    ws = [t.clone().requires_grad_() for t in (p.wq_a, p.q_norm, p.wq_b, p.wkv_a, p.kv_norm, p.wkv_b, p.wo)]

    def f(xx: Tensor, *w: Tensor) -> Tensor:
        pp = MLAParams(wq_a=w[0], q_norm=w[1], wq_b=w[2], wkv_a=w[3], kv_norm=w[4], wkv_b=w[5], wo=w[6])
        return mla_attention(xx, pp, cos, sin, 2, 2, 2, 2, 0.7, 1e-3)

    assert torch.autograd.gradcheck(f, (x, *ws), fast_mode=True)


def test_softmax_scale_hand_value() -> None:
    m = 1.0 + 0.1 * 0.707 * math.log(40.0)
    want = m * m / math.sqrt(192)
    assert mla_softmax_scale(192, 40.0, 0.707, 163840, 4096) == pytest.approx(want, rel=1e-15)
    assert mla_softmax_scale(192, 40.0, 0.707, 4096, 4096) == pytest.approx(1 / math.sqrt(192), rel=1e-15)


def test_params_ranks() -> None:
    lora = make_params(16, 2, 4, 4, 3, 6, 5, seed=0)
    plain = make_params(16, 2, 4, 4, 3, 0, 5, seed=0)
    assert (lora.q_lora_rank, lora.kv_lora_rank, plain.q_lora_rank) == (6, 5, 0)


def test_errors_name_the_fix() -> None:
    p = make_params(16, 2, 4, 4, 3, 6, 5, seed=1)
    cos, sin = tables(4)
    x = gen((1, 4, 16), 0)
    with pytest.raises(ValueError, match="exactly one"):
        run(x, replace(p, wq=torch.zeros(16, 16)), cos, sin, 0.3)
    with pytest.raises(ValueError, match="exactly one"):
        run(x, replace(p, wq_a=None, q_norm=None, wq_b=None), cos, sin, 0.3)
    with pytest.raises(ValueError, match="q_norm and wq_b must be None"):
        run(x, replace(p, wq=torch.zeros(16, 16), wq_a=None), cos, sin, 0.3)
    with pytest.raises(ValueError, match="wkv_b has shape"):
        run(x, replace(p, wkv_b=torch.zeros(3, 5)), cos, sin, 0.3)
    with pytest.raises(ValueError, match=r"\[B, S, dim\]"):
        run(x[0], p, cos, sin, 0.3)
    with pytest.raises(ValueError, match="cos/sin"):
        run(gen((1, 5, 16), 0), p, cos, sin, 0.3)
    with pytest.raises(ValueError, match="rope dim even"):
        mla_attention(x, p, cos, sin, 2, 4, 3, 3, 0.3, EPS)
    with pytest.raises(ValueError, match="qk_head_dim"):
        mla_softmax_scale(0, 40.0, 1.0, 8, 4)


def test_sep_mla_no_causal_mask() -> None:
    p = make_params(16, 2, 4, 4, 3, 6, 5, seed=11)
    cos, sin = tables(5)
    x = gen((1, 5, 16), 12)
    correct = naive_mla(x, p, cos, sin, 2, 4, 4, 3, 0.35, causal=True)
    mutated = naive_mla(x, p, cos, sin, 2, 4, 4, 3, 0.35, causal=False)
    assert not torch.allclose(correct[:, :-1], mutated[:, :-1], atol=1e-3)
    assert torch.allclose(run(x, p, cos, sin, 0.35), correct, rtol=1e-10, atol=1e-12)


def test_sep_mla_softmax_scale_no_mscale() -> None:
    # YaRN on (16 > 4 tokens, factor 40): the scale must carry mscale^2 = (1 + 0.1 ln 40)^2.
    d_qk = 4 + 4
    correct_scale = (1.0 + 0.1 * math.log(40.0)) ** 2 / math.sqrt(d_qk)
    mutated_scale = 1.0 / math.sqrt(d_qk)
    p = make_params(16, 2, 4, 4, 3, 6, 5, seed=13)
    cos, sin = yarn_cos_sin(16, 4, 10000.0, 40.0, 4, 32.0, 1.0)
    x = gen((1, 6, 16), 14, 3.0)
    correct = naive_mla(x, p, cos, sin, 2, 4, 4, 3, correct_scale)
    mutated = naive_mla(x, p, cos, sin, 2, 4, 4, 3, mutated_scale)
    assert not torch.allclose(correct, mutated, atol=1e-3)
    scale = mla_softmax_scale(d_qk, 40.0, 1.0, 16, 4)
    assert scale == pytest.approx(correct_scale, rel=1e-15)
    assert torch.allclose(run(x, p, cos, sin, scale), correct, rtol=1e-10, atol=1e-12)
