"""Grouped GEMMs (bf16, fp8, nvfp4) and the GEMM + activation epilogue, bound contracts."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity.compare import (
    U_FP32,
    U_HOPPER_FP8_BLOCK,
    Contract,
    bound_contract,
    gemm_radius,
    ulp_of,
)
from parity.entry import (
    GEMM,
    GEMM_ADV,
    OpEntry,
)
from parity.inputs import (
    I,
    Inputs,
    Params,
    S,
    adversarial_fill,
    dt,
    group_counts,
    group_ends,
    randint,
    randn,
    reduce_fill,
    skew_of,
    space,
    uniform,
    with_adv,
)
from parity.oracles import (
    F64,
    Expect,
    d,
    dequant_mx,
    dequant_nvfp4,
    f32,
    relu64,
    sigmoid64,
)

FP8_SM90 = bound_contract(
    1,
    2,
    u_acc=U_FP32,
    block=128,
    u_block=U_HOPPER_FP8_BLOCK,
    note="Hopper fp8 wgmma: ~14-bit in-block accumulation (u_block = 2^-14) over 128-wide K blocks, "
    "each block promoted to an fp32 accumulator (u_acc = 2^-24), as in DeepSeek-V3",
)
FP8_SM100 = bound_contract(1, 2, note="tcgen05 block-scaled MMA accumulates in fp32: u_acc = 2^-24")


def space_gemm(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    if big:
        return space(
            E=I(1, 16),
            rows=S([128, 512, 2048]),
            K=S([128, 1024, 2048]),
            N=S([128, 512, 1536]),
            tail=S([0, 128]),
            align=S([128]),
        )
    return space(
        E=I(1, 5), rows=I(0, 40), K=S([1, 16, 64, 136]), N=S([8, 32, 72]), tail=I(0, 5), align=S([1])
    )


def space_gemm_q(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    if big:
        return space(
            E=I(1, 8),
            rows=S([128, 512]),
            K=S([128, 512, 1024]),
            N=S([128, 256, 512]),
            tail=S([0, 128]),
            align=S([128]),
        )
    return space(E=I(1, 3), rows=I(0, 24), K=S([128, 256]), N=S([128]), tail=I(0, 3), align=S([1]))


def _gemm_groups(q: Params, g: torch.Generator, adv: str | None) -> tuple[int, Tensor]:
    align = int(q["align"])
    rows = (int(q["rows"]) // align) * align
    counts = group_counts(rows, q["E"], g, skew_of(adv), align)
    if adv == "single_token":
        counts = torch.zeros(q["E"], dtype=torch.int64)
        counts[int(torch.randint(0, q["E"], (1,), generator=g))] = 1
    m = int(counts.sum()) + (0 if adv == "single_token" else int(q["tail"]))
    return m, group_ends(counts)


def _gemm_q(p: Params, adv: str | None) -> dict[str, Any]:
    """k1 for GEMMs: K = 8, one partial K tile and the narrowest rows the TMA fast path takes (16 bytes)."""
    return with_adv(p, adv, **({"K": 8} if adv == "k1" else {}))


def make_grouped_gemm(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = _gemm_q(p, adv)
    dtype, e, k, n = dt(q["dtype"]), q["E"], q["K"], q["N"]
    m, offs = _gemm_groups(q, g, adv)
    x = reduce_fill(randn([m, k], dtype, g), adv, g)
    w = randn([e, n, k], dtype, g, 1.0 / math.sqrt(k))
    return Inputs((x, w, offs), shape={"M": m, "N": n, "K": k, "E": e}, dtype=q["dtype"])


def make_grouped_gemm_dgrad(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = _gemm_q(p, adv)
    dtype, e, k, n = dt(q["dtype"]), q["E"], q["K"], q["N"]
    m, offs = _gemm_groups(q, g, adv)
    dy = reduce_fill(randn([m, n], dtype, g), adv, g)
    w = randn([e, n, k], dtype, g, 1.0 / math.sqrt(n))
    return Inputs((dy, w, offs), shape={"M": m, "N": n, "K": k, "E": e}, dtype=q["dtype"])


def make_grouped_gemm_wgrad(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = _gemm_q(p, adv)
    dtype, e, k, n = dt(q["dtype"]), q["E"], q["K"], q["N"]
    m, offs = _gemm_groups(q, g, adv)
    dy = randn([m, n], dtype, g)
    x = adversarial_fill(randn([m, k], dtype, g), adv, g) if adv != "max" else randn([m, k], dtype, g)
    return Inputs((dy, x, offs), shape={"M": m, "N": n, "K": k, "E": e}, dtype=q["dtype"])


def space_gemm_act(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    if big:
        return space(
            E=I(1, 16),
            rows=S([128, 512]),
            K=S([1024, 2048]),
            N=S([256, 1408]),
            tail=S([0, 128]),
            align=S([128]),
            activation=S(["swiglu", "relu2"]),
        )
    return space(
        E=I(1, 4),
        rows=I(0, 32),
        K=S([1, 16, 64]),
        N=S([8, 34]),
        tail=I(0, 3),
        align=S([1]),
        activation=S(["swiglu", "relu2"]),
    )


def make_grouped_gemm_act(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = _gemm_q(p, adv)
    dtype, e, k, n, act = dt(q["dtype"]), q["E"], q["K"], q["N"], q["activation"]
    m, offs = _gemm_groups(q, g, adv)
    x = reduce_fill(randn([m, k], dtype, g), adv, g)
    w = randn([e, n, k], dtype, g, 2.0 / math.sqrt(k))
    return Inputs(
        (x, w, offs, act), shape={"M": m, "N": n, "K": k, "E": e}, dtype=q["dtype"], meta={"activation": act}
    )


def _fp8_codes(shape: list[int], g: torch.Generator, adv: str | None) -> Tensor:
    """Finite e4m3 codes (NaN 0x7F/0xFF excluded unless adv=nan); denormal -> subnormal codes only."""
    hi = 0x08 if adv == "denormal" else 0x7F
    mag = randint(0, hi, shape, g)
    sign = randint(0, 2, shape, g) << 7
    codes = (mag | sign).to(torch.uint8)
    if adv == "zero":
        codes = torch.zeros_like(codes)
    if adv == "nan" and codes.numel():
        codes.reshape(-1)[0] = 0x7F
    return codes


def make_grouped_gemm_fp8(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = _gemm_q(p, adv)
    e, k, n = q["E"], q["K"], q["N"]
    m, offs = _gemm_groups(q, g, adv)
    xq = _fp8_codes([m, k], g, adv)
    xs = randint(120, 135, [m, k // 128], g).to(torch.uint8)
    wq = _fp8_codes([e, n, k], g, None)
    ws = randint(118, 131, [e, n // 128, k // 128], g).to(torch.uint8)
    return Inputs((xq, xs, wq, ws, offs), shape={"M": m, "N": n, "K": k, "E": e}, dtype="fp8")


def _nvfp4_operand(
    lead: list[int], k: int, g: torch.Generator, adv: str | None
) -> tuple[Tensor, Tensor, Tensor]:
    packed = randint(0, 256, [*lead, k // 2], g).to(torch.uint8)
    lo = 0x01 if adv == "denormal" else 0x30
    hi = 0x08 if adv == "denormal" else 0x48
    bs = randint(lo, hi, [*lead, k // 16], g).to(torch.uint8)
    if adv == "zero":
        packed = torch.zeros_like(packed)
    if adv == "nan" and bs.numel():
        bs.reshape(-1)[0] = 0x7F
    ts = (uniform([], g, 0.5, 2.0) * 2.0**-4).to(torch.float32)
    return packed, bs, ts


def make_grouped_gemm_nvfp4(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = _gemm_q(p, adv)
    e, k, n = q["E"], q["K"], q["N"]
    m, offs = _gemm_groups(q, g, adv)
    xp, xbs, xts = _nvfp4_operand([m], k, g, adv)
    wp, wbs, wts = _nvfp4_operand([e, n], k, g, None)
    return Inputs((xp, xbs, xts, wp, wbs, wts, offs), shape={"M": m, "N": n, "K": k, "E": e}, dtype="nvfp4")


def _groups(offs: Tensor) -> list[tuple[int, int]]:
    ends = offs.to(torch.int64).tolist()
    return [(0 if i == 0 else ends[i - 1], ends[i]) for i in range(len(ends))]


def _gemm64(x: Tensor, w: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """Per group x[rows] @ w[e]^T in float64, plus |x| @ |w|^T; rows past offs[-1] stay exactly 0."""
    m, n = x.shape[0], w.shape[1]
    out = torch.zeros(m, n, dtype=F64)
    mag = torch.zeros(m, n, dtype=F64)
    for e, (a, b) in enumerate(_groups(offs)):
        if b > a:
            out[a:b] = x[a:b] @ w[e].T
            mag[a:b] = x[a:b].abs() @ w[e].abs().T
    return out, mag


def grouped_gemm(inp: Inputs, c: Contract) -> list[Expect | None]:
    x, w, offs = inp.args
    v, mag = _gemm64(d(x), d(w), offs)
    return [Expect(v, mag=mag, k=float(x.shape[1]))]


def grouped_gemm_dgrad(inp: Inputs, c: Contract) -> list[Expect | None]:
    dy, w, offs = inp.args
    v, mag = _gemm64(d(dy), d(w).transpose(1, 2), offs)
    return [Expect(v, mag=mag, k=float(dy.shape[1]))]


def grouped_gemm_wgrad(inp: Inputs, c: Contract) -> list[Expect | None]:
    dy, x, offs = inp.args
    e = offs.numel()
    out = torch.zeros(e, dy.shape[1], x.shape[1], dtype=F64)
    mag = torch.zeros_like(out)
    kk = torch.zeros(e, 1, 1, dtype=F64)
    for i, (a, b) in enumerate(_groups(offs)):
        out[i] = d(dy[a:b]).T @ d(x[a:b])
        mag[i] = d(dy[a:b]).abs().T @ d(x[a:b]).abs()
        kk[i] = float(b - a)
    return [Expect(out, mag=mag, k=kk)]


def grouped_gemm_fp8(inp: Inputs, c: Contract) -> list[Expect | None]:
    xq, xs, wq, ws, offs = inp.args
    x = dequant_mx(xq, xs, 1, 128)
    w = dequant_mx(wq, ws, 128, 128)
    v, mag = _gemm64(x, w, offs)
    return [Expect(v, mag=mag, k=float(xq.shape[1]))]


def grouped_gemm_nvfp4(inp: Inputs, c: Contract) -> list[Expect | None]:
    xp, xbs, xts, wp, wbs, wts, offs = inp.args
    v, mag = _gemm64(f32(dequant_nvfp4(xp, xbs, xts)), f32(dequant_nvfp4(wp, wbs, wts)), offs)
    return [Expect(v, mag=mag, k=float(xp.shape[1] * 2))]


SILU_ARGMIN = -1.2784645427610738
"""Root of 1 + g*(1 - sigmoid(g)) = 0: silu decreases left of it and increases right of it."""


def _silu(g: Tensor) -> Tensor:
    return g * sigmoid64(g)


def _silu_range(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    a, b = _silu(lo), _silu(hi)
    inside = (lo < SILU_ARGMIN) & (hi > SILU_ARGMIN)
    vmin = torch.where(inside, _silu(torch.tensor(SILU_ARGMIN, dtype=F64)), torch.minimum(a, b))
    return vmin, torch.maximum(a, b)


def _mul_range(a: Tensor, b: Tensor, c_: Tensor, d_: Tensor) -> tuple[Tensor, Tensor]:
    p = torch.stack((a * c_, a * d_, b * c_, b * d_))
    return p.min(0).values, p.max(0).values


def grouped_gemm_act(inp: Inputs, c: Contract) -> list[Expect | None]:
    """GEMM bound (plus the bf16 rounding of h in the unfused spec) pushed through the activation as an
    interval; the fast output must land in it widened by the contract's n ULPs."""
    x, w, offs, act = inp.args
    h, mag = _gemm64(d(x), d(w), offs)
    rad = gemm_radius(c, mag, float(x.shape[1])) + ulp_of(h, x.dtype)
    lo, hi = h - rad, h + rad
    if act == "relu2":
        rl, rh = relu64(lo), relu64(hi)
        vlo, vhi, val = rl * rl, rh * rh, relu64(h) ** 2
    else:
        slo, shi = _silu_range(lo[:, 0::2], hi[:, 0::2])
        vlo, vhi = _mul_range(slo, shi, lo[:, 1::2], hi[:, 1::2])
        val = _silu(h[:, 0::2]) * h[:, 1::2]
    return [Expect(val, lo=vlo, hi=vhi)]


