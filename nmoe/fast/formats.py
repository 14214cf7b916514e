"""Fast MX-FP8 / NVFP4 quantize and dequantize: CuTeDSL kernels (nmoe/fast/kernels/formats.py) behind
torch custom ops, bit-identical to the spec in every output bit (codes, scale bytes, NaN payloads).

The NVFP4 tensor amax is reduced on the device (atomic max on fp32 bits), so no op here syncs the host.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nmoe.constants import FP8_WEIGHT_BLOCK as WEIGHT_BLOCK
from nmoe.constants import MX_BLOCKS, NVFP4_BLOCK
from nmoe.fast import runtime
from nmoe.fast.limits import VEC_BYTES
from nmoe.fast.op import Kernel, fast_op
from nmoe.fast.runtime import KernelSpec, vector_aligned

_DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bfloat16", torch.float16: "float16",
                                        torch.float32: "float32"}
_VEC: dict[str, int] = {"bfloat16": 8, "float16": 8, "float32": 4}
_CODE_VEC = 8
_AMAX_CTAS_PER_SM = 8
_THREADS = 256
KERNELS_BY_NAME: dict[str, Kernel] = {
    name: Kernel.by_name("nmoe.fast.kernels.formats", name)
    for name in ("mx_quant", "mx_dequant", "mxw_quant", "mxw_dequant", "nvfp4_amax", "nvfp4_quant",
                 "nvfp4_dequant")
}


def _launch(kernel: str, spec: dict[str, Any], tensors: tuple[Tensor, ...], scalars: tuple[Any, ...]) -> None:
    device, arch = runtime.device_arch(*tensors)
    KERNELS_BY_NAME[kernel].launcher(arch, **spec)(device, *(t.data_ptr() for t in tensors), *scalars)


def _float_input(x: Tensor, who: str) -> str:
    if x.dtype not in _DTYPE_NAMES:
        raise ValueError(f"{who}: expected fp32/bf16/fp16 input, got {x.dtype}; "
                         "cast to float32 explicitly first")
    return _DTYPE_NAMES[x.dtype]


def _last_dim(x: Tensor, who: str) -> int:
    if x.dim() == 0:
        raise ValueError(f"{who}: need [..., K], got a 0-dim tensor; reshape it to [1, K]")
    return int(x.shape[-1])


def _check_codes(codes: Tensor, who: str) -> None:
    if codes.dtype != torch.uint8:
        raise ValueError(f"{who}: codes must be uint8 bit patterns, got {codes.dtype}; pass encoder output")


def _check_block(k: int, block: int, who: str) -> None:
    if k % block != 0:
        raise ValueError(f"{who}: size {k} is not a multiple of the block {block}; pad it with zeros to a "
                         f"multiple of {block}")


def _check_mx_block(block: int, who: str) -> None:
    if block not in MX_BLOCKS:
        raise ValueError(f"{who}: block {block} unsupported; use 32 (sm_100a) or 128 (sm_90a)")


def _check_weight(shape: torch.Size, who: str) -> tuple[int, int]:
    if len(shape) < 2:
        raise ValueError(f"{who}: need [..., N, K], got shape {tuple(shape)}")
    n, k = shape[-2], shape[-1]
    _check_block(n, WEIGHT_BLOCK, f"{who} (N)")
    _check_block(k, WEIGHT_BLOCK, f"{who} (K)")
    return n, k


# --------------------------------------------------------------------------------------------------------
# MX-FP8, 1 x block along K
# --------------------------------------------------------------------------------------------------------
def _quantize_mxfp8_impl(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    dtype_name = _float_input(x, "quantize_mxfp8")
    _check_mx_block(block, "quantize_mxfp8")
    k = _last_dim(x, "quantize_mxfp8")
    _check_block(k, block, "quantize_mxfp8")
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], k // block), dtype=torch.uint8, device=x.device)
    if x.numel():
        vec = _VEC[dtype_name]
        spec = {"vec": vec, "group": block // vec, "dtype_name": dtype_name}
        _launch("mx_quant", spec, (vector_aligned(x, VEC_BYTES), codes, scales), (x.numel() // vec,))
    return codes, scales


def _quantize_mxfp8_fake(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    k = x.shape[-1]
    return (torch.empty(x.shape, dtype=torch.uint8, device=x.device),
            torch.empty((*x.shape[:-1], k // block), dtype=torch.uint8, device=x.device))


def _dequantize_mxfp8_impl(codes: Tensor, scales: Tensor, block: int) -> Tensor:
    _check_codes(codes, "dequantize_mxfp8")
    _check_codes(scales, "dequantize_mxfp8 (scales)")
    _check_mx_block(block, "dequantize_mxfp8")
    k = codes.shape[-1]
    _check_block(k, block, "dequantize_mxfp8")
    if scales.shape != (*codes.shape[:-1], k // block):
        raise ValueError(f"dequantize_mxfp8: scales {tuple(scales.shape)} do not match codes "
                         f"{tuple(codes.shape)} with block {block}; pass quantize_mxfp8's pair")
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    if codes.numel():
        _launch("mx_dequant", {"vec": _CODE_VEC, "block": block},
                (vector_aligned(codes, _CODE_VEC), scales.contiguous(), out), (codes.numel() // _CODE_VEC,))
    return out


def _dequantize_mxfp8_fake(codes: Tensor, scales: Tensor, block: int) -> Tensor:
    return torch.empty(codes.shape, dtype=torch.float32, device=codes.device)


# --------------------------------------------------------------------------------------------------------
# MX-FP8 weights, 128 x 128 blocks over the last two dims
# --------------------------------------------------------------------------------------------------------
def _quantize_mxfp8_weight_impl(w: Tensor) -> tuple[Tensor, Tensor]:
    dtype_name = _float_input(w, "quantize_mxfp8_weight")
    n, k = _check_weight(w.shape, "quantize_mxfp8_weight")
    codes = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    scales = torch.empty((*w.shape[:-2], n // WEIGHT_BLOCK, k // WEIGHT_BLOCK), dtype=torch.uint8,
                         device=w.device)
    if w.numel():
        spec = {"vec": _VEC[dtype_name], "dtype_name": dtype_name}
        _launch("mxw_quant", spec, (vector_aligned(w, VEC_BYTES), codes, scales), (w.numel() // k, k))
    return codes, scales


def _quantize_mxfp8_weight_fake(w: Tensor) -> tuple[Tensor, Tensor]:
    n, k = w.shape[-2], w.shape[-1]
    return (torch.empty(w.shape, dtype=torch.uint8, device=w.device),
            torch.empty((*w.shape[:-2], n // WEIGHT_BLOCK, k // WEIGHT_BLOCK), dtype=torch.uint8,
                        device=w.device))


def _dequantize_mxfp8_weight_impl(codes: Tensor, scales: Tensor) -> Tensor:
    _check_codes(codes, "dequantize_mxfp8_weight")
    _check_codes(scales, "dequantize_mxfp8_weight (scales)")
    n, k = _check_weight(codes.shape, "dequantize_mxfp8_weight")
    if scales.shape != (*codes.shape[:-2], n // WEIGHT_BLOCK, k // WEIGHT_BLOCK):
        raise ValueError(f"dequantize_mxfp8_weight: scales {tuple(scales.shape)} do not match codes "
                         f"{tuple(codes.shape)}; pass quantize_mxfp8_weight's pair")
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    if codes.numel():
        _launch("mxw_dequant", {"vec": _CODE_VEC},
                (vector_aligned(codes, _CODE_VEC), scales.contiguous(), out), (codes.numel() // k, k))
    return out


def _dequantize_mxfp8_weight_fake(codes: Tensor, scales: Tensor) -> Tensor:
    return torch.empty(codes.shape, dtype=torch.float32, device=codes.device)


# --------------------------------------------------------------------------------------------------------
# NVFP4
# --------------------------------------------------------------------------------------------------------
def _quantize_nvfp4_impl(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    dtype_name = _float_input(x, "quantize_nvfp4")
    k = _last_dim(x, "quantize_nvfp4")
    _check_block(k, NVFP4_BLOCK, "quantize_nvfp4")
    packed = torch.empty((*x.shape[:-1], k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], k // NVFP4_BLOCK), dtype=torch.uint8, device=x.device)
    g = torch.zeros((), dtype=torch.float32, device=x.device)
    if x.numel():
        vec = _VEC[dtype_name]
        nvec = x.numel() // vec
        xa = vector_aligned(x, VEC_BYTES)
        device, _ = runtime.device_arch(x)
        amax = torch.zeros(1, dtype=torch.int32, device=x.device)
        ctas = max(1, min(-(-nvec // _THREADS), _AMAX_CTAS_PER_SM * runtime.sm_count(device)))
        _launch("nvfp4_amax", {"vec": vec, "dtype_name": dtype_name}, (xa, amax), (nvec, ctas))
        spec = {"vec": vec, "group": NVFP4_BLOCK // vec, "dtype_name": dtype_name}
        _launch("nvfp4_quant", spec, (xa, amax, packed, scales, g), (nvec,))
    return packed, scales, g


def _quantize_nvfp4_fake(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    k = x.shape[-1]
    return (torch.empty((*x.shape[:-1], k // 2), dtype=torch.uint8, device=x.device),
            torch.empty((*x.shape[:-1], k // NVFP4_BLOCK), dtype=torch.uint8, device=x.device),
            torch.empty((), dtype=torch.float32, device=x.device))


def _dequantize_nvfp4_impl(packed: Tensor, block_scales: Tensor, tensor_scale: Tensor) -> Tensor:
    _check_codes(packed, "dequantize_nvfp4")
    _check_codes(block_scales, "dequantize_nvfp4 (block_scales)")
    k = 2 * packed.shape[-1]
    _check_block(k, NVFP4_BLOCK, "dequantize_nvfp4")
    if block_scales.shape != (*packed.shape[:-1], k // NVFP4_BLOCK):
        raise ValueError(f"dequantize_nvfp4: block_scales {tuple(block_scales.shape)} do not match "
                         f"{(*packed.shape[:-1], k)} codes; pass quantize_nvfp4's outputs")
    if tensor_scale.dim() != 0 or tensor_scale.dtype != torch.float32:
        raise ValueError("dequantize_nvfp4: tensor_scale must be 0-dim fp32 (quantize_nvfp4's 3rd output)")
    out = torch.empty((*packed.shape[:-1], k), dtype=torch.float32, device=packed.device)
    if packed.numel():
        _launch("nvfp4_dequant", {}, (vector_aligned(packed, NVFP4_BLOCK // 2), block_scales.contiguous(),
                                      tensor_scale.contiguous(), out), (out.numel() // NVFP4_BLOCK,))
    return out


def _dequantize_nvfp4_fake(packed: Tensor, block_scales: Tensor, tensor_scale: Tensor) -> Tensor:
    return torch.empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=torch.float32, device=packed.device)


_quantize_mxfp8_op = fast_op("quantize_mxfp8", _quantize_mxfp8_impl, _quantize_mxfp8_fake)
_dequantize_mxfp8_op = fast_op("dequantize_mxfp8", _dequantize_mxfp8_impl, _dequantize_mxfp8_fake)
_quantize_mxfp8_weight_op = fast_op("quantize_mxfp8_weight", _quantize_mxfp8_weight_impl,
                                    _quantize_mxfp8_weight_fake)
_dequantize_mxfp8_weight_op = fast_op("dequantize_mxfp8_weight", _dequantize_mxfp8_weight_impl,
                                      _dequantize_mxfp8_weight_fake)
_quantize_nvfp4_op = fast_op("quantize_nvfp4", _quantize_nvfp4_impl, _quantize_nvfp4_fake)
_dequantize_nvfp4_op = fast_op("dequantize_nvfp4", _dequantize_nvfp4_impl, _dequantize_nvfp4_fake)


def quantize_mxfp8(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """MX-FP8 along the last dim: e4m3 codes [..., K] and e8m0 scale bytes [..., K//block]."""
    return _quantize_mxfp8_op(x, block)


def dequantize_mxfp8(codes: Tensor, scales: Tensor, block: int) -> Tensor:
    return _dequantize_mxfp8_op(codes, scales, block)


def quantize_mxfp8_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """MX-FP8 with 128x128 blocks over the last two dims (DeepSeek-V3 weight layout)."""
    return _quantize_mxfp8_weight_op(w)


def dequantize_mxfp8_weight(codes: Tensor, scales: Tensor) -> Tensor:
    return _dequantize_mxfp8_weight_op(codes, scales)


def quantize_nvfp4(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """NVFP4 along the last dim: packed e2m1 [..., K//2], e4m3 block scales [..., K//16], fp32 tensor
    scale (0-dim, on the device: no host sync)."""
    return _quantize_nvfp4_op(x)


def dequantize_nvfp4(packed: Tensor, block_scales: Tensor, tensor_scale: Tensor) -> Tensor:
    return _dequantize_nvfp4_op(packed, block_scales, tensor_scale)


# --------------------------------------------------------------------------------------------------------
# Compile checks (no GPU): what each kernel's PTX must and must not contain.
# --------------------------------------------------------------------------------------------------------
# No narrowing cvt (rounding is integer arithmetic, proven against the spec bit for bit); no flush-to-zero
# or approximate division (amax_b/6/g and x/denom are IEEE divisions in the spec); plain mul/add could be
# contracted into an FMA, so every fp32 op carries `.rn`; local memory means spills. min.f32 (NaN-quiet)
# appears only on the MX-FP8 path for ordinary blocks, whose NaN lanes are rewritten afterwards.
_FORBID = (r"\bcvt\.[a-z.]*\.(e4m3x2|e2m1x2|e5m2x2|ue8m0x2)\b", r"\.ftz\b", r"\.approx\b", r"\bdiv\.full\b",
           r"\b(mul|add|sub|fma)\.f32\b", r"\b(ld|st)\.local\b")
_LD128, _ST128 = runtime.LD128, runtime.ST128
_DIV_RN = r"\bdiv\.rn\.f32\b"
_MUL_RN = r"\bmul\.rn\.f32\b"
_ADD_RN = r"\badd\.rn\.f32\b"
_SHFL = r"\bshfl\.sync\.bfly\.b32\b"
# MX-FP8 packs four codes per word with byte permutes and clamps |v| with one float min.
_MX = (r"\bprmt\.b32\b", r"\bmin\.f32\b", _MUL_RN, _ADD_RN)
_CODES_ST = {8: r"\bst\.global\.(v2\.b32|b64)\b", 4: r"\bst\.global\.b32\b"}
_PACKED_ST = {8: r"\bst\.global\.b32\b", 4: r"\bst\.global\.(v2\.b8|b16)\b"}
_SCALE_ST = r"\bst\.global\.b8\b"

_FP_SUFFIX = {"bfloat16": "", "float32": "_f32"}


def _quant_spec(op: str, name: str, kernel: str, spec: dict[str, Any], expect: tuple[str, ...]) -> KernelSpec:
    return runtime.portable_spec(op, name, KERNELS_BY_NAME[kernel].compiler(**spec), expect, _FORBID)


def _kernel_specs() -> tuple[KernelSpec, ...]:
    out: list[KernelSpec] = []
    for dtype_name, sfx in _FP_SUFFIX.items():
        vec = _VEC[dtype_name]
        for block in MX_BLOCKS:
            out.append(_quant_spec(
                f"quantize_mxfp8_{block}", f"mx_quant_b{block}{sfx}", "mx_quant",
                {"vec": vec, "group": block // vec, "dtype_name": dtype_name},
                (_LD128, _SHFL, *_MX, _CODES_ST[vec], _SCALE_ST)))
        out.append(_quant_spec(
            "quantize_mxfp8_w128", f"mxw_quant{sfx}", "mxw_quant", {"vec": vec, "dtype_name": dtype_name},
            (_LD128, _SHFL, r"\bbar\.sync\b", *_MX, _CODES_ST[vec], _SCALE_ST)))
        out.append(_quant_spec(
            "quantize_nvfp4", f"nvfp4_amax{sfx}", "nvfp4_amax", {"vec": vec, "dtype_name": dtype_name},
            (_LD128, _SHFL, r"\batom\.global\.max\.s32\b")))
        out.append(_quant_spec(
            "quantize_nvfp4", f"nvfp4_quant{sfx}", "nvfp4_quant",
            {"vec": vec, "group": NVFP4_BLOCK // vec, "dtype_name": dtype_name},
            (_LD128, _SHFL, _DIV_RN, _MUL_RN, _ADD_RN, _PACKED_ST[vec], _SCALE_ST)))
    for block in MX_BLOCKS:
        out.append(_quant_spec(f"dequantize_mxfp8_{block}", f"mx_dequant_b{block}", "mx_dequant",
                               {"vec": _CODE_VEC, "block": block}, (r"\bld\.global\.(v2\.b32|b64)\b",
                                                                     _ST128, _MUL_RN)))
    out.append(_quant_spec("dequantize_mxfp8_w128", "mxw_dequant", "mxw_dequant", {"vec": _CODE_VEC},
                           (r"\bld\.global\.(v2\.b32|b64)\b", _ST128, _MUL_RN)))
    out.append(_quant_spec("dequantize_nvfp4", "nvfp4_dequant", "nvfp4_dequant", {},
                           (r"\bld\.global\.(v2\.b32|b64)\b", _ST128, _MUL_RN)))
    return tuple(out)


KERNELS: tuple[KernelSpec, ...] = _kernel_specs()
