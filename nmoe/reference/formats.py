"""Number formats: bf16, e4m3, e8m0, e2m1, MX-FP8 and NVFP4, bit-exact.

Rounding is done on integer bit patterns so every tie and overflow is explicit; the only float ops are
the pinned fp32 scale computations, written out in the order the fast path must reproduce.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nmoe.constants import BF16_CANONICAL_NAN, E2M1_MAX, E4M3_MAX, F32_CANONICAL_NAN, MX_BLOCKS, NVFP4_BLOCK
from nmoe.constants import FP8_WEIGHT_BLOCK as WEIGHT_BLOCK

_F32_MANT = 23
_F32_BIAS = 127


def _f32(x: Tensor, who: str) -> Tensor:
    """Widen exactly to fp32; fp64 is refused because narrowing it first would round twice."""
    if x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return x.to(torch.float32)
    raise ValueError(f"{who}: expected fp32/bf16/fp16 input, got {x.dtype}; cast to float32 explicitly first")


def _bits(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(bits: Tensor) -> Tensor:
    return bits.to(torch.int64).where(bits < 2**31, bits - 2**32).to(torch.int32).view(torch.float32)


def _pow2(k: Tensor) -> Tensor:
    """Exact fp32 2^k for integer k in [-149, 127], built from bits (subnormals included)."""
    k = k.to(torch.int64)
    normal = (k + _F32_BIAS).clamp(min=0) << _F32_MANT
    sub = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return _from_bits(torch.where(k >= -126, normal, sub))


def _rne_shift(sig: Tensor, shift: Tensor) -> Tensor:
    """round-half-even(sig / 2^shift) for int64 sig < 2^24 and shift >= 1."""
    shift = shift.clamp(1, 30)
    q = sig >> shift
    rem = sig - (q << shift)
    half = torch.ones_like(sig) << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(torch.int64)


def _encode_minifloat(x: Tensor, mbits: int, emin: int, vmax: float) -> tuple[Tensor, Tensor, Tensor]:
    """RNE of fp32 x to a format with `mbits` mantissa bits and min normal exponent `emin`.

    Returns (sign, magnitude code, nan mask); x is clamped to ±vmax first, so the code never overflows.
    """
    nan = torch.isnan(x)
    sign = _bits(x) >> 31
    bits = _bits(torch.clamp(x, -vmax, vmax).where(~nan, torch.zeros_like(x))) & 0x7FFFFFFF
    biased = (bits >> _F32_MANT) & 0xFF
    mant = bits & ((1 << _F32_MANT) - 1)
    sig = torch.where(biased > 0, mant | (1 << _F32_MANT), mant)
    e_eff = torch.clamp(biased - _F32_BIAS, min=emin)
    shift = (_F32_BIAS + _F32_MANT) + e_eff - mbits - biased.clamp(min=1)
    n = _rne_shift(sig, shift)
    return sign, ((e_eff - emin) << mbits) + n, nan


def _decode_minifloat(codes: Tensor, ebits: int, mbits: int, bias: int) -> Tensor:
    """Exact fp32 value of sign|exp|mantissa codes (no inf/NaN handling; callers add their own)."""
    c = codes.to(torch.int64)
    sign = (c >> (ebits + mbits)) & 1
    e = (c >> mbits) & ((1 << ebits) - 1)
    m = c & ((1 << mbits) - 1)
    sig = torch.where(e > 0, m + (1 << mbits), m)
    mag = sig.to(torch.float32) * _pow2(e.clamp(min=1) - bias - mbits)
    return torch.where(sign == 1, -mag, mag)


def _check_codes(codes: Tensor, who: str) -> None:
    if codes.dtype != torch.uint8:
        raise ValueError(f"{who}: codes must be uint8 bit patterns, got {codes.dtype}; pass encoder output")


def to_bf16(x: Tensor) -> Tensor:
    """bf16 by round-to-nearest-even from fp32 bits; overflow goes to ±Inf (IEEE, as on every stack).

    Every NaN becomes the canonical 0x7FC0: NaN payloads differ across CPUs, GPUs and vector paths.
    """
    xf = _f32(x, "to_bf16")
    bits = _bits(xf)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = torch.where(torch.isnan(xf), torch.full_like(rounded, BF16_CANONICAL_NAN), rounded)
    return out.where(out < 2**15, out - 2**16).to(torch.int16).view(torch.bfloat16)


def round_to(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Round fp32 (or fp64, for gradcheck) math once to an op's output dtype, with canonical NaN bits."""
    if dtype == torch.bfloat16:
        return to_bf16(x)
    if dtype == torch.float32:
        xf = _f32(x, "round_to")
        nan = torch.tensor(F32_CANONICAL_NAN, dtype=torch.int32).view(torch.float32)
        return torch.where(torch.isnan(xf), nan, xf)
    if dtype == torch.float64:
        return x.to(torch.float64)
    raise ValueError(f"round_to: output dtype {dtype} is not in the spec; use bf16 or fp32 (fp64: gradcheck)")


