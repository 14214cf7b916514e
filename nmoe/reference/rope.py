"""Rotary embedding spec: YaRN frequencies as in DeepSeek-V3, fp32 angles, interleaved pairs (x[2i], x[2i+1]).

Frequencies in fp64 rounded once to fp32; angle = fp32(t * freq); cos/sin in fp64 of that angle, rounded once.
"""

import math

import torch
from torch import Tensor

from nmoe.reference.formats import round_to


def _yarn_active(max_seq_len: int, original_seq_len: int) -> bool:
    return max_seq_len > original_seq_len


def _check_rope_args(
    max_seq_len: int,
    rope_dim: int,
    rope_theta: float,
    rope_factor: float,
    original_seq_len: int,
    beta_fast: float,
    beta_slow: float,
) -> None:
    if max_seq_len < 1 or original_seq_len < 1:
        raise ValueError(
            f"rope: max_seq_len={max_seq_len} and original_seq_len={original_seq_len} must be >= 1"
        )
    if rope_dim < 2 or rope_dim % 2:
        raise ValueError(f"rope: rope_dim={rope_dim} must be even and >= 2 (pairs are rotated)")
    if not rope_theta > 1.0:
        raise ValueError(f"rope: rope_theta={rope_theta} must be > 1 (e.g. 10000)")
    if not rope_factor >= 1.0:
        raise ValueError(f"rope: rope_factor={rope_factor} must be >= 1 (1 disables YaRN scaling)")
    if not beta_fast > beta_slow > 0.0:
        raise ValueError(
            f"rope: need beta_fast > beta_slow > 0, got beta_fast={beta_fast}, beta_slow={beta_slow} "
            "(DeepSeek-V3 uses 32 and 1)"
        )


def _correction_dim(n_rotations: float, rope_dim: int, rope_theta: float, original_seq_len: int) -> float:
    """Pair index whose wavelength fits n_rotations times into original_seq_len."""
    return rope_dim * math.log(original_seq_len / (n_rotations * 2 * math.pi)) / (2 * math.log(rope_theta))


def yarn_inv_freq(
    max_seq_len: int,
    rope_dim: int,
    rope_theta: float,
    rope_factor: float,
    original_seq_len: int,
    beta_fast: float,
    beta_slow: float,
) -> Tensor:
    """fp32 [rope_dim//2] frequencies; YaRN-blended iff max_seq_len > original_seq_len (DeepSeek-V3 rule).

    Pairs below beta_fast's correction dim keep theta^(-2i/d), those above beta_slow's get /rope_factor.
    """
    _check_rope_args(max_seq_len, rope_dim, rope_theta, rope_factor, original_seq_len, beta_fast, beta_slow)
    idx = torch.arange(0, rope_dim, 2, dtype=torch.float64)
    freq = 1.0 / rope_theta ** (idx / rope_dim)
    if _yarn_active(max_seq_len, original_seq_len):
        low = max(math.floor(_correction_dim(beta_fast, rope_dim, rope_theta, original_seq_len)), 0)
        high = math.ceil(_correction_dim(beta_slow, rope_dim, rope_theta, original_seq_len))
        high = min(high, rope_dim - 1)
        span = (high - low) if high != low else 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / span).clamp(0.0, 1.0)
        smooth = 1.0 - ramp
        freq = freq / rope_factor * (1.0 - smooth) + freq * smooth
    return freq.to(torch.float32)


def yarn_cos_sin(
    max_seq_len: int,
    rope_dim: int,
    rope_theta: float,
    rope_factor: float,
    original_seq_len: int,
    beta_fast: float,
    beta_slow: float,
) -> tuple[Tensor, Tensor]:
    """(cos, sin) fp32 [max_seq_len, rope_dim//2] for positions 0..max_seq_len-1; slice [:S] for shorter runs.

    YaRN activation depends on the configured max_seq_len, never on a batch's length.
    """
    freq = yarn_inv_freq(
        max_seq_len, rope_dim, rope_theta, rope_factor, original_seq_len, beta_fast, beta_slow
    )
    angle = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freq)
    angle64 = angle.to(torch.float64)
    return torch.cos(angle64).to(torch.float32), torch.sin(angle64).to(torch.float32)


def yarn_mscale(rope_factor: float, mscale: float, max_seq_len: int, original_seq_len: int) -> float:
    """YaRN temperature 0.1*mscale*ln(factor)+1 (1 when YaRN is off); MLA squares it into the scale."""
    if not _yarn_active(max_seq_len, original_seq_len) or rope_factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(rope_factor) + 1.0


def _check_apply(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"apply_rope: last dim of x {tuple(x.shape)} must be even (interleaved pairs)")
    if cos.shape != sin.shape or cos.dim() < 1 or cos.shape[-1] != x.shape[-1] // 2:
        raise ValueError(
            f"apply_rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must share a shape ending in "
            f"{x.shape[-1] // 2} (= x.shape[-1] // 2); slice the tables to [:S] and match x's layout"
        )


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by angle; cos/sin [S, D/2] broadcast against x[..., S, D/2].

    Math in fp32 (fp64 for fp64 inputs): y0 = x0*c - x1*s, y1 = x0*s + x1*c; rounded once to x.dtype,
    every NaN canonical (docs/spec-corners.md).
    """
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
