"""MX-FP8 / NVFP4 quantize (and MX-FP8 dequantize) at the model's activation shapes vs torch baselines.

Bytes floor, bf16 x [T, H] (2 B), each tensor read or written once:
  quantize_mxfp8 (block B)     x -> codes [T,H] (1 B), scales [T,H/B] (1 B):  2TH + TH + TH/B
  quantize_mxfp8_weight        w -> codes, scales [T/128, H/128]:             2TH + TH + TH/128^2
  quantize_nvfp4               x read twice (global amax, then blocks) -> packed TH/2, scales TH/16:
                                                                              4TH + TH/2 + TH/16
  dequantize_mxfp8 (B = 32)    codes, scales -> fp32 [T,H] (4 B):             TH + TH/32 + 4TH
Baselines are the same math as plain torch expressions, eager and torch.compile (torch has no e2m1 cast,
so the NVFP4 baseline stops at the fp32 quotients: it does less work than the fast op).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import measure_op, mismatch, try_compile
from torch import Tensor

SHAPES = ((32768, 4096), (24576, 1536))


def mxfp8_torch(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """amax per block, power-of-two scale ceil(log2(amax/448)), clamp, cast to e4m3."""
    xb = x.float().reshape(*x.shape[:-1], -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    e = torch.ceil(torch.log2(amax / 448.0)).clamp(-126, 127)
    q = (xb * torch.exp2(-e)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).reshape(x.shape), (e + 127).to(torch.uint8).squeeze(-1)


def nvfp4_scales_torch(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    xf = x.float()
    g = xf.abs().amax() / 2688.0
    xb = xf.reshape(*x.shape[:-1], -1, 16)
    s = (xb.abs().amax(-1, keepdim=True) / 6.0 / g).clamp(0, 448).to(torch.float8_e4m3fn)
    return (xb / (s.float() * g)).clamp(-6, 6), s.view(torch.uint8).squeeze(-1), g


def mxfp8_dequant_torch(codes: Tensor, scales: Tensor, block: int) -> Tensor:
    v = codes.view(torch.float8_e4m3fn).float().reshape(*codes.shape[:-1], -1, block)
    return (v * torch.exp2(scales.float() - 127).unsqueeze(-1)).reshape(codes.shape)


def _shape(t: int, h: int) -> dict[str, int]:
    return {"T": t, "H": h}


@pytest.mark.parametrize("block", (32, 128))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}".format(*s))
def test_bench_quantize_mxfp8(benchmark: Any, shape: tuple[int, int], block: int) -> None:
    from nmoe.fast import formats as fmt
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    compiled, note = try_compile(mxfp8_torch, x, block)
    check = mismatch(fmt.quantize_mxfp8(x, block)[1], mxfp8_torch(x, block)[1])
    measure_op(benchmark, f"quantize_mxfp8_b{block}", _shape(*shape), 3.0 * n + n / block,
               lambda: fmt.quantize_mxfp8(x, block), lambda: mxfp8_torch(x, block),
               None if compiled is None else lambda: compiled(x, block), note, baseline_check=check or "ok")
    assert check is None, f"quantize_mxfp8 scales disagree with the torch baseline on normal data: {check}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}".format(*s))
def test_bench_quantize_mxfp8_weight(benchmark: Any, shape: tuple[int, int]) -> None:
    from nmoe.fast import formats as fmt
    w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    n = w.numel()
    compiled, note = try_compile(mxfp8_torch, w, 128)
    measure_op(benchmark, "quantize_mxfp8_weight", _shape(*shape), 3.0 * n + n / 128**2,
               lambda: fmt.quantize_mxfp8_weight(w), lambda: mxfp8_torch(w, 128),
               None if compiled is None else lambda: compiled(w, 128), note + " (baseline: 1x128 blocks)")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}".format(*s))
def test_bench_quantize_nvfp4(benchmark: Any, shape: tuple[int, int]) -> None:
    from nmoe.fast import formats as fmt
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    compiled, note = try_compile(nvfp4_scales_torch, x)
    measure_op(benchmark, "quantize_nvfp4", _shape(*shape), 4.0 * n + n / 2 + n / 16,
               lambda: fmt.quantize_nvfp4(x), lambda: nvfp4_scales_torch(x),
               None if compiled is None else lambda: compiled(x), note + " (baseline: scales only)")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}".format(*s))
def test_bench_dequantize_mxfp8(benchmark: Any, shape: tuple[int, int]) -> None:
    from nmoe.fast import formats as fmt
    codes, scales = fmt.quantize_mxfp8(torch.randn(shape, device="cuda", dtype=torch.bfloat16), 32)
    n = codes.numel()
    compiled, note = try_compile(mxfp8_dequant_torch, codes, scales, 32)
    check = mismatch(fmt.dequantize_mxfp8(codes, scales, 32), mxfp8_dequant_torch(codes, scales, 32))
    measure_op(benchmark, "dequantize_mxfp8_b32", _shape(*shape), n + n / 32 + 4.0 * n,
               lambda: fmt.dequantize_mxfp8(codes, scales, 32),
               lambda: mxfp8_dequant_torch(codes, scales, 32),
               None if compiled is None else lambda: compiled(codes, scales, 32), note,
               baseline_check=check or "ok")
    assert check is None, f"dequantize_mxfp8 disagrees with the torch baseline: {check}"