ENTRIES: list[OpEntry] = [
    OpEntry(
        name="grouped_gemm",
        module="gemm",
        fn="grouped_gemm",
        space=space_gemm,
        make=make_grouped_gemm,
        contract=GEMM,
        oracle=grouped_gemm,
        adversarial=GEMM_ADV,
    ),
    OpEntry(
        name="grouped_gemm_dgrad",
        module="gemm",
        fn="grouped_gemm_dgrad",
        space=space_gemm,
        make=make_grouped_gemm_dgrad,
        contract=GEMM,
        oracle=grouped_gemm_dgrad,
        adversarial=GEMM_ADV,
    ),
    OpEntry(
        name="grouped_gemm_wgrad",
        module="gemm",
        fn="grouped_gemm_wgrad",
        space=space_gemm,
        make=make_grouped_gemm_wgrad,
        contract=GEMM,
        oracle=grouped_gemm_wgrad,
        adversarial=("zero", "empty_expert", "single_token", "k1", "nan", "inf", "denormal", "zipf"),
    ),
    OpEntry(
        name="grouped_gemm_fp8",
        module="gemm",
        fn="grouped_gemm_fp8",
        space=space_gemm_q,
        make=make_grouped_gemm_fp8,
        contract=GEMM,
        oracle=grouped_gemm_fp8,
        arch_contracts={"sm_90a": FP8_SM90, "sm_100a": FP8_SM100},
        adversarial=("zero", "empty_expert", "single_token", "nan", "denormal"),
        dtypes=("fp8",),
    ),
    OpEntry(
        name="grouped_gemm_nvfp4",
        module="gemm",
        fn="grouped_gemm_nvfp4",
        space=space_gemm_q,
        make=make_grouped_gemm_nvfp4,
        contract=bound_contract(1, 2, note="tcgen05 block-scaled fp4 MMA, fp32 accumulator: u_acc = 2^-24"),
        oracle=grouped_gemm_nvfp4,
        adversarial=("zero", "empty_expert", "single_token", "nan", "denormal"),
        dtypes=("nvfp4",),
        archs=("sm_100a",),
    ),
    OpEntry(
        name="grouped_gemm_act",
        module="gemm",
        fn="grouped_gemm_act",
        space=space_gemm_act,
        make=make_grouped_gemm_act,
        contract=bound_contract(
            1,
            2,
            note="GEMM bound (fp32, u_acc = 2^-24) plus h's bf16 rounding, pushed "
            "through the activation as an interval, then 1 ULP of the output",
        ),
        oracle=grouped_gemm_act,
        adversarial=("zero", "empty_expert", "single_token", "k1"),
    ),
]
