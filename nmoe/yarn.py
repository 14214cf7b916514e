"""YaRN's rope tables and temperature and the MLA softmax scale: host-side model constants, shared by the spec
and the fast path. Frequencies in fp64 rounded once to fp32; angle = fp32(t * freq); cos/sin in fp64 of that
angle, rounded once, on the host (CUDA's fp64 cos/sin are not correctly rounded)."""

import math

import torch
from torch import Tensor


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
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """(cos, sin) fp32 [max_seq_len, rope_dim//2] for positions 0..max_seq_len-1, built on the host, then on
    `device`; slice [:S] for shorter runs. YaRN is active by the configured max_seq_len, never a batch's."""
    freq = yarn_inv_freq(
        max_seq_len, rope_dim, rope_theta, rope_factor, original_seq_len, beta_fast, beta_slow
    )
    angle = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freq)
    angle64 = angle.to(torch.float64)
    cos, sin = torch.cos(angle64).to(torch.float32), torch.sin(angle64).to(torch.float32)
    return cos.to(device), sin.to(device)


def yarn_mscale(rope_factor: float, mscale: float, max_seq_len: int, original_seq_len: int) -> float:
    """YaRN temperature 0.1*mscale*ln(factor)+1 (1 when YaRN is off); MLA squares it into the scale."""
    if not _yarn_active(max_seq_len, original_seq_len) or rope_factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(rope_factor) + 1.0


def mla_softmax_scale(
    qk_head_dim: int, rope_factor: float, mscale: float, max_seq_len: int, original_seq_len: int
) -> float:
    """qk_head_dim^-0.5 times the YaRN mscale squared (DeepSeek-V3: softmax_scale *= mscale * mscale)."""
    if qk_head_dim < 1:
        raise ValueError(f"mla_softmax_scale: qk_head_dim={qk_head_dim} must be >= 1")
    m = yarn_mscale(rope_factor, mscale, max_seq_len, original_seq_len)
    return math.pow(qk_head_dim, -0.5) * m * m
