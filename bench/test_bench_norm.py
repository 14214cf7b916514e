"""rmsnorm fwd/bwd at the model's shapes vs torch eager, torch.compile and F.rms_norm.

Bytes floor, bf16 x [T, H] (2 B), each tensor read or written once (w and dw are negligible):
  fwd  x -> y:             2TH + 2TH       = 4TH
  bwd  dy, x -> dx (+dw):  2TH + 2TH + 2TH = 6TH   (+ fp32 dw partials, ctas x H x 4 B written and read)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import measure_op, mismatch, try_compile
from torch import Tensor

SHAPES = ((32768, 4096), (24576, 1536))
EPS = 1e-6


def rmsnorm_torch(x: Tensor, w: Tensor) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def rmsnorm_bwd_torch(dy: Tensor, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    xf, g = x.float(), dy.float() * w.float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS)
    dx = r * (g - xf * (r * r) * (g * xf).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dy.float() * xf * r).sum(0).to(w.dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}".format(*s))
def test_bench_rmsnorm_fwd(benchmark: Any, shape: tuple[int, int]) -> None:
    from nmoe.fast import norm as norm
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(shape[1], device="cuda")).to(torch.bfloat16)
    compiled, note = try_compile(rmsnorm_torch, x, w)
    check = mismatch(norm.rmsnorm(x, w, EPS), rmsnorm_torch(x, w), rtol=2**-7)
    measure_op(benchmark, "rmsnorm_fwd", {"T": shape[0], "H": shape[1]}, 4.0 * x.numel(),
               lambda: norm.rmsnorm(x, w, EPS), lambda: rmsnorm_torch(x, w),
               None if compiled is None else lambda: compiled(x, w), note, baseline_check=check or "ok")
    assert check is None, f"rmsnorm disagrees with the torch baseline: {check}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}".format(*s))
def test_bench_rmsnorm_fwd_vs_f_rms_norm(benchmark: Any, shape: tuple[int, int]) -> None:
    from nmoe.fast import norm as norm
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(shape[1], device="cuda")).to(torch.bfloat16)
    measure_op(benchmark, "rmsnorm_fwd_vs_F.rms_norm", {"T": shape[0], "H": shape[1]}, 4.0 * x.numel(),
               lambda: norm.rmsnorm(x, w, EPS), lambda: F.rms_norm(x, (shape[1],), w, EPS), None,
               "F.rms_norm is torch's own kernel; no compile baseline")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}".format(*s))
def test_bench_rmsnorm_bwd(benchmark: Any, shape: tuple[int, int]) -> None:
    from nmoe.fast import norm as norm
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(shape[1], device="cuda")).to(torch.bfloat16)
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    compiled, note = try_compile(rmsnorm_bwd_torch, dy, x, w)
    check = mismatch(norm.rmsnorm_bwd(dy, x, w, EPS)[0], rmsnorm_bwd_torch(dy, x, w)[0],
                     rtol=2**-6, atol=1e-3)
    measure_op(benchmark, "rmsnorm_bwd", {"T": shape[0], "H": shape[1]}, 6.0 * x.numel(),
               lambda: norm.rmsnorm_bwd(dy, x, w, EPS), lambda: rmsnorm_bwd_torch(dy, x, w),
               None if compiled is None else lambda: compiled(dy, x, w), note, baseline_check=check or "ok")
    assert check is None, f"rmsnorm_bwd disagrees with the torch baseline: {check}"
