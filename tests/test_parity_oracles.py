"""Oracles that cannot be fooled: each deliberately wrong reference below once passed the CPU self-check.
It is swapped in where the self-check resolves it (nmoe.reference.<module>.<fn>) and must now go red, while
the spec itself stays green. The oracles derive from the spec text (docs/spec-corners.md), not the code."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import nmoe.reference.activation as ref_act
import nmoe.reference.formats as ref_fmt
import nmoe.reference.moe as ref_moe
import nmoe.reference.router as ref_router
from nmoe import cli

RELU2 = ref_act.relu2
ROUTER_TOPK = ref_router.router_topk
QUANTIZE_NVFP4, QUANTIZE_MXFP8 = ref_fmt.quantize_nvfp4, ref_fmt.quantize_mxfp8


def _selfcheck(tmp_path: Path, op: str, cases: int = 2) -> list[dict[str, Any]]:
    """The CPU self-check of one op through the public command; its CPU case rows."""
    out = tmp_path / f"{op}.json"
    rc = cli.main(
        ["parity", "--ops", op, "--mode", "selfcheck", "--cases", str(cases), "--seed", "0", "--no-compile",
         "--no-db", "--quiet", "--report", str(out)]
    )
    rows = [c for c in json.loads(out.read_text())["cases"] if c["arch"] == "cpu"]
    assert rows and (rc == 0) == all(c["status"] == "pass" for c in rows)
    return rows


def _failed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in rows if c["status"] == "fail"]


def _assert_green(tmp_path: Path, op: str, cases: int = 2) -> None:
    bad = _failed(_selfcheck(tmp_path, op, cases))
    assert not bad, [c["reason"] for c in bad]


# ----------------------------------------------------------------------------------------------------------
# bitwise compares bits: ±0 and NaN payloads count


def _relu2_negative_zero(x: Tensor) -> Tensor:
    out = RELU2(x)
    return torch.where(out == 0, torch.full_like(out, -0.0), out)


def _relu2_nan_ffc1(x: Tensor) -> Tensor:
    out = RELU2(x)
    bits = 0xFFC1 - 2**16 if out.dtype == torch.bfloat16 else 0xFFC10000 - 2**32
    ity = torch.int16 if out.dtype == torch.bfloat16 else torch.int32
    return torch.where(torch.isnan(out), torch.tensor(bits).to(ity).view(out.dtype), out)


@pytest.mark.parametrize("wrong", [_relu2_negative_zero, _relu2_nan_ffc1], ids=["-0", "nan_ffc1"])
def test_bitwise_selfcheck_sees_signed_zero_and_nan_payload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrong: Callable[[Tensor], Tensor]
) -> None:
    _assert_green(tmp_path, "relu2")
    monkeypatch.setattr(ref_act, "relu2", wrong)
    bad = _failed(_selfcheck(tmp_path, "relu2"))
    assert bad and all("differ in bits" in c["reason"] for c in bad)


# ----------------------------------------------------------------------------------------------------------
# router_topk and moe_layer: an oracle of their own


def _topk_ties_high(
    logits: Tensor, bias: Tensor, k: int, score_func: str, n_groups: int = 1, topk_groups: int = 1
) -> tuple[Tensor, Tensor]:
    """The spec run on the experts in reverse order: every tie (expert or group) goes to the higher id."""
    w, ids = ROUTER_TOPK(logits.flip(-1), bias.flip(-1), k, score_func, n_groups, topk_groups)
    return w, logits.shape[-1] - 1 - ids


def test_router_topk_oracle_sends_ties_to_the_lower_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _assert_green(tmp_path, "router_topk")
    monkeypatch.setattr(ref_router, "router_topk", _topk_ties_high)
    bad = _failed(_selfcheck(tmp_path, "router_topk"))
    assert {"adv:ties", "adv:inf", "adv:max"} <= {c["case"] for c in bad}, [c["case"] for c in bad]
    assert all("ids:" in c["reason"] for c in bad)


def test_moe_layer_oracle_routes_on_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both router bindings are wrong, so an oracle that borrowed the spec's routing would stay green."""
    _assert_green(tmp_path, "moe_layer")
    monkeypatch.setattr(ref_router, "router_topk", _topk_ties_high)
    monkeypatch.setattr(ref_moe, "router_topk", _topk_ties_high)
    bad = _failed(_selfcheck(tmp_path, "moe_layer"))
    assert any(c["case"] == "adv:ties" and "ids:" in c["reason"] for c in bad), [c["reason"] for c in bad]


# ----------------------------------------------------------------------------------------------------------
# swiglu: float64 oracle, no op order of the spec's; the underflow corner is reached


def _sigmoid_flushing(g: Tensor) -> Tensor:
    return torch.sigmoid(torch.clamp(g, min=-87.0)) * (g >= -87.0)


def _swiglu_flushing(h: Tensor) -> Tensor:
    g, u = h.float()[..., 0::2], h.float()[..., 1::2]
    return (g * _sigmoid_flushing(g) * u).to(h.dtype)


def _swiglu_bwd_flushing(dy: Tensor, h: Tensor) -> Tensor:
    g, u, d = h.float()[..., 0::2], h.float()[..., 1::2], dy.float()
    s = _sigmoid_flushing(g)
    return torch.stack((d * u * (s * (1 + g * (1 - s))), d * g * s), -1).flatten(-2).to(dy.dtype)


