"""Router: logits GEMM, top-k selection (with its own oracle, exact where fp32 decides) and bias update."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from parity.compare import (
    BITWISE,
    Contract,
    Verdict,
    ulp_of,
)
from parity.entry import (
    GEMM,
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
    route,
    space,
    sprinkle,
    uniform,
    with_adv,
)
from parity.oracles import (
    F64,
    Expect,
    d,
    f32,
    sigmoid64,
    spec_out,
)


def space_router_logits(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 512 if big else 24),
        H=by_size(big, [1, 16, 64, 200], [2048, 7168]),
        E=by_size(big, [4, 16, 64], [64, 256]),
    )


def make_router_logits(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    q = with_adv(p, adv, **({"T": 1} if adv == "single_token" else {}), **({"H": 1} if adv == "k1" else {}))
    dtype, t, h, e = dt(q["dtype"]), q["T"], q["H"], q["E"]
    x = reduce_fill(randn([t, h], dtype, g), adv, g)
    wr = randn([e, h], dtype, g, 1.0 / math.sqrt(h))
    return Inputs((x, wr), shape={"T": t, "H": h, "E": e}, dtype=q["dtype"])


def space_router_topk(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    return space(
        T=I(1, 512 if big else 24),
        E=by_size(big, [8, 16, 64], [64, 256]),
        k=I(1, 8),
        score_func=S(["sigmoid", "softmax"]),
        n_groups=S([1, 2, 4, 8]),
        topk_groups=I(1, 8),
    )


def make_router_topk(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    """Real ties, bias 0: adv=ties takes integer logits, for sigmoid mixed with logits in [17, 40] whose fp32
    sigmoids all round to 1.0 (ties only after rounding); inf/max sprinkle saturated logits."""
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
        if q["score_func"] == "sigmoid":
            saturated = uniform([t, e], g, 17.0, 40.0).to(torch.float32)
            logits = torch.where(uniform([t, e], g) < 0.25, saturated, logits)
    elif adv == "zipf":
        bias = -torch.log1p(torch.randperm(e, generator=g).to(torch.float32))
    elif adv in ("nan", "inf", "max"):
        logits = sprinkle(logits, adv, g, 0.25)
        bias = torch.zeros_like(bias)
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
        E=by_size(big, [1, 8, 64], [64, 256]),
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


def router_logits(inp: Inputs, c: Contract) -> list[Expect | None]:
    x, wr = d(inp.args[0]), d(inp.args[1])
    return [Expect(x @ wr.T, mag=x.abs() @ wr.abs().T, k=float(x.shape[1]))]


def bias_update(inp: Inputs, c: Contract) -> list[Expect | None]:
    bias, counts, rate, clamp = inp.args
    cnt = counts.to(torch.int64)
    direction = torch.sign(cnt.sum() - bias.numel() * cnt).to(F64)
    new = f32(d(bias) + f32(torch.tensor(float(rate), dtype=F64)) * direction)
    lim = float(f32(torch.tensor(float(clamp), dtype=F64)))
    return [spec_out(torch.clamp(new, -lim, lim), torch.float32)]


def _tol(v: Tensor) -> Tensor:
    return 16 * 2.0**-24 * (v.abs() + 1.0)


def _kept_groups(gs: Tensor, tg: int, used: set[int]) -> tuple[set[int], str]:
    """Groups whose experts compete: those surely in the top tg, plus near-ties at the cut that the op used;
    when every near-tie is an exact tie, the spec's choice (lower group id first) is the only valid one."""
    order = sorted(range(gs.numel()), key=lambda g: (-float(gs[g]), g))
    cut = gs[order[tg - 1]]
    near = (gs - cut).abs() <= _tol(cut)
    if bool(((gs == cut) | ~near).all()):
        kept = set(order[:tg])
    else:
        sure = {g for g in range(gs.numel()) if bool(gs[g] > cut + _tol(cut))}
        kept = sure | {g for g in used if bool(near[g])}
    return kept, "" if used <= kept else f"ids use groups {sorted(used - kept)} outside the top {tg}"


