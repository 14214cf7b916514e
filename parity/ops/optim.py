"""AdamW and Muon steps (in-place ops: the outputs are the mutated arguments)."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity.compare import (
    Contract,
    bound_contract,
)
from parity.entry import (
    RATIO2_FP32,
    OpEntry,
)
from parity.inputs import (
    I,
    Inputs,
    Params,
    S,
    by_size,
    randn,
    space,
    with_adv,
)
from parity.oracles import (
    F64,
    Expect,
    d,
)


def space_adamw(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        R=I(1, 4096 if big else 16),
        C=by_size(big, [1, 8, 33], [1024, 7168]),
        step=S([1, 10, 1000]),
        lr=S([1e-3, 3e-4, 0.02]),
        beta2=S([0.95, 0.999]),
        wd=S([0.0, 0.1]),
    )


def make_adamw(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = with_adv(p, adv, **({"R": 1, "C": 1} if adv == "single_token" else {}))
    shape = [q["R"], q["C"]]
    par = randn(shape, torch.float32, g, 0.02)
    grad = randn(shape, torch.float32, g, 1e-2)
    m = randn(shape, torch.float32, g, 1e-2)
    v = (randn(shape, torch.float64, g, 1e-2) ** 2).to(torch.float32)
    if adv == "zero":
        grad, m, v = torch.zeros_like(grad), torch.zeros_like(m), torch.zeros_like(v)
    elif adv == "denormal":
        grad = randn(shape, torch.float32, g, 1e-20)
    scale = torch.tensor(0.3) if adv == "clipped" else None
    if p.get("dtype") == "bf16m":
        m, v = m.bfloat16(), v.bfloat16()
    args = (par, grad, m, v, int(q["step"]), float(q["lr"]), 0.9, float(q["beta2"]), 1e-8, float(q["wd"]),
            scale)
    dims = {"R": q["R"], "C": q["C"], "step": int(q["step"])}
    return Inputs(args, shape=dims, dtype=p.get("dtype", "fp32"))


def space_muon(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        E=S([0, 2]),
        R=I(2, 1024 if big else 12),
        C=I(2, 2048 if big else 16),
        lr=S([0.02, 1e-3]),
        wd=S([0.0, 0.1]),
        nesterov=st.booleans(),
    )


def make_muon(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    shape = ([p["E"]] if p["E"] else []) + [p["R"], p["C"]]
    par = randn(shape, torch.float32, g, 0.02)
    grad = randn(shape, torch.float32, g, 1e-2)
    buf = randn(shape, torch.float32, g, 1e-2)
    if adv == "zero":
        grad, buf = torch.zeros_like(grad), torch.zeros_like(buf)
    args = (par, grad, buf, float(p["lr"]), 0.95, float(p["wd"]), bool(p["nesterov"]), 5)
    return Inputs(args, shape={"E": p["E"], "R": p["R"], "C": p["C"]}, dtype="fp32")


def adamw(inp: Inputs, c: Contract) -> list[Expect | None]:
    """Per output a forward-error budget in units of u (coefficient roundings included): m, v are
    length-2 sums; p adds the decay rounding, the update's error (driven by m's) and the subtraction. A clip
    factor s multiplies g exactly here; its one fp32 rounding adds a unit to g's terms (two to g*g's).
    bf16 moments (dtype "bf16m") read exactly; their stores get the contract's one ulp in bf16."""
    p, g, m, v, step, lr, b1, b2, eps, wd, scale = inp.args
    p, g, m, v = d(p), d(g), d(m), d(v)
    extra = 0.0
    if scale is not None:
        g, extra = g * float(scale), 1.0
    p1 = p * (1 - lr * wd)
    m1 = b1 * m + (1 - b1) * g
    v1 = b2 * v + (1 - b2) * g * g
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    denom = torch.sqrt(v1 / bc2) + eps
    upd = lr * (m1 / bc1) / denom
    pn = p1 - upd
    mag_m = (b1 * m).abs() + ((1 - b1) * g).abs()
    mag_v = (b2 * v).abs() + ((1 - b2) * g * g).abs()
    mag_p = 2 * p1.abs() + pn.abs() + lr / bc1 * (3 + extra) * mag_m / denom + (12 + 2 * extra) * upd.abs()
    return [Expect(pn, mag=mag_p, k=1.0), Expect(m1, mag=mag_m, k=3.0 + extra),
            Expect(v1, mag=mag_v, k=4.0 + 2 * extra)]


NS5 = (3.4445, -4.7750, 2.0315)


def ns5(u: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
    """Newton-Schulz quintic iteration (Muon) with every op in `dtype`."""
    a, b, c_ = NS5
    x = u.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.pow(2).sum(dim=(-2, -1), keepdim=True).sqrt() + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c_ * (gram @ gram)) @ x
    out: Tensor = x.mT if tall else x
    return out


def muon(inp: Inputs, c: Contract) -> list[Expect | None]:
    """p: ratio against a Muon step whose Newton-Schulz runs in bf16 (common practice); buf: bound."""
    p, g, buf, lr, mu, wd, nesterov, steps = inp.args
    pd, gd, bd = d(p), d(g), d(buf)
    buf1 = mu * bd + gd
    u = gd + mu * buf1 if nesterov else buf1
    scale = 0.2 * math.sqrt(max(p.shape[-2], p.shape[-1]))
    p64 = pd * (1 - lr * wd) - lr * scale * ns5(u, steps, F64)
    b32 = buf.mul(mu).add(g)
    u32 = g + mu * b32 if nesterov else b32
    p_lp = p * (1 - lr * wd) - (lr * scale) * ns5(u32, steps, torch.bfloat16).to(torch.float32)
    return [Expect(p64, lowprec=p_lp), Expect(buf1, mag=(mu * bd).abs() + gd.abs(), k=3.0)]


ENTRIES: list[OpEntry] = [
    OpEntry(
        name="adamw",
        module="optim",
        fn="adamw_step",
        space=space_adamw,
        make=make_adamw,
        contract=bound_contract(
            1,
            2,
            note="per-op fp32 roundings (u = 2^-24) of the AdamW update; ulp(n) cannot "
            "hold where m = b1*m + (1-b1)*g cancels",
        ),
        oracle=adamw,
        output_names=("p", "m", "v"),
        adversarial=("zero", "denormal", "single_token", "clipped"),
        dtypes=("fp32", "bf16m"),
        ref64=True,
        inplace=(0, 2, 3),
    ),
    OpEntry(
        name="muon",
        module="optim",
        fn="muon_step",
        space=space_muon,
        make=make_muon,
        contract=RATIO2_FP32,
        oracle=muon,
        output_names=("p", "buf"),
        output_contracts={1: bound_contract(1, 2, note="buf = mu*buf + g: fp32, u = 2^-24")},
        adversarial=("zero",),
        dtypes=("fp32",),
        ref64=True,
        inplace=(0, 2),
        note="p: ratio against a bf16 Newton-Schulz step; no tight bound survives 5 NS iterations",
    ),
]
