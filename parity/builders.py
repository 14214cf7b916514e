"""Per-op parameter spaces and input builders (random draws plus adversarial kinds).
CPU spaces stay tiny so a CPU parity run takes minutes; `big` (GPU) spaces keep GEMM dims and group
ends multiples of 128, as permute(align=128) produces them."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity.inputs import (
    Inputs,
    Params,
    adversarial_fill,
    dt,
    group_counts,
    group_ends,
    is_tie,
    pick,
    pow2,
    randint,
    randn,
    route,
    space,
    sprinkle,
    tie_candidates,
    uniform,
    with_adv,
)

S = st.sampled_from
I = st.integers


def _big(big: bool, small: list[Any], large: list[Any]) -> st.SearchStrategy[Any]:
    return S(large if big else small)


# ----------------------------------------------------------------------------------------------------------
# Elementwise: relu2, swiglu


def space_rows(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 512 if big else 24), H=_big(big, [1, 8, 64, 130], [128, 2048, 7168]), scale=S([1.0, 4.0, 1e-3])
    )


def product_ties(dtype: torch.dtype, n: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """n pairs (a, b) of few-bit values whose exact product a*b is a rounding tie of `dtype`."""
    c = tie_candidates(dtype)
    if c.numel() > 256:
        c = c[torch.randperm(c.numel(), generator=g)[:256]]
    a, b = torch.meshgrid(c, c, indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)
    ok = is_tie(a * b, dtype)
    idx = pick(torch.nonzero(ok).reshape(-1), n, g)
    sa, sb = pow2([n], -6, 6, g), pow2([n], -6, 6, g)
    return a[idx] * sa, b[idx] * sb


def square_ties(dtype: torch.dtype, n: int, g: torch.Generator) -> Tensor:
    """n values x (float64, representable in dtype) whose exact square is a rounding tie of `dtype`."""
    c = tie_candidates(dtype)
    return pick(c[is_tie(c * c, dtype)], n, g) * pow2([n], -6, 6, g)


def make_relu2(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    dtype, t, h = dt(p["dtype"]), p["T"], p["H"]
    if adv == "ties":
        x = square_ties(dtype, t * h, g).to(dtype).reshape(t, h)
    else:
        x = adversarial_fill(randn([t, h], dtype, g, 4.0 * p.get("scale", 1.0)), adv, g)
    return Inputs((x,), shape={"T": t, "H": h}, dtype=p["dtype"])


def make_relu2_bwd(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    dtype, t, h = dt(p["dtype"]), p["T"], p["H"]
    if adv == "ties":
        a, b = product_ties(dtype, t * h, g)
        dy, x = a.to(dtype).reshape(t, h), (b / 2).to(dtype).reshape(t, h)
    else:
        x = adversarial_fill(randn([t, h], dtype, g, 4.0 * p.get("scale", 1.0)), adv, g)
        dy = adversarial_fill(randn([t, h], dtype, g), adv, g)
    return Inputs((dy, x), shape={"T": t, "H": h}, dtype=p["dtype"])


def space_swiglu(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 512 if big else 24), I=_big(big, [1, 4, 32, 65], [128, 1408, 2048]), scale=S([1.0, 4.0, 0.05])
    )


def make_swiglu(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    dtype, t, i = dt(p["dtype"]), p["T"], p["I"]
    h = adversarial_fill(randn([t, 2 * i], dtype, g, 2.0 * p.get("scale", 1.0)), adv, g)
    return Inputs((h,), shape={"T": t, "I": i}, dtype=p["dtype"])


def make_swiglu_bwd(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    dtype, t, i = dt(p["dtype"]), p["T"], p["I"]
    h = adversarial_fill(randn([t, 2 * i], dtype, g, 2.0 * p.get("scale", 1.0)), adv, g)
    dy = adversarial_fill(randn([t, i], dtype, g), adv, g)
    return Inputs((dy, h), shape={"T": t, "I": i}, dtype=p["dtype"])


# ----------------------------------------------------------------------------------------------------------
# combine


def space_combine(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 256 if big else 16),
        K=I(1, 8),
        H=_big(big, [1, 8, 64], [2048, 7168]),
        shared=st.booleans(),
        routed_scale=S([1.0, 2.5, 0.3]),
    )


def _combine_common(p: Params, g: torch.Generator, adv: str | None) -> tuple[Tensor, Tensor, dict[str, int]]:
    q = with_adv(
        p, adv, **({"K": 1} if adv in ("k1", "ties") else {}), **({"T": 1} if adv == "single_token" else {})
    )
    dtype, t, k, h = dt(q["dtype"]), q["T"], q["K"], q["H"]
    w = torch.softmax(randn([t, k], torch.float64, g), dim=-1).to(torch.float32)
    y = adversarial_fill(randn([t, k, h], dtype, g, 2.0), adv, g)
    if adv == "ties":
        c = tie_candidates(dtype)
        a = pick(c[is_tie(c[:, None] * c[None, :], dtype).any(dim=1)], t, g)
        rows = [pick(c[is_tie(a[i] * c, dtype)], h, g) for i in range(t)]
        w = a.reshape(t, 1).to(torch.float32)
        y = torch.stack(rows).reshape(t, 1, h).to(dtype)
    return w, y, {"T": t, "K": k, "H": h}


def make_combine(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    w, y, shape = _combine_common(p, g, adv)
    scale = 1.0 if adv == "ties" else float(p["routed_scale"])
    shared = None
    if p["shared"] and adv != "ties":
        shared = adversarial_fill(randn([shape["T"], shape["H"]], y.dtype, g), adv, g)
    return Inputs((y, w, scale, shared), shape=shape, dtype=p["dtype"])


def make_combine_bwd(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    w, y, shape = _combine_common(p, g, adv)
    dout = adversarial_fill(randn([shape["T"], shape["H"]], y.dtype, g), adv, g)
    return Inputs((dout, y, w, float(p["routed_scale"])), shape=shape, dtype=p["dtype"])


# ----------------------------------------------------------------------------------------------------------
# router


def space_router_logits(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 512 if big else 24),
        H=_big(big, [1, 16, 64, 200], [2048, 7168]),
        E=_big(big, [4, 16, 64], [64, 256]),
    )


def one_per_row(x: Tensor, kind: str, g: torch.Generator) -> Tensor:
    """One special value per row (reductions: no two overflows that could cancel inside a row)."""
    out = x.clone()
    if out.numel() == 0:
        return out
    rows = out.reshape(-1, out.shape[-1])
    col = torch.randint(0, rows.shape[1], (rows.shape[0],), generator=g)
    sign = torch.where(torch.randint(0, 2, (rows.shape[0],), generator=g).bool(), -1.0, 1.0)
    val = {"max": float(torch.finfo(x.dtype).max), "inf": math.inf, "nan": math.nan}[kind]
    rows[torch.arange(rows.shape[0]), col] = (sign * val).to(x.dtype)
    return rows.reshape(x.shape)


def reduce_fill(x: Tensor, adv: str | None, g: torch.Generator) -> Tensor:
    """Adversarial fill for operands of reductions: specials at most once per row for max."""
    if adv == "max":
        return one_per_row(x, "max", g)
    return adversarial_fill(x, adv, g)


def make_router_logits(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = with_adv(p, adv, **({"T": 1} if adv == "single_token" else {}), **({"H": 1} if adv == "k1" else {}))
    dtype, t, h, e = dt(q["dtype"]), q["T"], q["H"], q["E"]
    x = reduce_fill(randn([t, h], dtype, g), adv, g)
    wr = randn([e, h], dtype, g, 1.0 / math.sqrt(h))
    return Inputs((x, wr), shape={"T": t, "H": h, "E": e}, dtype=q["dtype"])


def space_router_topk(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 512 if big else 24),
        E=_big(big, [8, 16, 64], [64, 256]),
        k=I(1, 8),
        score_func=S(["sigmoid", "softmax"]),
        n_groups=S([1, 2, 4, 8]),
        topk_groups=I(1, 8),
    )


def make_router_topk(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = with_adv(
        p,
        adv,
        **({"T": 1} if adv == "single_token" else {}),
        **({"k": 1} if adv == "k1" else {}),
        **({"score_func": "sigmoid"} if adv == "inf" else {}),
    )
    t, e = q["T"], q["E"]
    ng = q["n_groups"] if e % q["n_groups"] == 0 and e // q["n_groups"] >= 2 else 1
    tg = 1 + (q["topk_groups"] - 1) % ng
    avail = e if ng == 1 else tg * (e // ng)
    k = 1 + (q["k"] - 1) % min(avail, 8)
    logits = randn([t, e], torch.float32, g, 2.0)
    bias = randn([e], torch.float32, g, 0.1)
    if adv == "ties":
        logits = torch.round(logits)
        bias = torch.zeros_like(bias)
    elif adv == "zipf":
        bias = -torch.log1p(torch.randperm(e, generator=g).to(torch.float32))
    elif adv in ("nan", "inf", "max"):
        logits = sprinkle(logits, adv, g, 0.05)
    shape = {"T": t, "E": e, "k": k, "n_groups": ng, "topk_groups": tg}
    return Inputs(
        (logits, bias, k, q["score_func"], ng, tg),
        shape=shape,
        dtype="fp32",
        raises=adv == "nan",
        meta={"score_func": q["score_func"]},
    )


def space_bias_update(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        E=_big(big, [1, 8, 64], [64, 256]),
        tokens=I(0, 4096),
        rate=S([1e-3, 0.01, 0.0]),
        clamp=S([0.5, 1.0, 0.03]),
    )


def make_bias_update(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    e, clamp = p["E"], float(p["clamp"])
    bias = torch.clamp(randn([e], torch.float32, g, 0.01), -clamp, clamp)
    skew = "zipf" if adv == "zipf" else "uniform"
    k = min(4, e)
    counts = torch.bincount(route(p["tokens"], k, e, g, skew).reshape(-1), minlength=e)
    if adv == "ties":
        counts = torch.full((e,), int(p["tokens"]) // max(e, 1), dtype=torch.int64)
    elif adv == "zero":
        counts = torch.zeros(e, dtype=torch.int64)
    elif adv == "max":
        bias = torch.where(torch.arange(e) % 2 == 0, clamp, -clamp).to(torch.float32)
    return Inputs((bias, counts, float(p["rate"]), clamp), shape={"E": e}, dtype="fp32")


# ----------------------------------------------------------------------------------------------------------
# permute / unpermute / rdep


def space_permute(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 512 if big else 24),
        K=I(1, 8),
        E=I(8, 64) if big else I(1, 12),
        H=_big(big, [1, 8, 32], [2048, 7168]),
        align=_big(big, [1, 4, 16], [128]),
    )


def nan_payloads(n: int, dtype: torch.dtype, g: torch.Generator) -> Tensor:
    """NaNs with random signs and payloads: a copy must carry every bit."""
    if dtype == torch.bfloat16 or dtype == torch.float16:
        mant = 7 if dtype == torch.bfloat16 else 10
        base = 0x7F80 if dtype == torch.bfloat16 else 0x7C00
        bits = base | torch.randint(1, 2**mant, (n,), generator=g, dtype=torch.int64)
        bits = bits | (torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) << 15)
        return torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16).view(dtype)
    bits = 0x7F800000 | torch.randint(1, 2**23, (n,), generator=g, dtype=torch.int64)
    return bits.to(torch.int32).view(torch.float32).to(dtype)


def _routing_q(p: Params, adv: str | None) -> dict[str, Any]:
    return with_adv(
        p, adv, **({"T": 1} if adv == "single_token" else {}), **({"K": 1} if adv == "k1" else {})
    )


def _skew(adv: str | None) -> str:
    return {"empty_expert": "empty", "zipf": "zipf"}.get(adv or "", "uniform")


def _payload_x(shape: list[int], dtype: torch.dtype, g: torch.Generator, adv: str | None) -> Tensor:
    x = randn(shape, dtype, g)
    if adv == "nan" and x.numel():
        flat = x.reshape(-1)
        pos = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 4)]
        flat[pos] = nan_payloads(pos.numel(), dtype, g)
        return flat.reshape(shape)
    return adversarial_fill(x, adv, g) if adv in ("zero", "inf", "denormal", "max") else x


def make_permute(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = _routing_q(p, adv)
    dtype, t, k, h, align = dt(q["dtype"]), q["T"], q["K"], q["H"], q["align"]
    e = max(q["E"], k)
    ids = route(t, k, e, g, _skew(adv))
    x = _payload_x([t, h], dtype, g, adv)
    return Inputs(
        (x, ids, e, align), shape={"T": t, "K": k, "E": e, "H": h, "align": align}, dtype=q["dtype"]
    )


def make_unpermute(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    from parity.oracles import permute_layout

    q = _routing_q(p, adv)
    dtype, t, k, h, align = dt(q["dtype"]), q["T"], q["K"], q["H"], q["align"]
    e = max(q["E"], k)
    slot, _, _ = permute_layout(route(t, k, e, g, _skew(adv)), e, align)
    yp = _payload_x([slot.numel(), h], dtype, g, adv)
    return Inputs((yp, slot, t, k), shape={"T": t, "K": k, "E": e, "H": h, "align": align}, dtype=q["dtype"])


def space_rdep(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        W=S([1, 2, 4, 8] if big else [1, 2, 4]),
        T=I(1, 256 if big else 12),
        K=I(1, 4),
        n_local=I(1, 8 if big else 4),
        H=_big(big, [1, 8, 32], [2048]),
        slack=I(0, 3),
    )


def _rdep_routes(
    q: Params, g: torch.Generator, adv: str | None
) -> tuple[list[Tensor], list[Tensor], int, int]:
    w, t, k, h = q["W"], q["T"], q["K"], q["H"]
    e = w * q["n_local"]
    k = min(k, e)
    dtype = dt(q["dtype"])
    xs = [_payload_x([t, h], dtype, g, adv) for _ in range(w)]
    ids = [route(t, k, e, g, _skew(adv)) for _ in range(w)]
    owner = torch.stack(ids).reshape(-1) // q["n_local"]
    need = int(torch.bincount(owner, minlength=w).max()) if owner.numel() else 0
    cap = need - 1 if adv == "overflow" else need + int(q["slack"])
    return xs, ids, e, cap


def make_rdep_dispatch(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = _routing_q(p, adv)
    xs, ids, e, cap = _rdep_routes(q, g, adv)
    shape = {"W": q["W"], "T": q["T"], "K": ids[0].shape[1], "E": e, "H": q["H"], "capacity": cap}
    return Inputs((xs, ids, e, cap), shape=shape, dtype=q["dtype"], raises=adv == "overflow")


def make_rdep_return(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    from parity.oracles import rdep_recvs

    q = _routing_q(p, adv)
    xs, ids, e, _ = _rdep_routes(q, g, None if adv == "overflow" else adv)
    recvs = rdep_recvs(xs, ids, e)
    ys = [_payload_x([int(r.row_id.numel()), q["H"]], dt(q["dtype"]), g, adv) for r in recvs]
    k = ids[0].shape[1]
    shape = {"W": q["W"], "T": q["T"], "K": k, "E": e, "H": q["H"]}
    return Inputs((ys, recvs, q["T"], k), shape=shape, dtype=q["dtype"])


# ----------------------------------------------------------------------------------------------------------
# grouped GEMMs


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
    counts = group_counts(rows, q["E"], g, _skew(adv), align)
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
