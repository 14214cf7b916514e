"""Chunked cross-entropy forward and backward."""

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
    OpEntry,
)
from parity.inputs import (
    I,
    Inputs,
    Params,
    S,
    dt,
    randint,
    randn,
    space,
    uniform,
    with_adv,
)
from parity.oracles import (
    F64,
    Expect,
    d,
)

CE = bound_contract(1, 2, note="fp32 GEMM (u = 2^-24, K = D) through logsumexp; see cross_entropy")
CE_BWD = bound_contract(
    1,
    2,
    note="fp32 dlogits rounded once to bf16 (the fast path feeds them to bf16 GEMMs: 2^-8 relative, "
    "2^16 u), then fp32 GEMMs over V (dh) and T (dw); see cross_entropy_bwd",
)
BF16_IN_U = 2.0**16  # bf16 unit roundoff 2^-8 (8 significant bits) in units of u = 2^-24
TINY_U = 2.0**-102  # a value below fp32's least normal 2^-126 flushed to zero (FTZ exp, MMA), in units of u
BF16_SUB_U = 2.0**-110  # half of bf16's subnormal spacing 2^-133: a dlogit's absolute rounding there
F32_SUB_U = 2.0**-126  # half of fp32's subnormal spacing 2^-149


def space_ce(big: bool) -> st.SearchStrategy[dict[str, Any]]:
    if big:
        return space(
            T=S([256, 1024]),
            D=S([512, 1024]),
            V=S([8192, 32768]),
            chunk=S([256, 4096]),
            ignore=S([0.0, 0.2]),
            scale=S([1.0, 4.0]),
            dloss=S([1.0, 0.5]),
        )
    return space(
        T=I(1, 16),
        D=S([8, 32]),
        V=S([5, 64, 300]),
        chunk=S([1, 3, 4096]),
        ignore=S([0.0, 0.3]),
        scale=S([1.0, 4.0]),
        dloss=S([1.0, 0.5]),
    )


def _ce_inputs(
    p: Params, g: torch.Generator, adv: str | None
) -> tuple[Tensor, Tensor, Tensor, dict[str, int]]:
    q = with_adv(p, adv, **({"T": 1} if adv == "single_token" else {}))
    dtype, t, dd, v = dt(q["dtype"]), q["T"], q["D"], q["V"]
    h = randn([t, dd], dtype, g, float(q["scale"]) * (40.0 if adv == "max" else 1.0))
    if adv == "zero":
        h = torch.zeros_like(h)
    w = randn([v, dd], dtype, g, 1.0 / math.sqrt(dd))
    targets = randint(0, v, [t], g)
    drop = uniform([t], g) < float(q["ignore"])
    if adv == "all_ignored":
        drop = torch.ones(t, dtype=torch.bool)
    targets = torch.where(drop, -100, targets)
    return h, w, targets, {"T": t, "D": dd, "V": v, "chunk": int(q["chunk"])}


