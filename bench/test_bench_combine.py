"""combine fwd / bwd (routed_scale * sum_k w_k*y_k + shared per token), nmoe vs torch eager and torch.compile.

y [T,K,H] bf16, w [T,K] fp32 (positive, rows sum to 1), shared [T,H] bf16, routed_scale 2.446.
Bytes floor, each tensor read or written once: fwd reads y, w, shared, writes out: 2TKH + 4TK + 2TH + 2TH;
bwd reads dout, y, w, writes dy, dw (dshared is dout itself, so 0 B): 2TH + 2TKH + 4TK + 2TKH + 4TK
= 4TKH + 2TH + 8TK. The public combine_bwd also clones dout for dshared (4TH B more, not in the floor).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import measure_op, mismatch, try_compile
from torch import Tensor

CONFIGS = ((32768, 4096, 128, 8), (24576, 1536, 128, 8))
ROUTED_SCALE = 2.446


def combine_torch(y: Tensor, w: Tensor, scale: float, shared: Tensor) -> Tensor:
    acc = (y.float() * w.unsqueeze(-1)).sum(1)
    return (acc * scale + shared.float()).to(y.dtype)


def combine_bwd_torch(dout: Tensor, y: Tensor, w: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    g = dout.float().unsqueeze(1) * scale
    return (g * w.unsqueeze(-1)).to(y.dtype), (g * y.float()).sum(-1), dout


def _inputs(t: int, k: int, h: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(t, k, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.rand(t, k, device="cuda", generator=g) + 0.05
    rows = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
    return y, w / w.sum(-1, keepdim=True), rows


def _shape(cfg: tuple[int, ...]) -> dict[str, int]:
    return dict(zip(("T", "H", "E", "K"), cfg, strict=True))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "T{}_H{}_E{}_K{}".format(*c))
def test_bench_combine_fwd(benchmark: Any, cfg: tuple[int, ...]) -> None:
    from nmoe.fast import combine as fc
    t, h, _, k = cfg
    y, w, shared = _inputs(t, k, h)
    args = (y, w, ROUTED_SCALE, shared)
    compiled, note = try_compile(combine_torch, *args)
    check = mismatch(fc.combine(*args), combine_torch(*args), rtol=1e-2, atol=1e-3)

    def fast() -> None:
        fc.combine(*args)

    def eager() -> None:
        combine_torch(*args)

    def comp() -> None:
        assert compiled is not None
        compiled(*args)

    nbytes = 2.0 * t * k * h + 4.0 * t * k + 4.0 * t * h
    measure_op(benchmark, "combine_fwd", _shape(cfg), nbytes, fast, eager, None if compiled is None else comp,
               note, routed_scale=ROUTED_SCALE, shared=True, baseline_check=check or "ok")
    assert check is None, f"combine_fwd: nmoe and the torch baseline disagree ({check})"


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "T{}_H{}_E{}_K{}".format(*c))
def test_bench_combine_bwd(benchmark: Any, cfg: tuple[int, ...]) -> None:
    from nmoe.fast import combine as fc
    t, h, _, k = cfg
    y, w, dout = _inputs(t, k, h)
    args = (dout, y, w, ROUTED_SCALE)
    compiled, note = try_compile(combine_bwd_torch, *args)
    got, want = fc.combine_bwd(*args), combine_bwd_torch(*args)
    check = "; ".join(f"{name}: {msg}" for name, msg in (
        ("dy", mismatch(got[0], want[0], rtol=1e-2, atol=1e-3)),
        ("dw", mismatch(got[1], want[1], rtol=1e-4, atol=5e-2)),
        ("dshared", mismatch(got[2], want[2])),
    ) if msg is not None)
    del got, want

    def fast() -> None:
        fc.combine_bwd(*args)

    def eager() -> None:
        combine_bwd_torch(*args)

    def comp() -> None:
        assert compiled is not None
        compiled(*args)

    nbytes = 4.0 * t * k * h + 2.0 * t * h + 8.0 * t * k
    measure_op(benchmark, "combine_bwd", _shape(cfg), nbytes, fast, eager, None if compiled is None else comp,
               note, routed_scale=ROUTED_SCALE, impl_extra_bytes=4.0 * t * h + 4.0 * t * k,
               baseline_check=check or "ok")
    assert not check, f"combine_bwd: nmoe and the torch baseline disagree ({check})"