def _swiglu_bwd_other_order(dy: Tensor, h: Tensor) -> Tensor:
    """A valid implementation in another fp32 order: dy*(u*(s + g*s*(1-s))), (dy*g)*s."""
    g, u, d = h.float()[..., 0::2], h.float()[..., 1::2], dy.float()
    e = torch.exp(-g.abs())
    s = torch.where(g >= 0, 1 / (1 + e), e / (1 + e))
    return torch.stack((d * (u * (s + g * s * (1 - s))), (d * g) * s), -1).flatten(-2).to(dy.dtype)


@pytest.mark.parametrize(
    ("op", "wrong"), [("swiglu", _swiglu_flushing), ("swiglu_bwd", _swiglu_bwd_flushing)], ids=["fwd", "bwd"]
)
def test_swiglu_underflow_corner_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: str, wrong: Callable[..., Tensor]
) -> None:
    _assert_green(tmp_path, op)
    monkeypatch.setattr(ref_act, op, wrong)
    bad = _failed(_selfcheck(tmp_path, op))
    assert [c["case"] for c in bad] == ["adv:underflow"]


def test_swiglu_bwd_oracle_does_not_pin_the_specs_op_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ref_act, "swiglu_bwd", _swiglu_bwd_other_order)
    _assert_green(tmp_path, "swiglu_bwd")


# ----------------------------------------------------------------------------------------------------------
# formats: the spec's corner rules, from the spec text


def _nvfp4_saturating_zero_scale(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Where s_b*g is 0, x/(s_b*g) taken as ±Inf and saturated to ±6 instead of codes 0."""
    packed, sb, g = QUANTIZE_NVFP4(x)
    codes = ref_fmt.unpack_e2m1(packed)
    dead = (ref_fmt.e4m3_decode(sb) * g == 0).repeat_interleave(16, dim=-1) & torch.isfinite(x.float())
    sat = torch.where(x.float() < 0, 15, 7).to(torch.uint8)
    codes = torch.where(dead & (x.float() != 0), sat, codes)
    return ref_fmt.pack_e2m1(codes), sb, g


def _nvfp4_negative_nan_scale(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    packed, sb, g = QUANTIZE_NVFP4(x)
    return packed, torch.where(sb == 0x7F, torch.full_like(sb, 0xFF), sb), g


def _nvfp4_max_over_all(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    packed, sb, g = QUANTIZE_NVFP4(x)
    xf = x.float()
    amax = xf.abs().nan_to_num(nan=0.0, posinf=torch.inf).amax() if xf.numel() else g
    return packed, sb, torch.where(torch.isinf(amax), amax / 2688.0, g)


@pytest.mark.parametrize(
    ("wrong", "corner"),
    [
        (_nvfp4_saturating_zero_scale, ("adv:underflow",)),
        (_nvfp4_negative_nan_scale, ("adv:nan", "adv:inf")),
        (_nvfp4_max_over_all, ("adv:inf",)),
    ],
    ids=["zero_scale_codes", "nan_block_scale", "tensor_max_finite"],
)
def test_nvfp4_corner_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrong: Callable[[Tensor], Any], corner: tuple[str, ...]
) -> None:
    _assert_green(tmp_path, "quantize_nvfp4", cases=1)
    monkeypatch.setattr(ref_fmt, "quantize_nvfp4", wrong)
    bad = _failed(_selfcheck(tmp_path, "quantize_nvfp4", cases=1))
    assert bad and all(c["case"].startswith(corner) for c in bad), [c["case"] for c in bad]


def _mxfp8_unsigned_nan(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    codes, scales = QUANTIZE_MXFP8(x, block)
    return torch.where((codes & 0x7F) == 0x7F, torch.full_like(codes, 0x7F), codes), scales


def test_negative_nan_reaches_e4m3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adversarial NaNs carry both signs, so an e4m3 encoder that drops a NaN's sign goes red."""
    monkeypatch.setattr(ref_fmt, "quantize_mxfp8", _mxfp8_unsigned_nan)
    bad = _failed(_selfcheck(tmp_path, "quantize_mxfp8_32", cases=1))
    assert bad and all(c["case"].startswith("adv:nan") for c in bad)


def _fp32_sums(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """a @ b.T accumulated in fp32 left to right and right to left."""
    prods = (a.double()[:, None, :] * b.double()[None, :, :]).to(torch.float32)
    fwd, rev = torch.zeros(prods.shape[:2]), torch.zeros(prods.shape[:2])
    for j in range(prods.shape[2]):
        fwd = fwd + prods[..., j]
        rev = rev + prods[..., -1 - j]
    return fwd, rev


def test_fp32_dot_exact_holds_only_where_every_order_is_exact() -> None:
    from parity.oracles import fp32_dot_exact

    g = torch.Generator().manual_seed(3)
    grid = (torch.round(torch.randn(4, 512, generator=g) * 32).clamp(-127, 127) / 32).bfloat16()
    signs = (torch.randint(-1, 2, (3, 512), generator=g) * 2.0**-5).bfloat16()
    fwd, rev = _fp32_sums(grid, signs)
    assert fp32_dot_exact(grid, signs)
    assert torch.equal(fwd.double(), grid.double() @ signs.double().T) and torch.equal(fwd, rev)
    wide = torch.randn(4, 512, generator=g).bfloat16()
    fwd, rev = _fp32_sums(wide, torch.randn(3, 512, generator=g).bfloat16())
    assert not torch.equal(fwd, rev)
    assert not fp32_dot_exact(wide, torch.randn(3, 512, generator=g).bfloat16())
    ones = torch.ones(1, 3)
    assert fp32_dot_exact(torch.tensor([[2.0**23, 2.0**22, 1.0]]), ones)
    assert not fp32_dot_exact(torch.tensor([[2.0**23, 2.0**23, 1.0]]), ones)
    assert float(torch.tensor(2.0**24, dtype=torch.float32) + 1) == 2.0**24