def e4m3_encode(x: Tensor) -> Tensor:
    """float8_e4m3fn bit patterns: clamp to ±448, RNE; NaN keeps its sign as S.1111.111."""
    sign, mag, nan = _encode_minifloat(_f32(x, "e4m3_encode"), mbits=3, emin=-6, vmax=E4M3_MAX)
    mag = torch.where(nan, torch.full_like(mag, 0x7F), mag)
    return ((sign << 7) | mag).to(torch.uint8)


def e4m3_decode(codes: Tensor) -> Tensor:
    _check_codes(codes, "e4m3_decode")
    val = _decode_minifloat(codes, ebits=4, mbits=3, bias=7)
    return torch.where((codes & 0x7F) == 0x7F, torch.copysign(torch.full_like(val, float("nan")), val), val)


def e8m0_decode(b: Tensor) -> Tensor:
    """2^(b-127) exactly (b = 0 is the fp32 subnormal 2^-127); 255 is NaN."""
    _check_codes(b, "e8m0_decode")
    val = _pow2(b.to(torch.int64) - 127)
    return torch.where(b == 255, torch.full_like(val, float("nan")), val)


def e2m1_encode(x: Tensor) -> Tensor:
    """Codes 0..15 (bit 3 = sign), RNE, saturating at ±6; e2m1 has no NaN, so NaN input is refused."""
    xf = _f32(x, "e2m1_encode")
    if bool(torch.isnan(xf).any()):
        raise ValueError("e2m1_encode: input holds NaN, which e2m1 cannot represent; mask or fix it upstream")
    sign, mag, _ = _encode_minifloat(xf, mbits=1, emin=0, vmax=E2M1_MAX)
    return ((sign << 3) | mag).to(torch.uint8)


def e2m1_decode(codes: Tensor) -> Tensor:
    _check_codes(codes, "e2m1_decode")
    if bool((codes > 15).any()):
        raise ValueError("e2m1_decode: codes above 15; unpack packed bytes with unpack_e2m1 first")
    return _decode_minifloat(codes, ebits=2, mbits=1, bias=1)


def pack_e2m1(codes: Tensor) -> Tensor:
    """Two codes per byte: element 2i in the low nibble, 2i+1 in the high nibble."""
    _check_codes(codes, "pack_e2m1")
    if codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_e2m1: last dim {codes.shape[-1]} is odd; pad it to an even length")
    if bool((codes > 15).any()):
        raise ValueError("pack_e2m1: codes above 15; pass e2m1_encode output (4-bit codes)")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: Tensor) -> Tensor:
    _check_codes(packed, "unpack_e2m1")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def _check_block(k: int, block: int, who: str) -> None:
    if k % block != 0:
        raise ValueError(f"{who}: size {k} is not a multiple of the block {block}; pad it with zeros to a "
                         f"multiple of {block}")


