"""Expert activations: relu2 and interleaved swiglu, forward and explicit backward.

Math runs in fp32 (fp64 only when handed fp64, for gradcheck) and is rounded once to the output dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmoe.reference.formats import round_to


def _acc_dtype(*ts: Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs; fp64 only when an input is fp64 (gradcheck)."""
    dt = torch.float32
    for t in ts:
        if not t.is_floating_point():
            raise ValueError(f"expected a floating tensor, got {t.dtype}; cast the input to bf16 or fp32")
        dt = torch.promote_types(dt, t.dtype)
    return dt


def _relu(xf: Tensor) -> Tensor:
    """Clamp at 0 with pinned edge cases: NaN propagates, -0 becomes +0."""
    return torch.where(xf <= 0, torch.zeros_like(xf), xf)


def relu2(x: Tensor) -> Tensor:
    xf = x.to(_acc_dtype(x))
    r = _relu(xf)
    return round_to(r * r, x.dtype)


def relu2_bwd(dy: Tensor, x: Tensor) -> Tensor:
    if dy.shape != x.shape:
        raise ValueError(f"relu2_bwd: dy {tuple(dy.shape)} != x {tuple(x.shape)}; pass matching tensors")
    acc = _acc_dtype(dy, x)
    two_r = 2 * _relu(x.to(acc))
    return round_to(dy.to(acc) * two_r, dy.dtype)


def _split_interleaved(h: Tensor) -> tuple[Tensor, Tensor]:
    if h.shape[-1] % 2 != 0:
        raise ValueError(f"swiglu: last dim {h.shape[-1]} is odd; pass [..., 2I] gate/up interleaved")
    return h[..., 0::2], h[..., 1::2]


def _sigmoid(g: Tensor) -> Tensor:
    """sigmoid via exp(-|g|) so g*sigmoid(g) keeps its subnormal tail (torch.sigmoid flushes near -89)."""
    e = torch.exp(-g.abs())
    return torch.where(g >= 0, 1 / (1 + e), e / (1 + e))


def swiglu(h: Tensor) -> Tensor:
    acc = _acc_dtype(h)
    g, u = _split_interleaved(h.to(acc))
    return round_to(g * _sigmoid(g) * u, h.dtype)


def swiglu_bwd(dy: Tensor, h: Tensor) -> Tensor:
    acc = _acc_dtype(dy, h)
    g, u = _split_interleaved(h.to(acc))
    if dy.shape != g.shape:
        raise ValueError(f"swiglu_bwd: dy {tuple(dy.shape)} must be h with last dim halved {tuple(g.shape)}")
    d = dy.to(acc)
    s = _sigmoid(g)
    silu = g * s
    dg = d * u * (s * (1 + g * (1 - s)))
    du = d * silu
    return round_to(torch.stack((dg, du), dim=-1).flatten(-2), dy.dtype)
