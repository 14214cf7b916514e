"""relu2 / swiglu fwd and bwd on the routed up-projection output: nmoe vs torch eager and torch.compile.

Rows M = T*K routed slots; I = moe_inter_dim, 1024 at H=4096 and 256 at H=1536 (the grouped GEMM shapes);
relu2 acts on the up projection h [M, I], swiglu on the interleaved gate/up h [M, 2I]; all bf16 (2 B).
Bytes floor, each tensor read or written once:
  relu2 fwd  x[M,I] -> y[M,I]:               2MI + 2MI       = 4MI
  relu2 bwd  dy[M,I], x[M,I] -> dx[M,I]:     2MI + 2MI + 2MI = 6MI
  swiglu fwd h[M,2I] -> y[M,I]:              4MI + 2MI       = 6MI
  swiglu bwd dy[M,I], h[M,2I] -> dh[M,2I]:   2MI + 4MI + 4MI = 10MI
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import measure_op, mismatch, try_compile
from torch import Tensor

CONFIGS = ((32768, 4096, 1024, 128, 8), (24576, 1536, 256, 128, 8))


def relu2_torch(x: Tensor) -> Tensor:
    return torch.relu(x.float()).square().to(x.dtype)


def relu2_bwd_torch(dy: Tensor, x: Tensor) -> Tensor:
    return (dy.float() * (2.0 * torch.relu(x.float()))).to(dy.dtype)


def swiglu_torch(h: Tensor) -> Tensor:
    hf = h.float()
    return (F.silu(hf[..., 0::2]) * hf[..., 1::2]).to(h.dtype)


def swiglu_bwd_torch(dy: Tensor, h: Tensor) -> Tensor:
    hf, d = h.float(), dy.float()
    g, u = hf[..., 0::2], hf[..., 1::2]
    s = torch.sigmoid(g)
    dg = d * u * s * (1.0 + g * (1.0 - s))
    du = d * (g * s)
    return torch.stack((dg, du), dim=-1).reshape(h.shape).to(dy.dtype)


@dataclass(frozen=True)
class Case:
    fast: str
    torch_fn: Callable[..., Tensor]
    widths: tuple[int, ...]
    floor_bytes_per_mi: int


CASES = {
    "relu2_fwd": Case("relu2", relu2_torch, (1,), 4),
    "relu2_bwd": Case("relu2_bwd", relu2_bwd_torch, (1, 1), 6),
    "swiglu_fwd": Case("swiglu", swiglu_torch, (2,), 6),
    "swiglu_bwd": Case("swiglu_bwd", swiglu_bwd_torch, (1, 2), 10),
}


@pytest.mark.parametrize("op", list(CASES))
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "T{}_H{}_I{}_E{}_K{}".format(*c))
def test_bench_activation(benchmark: Any, cfg: tuple[int, ...], op: str) -> None:
    from nmoe.fast import activation as act
    case = CASES[op]
    t, h, i, e, k = cfg
    m = t * k
    g = torch.Generator(device="cuda").manual_seed(0)
    args = tuple(torch.randn(m, w * i, device="cuda", dtype=torch.bfloat16, generator=g) for w in case.widths)
    fast_fn = getattr(act, case.fast)
    compiled, note = try_compile(case.torch_fn, *args)
    check = mismatch(fast_fn(*args), case.torch_fn(*args), rtol=1e-2, atol=1e-3)

    def fast() -> None:
        fast_fn(*args)

    def eager() -> None:
        case.torch_fn(*args)

    def comp() -> None:
        assert compiled is not None
        compiled(*args)

    measure_op(benchmark, op, {"T": t, "H": h, "I": i, "E": e, "K": k, "M": m},
               float(case.floor_bytes_per_mi * m * i), fast, eager, None if compiled is None else comp, note,
               baseline_check=check or "ok")
    assert check is None, f"{op}: nmoe and the torch baseline disagree ({check}); fix the baseline or the op"
