"""Rotary embedding spec: YaRN frequencies as in DeepSeek-V3, fp32 angles, interleaved pairs (x[2i], x[2i+1]).

Frequencies in fp64 rounded once to fp32; angle = fp32(t * freq); cos/sin in fp64 of that angle, rounded once.
"""


import torch
from torch import Tensor

from nmoe.reference.formats import round_to
from nmoe.yarn import yarn_cos_sin, yarn_inv_freq, yarn_mscale

__all__ = ["apply_rope", "yarn_cos_sin", "yarn_inv_freq", "yarn_mscale"]


def _check_apply(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"apply_rope: last dim of x {tuple(x.shape)} must be even (interleaved pairs)")
    if cos.shape != sin.shape or cos.dim() < 1 or cos.shape[-1] != x.shape[-1] // 2:
        raise ValueError(
            f"apply_rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must share a shape ending in "
            f"{x.shape[-1] // 2} (= x.shape[-1] // 2); slice the tables to [:S] and match x's layout"
        )


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by angle; cos/sin [S, D/2] broadcast against x[..., S, D/2]."""
    # Math in fp32 (fp64 for fp64 inputs): y0 = x0*c - x1*s, y1 = x0*s + x1*c; rounded once to x.dtype,
    # every NaN canonical (docs/spec-corners.md).
    _check_apply(x, cos, sin)
    acc = torch.promote_types(torch.promote_types(x.dtype, torch.float32), cos.dtype)
    xf = x.to(acc)
    c = cos.to(acc)
    s = sin.to(acc)
    x0 = xf[..., 0::2]
    x1 = xf[..., 1::2]
    y = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return round_to(y.flatten(-2), x.dtype)


def apply_rope_bwd(dy: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Gradient of apply_rope: rotation is orthogonal, so dx is dy rotated by the negated angle."""
    return apply_rope(dy, cos, -sin)