def _mx_scale_byte(amax: Tensor, finite: Tensor) -> Tensor:
    """e8m0 byte = ceil(log2(amax/448)) from the fp32 bits of s, clamped to [1, 254]; 255 if non-finite."""
    s = amax / E4M3_MAX
    bits = _bits(torch.where(finite, s, torch.zeros_like(s)))
    byte = ((bits >> _F32_MANT) & 0xFF) + ((bits & ((1 << _F32_MANT) - 1)) != 0).to(torch.int64)
    byte = torch.clamp(byte, 1, 254)
    return torch.where(finite, byte, torch.full_like(byte, 255))


def _mx_quantize_blocks(xb: Tensor, dims: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Quantize fp32 xb whose block elements span `dims`; returns (codes like xb, int64 bytes keepdim)."""
    finite = torch.isfinite(xb).all(dim=dims, keepdim=True)
    amax = xb.abs().where(torch.isfinite(xb), torch.zeros_like(xb)).amax(dim=dims, keepdim=True)
    byte = _mx_scale_byte(amax, finite)
    codes = e4m3_encode(xb * _pow2(127 - byte))
    codes = torch.where(finite & (amax == 0), torch.zeros_like(codes), codes)
    return codes, byte


def quantize_mxfp8(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """MX-FP8 along the last dim: e4m3 codes [..., K] and e8m0 scale bytes [..., K//block]."""
    if block not in MX_BLOCKS:
        raise ValueError(f"quantize_mxfp8: block {block} unsupported; use 32 (sm_100a) or 128 (sm_90a)")
    xf = _f32(x, "quantize_mxfp8")
    k = xf.shape[-1]
    _check_block(k, block, "quantize_mxfp8")
    xb = xf.reshape(*xf.shape[:-1], k // block, block)
    codes, byte = _mx_quantize_blocks(xb, (-1,))
    return codes.reshape(xf.shape), byte.squeeze(-1).to(torch.uint8)


def dequantize_mxfp8(codes: Tensor, scales: Tensor, block: int) -> Tensor:
    k = codes.shape[-1]
    _check_block(k, block, "dequantize_mxfp8")
    if scales.shape != (*codes.shape[:-1], k // block):
        raise ValueError(f"dequantize_mxfp8: scales {tuple(scales.shape)} do not match codes "
                         f"{tuple(codes.shape)} with block {block}; pass quantize_mxfp8's pair")
    vals = e4m3_decode(codes).reshape(*codes.shape[:-1], k // block, block)
    return round_to(vals * e8m0_decode(scales).unsqueeze(-1), torch.float32).reshape(codes.shape)


def quantize_mxfp8_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """MX-FP8 with 128x128 blocks over the last two dims (DeepSeek-V3 weight layout)."""
    wf = _f32(w, "quantize_mxfp8_weight")
    if wf.dim() < 2:
        raise ValueError(f"quantize_mxfp8_weight: need [..., N, K], got shape {tuple(wf.shape)}")
    n, k = wf.shape[-2:]
    _check_block(n, WEIGHT_BLOCK, "quantize_mxfp8_weight (N)")
    _check_block(k, WEIGHT_BLOCK, "quantize_mxfp8_weight (K)")
    lead = wf.shape[:-2]
    wb = wf.reshape(*lead, n // WEIGHT_BLOCK, WEIGHT_BLOCK, k // WEIGHT_BLOCK, WEIGHT_BLOCK)
    codes, byte = _mx_quantize_blocks(wb, (-3, -1))
    return codes.reshape(wf.shape), byte.squeeze(-1).squeeze(-2).to(torch.uint8)


def dequantize_mxfp8_weight(codes: Tensor, scales: Tensor) -> Tensor:
    n, k = codes.shape[-2:]
    _check_block(n, WEIGHT_BLOCK, "dequantize_mxfp8_weight (N)")
    _check_block(k, WEIGHT_BLOCK, "dequantize_mxfp8_weight (K)")
    lead = codes.shape[:-2]
    if scales.shape != (*lead, n // WEIGHT_BLOCK, k // WEIGHT_BLOCK):
        raise ValueError(f"dequantize_mxfp8_weight: scales {tuple(scales.shape)} do not match codes "
                         f"{tuple(codes.shape)}; pass quantize_mxfp8_weight's pair")
    vals = e4m3_decode(codes).reshape(*lead, n // WEIGHT_BLOCK, WEIGHT_BLOCK, k // WEIGHT_BLOCK, WEIGHT_BLOCK)
    scale = e8m0_decode(scales).unsqueeze(-2).unsqueeze(-1)
    return round_to(vals * scale, torch.float32).reshape(codes.shape)


def nvfp4_tensor_scale(x: Tensor) -> Tensor:
    """g = amax/(448*6) in one fp32 division, amax over finite elements only."""
    xf = _f32(x, "nvfp4_tensor_scale")
    amax = xf.abs().where(torch.isfinite(xf), torch.zeros_like(xf)).amax() if xf.numel() else xf.new_zeros(())
    return amax / (E4M3_MAX * E2M1_MAX)


def quantize_nvfp4(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """NVFP4 along the last dim: packed e2m1 [..., K//2], e4m3 block scales [..., K//16] and one fp32
    tensor scale."""
    # fp32 op order: g = amax/2688; s_b = e4m3((amax_b/6)/g); codes = e2m1(x/(s_b*g)). Where s_b*g is 0 the
    # codes are 0; a block holding NaN/±Inf gets scale 0x7F (NaN) and codes 0, so it dequantizes to NaN.
    xf = _f32(x, "quantize_nvfp4")
    k = xf.shape[-1]
    _check_block(k, NVFP4_BLOCK, "quantize_nvfp4")
    g = nvfp4_tensor_scale(xf)
    xb = xf.reshape(*xf.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    finite = torch.isfinite(xb).all(dim=-1, keepdim=True)
    xb = torch.where(finite, xb, torch.zeros_like(xb))
    amax_b = xb.abs().amax(dim=-1, keepdim=True)
    s_real = amax_b / E2M1_MAX / g if bool(g > 0) else torch.zeros_like(amax_b)
    s_code = e4m3_encode(torch.clamp(s_real, 0.0, E4M3_MAX))
    denom = e4m3_decode(s_code) * g
    ok = finite & (denom > 0)
    q = torch.clamp(xb / torch.where(ok, denom, torch.ones_like(denom)), -E2M1_MAX, E2M1_MAX)
    codes = torch.where(ok, e2m1_encode(q), torch.zeros_like(xb, dtype=torch.uint8))
    s_code = torch.where(finite, s_code, torch.full_like(s_code, 0x7F))
    return pack_e2m1(codes.reshape(xf.shape)), s_code.squeeze(-1), g


def dequantize_nvfp4(packed: Tensor, block_scales: Tensor, tensor_scale: Tensor) -> Tensor:
    """(code * s_b) * g: the first product is exact, so only the tensor-scale multiply rounds."""
    codes = unpack_e2m1(packed)
    k = codes.shape[-1]
    _check_block(k, NVFP4_BLOCK, "dequantize_nvfp4")
    if block_scales.shape != (*codes.shape[:-1], k // NVFP4_BLOCK):
        raise ValueError(f"dequantize_nvfp4: block_scales {tuple(block_scales.shape)} do not match "
                         f"{tuple(codes.shape)} codes; pass quantize_nvfp4's outputs")
    if tensor_scale.dim() != 0 or tensor_scale.dtype != torch.float32:
        raise ValueError("dequantize_nvfp4: tensor_scale must be 0-dim fp32 (quantize_nvfp4's 3rd output)")
    vals = e2m1_decode(codes).reshape(*codes.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    prod = (vals * e4m3_decode(block_scales).unsqueeze(-1)) * tensor_scale
    return round_to(prod, torch.float32).reshape(codes.shape)
