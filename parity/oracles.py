"""Float64 oracles written independently of nmoe.reference (float64 math, explicit fp32 roundings where
the spec pins them, torch's float8 type for e4m3) plus invariants for ops with no closed form. An oracle
returns one Expect per flattened output (None: checked by determinism only)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from parity.compare import Contract, Verdict, conservation, gemm_radius, ulp_of
from parity.inputs import Inputs, e4m3_values

F64 = torch.float64


@dataclass(frozen=True)
class Expect:
    """Expected value of one output: float64 `value` (or exact bits when exact=True), plus what the
    contract needs: mag/k for bound radii, lo/hi for bounds propagated through an epilogue, lowprec for
    ratio contracts."""

    value: Tensor
    exact: bool = False
    mag: Tensor | None = None
    k: float | Tensor = 0.0
    lo: Tensor | None = None
    hi: Tensor | None = None
    lowprec: Tensor | None = None


Oracle = Callable[[Inputs, Contract], Sequence["Expect | None"]]
Invariant = Callable[[Inputs, Any], Verdict]


def f32(x: Tensor) -> Tensor:
    """Round float64 to fp32 once (IEEE cast) and widen back: models one pinned fp32 operation."""
    return x.to(torch.float32).to(F64)


def d(x: Tensor) -> Tensor:
    return x.to(F64)


def _relu(x: Tensor) -> Tensor:
    return torch.where(x <= 0, torch.zeros_like(x), x)


# ----------------------------------------------------------------------------------------------------------
# activations


def relu2(inp: Inputs, c: Contract) -> list[Expect | None]:
    r = _relu(d(inp.args[0]))
    return [Expect(f32(r * r))]


def relu2_bwd(inp: Inputs, c: Contract) -> list[Expect | None]:
    dy, x = d(inp.args[0]), d(inp.args[1])
    return [Expect(f32(dy * f32(2 * _relu(x))))]


def _sigmoid(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def swiglu(inp: Inputs, c: Contract) -> list[Expect | None]:
    h = d(inp.args[0])
    g, u = h[..., 0::2], h[..., 1::2]
    return [Expect(g * _sigmoid(g) * u)]


def swiglu_bwd(inp: Inputs, c: Contract) -> list[Expect | None]:
    """The spec pins dg = (d*u)*ds with d*u rounded to fp32 first; modelling that rounding makes its overflow
    at ±bf16 max (inf, and inf*0 = NaN where the sigmoid underflows) part of the contract."""
    dy, h = d(inp.args[0]), d(inp.args[1])
    g, u = h[..., 0::2], h[..., 1::2]
    s = _sigmoid(g)
    dg = f32(dy * u) * (s * (1 + g * (1 - s)))
    du = dy * g * s
    return [Expect(torch.stack((dg, du), dim=-1).flatten(-2))]


# ----------------------------------------------------------------------------------------------------------
# combine


def combine(inp: Inputs, c: Contract) -> list[Expect | None]:
    y, w, scale, shared = inp.args
    yd, wd = d(y), d(w)
    acc = f32(wd[:, 0, None] * yd[:, 0])
    for k in range(1, y.shape[1]):
        acc = f32(acc + f32(wd[:, k, None] * yd[:, k]))
    acc = f32(acc * f32(torch.tensor(float(scale), dtype=F64)))
    if shared is not None:
        acc = f32(acc + d(shared))
    return [Expect(acc)]


def combine_bwd(inp: Inputs, c: Contract) -> list[Expect | None]:
    dout, y, w, scale = inp.args
    g = f32(d(dout) * f32(torch.tensor(float(scale), dtype=F64)))
    dy = f32(g[:, None, :] * d(w)[:, :, None])
    dw = (g[:, None, :] * d(y)).sum(-1)
    mag = (g[:, None, :].abs() * d(y).abs()).sum(-1)
    return [Expect(dy), Expect(dw, mag=mag, k=float(y.shape[2])), Expect(dout.clone(), exact=True)]


# ----------------------------------------------------------------------------------------------------------
# router


def router_logits(inp: Inputs, c: Contract) -> list[Expect | None]:
    x, wr = d(inp.args[0]), d(inp.args[1])
    return [Expect(x @ wr.T, mag=x.abs() @ wr.abs().T, k=float(x.shape[1]))]


def bias_update(inp: Inputs, c: Contract) -> list[Expect | None]:
    bias, counts, rate, clamp = inp.args
    cnt = counts.to(torch.int64)
    direction = torch.sign(cnt.sum() - bias.numel() * cnt).to(F64)
    new = f32(d(bias) + f32(torch.tensor(float(rate), dtype=F64)) * direction)
    lim = float(f32(torch.tensor(float(clamp), dtype=F64)))
    return [Expect(torch.clamp(new, -lim, lim))]


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
    score = _sigmoid(lg) if score_func == "sigmoid" else torch.softmax(lg, dim=-1)
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


# ----------------------------------------------------------------------------------------------------------
# permute / unpermute / rdep


def permute_layout(ids: Tensor, n_experts: int, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """(slot [R], counts int32 [E], offs int32 [E]) by plain loops: rows sorted by (expert, t, k)."""
    flat = ids.reshape(-1).tolist()
    n = len(flat)
    rows = -(-(n + n_experts * (align - 1)) // align) * align
    by_e: list[list[int]] = [[] for _ in range(n_experts)]
    for s, e in enumerate(flat):
        by_e[e].append(s)
    slot = [-1] * rows
    counts, offs, pos = [], [], 0
    for e in range(n_experts):
        for j, s in enumerate(by_e[e]):
            slot[pos + j] = s
        counts.append(len(by_e[e]))
        pos += -(-len(by_e[e]) // align) * align
        offs.append(pos)
    return (
        torch.tensor(slot, dtype=torch.int64),
        torch.tensor(counts, dtype=torch.int32),
        torch.tensor(offs, dtype=torch.int32),
    )


def permute(inp: Inputs, c: Contract) -> list[Expect | None]:
    x, ids, e, align = inp.args
    slot, counts, offs = permute_layout(ids, e, align)
    k = ids.shape[1]
    xp = torch.zeros(slot.numel(), x.shape[1], dtype=x.dtype)
    real = slot >= 0
    xp[real] = x[slot[real] // k]
    return [
        Expect(xp, exact=True),
        Expect(counts, exact=True),
        Expect(offs, exact=True),
        Expect(slot, exact=True),
    ]


def permute_invariants(inp: Inputs, out: Any) -> Verdict:
    ids = inp.args[1]
    slot = out.slot
    return conservation(slot[slot >= 0], ids.numel(), "slot")


def unpermute(inp: Inputs, c: Contract) -> list[Expect | None]:
    yp, slot, t, k = inp.args
    y = torch.zeros(t * k, yp.shape[1], dtype=yp.dtype)
    for r, s in enumerate(slot.tolist()):
        if s >= 0:
            y[s] = yp[r]
    return [Expect(y.reshape(t, k, yp.shape[1]), exact=True)]


@dataclass(frozen=True)
class Recv:
    """Field-for-field twin of the reference RdepRecv, used only if the reference is absent."""

    x: Tensor
    row_id: Tensor
    local_eid: Tensor
    counts: Tensor


def _rdep_rows(ids: Sequence[Tensor], n_experts: int) -> list[list[tuple[int, int, int]]]:
    """Per destination rank: (local expert, row_id, src) sorted by (local expert, src, t, k)."""
    w = len(ids)
    n_local = n_experts // w
    t, k = ids[0].shape
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(w)]
    for src in range(w):
        for ti in range(t):
            for ki in range(k):
                eid = int(ids[src][ti, ki])
                out[eid // n_local].append((eid % n_local, (src * t + ti) * k + ki, src))
    return [sorted(rows) for rows in out]


def rdep_recvs(xs: Sequence[Tensor], ids: Sequence[Tensor], n_experts: int) -> list[Any]:
    """Oracle receive batches, typed as the reference's RdepRecv when that module is present."""
    try:
        from nmoe.reference.rdep import RdepRecv

        cls: Any = RdepRecv
    except ImportError:
        cls = Recv
    w = len(xs)
    n_local = n_experts // w
    t, k = ids[0].shape
    h = xs[0].shape[1]
    recvs = []
    for rows in _rdep_rows(ids, n_experts):
        x = (
            torch.stack([xs[rid // (t * k)][(rid // k) % t] for _, rid, _ in rows])
            if rows
            else torch.zeros(0, h, dtype=xs[0].dtype)
        )
        row_id = torch.tensor([rid for _, rid, _ in rows], dtype=torch.int64)
        local = torch.tensor([le for le, _, _ in rows], dtype=torch.int64)
        counts = torch.bincount(local, minlength=n_local)
        recvs.append(cls(x=x, row_id=row_id, local_eid=local, counts=counts))
    return recvs


def rdep_dispatch(inp: Inputs, c: Contract) -> list[Expect | None]:
    xs, ids, e, _ = inp.args
    out: list[Expect | None] = []
    for r in rdep_recvs(xs, ids, e):
        out += [
            Expect(r.x, exact=True),
            Expect(r.row_id, exact=True),
            Expect(r.local_eid, exact=True),
            Expect(r.counts, exact=True),
        ]
    return out


def rdep_dispatch_invariants(inp: Inputs, out: Any) -> Verdict:
    xs, ids, _, _ = inp.args
    rows = torch.cat([r.row_id for r in out]) if out else torch.zeros(0, dtype=torch.int64)
    return conservation(rows, len(xs) * ids[0].numel(), "rdep row_id")


def rdep_return(inp: Inputs, c: Contract) -> list[Expect | None]:
    ys, recvs, t, k = inp.args
    w = len(recvs)
    h = ys[0].shape[1]
    out = torch.zeros(w * t * k, h, dtype=ys[0].dtype)
    for y, r in zip(ys, recvs, strict=True):
        for i, rid in enumerate(r.row_id.tolist()):
            out[rid] = y[i]
    return [Expect(o, exact=True) for o in out.reshape(w, t, k, h).unbind(0)]


def rdep_return_invariants(inp: Inputs, out: Any) -> Verdict:
    _, recvs, t, k = inp.args
    rows = torch.cat([r.row_id for r in recvs])
    return conservation(rows, len(recvs) * t * k, "rdep returned row_id")


# ----------------------------------------------------------------------------------------------------------
# grouped GEMMs


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


def dequant_mx(codes: Tensor, scales: Tensor, rows: int, cols: int) -> Tensor:
    """float64 e4m3 values times 2^(byte-127), each scale covering a rows x cols block of the last 2 dims."""
    s = torch.where(scales == 255, math.nan, torch.pow(2.0, scales.to(F64) - 127))
    s = s.repeat_interleave(cols, dim=-1)
    if rows > 1:
        s = s.repeat_interleave(rows, dim=-2)
    return e4m3_values(codes) * s


def grouped_gemm_fp8(inp: Inputs, c: Contract) -> list[Expect | None]:
    xq, xs, wq, ws, offs = inp.args
    x = dequant_mx(xq, xs, 1, 128)
    w = dequant_mx(wq, ws, 128, 128)
    v, mag = _gemm64(x, w, offs)
    return [Expect(v, mag=mag, k=float(xq.shape[1]))]


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F64)


def e2m1_values(packed: Tensor) -> Tensor:
    """float64 e2m1 values of a packed byte tensor (element 2i in the low nibble)."""
    p = packed.to(torch.int64)
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)
    mag = E2M1[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


def dequant_nvfp4(packed: Tensor, bs: Tensor, ts: Tensor) -> Tensor:
    """(code * s_b) * g with the spec's single fp32 rounding on the tensor-scale multiply."""
    v = e2m1_values(packed) * e4m3_values(bs).repeat_interleave(16, dim=-1)
    return f32(v * d(ts))


def grouped_gemm_nvfp4(inp: Inputs, c: Contract) -> list[Expect | None]:
    xp, xbs, xts, wp, wbs, wts, offs = inp.args
    v, mag = _gemm64(dequant_nvfp4(xp, xbs, xts), dequant_nvfp4(wp, wbs, wts), offs)
    return [Expect(v, mag=mag, k=float(xp.shape[1] * 2))]


SILU_ARGMIN = -1.2784645427610738
"""Root of 1 + g*(1 - sigmoid(g)) = 0: silu decreases left of it and increases right of it."""


def _silu(g: Tensor) -> Tensor:
    return g * _sigmoid(g)


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
        rl, rh = _relu(lo), _relu(hi)
        vlo, vhi, val = rl * rl, rh * rh, _relu(h) ** 2
    else:
        slo, shi = _silu_range(lo[:, 0::2], hi[:, 0::2])
        vlo, vhi = _mul_range(slo, shi, lo[:, 1::2], hi[:, 1::2])
        val = _silu(h[:, 0::2]) * h[:, 1::2]
    return [Expect(val, lo=vlo, hi=vhi)]


# ----------------------------------------------------------------------------------------------------------
# norm, rope


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


def rope(inp: Inputs, c: Contract) -> list[Expect | None]:
    """y0 = x0*c - x1*s cancels; two fp32 products and one add give |err| <= 2u(|x0 c| + |x1 s|)."""
    x, cos, sin = d(inp.args[0]), d(inp.args[1]), d(inp.args[2])
    x0, x1 = x[..., 0::2], x[..., 1::2]
    val = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    mag = torch.stack(((x0 * cos).abs() + (x1 * sin).abs(), (x0 * sin).abs() + (x1 * cos).abs()), -1).flatten(
        -2
    )
    return [Expect(val, mag=mag, k=2.0)]


# ----------------------------------------------------------------------------------------------------------
# loss


def _ce_parts(inp: Inputs) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """(logits, probs, onehot, kept mask, per-token logit error bound in units of u, n_kept)."""
    h, w, targets, ignore = d(inp.args[0]), d(inp.args[1]), inp.args[2], int(inp.args[3])
    logits = h @ w.T
    kept = targets != ignore
    tgt = torch.where(kept, targets, 0).to(torch.int64)
    onehot = torch.zeros_like(logits)
    onehot[torch.arange(logits.shape[0]), tgt] = 1.0
    probs = torch.softmax(logits, dim=-1)
    lerr = h.shape[1] * (h.abs() @ w.abs().T).amax(dim=-1) if logits.numel() else torch.zeros(0, dtype=F64)
    return logits, probs, onehot, kept, lerr, int(kept.sum())


def cross_entropy(inp: Inputs, c: Contract) -> list[Expect | None]:
    """Per kept token: |dl| <= D*u*max_j sum|h||w|, lse adds V+8 (sum of V exps, exp, log) and the
    subtractions their own rounding; the chunked mean adds (N+2)*|loss|. All in units of u (k=1)."""
    logits, _, onehot, kept, lerr, n = _ce_parts(inp)
    if n == 0:
        z = torch.zeros((), dtype=F64)
        return [Expect(z, mag=z, k=1.0)]
    lse = torch.logsumexp(logits, dim=-1)
    per = lse - (logits * onehot).sum(-1)
    loss = per[kept].sum() / n
    v = logits.shape[1]
    err = (2 * lerr + v + 8 + lse.abs() + per.abs())[kept].sum() / n + (n + 2) * loss.abs()
    return [Expect(loss, mag=err, k=1.0)]


def cross_entropy_bwd(inp: Inputs, c: Contract) -> list[Expect | None]:
    """dlogits = dloss*(p - onehot)/N; its error (units of u) is coef*p*(2*lerr + V + 8) + 2|dlogits|, then
    the two GEMMs add V (dh) and T (dw) times the |.| products."""
    dloss = float(inp.args[0])
    shifted = Inputs(inp.args[1:], inp.kwargs, inp.shape, inp.dtype)
    h, w = d(inp.args[1]), d(inp.args[2])
    _, probs, onehot, kept, lerr, n = _ce_parts(shifted)
    if n == 0:
        return [
            Expect(torch.zeros_like(h), mag=torch.zeros_like(h), k=1.0),
            Expect(torch.zeros_like(w), mag=torch.zeros_like(w), k=1.0),
        ]
    coef = dloss / n
    g = torch.where(kept[:, None], (probs - onehot) * coef, 0.0)
    delta = torch.where(kept[:, None], abs(coef) * probs * (2 * lerr[:, None] + probs.shape[1] + 8), 0.0)
    delta = delta + 2 * g.abs()
    mag_dh = delta @ w.abs() + probs.shape[1] * (g.abs() @ w.abs())
    mag_dw = delta.T @ h.abs() + h.shape[0] * (g.abs().T @ h.abs())
    return [Expect(g @ w, mag=mag_dh, k=1.0), Expect(g.T @ h, mag=mag_dw, k=1.0)]


# ----------------------------------------------------------------------------------------------------------
# formats


def _e4m3_codes(x32: Tensor) -> Tensor:
    """float8_e4m3fn codes of fp32 values already clamped to ±448 (torch's RNE cast; NaN -> 0x7F/0xFF)."""
    return x32.to(torch.float8_e4m3fn).view(torch.uint8)


def _mx_byte(amax: Tensor) -> Tensor:
    """127 + ceil(log2(fp32(amax/448))) by frexp on float64, clamped to [1, 254]."""
    s = f32(amax / 448.0)
    m, e = torch.frexp(torch.where(s > 0, s, torch.ones_like(s)))
    ceil_log2 = torch.where(m == 0.5, e - 1, e).to(torch.int64)
    return torch.where(s > 0, torch.clamp(127 + ceil_log2, 1, 254), torch.ones_like(ceil_log2))


def _mx_quantize(xb: Tensor, dims: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    x = d(xb)
    finite = torch.isfinite(x).all(dim=dims[0], keepdim=True)
    for dd in dims[1:]:
        finite = finite.all(dim=dd, keepdim=True)
    amax = torch.where(torch.isfinite(x), x.abs(), 0.0)
    for dd in dims:
        amax = amax.amax(dim=dd, keepdim=True)
    byte = torch.where(finite, _mx_byte(amax), 255)
    scaled = (x * torch.pow(2.0, (127 - byte).to(F64))).to(torch.float32)
    codes = _e4m3_codes(torch.clamp(scaled, -448.0, 448.0))
    codes = torch.where(finite & (amax == 0), torch.zeros_like(codes), codes)
    return codes, byte.to(torch.uint8)


def quantize_mxfp8(inp: Inputs, c: Contract) -> list[Expect | None]:
    x, block = inp.args
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    codes, byte = _mx_quantize(xb, (-1,))
    return [Expect(codes.reshape(x.shape), exact=True), Expect(byte.squeeze(-1), exact=True)]


def quantize_mxfp8_weight(inp: Inputs, c: Contract) -> list[Expect | None]:
    (w,) = inp.args
    *lead, n, k = w.shape
    wb = w.reshape(*lead, n // 128, 128, k // 128, 128)
    codes, byte = _mx_quantize(wb, (-3, -1))
    return [Expect(codes.reshape(w.shape), exact=True), Expect(byte.squeeze(-1).squeeze(-2), exact=True)]


def dequantize_mxfp8(inp: Inputs, c: Contract) -> list[Expect | None]:
    codes, scales, block = inp.args
    return [Expect(f32(dequant_mx(codes, scales, 1, block)))]


def dequantize_mxfp8_weight(inp: Inputs, c: Contract) -> list[Expect | None]:
    codes, scales = inp.args
    return [Expect(f32(dequant_mx(codes, scales, 128, 128)))]


def _e2m1_codes(q: Tensor) -> Tensor:
    """RNE e2m1 code (bit 3 = sign) of float64 values already clamped to ±6, by nearest-grid search."""
    a = q.abs().unsqueeze(-1)
    dist = (a - E2M1).abs()
    best = dist.min(-1, keepdim=True).values
    tied = dist == best
    even = tied & (torch.arange(8) % 2 == 0)
    idx = torch.where(tied.sum(-1) > 1, even.to(torch.int64).argmax(-1), dist.argmin(-1))
    return (idx | (torch.signbit(q).to(torch.int64) << 3)).to(torch.uint8)


def quantize_nvfp4(inp: Inputs, c: Contract) -> list[Expect | None]:
    """g = amax/2688; s_b = e4m3((amax_b/6)/g); codes = e2m1(clamp(x/(s_b*g))), each op one fp32 rounding."""
    (x,) = inp.args
    xd = d(x)
    fin = torch.isfinite(xd)
    g = f32(torch.where(fin, xd.abs(), 0.0).amax() / 2688.0) if xd.numel() else torch.zeros((), dtype=F64)
    xb = xd.reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    finite = torch.isfinite(xb).all(-1, keepdim=True)
    xb = torch.where(finite, xb, 0.0)
    amax_b = xb.abs().amax(-1, keepdim=True)
    s_real = f32(f32(amax_b / 6.0) / g) if float(g) > 0 else torch.zeros_like(amax_b)
    s_code = _e4m3_codes(torch.clamp(s_real, 0.0, 448.0).to(torch.float32))
    denom = f32(e4m3_values(s_code) * g)
    ok = finite & (denom > 0)
    q = torch.clamp(f32(xb / torch.where(ok, denom, 1.0)), -6.0, 6.0)
    codes = torch.where(ok, _e2m1_codes(q), torch.zeros_like(q, dtype=torch.uint8)).reshape(x.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    s_code = torch.where(finite, s_code, torch.full_like(s_code, 0x7F)).squeeze(-1)
    return [Expect(packed, exact=True), Expect(s_code, exact=True), Expect(g.to(torch.float32), exact=True)]


def dequantize_nvfp4(inp: Inputs, c: Contract) -> list[Expect | None]:
    packed, bs, ts = inp.args
    return [Expect(dequant_nvfp4(packed, bs, ts))]


# ----------------------------------------------------------------------------------------------------------
# attention (low-precision baseline; ref64 is the spec evaluated on fp64 inputs)


def mla_lowprec(inp: Inputs) -> Tensor:
    """The FlashAttention-style baseline: the same MLA math with every torch op in x.dtype (bf16)."""
    x, p, cos, sin, nh, dn, dr, dv, scale, eps = inp.args
    lp = x.dtype
    b, s, _ = x.shape

    def lin(t: Tensor, w: Tensor) -> Tensor:
        return t @ w.to(lp).T

    def rms(t: Tensor, w: Tensor) -> Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.to(lp)

    def rot(t: Tensor) -> Tensor:
        c_, s_ = cos[:s].to(lp), sin[:s].to(lp)
        t0, t1 = t[..., 0::2], t[..., 1::2]
        return torch.stack((t0 * c_ - t1 * s_, t0 * s_ + t1 * c_), dim=-1).flatten(-2)

    q = lin(x, p.wq) if p.wq is not None else lin(rms(lin(x, p.wq_a), p.q_norm), p.wq_b)
    q = q.view(b, s, nh, dn + dr).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [dn, dr], dim=-1)
    c_kv, k_pe = torch.split(lin(x, p.wkv_a), [p.kv_norm.shape[0], dr], dim=-1)
    kv = lin(rms(c_kv, p.kv_norm), p.wkv_b).view(b, s, nh, dn + dv).transpose(1, 2)
    k_nope, v = torch.split(kv, [dn, dv], dim=-1)
    scores = (q_nope @ k_nope.mT + rot(q_pe) @ rot(k_pe.unsqueeze(1)).mT) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    o = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, nh * dv)
    return lin(o, p.wo)


# ----------------------------------------------------------------------------------------------------------
# optimizers (in-place ops: the outputs are the mutated p, m, v / p, buf)


def adamw(inp: Inputs, c: Contract) -> list[Expect | None]:
    """Per output a forward-error budget in units of u (coefficient roundings included): m, v are
    length-2 sums; p adds the decay rounding, the update's error (driven by m's) and the subtraction."""
    p, g, m, v, step, lr, b1, b2, eps, wd = inp.args
    p, g, m, v = d(p), d(g), d(m), d(v)
    p1 = p * (1 - lr * wd)
    m1 = b1 * m + (1 - b1) * g
    v1 = b2 * v + (1 - b2) * g * g
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    denom = torch.sqrt(v1 / bc2) + eps
    upd = lr * (m1 / bc1) / denom
    pn = p1 - upd
    mag_m = (b1 * m).abs() + ((1 - b1) * g).abs()
    mag_v = (b2 * v).abs() + ((1 - b2) * g * g).abs()
    mag_p = 2 * p1.abs() + pn.abs() + lr / bc1 * 3 * mag_m / denom + 12 * upd.abs()
    return [Expect(pn, mag=mag_p, k=1.0), Expect(m1, mag=mag_m, k=3.0), Expect(v1, mag=mag_v, k=4.0)]


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


# ----------------------------------------------------------------------------------------------------------
# MoE layer


def _act(h: Tensor, activation: str) -> Tensor:
    if activation == "swiglu":
        g, u = h[..., 0::2], h[..., 1::2]
        return g * torch.sigmoid(g) * u
    r = torch.where(h <= 0, torch.zeros_like(h), h)
    return r * r


def _moe_in(x: Tensor, p: Any, cfg: Any, weights: Tensor, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Routed experts, combine and shared experts with every op in `dtype`."""
    up = p.w13 if cfg.activation == "swiglu" else p.w1
    xd = x.to(dtype)
    t, k = ids.shape
    y = torch.zeros(t, k, x.shape[1], dtype=dtype)
    for e in range(cfg.n_routed_experts):
        ti, ki = torch.nonzero(ids == e, as_tuple=True)
        if ti.numel():
            a = _act(xd[ti] @ up[e].to(dtype).T, cfg.activation)
            y[ti, ki] = a @ p.w2[e].to(dtype).T
    out: Tensor = (weights.to(dtype)[:, :, None] * y).sum(1) * cfg.route_scale
    sh_up = p.shared_w13 if cfg.activation == "swiglu" else p.shared_w1
    if sh_up is not None:
        out = out + _act(xd @ sh_up.to(dtype).T, cfg.activation) @ p.shared_w2.to(dtype).T
    return out


def moe_layer(inp: Inputs, c: Contract) -> list[Expect | None]:
    """Routing is the spec's own (its discrete choice is contracted bitwise by router_topk); given it, the
    output is checked against float64 math with a bf16 torch composition as the ratio baseline."""
    from nmoe.reference.router import expert_counts, router_logits, router_topk

    x, p, cfg = inp.args
    logits = router_logits(x, p.router_w)
    weights, ids = router_topk(
        logits,
        p.router_bias,
        cfg.n_activated_experts,
        cfg.score_func,
        cfg.n_expert_groups,
        cfg.n_limited_groups,
    )
    out64 = _moe_in(x, p, cfg, weights, ids, F64)
    low = _moe_in(x, p, cfg, weights, ids, torch.bfloat16)
    counts = expert_counts(ids, cfg.n_routed_experts)
    return [
        Expect(out64, lowprec=low),
        Expect(weights, exact=True),
        Expect(ids, exact=True),
        Expect(counts, exact=True),
    ]
