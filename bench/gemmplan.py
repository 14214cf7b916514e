"""Shapes, routed group sizes, FLOP/byte counts, rep budgets and the baselines' call shapes of the grouped
GEMM bench, kept apart from the timing code so CPU tests can pin them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

Config = tuple[int, int, int, int, int]

CONFIGS: tuple[Config, ...] = ((32768, 4096, 1024, 128, 8), (24576, 1536, 256, 128, 8),
                               (32768, 4096, 512, 256, 8))
PROJS = ("up", "down")
ROUTINGS = ("uniform", "zipf1.2")
PASSES = ("fwd", "dgrad", "wgrad")
ACTS = ("swiglu", "relu2")
BF16_BYTES = 2
FP8_ACT_BLOCK = 128
FP8_WEIGHT_BLOCK = 128


def config_id(cfg: Config) -> str:
    return "T{}_H{}_I{}_E{}_K{}".format(*cfg)


def routed_counts(m: int, e: int, routing: str) -> list[int]:
    """Rows per expert: "uniform", or "zipfS" with expert i getting m * (i+1)^-S / sum (remainder to expert
    0); the Zipf counts are over slots and not capped at T, a skew stress rather than a top-k routing."""
    if routing == "uniform":
        return [m // e + (1 if i < m % e else 0) for i in range(e)]
    if not routing.startswith("zipf"):
        raise ValueError(f"routing {routing!r} unknown; use 'uniform' or 'zipf<exponent>'")
    s = float(routing.removeprefix("zipf"))
    p = [1.0 / (i + 1) ** s for i in range(e)]
    total = sum(p)
    c = [int(m * q / total) for q in p]
    c[0] += m - sum(c)
    return c


def proj_dims(cfg: Config, proj: str) -> tuple[int, int, int]:
    """(M, N, K) of the expert projection: up N = 2I, K = H; down N = H, K = I; M = T * topk."""
    t, h, i, _, k = cfg
    if proj == "up":
        return t * k, 2 * i, h
    if proj == "down":
        return t * k, h, i
    raise ValueError(f"projection {proj!r} unknown; use 'up' or 'down'")


def gemm_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def pass_bytes(m: int, n: int, k: int, e: int) -> float:
    """bf16 bytes each pass moves once: fwd x,w -> y; dgrad dy,w -> dx; wgrad dy,x -> dw (same sizes)."""
    return float(BF16_BYTES * (m * k + e * n * k + m * n))


def fp8_bytes(m: int, n: int, k: int, e: int) -> float:
    """e4m3 x and w, their E8M0 scale bytes (1x128 and 128x128 blocks), bf16 y."""
    scales = m * (k // FP8_ACT_BLOCK) + e * (n // FP8_WEIGHT_BLOCK) * (k // FP8_WEIGHT_BLOCK)
    return float(m * k + e * n * k + scales + BF16_BYTES * m * n)


def act_out_cols(act: str, n: int) -> int:
    """swiglu halves the interleaved gate/up columns; relu2 keeps them."""
    if act == "swiglu":
        return n // 2
    if act == "relu2":
        return n
    raise ValueError(f"activation {act!r} unknown; use 'swiglu' or 'relu2'")


def act_dims(cfg: Config, act: str) -> tuple[int, int, int]:
    """Up projection per activation: swiglu w13 [E, 2I, H], relu2 w1 [E, I, H] (the model's layouts)."""
    t, h, i, _, k = cfg
    if act not in ACTS:
        raise ValueError(f"activation {act!r} unknown; use one of {ACTS}")
    return t * k, (2 * i if act == "swiglu" else i), h


def act_bytes(act: str, m: int, n: int, k: int, e: int) -> float:
    return float(BF16_BYTES * (m * k + e * n * k + m * act_out_cols(act, n)))


def timed_reps(est_ms: float, reps: int, replays: int, budget_ms: float, min_reps: int = 5) -> int:
    """Samples per timing: `reps`, cut so samples * replays * est_ms stays near budget_ms, never below
    min_reps (nor above reps): large shapes get fewer samples, each still an average of `replays` calls."""
    if est_ms <= 0:
        return reps
    fit = int(budget_ms // (replays * est_ms))
    return max(1, min(reps, max(min_reps, fit)))


def input_copies(nbytes: float, rotate_bytes: int) -> int:
    """Operand sets to cycle through so back-to-back calls read at least rotate_bytes (L2 stays cold)."""
    return max(1, math.ceil(rotate_bytes / nbytes))


def geomean(xs: Sequence[float]) -> float:
    if not xs or any(x <= 0 for x in xs):
        raise ValueError(f"geomean needs positive values, got {list(xs)}")
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def grouped_mm(pass_: str, a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """torch._grouped_mm doing our pass: fwd a=x [M,K], b=w [E,N,K]; dgrad a=dy [M,N], b=w; wgrad a=dy,
    b=x [M,K], the 2d x 2d form grouping the reduced M and returning [E, N, K]."""
    if pass_ == "fwd":
        return torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
    if pass_ == "dgrad":
        return torch._grouped_mm(a, b, offs=offs)
    if pass_ == "wgrad":
        return torch._grouped_mm(a.t(), b, offs=offs)
    raise ValueError(f"pass {pass_!r} unknown; use one of {PASSES}")


def dense_mm(pass_: str, a: Tensor, b: Tensor) -> Tensor:
    """One cuBLAS torch.mm with the pass's layout and the same M x N x K: fwd x @ w[0]^T, dgrad dy @ w[0],
    wgrad dy^T @ x (one [N, K] output, not E)."""
    if pass_ == "fwd":
        return torch.mm(a, b[0].t())
    if pass_ == "dgrad":
        return torch.mm(a, b[0])
    if pass_ == "wgrad":
        return torch.mm(a.t(), b)
    raise ValueError(f"pass {pass_!r} unknown; use one of {PASSES}")


def batched_mm(pass_: str, a: Tensor, b: Tensor, e: int) -> Tensor:
    """One cuBLAS torch.bmm over E equal groups: our pass at uniform routing, each expert's own short
    reduction and output kept, so it prices the grouped shape itself rather than one long-K mm."""
    m = a.shape[0]
    if m % e:
        raise ValueError(f"batched_mm needs M ({m}) divisible by E ({e}): uniform routing only")
    ga = a.view(e, m // e, a.shape[1])
    if pass_ == "fwd":
        return torch.bmm(ga, b.transpose(1, 2))
    if pass_ == "dgrad":
        return torch.bmm(ga, b)
    if pass_ == "wgrad":
        return torch.bmm(ga.transpose(1, 2), b.view(e, m // e, b.shape[1]))
    raise ValueError(f"pass {pass_!r} unknown; use one of {PASSES}")


FP8_DENSE_SCALINGS = ("blockwise", "tensorwise")
FP8_DENSE_WHAT = {
    "blockwise": "one torch._scaled_mm [M,K] x [K,N], e4m3, x scaled per 1x128 and w per 128x128 block as "
                 "ours, bf16 out: cuBLAS's own fp8 on the dense shape",
    "tensorwise": "one torch._scaled_mm [M,K] x [K,N], e4m3, one scale per operand, bf16 out: cuBLAS's fp8 "
                  "with no block promotions",
}


def fp8_dense_scales(m: int, n: int, k: int, scaling: str, device: str) -> tuple[Tensor, Tensor]:
    """torch._scaled_mm's scales: singletons, or x's [M, K/128] outer-dim-major and w's [K/128, N/128]."""
    if scaling == "tensorwise":
        return torch.ones((), device=device), torch.ones((), device=device)
    if scaling == "blockwise":
        return (torch.ones(k // FP8_ACT_BLOCK, m, device=device).t(),
                torch.ones(n // FP8_WEIGHT_BLOCK, k // FP8_WEIGHT_BLOCK, device=device).t())
    raise ValueError(f"fp8 scaling {scaling!r} unknown; use one of {FP8_DENSE_SCALINGS}")


def fp8_dense_mm(m: int, n: int, k: int, scaling: str, device: str) -> Callable[[], Tensor]:
    """The dense fp8 mm at an fp8 row's M x N x K on random normal codes: what cuBLAS itself gains from fp8
    on that shape, the roofline of the fp8-over-bf16 goal."""
    sa, sb = fp8_dense_scales(m, n, k, scaling, device)
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    return lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


BATCHED_WHAT = "one torch.bmm over E equal groups (uniform routing), bf16: the grouped shape's own roofline"

DENSE_WHAT = {
    "fwd": "one torch.mm [M,K] x [K,N] (x @ w[0]^T), bf16, same 2MNK FLOPs, no grouping",
    "dgrad": "one torch.mm [M,N] x [N,K] (dy @ w[0]), bf16, same 2MNK FLOPs, no grouping",
    "wgrad": "one torch.mm [N,M] x [M,K] (dy^T @ x, one [N,K] output), bf16, same 2MNK FLOPs, no grouping",
}


def goal_summary(name: str, met: list[bool | None], expected: int, rule: str) -> dict[str, Any]:
    """A pass and routing's rows against their goal: all met only when every expected row was measured
    and judged (a wrong or unmeasured row leaves it None, never True)."""
    complete = len(met) == expected and None not in met
    return {"name": name, "shape": {}, "ms": None, "status": "summary", "n_shapes": len(met),
            "n_expected": expected, "shapes_meeting_goal": sum(m is True for m in met),
            "goal": {"per_shape": rule, "all_shapes_met": all(met) if complete else None}}
