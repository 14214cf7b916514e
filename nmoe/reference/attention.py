"""MLA attention spec (DeepSeek-V2/V3): q/kv LoRA with RMSNorm on the latents, decoupled shared rope key.

All math (projections, causal softmax) in fp32 (fp64 for fp64 x), rounded once to x.dtype; positions 0..S-1.
"""

import math

import torch
from torch import Tensor

from nmoe.layout import MLAParams, check_mla_params
from nmoe.reference.norm import rmsnorm
from nmoe.reference.rope import apply_rope
from nmoe.yarn import mla_softmax_scale

__all__ = ["mla_attention", "mla_softmax_scale"]


def mla_attention(
    x: Tensor,
    p: MLAParams,
    cos: Tensor,
    sin: Tensor,
    n_heads: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    softmax_scale: float,
    norm_eps: float,
) -> Tensor:
    """Causal MLA over x [B, S, dim] -> [B, S, dim] in x.dtype; cos/sin fp32 [>=S, rope/2] from yarn_cos_sin.

    softmax_scale should come from mla_softmax_scale (it carries the YaRN mscale).
    """
    if x.dim() != 3:
        raise ValueError(f"mla_attention: x must be [B, S, dim], got shape {tuple(x.shape)}")
    if min(n_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim) < 1 or qk_rope_head_dim % 2:
        raise ValueError(
            f"mla_attention: n_heads={n_heads}, qk_nope_head_dim={qk_nope_head_dim}, "
            f"qk_rope_head_dim={qk_rope_head_dim}, v_head_dim={v_head_dim} must be >= 1 (rope dim even)"
        )
    b, s, dim = x.shape
    if cos.dim() != 2 or cos.shape[0] < s or cos.shape[1] != qk_rope_head_dim // 2:
        raise ValueError(
            f"mla_attention: cos/sin shape {tuple(cos.shape)} must be [>= {s}, {qk_rope_head_dim // 2}]; "
            "build them with yarn_cos_sin(max_seq_len, qk_rope_head_dim, ...)"
        )
    check_mla_params(p, dim, n_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
    acc = torch.promote_types(x.dtype, torch.float32)
    cos_s, sin_s = cos[:s], sin[:s]

    def lin(t: Tensor, w: Tensor) -> Tensor:
        return t @ w.to(acc).T

    xf = x.to(acc)
    if p.wq is not None:
        q = lin(xf, p.wq)
    else:
        assert p.wq_a is not None and p.q_norm is not None and p.wq_b is not None
        q = lin(rmsnorm(lin(xf, p.wq_a), p.q_norm, norm_eps), p.wq_b)
    q = q.view(b, s, n_heads, qk_nope_head_dim + qk_rope_head_dim).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [qk_nope_head_dim, qk_rope_head_dim], dim=-1)
    q_pe = apply_rope(q_pe, cos_s, sin_s)

    c_kv, k_pe = torch.split(lin(xf, p.wkv_a), [p.kv_lora_rank, qk_rope_head_dim], dim=-1)
    k_pe = apply_rope(k_pe.unsqueeze(1), cos_s, sin_s)
    kv = lin(rmsnorm(c_kv, p.kv_norm, norm_eps), p.wkv_b)
    kv = kv.view(b, s, n_heads, qk_nope_head_dim + v_head_dim).transpose(1, 2)
    k_nope, v = torch.split(kv, [qk_nope_head_dim, v_head_dim], dim=-1)

    scores = (q_nope @ k_nope.mT + q_pe @ k_pe.mT) * softmax_scale
    future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(diagonal=1)
    scores = scores.masked_fill(future, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    o = (probs @ v).transpose(1, 2).reshape(b, s, n_heads * v_head_dim)
    return lin(o, p.wo).to(x.dtype)