def router_topk_invariants(inp: Inputs, out: Any) -> Verdict:
    """ids distinct, inside the kept groups, the top-k of scores+bias in descending order (exact ties: lower
    id first; near ties within fp32 tolerance either way), weights = unbiased scores / their sum."""
    logits, bias, k, score_func, ng, tg = inp.args
    weights, ids = out
    t, e = logits.shape
    if tuple(ids.shape) != (t, k) or tuple(weights.shape) != (t, k):
        shapes = f"{tuple(weights.shape)}, {tuple(ids.shape)}"
        return Verdict(False, {"violations": 1.0}, f"router_topk: shapes {shapes} are not [T, k]")
    ids64 = ids.to(torch.int64)
    if bool(((ids64 < 0) | (ids64 >= e)).any()):
        return Verdict(False, {"violations": 1.0}, "router_topk: ids outside [0, E)")
    lg = d(logits)
    score = sigmoid64(lg) if score_func == "sigmoid" else torch.softmax(lg, dim=-1)
    biased = score + d(bias)
    size = e // ng
    problems: list[str] = []
    for i in range(t):
        row = ids64[i].tolist()
        if len(set(row)) != k:
            problems.append(f"token {i}: repeated ids {row}")
            continue
        allowed = torch.ones(e, dtype=torch.bool)
        if ng > 1:
            top2 = biased[i].view(ng, size).sort(dim=-1, descending=True).values
            kept, why = _kept_groups(top2[:, 0] + top2[:, 1], tg, {r // size for r in row})
            if why:
                problems.append(f"token {i}: {why}")
            allowed = torch.tensor([g // size in kept for g in range(e)])
        b = biased[i, ids64[i]]
        for j in range(k - 1):
            if bool(b[j + 1] > b[j] + _tol(b[j])) or (bool(b[j + 1] == b[j]) and row[j + 1] < row[j]):
                problems.append(f"token {i}: order broken at position {j}")
        rest = allowed.clone()
        rest[ids64[i]] = False
        worst_sel = b.min()
        if bool(rest.any()) and bool(biased[i][rest].max() > worst_sel + _tol(worst_sel)):
            problems.append(f"token {i}: an unselected expert scores higher")
        tied_rest = torch.nonzero(rest & (biased[i] == worst_sel)).reshape(-1)
        tied_sel = [r for r in row if bool(biased[i, r] == worst_sel)]
        if tied_rest.numel() and int(tied_rest.min()) < max(tied_sel):
            problems.append(f"token {i}: tie broken toward a higher id")
        s = score[i, ids64[i]]
        want = s / s.sum()
        err = (d(weights[i]) - want).abs()
        if bool((err > (2 * k + 16) * ulp_of(want, torch.float32)).any()):
            problems.append(f"token {i}: weights off by {float(err.max()):.3g}")
    return Verdict(not problems, {"violations": float(len(problems))}, "; ".join(problems[:3]))


EXP_ULPS = 2.0
"""The spec's fp32 exp is within 1.1 ULP of exp (docs/spec-corners.md); the oracle allows 2."""


def _rn(x: Tensor) -> Tensor:
    """One fp32 rounding of an exact float64 result of fp32 operands (53 >= 2*24 + 2: no double-rounding)."""
    return x.to(torch.float32).to(F64)


def fp32_down(x: Tensor) -> Tensor:
    """The largest fp32 value <= x, as float64."""
    r = x.to(torch.float32)
    return torch.where(r.to(F64) > x, torch.nextafter(r, torch.tensor(-math.inf)), r).to(F64)


def fp32_up(x: Tensor) -> Tensor:
    r = x.to(torch.float32)
    return torch.where(r.to(F64) < x, torch.nextafter(r, torch.tensor(math.inf)), r).to(F64)


def _exp32(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """Every fp32 value an exp within EXP_ULPS of the true exp can give for arguments in [lo, hi]."""
    elo, ehi = torch.exp(lo), torch.exp(hi)
    low = fp32_up(elo - EXP_ULPS * ulp_of(elo, torch.float32))
    high = fp32_down(ehi + EXP_ULPS * ulp_of(ehi, torch.float32))
    return torch.clamp(low, min=0.0), torch.where(torch.isinf(ehi), math.inf, high)


def score_bounds(lo: Tensor, hi: Tensor, score_func: str) -> tuple[Tensor, Tensor]:
    """fp32 scores from fp32 logits in [lo, hi], as the spec text writes them: sigmoid = 1/(1 + exp(-x));
    softmax = exp(x - max) / (sum in ascending expert id); each step one correctly rounded fp32 op."""
    if score_func == "sigmoid":
        elo, ehi = _exp32(-hi, -lo)
        return _rn(1.0 / _rn(1.0 + ehi)), _rn(1.0 / _rn(1.0 + elo))
    mlo, mhi = lo.amax(-1, keepdim=True), hi.amax(-1, keepdim=True)
    elo, ehi = _exp32(_rn(lo - mhi), _rn(hi - mlo))
    slo, shi = torch.zeros_like(elo[:, 0]), torch.zeros_like(ehi[:, 0])
    for j in range(lo.shape[1]):
        slo, shi = _rn(slo + elo[:, j]), _rn(shi + ehi[:, j])
    return _rn(elo / shi[:, None]), _rn(ehi / slo[:, None])


def _before(lo: Tensor, hi: Tensor, same: Tensor) -> Tensor:
    """[N, N]: i surely ranks before j: its lowest value beats j's highest, or the two values are equal
    (both exact and equal, or computed from the same inputs) and i has the lower id."""
    n = lo.shape[0]
    lower_id = torch.arange(n)[:, None] < torch.arange(n)[None, :]
    point = lo == hi
    equal = (point[:, None] & point[None, :] & (lo[:, None] == lo[None, :])) | same
    return (lo[:, None] > hi[None, :]) | (equal & lower_id)


def _ranked(lo: Tensor, hi: Tensor, same: Tensor, allowed: Tensor, n: int) -> Tensor | None:
    """The first n of the allowed candidates by descending value (ties: lower id), or None where fp32
    rounding could order them differently."""
    mid = torch.where(allowed, (lo + hi) / 2, -math.inf)
    order = sorted(range(lo.numel()), key=lambda i: (-float(mid[i]), i))
    order = [i for i in order if bool(allowed[i])]
    before = _before(lo, hi, same)
    idx = torch.tensor(order, dtype=torch.int64)
    for p in range(min(n, len(order))):
        if not bool(before[idx[p], idx[p + 1 :]].all()):
            return None
    return idx[:n]


def _top_groups(
    blo: Tensor, bhi: Tensor, same: Tensor, inputs: tuple[Tensor, Tensor], ng: int, tg: int
) -> Tensor | None:
    """The tg groups with the largest fp32(top1 + top2) of their biased scores (ties: lower group id);
    two groups whose decided top-2 come from the same (logit, bias) pairs score the same."""
    size = blo.numel() // ng
    top_lo = blo.view(ng, size).sort(-1, descending=True).values
    top_hi = bhi.view(ng, size).sort(-1, descending=True).values
    glo, ghi = _rn(top_lo[:, 0] + top_lo[:, 1]), _rn(top_hi[:, 0] + top_hi[:, 1])
    keys: list[tuple[tuple[float, float], ...] | None] = []
    for gi in range(ng):
        sl = slice(gi * size, (gi + 1) * size)
        top = _ranked(blo[sl], bhi[sl], same[sl, sl], torch.ones(size, dtype=torch.bool), 2)
        if top is None or not bool(same[sl, sl][top, top].all()):
            keys.append(None)
            continue
        keys.append(tuple(sorted((float(inputs[0][sl][j]), float(inputs[1][sl][j])) for j in top)))
    gsame = torch.tensor([[a is not None and a == bb for bb in keys] for a in keys])
    return _ranked(glo, ghi, gsame, torch.ones(ng, dtype=torch.bool), tg)


def route_ids(
    lo: Tensor, hi: Tensor, bias: Tensor, k: int, score_func: str, ng: int, tg: int
) -> Tensor | None:
    """ids [T, k] by the spec's rule (top-k of fp32 scores + bias, ties to the lower id, groups ranked by
    the sum of their top-2 biased scores), decided on fp32 bounds of every score; None if any token's
    choice depends on rounding the spec leaves open. Equal logits known exactly (lo == hi) score equally."""
    slo, shi = score_bounds(lo, hi, score_func)
    b = d(bias)
    blo, bhi = _rn(slo + b), _rn(shi + b)
    t, e = lo.shape
    rows = []
    for i in range(t):
        known = lo[i] == hi[i]
        same = (
            known[:, None] & known[None, :] & (lo[i][:, None] == lo[i][None, :]) & (b[:, None] == b[None, :])
        )
        allowed = torch.ones(e, dtype=torch.bool)
        if ng > 1:
            groups = _top_groups(blo[i], bhi[i], same, (lo[i], b), ng, tg)
            if groups is None:
                return None
            allowed = torch.zeros(ng, dtype=torch.bool).index_fill(0, groups, True).repeat_interleave(e // ng)
        ids = _ranked(blo[i], bhi[i], same, allowed, k)
        if ids is None:
            return None
        rows.append(ids)
    return torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.int64)


def router_topk(inp: Inputs, c: Contract) -> list[Expect | None]:
    """ids from route_ids on the exact fp32 logits; weights (fp32 roundings of a normalisation) are left to
    router_topk_invariants, which checks them against float64 scores."""
    logits, bias, k, score_func, ng, tg = inp.args
    lg = d(logits)
    ids = route_ids(lg, lg, bias, k, score_func, ng, tg)
    return [None, None if ids is None else Expect(ids, exact=True)]


ENTRIES: list[OpEntry] = [
    OpEntry(
        name="router_logits",
        module="router",
        fn="router_logits",
        space=space_router_logits,
        make=make_router_logits,
        contract=GEMM,
        oracle=router_logits,
        adversarial=("nan", "inf", "zero", "max", "single_token", "k1"),
        dtypes=("bf16", "fp32"),
        ref64=True,
    ),
    OpEntry(
        name="router_topk",
        module="router",
        fn="router_topk",
        space=space_router_topk,
        make=make_router_topk,
        contract=BITWISE,
        oracle=router_topk,
        output_names=("weights", "ids"),
        invariants=(router_topk_invariants,),
        adversarial=("ties", "inf", "max", "zipf", "single_token", "k1"),
        dtypes=("fp32",),
        note="ids: an oracle deciding on fp32 bounds of every score; weights: invariants (normalised "
        "float64 scores); NaN logits trap the kernel (a dead CUDA context): that case is a subprocess "
        "test in tests/test_fast_router.py",
    ),
    OpEntry(
        name="bias_update",
        module="router",
        fn="bias_update",
        space=space_bias_update,
        make=make_bias_update,
        contract=BITWISE,
        oracle=bias_update,
        adversarial=("ties", "zero", "max", "zipf"),
        dtypes=("fp32",),
    ),
]
