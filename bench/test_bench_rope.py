"""apply_rope fwd at MLA's q rope part ([B, S, H, 64] bf16, table [S, 1, 32]) vs torch eager and
torch.compile of the same fp32 rotation.

Bytes floor: x read and y written once, 2 B each: 4 * numel (the fp32 tables, S * 64 * 4 B, stay in L2).
"""

from __future__ import annotations

from typing import Any

import torch
from conftest import measure_op, mismatch, try_compile
from torch import Tensor

B, S, H, D = 8, 4096, 16, 64


def rope_torch(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    xf = x.float()
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)


def test_bench_rope_fwd(benchmark: Any) -> None:
    from nmoe.fast.rope import apply_rope, yarn_cos_sin

    x = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    cos, sin = yarn_cos_sin(S, D, 1e4, 40.0, 1024, 32.0, 1.0, device="cuda")
    c3, s3 = cos.unsqueeze(1), sin.unsqueeze(1)
    compiled, note = try_compile(rope_torch, x, c3, s3)
    check = mismatch(apply_rope(x, c3, s3), rope_torch(x, c3, s3), rtol=2**-7, atol=2**-7)
    measure_op(benchmark, "rope_fwd", {"B": B, "S": S, "H": H, "D": D}, 4.0 * x.numel(),
               lambda: apply_rope(x, c3, s3), lambda: rope_torch(x, c3, s3),
               None if compiled is None else lambda: compiled(x, c3, s3), note, baseline_check=check or "ok")
    assert check is None, f"apply_rope disagrees with the torch baseline: {check}"