def make_cross_entropy(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    h, w, targets, shape = _ce_inputs(p, g, adv)
    return Inputs((h, w, targets, -100, shape["chunk"]), shape=shape, dtype=p["dtype"])


def make_cross_entropy_bwd(p: Params, g: torch.Generator, adv: str | None) -> Inputs:
    h, w, targets, shape = _ce_inputs(p, g, adv)
    return Inputs((float(p["dloss"]), h, w, targets, -100, shape["chunk"]), shape=shape, dtype=p["dtype"])


def _d(x: Tensor) -> Tensor:
    """float64 on the GPU when the run has one: the oracles' [T, V] float64 GEMMs take seconds per case on a
    CPU; results come back to the CPU."""
    return d(x).to("cuda" if torch.cuda.is_available() else "cpu")


def _ce_parts(h: Tensor, w: Tensor, targets: Tensor,
              ignore: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """(logits, probs, onehot, kept mask, per-token logit error bound in units of u, n_kept) of float64 h,
    w."""
    targets = targets.to(h.device)
    logits = h @ w.T
    kept = targets != ignore
    tgt = torch.where(kept, targets, 0).to(torch.int64)
    onehot = torch.zeros_like(logits)
    onehot[torch.arange(logits.shape[0], device=h.device), tgt] = 1.0
    probs = torch.softmax(logits, dim=-1)
    lerr = (h.shape[1] * (h.abs() @ w.abs().T).amax(dim=-1) if logits.numel()
            else torch.zeros(0, dtype=F64, device=h.device))
    return logits, probs, onehot, kept, lerr, int(kept.sum())


def cross_entropy(inp: Inputs, c: Contract) -> list[Expect | None]:
    """Per kept token: |dl| <= D*u*max_j sum|h||w|, lse adds V+8 (sum of V exps, exp, log) and the
    subtractions their own rounding; the chunked mean adds (N+2)*|loss|. All in units of u (k=1)."""
    h, w, targets, ignore = _d(inp.args[0]), _d(inp.args[1]), inp.args[2], int(inp.args[3])
    logits, _, onehot, kept, lerr, n = _ce_parts(h, w, targets, ignore)
    if n == 0:
        z = torch.zeros((), dtype=F64)
        return [Expect(z, mag=z, k=1.0)]
    lse = torch.logsumexp(logits, dim=-1)
    per = lse - (logits * onehot).sum(-1)
    loss = per[kept].sum() / n
    v = logits.shape[1]
    err = (2 * lerr + v + 8 + lse.abs() + per.abs())[kept].sum() / n + (n + 2) * loss.abs()
    return [Expect(loss.cpu(), mag=err.cpu(), k=1.0)]


def cross_entropy_bwd(inp: Inputs, c: Contract) -> list[Expect | None]:
    """dlogits = dloss*(p - onehot)/N, error (units of u) coef*p*(2*lerr + V + 8) + 2|dlogits|, 2^16|dlogits|
    for its bf16 rounding, and underflow's absolute errors (p flushed below 2^-126, subnormals); the two GEMMs
    add V (dh) and T (dw), each product flushable."""
    dloss = float(inp.args[0])
    h, w = _d(inp.args[1]), _d(inp.args[2])
    _, probs, onehot, kept, lerr, n = _ce_parts(h, w, inp.args[3], int(inp.args[4]))
    if n == 0:
        return [
            Expect(torch.zeros(h.shape, dtype=F64), mag=torch.zeros(h.shape, dtype=F64), k=1.0),
            Expect(torch.zeros(w.shape, dtype=F64), mag=torch.zeros(w.shape, dtype=F64), k=1.0),
        ]
    coef = dloss / n
    g = torch.where(kept[:, None], (probs - onehot) * coef, 0.0)
    delta = torch.where(kept[:, None], abs(coef) * probs * (2 * lerr[:, None] + probs.shape[1] + 8), 0.0)
    delta = delta + (2 + BF16_IN_U) * g.abs()
    delta = delta + torch.where(kept[:, None], abs(coef) * TINY_U + BF16_SUB_U + 2 * F32_SUB_U, 0.0)
    v, t = probs.shape[1], h.shape[0]
    mag_dh = delta @ w.abs() + v * (g.abs() @ w.abs()) + v * TINY_U
    mag_dw = delta.T @ h.abs() + t * (g.abs().T @ h.abs()) + t * TINY_U
    return [Expect((g @ w).cpu(), mag=mag_dh.cpu(), k=1.0), Expect((g.T @ h).cpu(), mag=mag_dw.cpu(), k=1.0)]


ENTRIES: list[OpEntry] = [
    OpEntry(
        name="cross_entropy",
        module="loss",
        fn="cross_entropy",
        space=space_ce,
        make=make_cross_entropy,
        contract=CE,
        oracle=cross_entropy,
        adversarial=("zero", "single_token", "max", "all_ignored"),
        ref64=True,
    ),
    OpEntry(
        name="cross_entropy_bwd",
        module="loss",
        fn="cross_entropy_bwd",
        space=space_ce,
        make=make_cross_entropy_bwd,
        contract=CE_BWD,
        oracle=cross_entropy_bwd,
        output_names=("dh", "dw"),
        adversarial=("zero", "single_token", "max", "all_ignored"),
        ref64=True,
    ),
]
