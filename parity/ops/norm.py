"""rmsnorm forward and backward, and add_rmsnorm (a residual add and the norm after it) with its backward."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

from parity.compare import (
    U_FP32,
    Contract,
    fmt,
    ulp_contract,
)
from parity.entry import (
    CANCEL,
    OpEntry,
)
from parity.inputs import (
    I,
    Inputs,
    Params,
    S,
    by_size,
    dt,
    randn,
    reduce_fill,
    space,
    with_adv,
)
from parity.oracles import (
    Expect,
    d,
)

ULP1 = ulp_contract(1, note="fp32 internal math, one rounding to bf16: fp32 error << 1 bf16 ULP")


def space_norm(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 512 if big else 16),
        D=by_size(big, [1, 8, 64, 136], [512, 2048, 7168]),
        eps=S([1e-6, 1e-5]),
        scale=S([1.0, 30.0, 1e-3]),
    )


def _rows(p: Params, g: torch.Generator, adv: str | None) -> tuple[Params, torch.Tensor, torch.Tensor]:
    """The family's case: its params, the normed rows [T, D] (adversarial values filled in), a weight ~1."""
    q = with_adv(p, adv, **({"T": 1} if adv == "single_token" else {}))
    dtype, t, dd = dt(q["dtype"]), q["T"], q["D"]
    x = reduce_fill(randn([t, dd], dtype, g, float(q["scale"])), adv, g)
    return q, x, (1.0 + randn([dd], torch.float64, g, 0.1)).to(dtype)


def _case(q: Params, args: tuple[Any, ...]) -> Inputs:
    return Inputs((*args, float(q["eps"])), shape={"T": q["T"], "D": q["D"]}, dtype=q["dtype"])


def make_rmsnorm(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q, x, w = _rows(p, g, adv)
    return _case(q, (x, w))


def make_rmsnorm_bwd(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q, x, w = _rows(p, g, adv)
    return _case(q, (randn(list(x.shape), x.dtype, g), x, w))


def rmsnorm(inp: Inputs, c: Contract) -> list[Expect | None]:
    x, w, eps = d(inp.args[0]), d(inp.args[1]), float(inp.args[2])
    r = 1.0 / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return [Expect(x * r * w)]


def rmsnorm_bwd(inp: Inputs, c: Contract) -> list[Expect | None]:
    """dx = r*(g - x*r^2*mean(g*x)) cancels (always at D=1), so its budget (units of u, k=1) follows each
    fp32 step: r carries (D+1)/2+2 from the mean of squares, mean(g*x) carries D+1 of its |terms|."""
    dy, x, w, eps = d(inp.args[0]), d(inp.args[1]), d(inp.args[2]), float(inp.args[3])
    dd = x.shape[-1]
    r = 1.0 / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    g = dy * w
    s = (g * x).mean(-1, keepdim=True)
    dx = r * (g - x * r * r * s)
    dw = (dy * x * r).reshape(-1, dd).sum(0)
    mag_dx = r * g.abs() + r**3 * x.abs() * (
        (dd + 1) * (g * x).abs().mean(-1, keepdim=True) + (dd + 8) * s.abs()
    )
    mag_dx = mag_dx + dx.abs() * ((dd + 1) / 2 + 4)
    rows = x.reshape(-1, dd).shape[0]
    mag_dw = (dy * x * r).abs().reshape(-1, dd).sum(0) * (rows + dd / 2 + 4)
    return [Expect(dx, mag=mag_dx, k=1.0), Expect(dw, mag=mag_dw, k=1.0)]


def make_add_rmsnorm(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q, h, w = _rows(p, g, adv)
    return _case(q, (h, randn(list(h.shape), h.dtype, g, float(q["scale"]) / 3), w))


def make_add_rmsnorm_bwd(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q, s, w = _rows(p, g, adv)
    return _case(q, (randn(list(s.shape), s.dtype, g), randn(list(s.shape), s.dtype, g), s, w))


def add_rmsnorm(inp: Inputs, c: Contract) -> list[Expect | None]:
    """s = h + a rounded once to the inputs' dtype (the pinned semantics: the norm reads that stream)."""
    h, a = inp.args[0], inp.args[1]
    s = (d(h) + d(a)).to(h.dtype)
    return [Expect(d(h) + d(a)), *rmsnorm(Inputs((s, *inp.args[2:])), c)]


def add_rmsnorm_bwd(inp: Inputs, c: Contract) -> list[Expect | None]:
    """dh = ds + dx: rmsnorm_bwd's budget for dx, plus dx's own rounding to the stream's dtype (unit u_out,
    in the contract's units of 2u) before the add."""
    ds, dy, s, w, eps = inp.args
    dx, dw = rmsnorm_bwd(Inputs((dy, s, w, eps)), c)
    assert dx is not None and dx.mag is not None
    mag = dx.mag + dx.value.abs() * (2.0 ** -fmt(s.dtype).p / (2 * U_FP32))
    return [Expect(d(ds) + dx.value, mag=mag, k=1.0), dw]


ENTRIES: list[OpEntry] = [
    OpEntry(
        name="rmsnorm",
        module="norm",
        fn="rmsnorm",
        space=space_norm,
        make=make_rmsnorm,
        contract=ULP1,
        oracle=rmsnorm,
        adversarial=("nan", "inf", "denormal", "zero", "single_token"),
        ref64=True,
    ),
    OpEntry(
        name="rmsnorm_bwd",
        module="norm",
        fn="rmsnorm_bwd",
        space=space_norm,
        make=make_rmsnorm_bwd,
        contract=CANCEL,
        oracle=rmsnorm_bwd,
        output_names=("dx", "dw"),
        adversarial=("zero", "single_token", "denormal"),
        ref64=True,
    ),
    OpEntry(
        name="add_rmsnorm",
        module="norm",
        fn="add_rmsnorm",
        space=space_norm,
        make=make_add_rmsnorm,
        contract=ULP1,
        oracle=add_rmsnorm,
        output_names=("s", "y"),
        adversarial=("nan", "inf", "denormal", "zero", "single_token"),
        ref64=True,
    ),
    OpEntry(
        name="add_rmsnorm_bwd",
        module="norm",
        fn="add_rmsnorm_bwd",
        space=space_norm,
        make=make_add_rmsnorm_bwd,
        contract=CANCEL,
        oracle=add_rmsnorm_bwd,
        output_names=("dh", "dw"),
        adversarial=("zero", "single_token", "denormal"),
        ref64=True,
    ),
]
