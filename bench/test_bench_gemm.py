"""Grouped GEMM at the routed expert shapes: nmoe fwd/dgrad/wgrad vs torch._grouped_mm with a same-FLOP cuBLAS
mm as roofline, fp8 fwd vs our bf16, fused activation vs GEMM + activation; goals sit beside the numbers, and
an op missing or not implemented here is a "not run" row, never a number (shapes and counts: gemmplan.py)."""

from __future__ import annotations

import gc
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import (
    REPLAYS,
    REPS,
    _why,
    append_row,
    baseline,
    capture,
    ceilings,
    cuda_median_ms,
    eager_call_ms,
    record,
    replay_median_ms,
)
from gemmplan import (
    ACTS,
    BATCHED_WHAT,
    CONFIGS,
    DENSE_WHAT,
    FP8_ACT_BLOCK,
    FP8_DENSE_SCALINGS,
    FP8_DENSE_WHAT,
    PASSES,
    PROJS,
    ROUTINGS,
    Config,
    act_bytes,
    act_dims,
    batched_mm,
    config_id,
    dense_mm,
    fp8_bytes,
    fp8_dense_mm,
    gemm_flops,
    geomean,
    goal_summary,
    grouped_mm,
    input_copies,
    pass_bytes,
    proj_dims,
    routed_counts,
    timed_reps,
)
from torch import Tensor

GOAL_SPEEDUP = 1.05
GOAL_DENSE_FRAC = 0.97
"""Uniform rows: ours over the same-FLOP dense cuBLAS mm; skewed rows: ours over torch._grouped_mm."""
GOAL_GEOMEAN = 1.15
GOAL_FP8 = 1.6
FP8_GOAL_MIN_H = 4096
CHECK_TOL = 2.0**-6
ROTATE_BYTES = 256 * 2**20
BUDGET_MS = 250.0
OURS = {"fwd": "grouped_gemm", "dgrad": "grouped_gemm_dgrad", "wgrad": "grouped_gemm_wgrad"}
SHAPES = [(c, p, r) for c in CONFIGS for p in PROJS for r in ROUTINGS]
SHAPE_IDS = [f"{config_id(c)}-{p}-{r}" for c, p, r in SHAPES]
_SPEEDUPS: dict[str, list[float]] = {}
_MET: dict[tuple[str, str], list[bool | None]] = {}
_FWD_MS: dict[tuple[Config, str, str], float] = {}
_DENSE: dict[tuple[Config, str, str], dict[str, Any]] = {}
_FP8_CEILING: dict[str, float | None] = {}
Operands = tuple[Tensor, ...]


class NotRun(Exception):
    """An op absent from this tree or not implemented for this GPU: its row says "not run", the test skips."""


def _shape(cfg: Config, m: int, n: int, k: int) -> dict[str, int]:
    t, h, i, e, topk = cfg
    return {"T": t, "H": h, "I": i, "E": e, "K": topk, "M": m, "N": n, "Kred": k}


def _randn(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).mul_(scale)


def _offs(counts: list[int]) -> Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()


def _reps(flops: float) -> int:
    est_ms = flops / (ceilings()["bf16_dense_TFLOPs"] * 1e12) * 1e3
    return timed_reps(est_ms, REPS, REPLAYS, BUDGET_MS)


def _tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None else flops / (ms * 1e-3) / 1e12


def _op(module: Any, name: str) -> Callable[..., Tensor]:
    fn: Callable[..., Tensor] | None = getattr(module, name, None)
    if fn is None:
        raise NotRun(f"{module.__name__}.{name} does not exist in this tree")
    return fn


def _first_call(label: str, call: Callable[[], Tensor]) -> Tensor:
    """NotImplementedError (ArchNotImplemented included) on the first call means the op is not run here."""
    try:
        out = call()
        torch.cuda.synchronize()
    except NotImplementedError as e:
        raise NotRun(f"{label}: {_why(e)}") from None
    return out


def _cycle(fn: Callable[..., object], sets: list[Operands], *tail: Any) -> Callable[[], None]:
    def step() -> None:
        for s in sets:
            fn(*s, *tail)

    return step


def _check(got: Tensor, want: Callable[[], Tensor]) -> str:
    """max |got - want| <= CHECK_TOL * max |want|: loose enough for rounding-order differences, tight enough
    that a wrong kernel is never recorded as fast; "unchecked: ..." when the reference itself fails."""
    try:
        ref = want()
    except Exception as e:
        return f"unchecked: reference failed: {_why(e)}"
    if got.shape != ref.shape:
        return f"shape {tuple(got.shape)} vs reference {tuple(ref.shape)}"
    err = float((got.float() - ref.float()).abs().max())
    scale = float(ref.float().abs().max())
    if err <= CHECK_TOL * scale:
        return "ok"
    return f"max |diff| {err:.3g} > {CHECK_TOL:.3g} * max |ref| {scale:.3g}"


def _wrong(check: str) -> bool:
    return check != "ok" and not check.startswith("unchecked")


def _goal(speedup: float | None, minimum: float | None, vs: str, check: str) -> dict[str, Any]:
    """A row whose output is wrong meets no goal, whatever its speed."""
    met = None if speedup is None or minimum is None or _wrong(check) else speedup >= minimum
    return {"speedup_vs": vs, "min": minimum, "met": met}


def _count(key: str, speedup: float | None, check: str) -> None:
    if speedup is not None and not _wrong(check):
        _SPEEDUPS.setdefault(key, []).append(speedup)


def _pick(entry: dict[str, Any]) -> tuple[str, float] | None:
    return None if entry["ms"] is None else (str(entry["name"]), float(entry["ms"]))


def _pedantic(benchmark: Any, graph: torch.cuda.CUDAGraph) -> None:
    def run() -> None:
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)


def _run(name: str, shape: dict[str, int], body: Callable[[], str]) -> None:
    """body times and records, returning its check; tensors are freed before pytest sees the outcome, so a
    skipped or failed row never holds GPU memory into the next shape."""
    outcome: tuple[str, str] | None = None
    try:
        check = body()
        if _wrong(check):
            outcome = ("fail", f"{name}: nmoe disagrees with its reference ({check})")
    except NotRun as e:
        append_row({"name": name, "shape": shape, "ms": None, "status": "not run", "reason": str(e)})
        outcome = ("skip", f"{name} not run: {e}")
    except Exception as e:
        append_row({"name": name, "shape": shape, "ms": None, "status": "error", "reason": _why(e)})
        outcome = ("fail", f"{name} raised:\n{traceback.format_exc()}")
    gc.collect()
    torch.cuda.empty_cache()
    if outcome is not None and outcome[0] == "skip":
        pytest.skip(outcome[1])
    if outcome is not None:
        pytest.fail(outcome[1])


def _roofline(name: str, step: Callable[[], object], what: str, role: str, flops: float,
              reps: int) -> dict[str, Any]:
    """A timed vendor-library entry beside our row: what it computes, why it is there, its TFLOP/s."""
    entry = baseline(name, step, reps=reps)
    entry.update(what=what, role=role, tflops=_tflops(flops, entry["ms"]))
    return entry


_EQUAL_FLOPS = "roofline at equal FLOPs, not a competitor"


def _dense(key: tuple[Config, str, str], a: Tensor, b: Tensor, flops: float, reps: int) -> dict[str, Any]:
    """Routing does not change the dense mm, so it is timed once per shape and pass."""
    if key not in _DENSE:
        pass_ = key[2]
        _DENSE[key] = _roofline("cublas_dense_mm", lambda: dense_mm(pass_, a, b), DENSE_WHAT[pass_],
                                _EQUAL_FLOPS, flops, reps)
    return dict(_DENSE[key])


def _batched(pass_: str, a: Tensor, b: Tensor, e: int, flops: float, reps: int) -> dict[str, Any]:
    """cuBLAS bmm over the uniform rows' equal groups: the grouped shape's roofline beside the dense one."""
    return _roofline("cublas_bmm", lambda: batched_mm(pass_, a, b, e), BATCHED_WHAT,
                     "roofline of the grouped shape, not a competitor", flops, reps)


def _pass_operands(pass_: str, m: int, n: int, k: int, e: int, seed: int) -> Operands:
    """fwd (x [M,K], w [E,N,K]); dgrad (dy [M,N], w); wgrad (dy, x); w scaled so outputs stay near 1."""
    if pass_ == "wgrad":
        return _randn((m, n), 2 * seed), _randn((m, k), 2 * seed + 1)
    a = _randn((m, k), 2 * seed) if pass_ == "fwd" else _randn((m, n), 2 * seed)
    return a, _randn((e, n, k), 2 * seed + 1, (k if pass_ == "fwd" else n) ** -0.5)


@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize(("cfg", "proj", "routing"), SHAPES, ids=SHAPE_IDS)
def test_bench_grouped_gemm(benchmark: Any, pass_: str, cfg: Config, proj: str, routing: str) -> None:
    m, n, k = proj_dims(cfg, proj)
    shape = _shape(cfg, m, n, k)
    name = f"grouped_gemm_{pass_}_{proj}_{routing}"

    def body() -> str:
        from nmoe.fast import gemm

        fn = _op(gemm, OURS[pass_])
        e = cfg[3]
        counts = routed_counts(m, e, routing)
        offs = _offs(counts)
        flops, nbytes = gemm_flops(m, n, k), pass_bytes(m, n, k, e)
        copies = input_copies(nbytes, ROTATE_BYTES)
        sets = [_pass_operands(pass_, m, n, k, e, s) for s in range(copies)]
        a0, b0 = sets[0]
        check = _check(_first_call(f"nmoe.fast.gemm.{OURS[pass_]}", lambda: fn(a0, b0, offs)),
                       lambda: grouped_mm(pass_, a0, b0, offs))
        reps = _reps(flops)
        ours = _cycle(fn, sets, offs)
        theirs = _cycle(lambda a, b: grouped_mm(pass_, a, b, offs), sets)
        graph = capture(ours)
        ms = replay_median_ms(graph, copies, reps=reps)
        base = baseline("torch._grouped_mm", theirs, copies, reps=reps)
        dense = _dense((cfg, proj, pass_), a0, b0, flops, reps)
        bmm = _batched(pass_, a0, b0, e, flops, reps) if routing == "uniform" else None
        row = record(name, shape, ms, flops=flops, nbytes=nbytes, baseline=_pick(base))
        row.setdefault("speedup", None)
        ours_tflops = row["tflops"]
        row.update(
            status="measured", routing=routing, max_group_rows=max(counts), input_copies=copies, reps=reps,
            baseline_tflops=_tflops(flops, base["ms"]), baselines=[base, dense, *([bmm] if bmm else [])],
            dense_tflops=dense["tflops"],
            frac_of_dense=None if dense["tflops"] is None else ours_tflops / dense["tflops"],
            frac_of_bmm=None if bmm is None or bmm["tflops"] is None else ours_tflops / bmm["tflops"],
            check=check,
        )
        if routing == "uniform":
            row["goal"] = _goal(row["frac_of_dense"], GOAL_DENSE_FRAC, "cublas_dense_mm (frac_of_dense)",
                                check)
        else:
            row["goal"] = _goal(row["speedup"], GOAL_SPEEDUP, "torch._grouped_mm", check)
        _MET.setdefault((pass_, routing), []).append(row["goal"]["met"])
        _count(pass_, row["speedup"], check)
        if pass_ == "fwd":
            _FWD_MS[(cfg, proj, routing)] = ms
            eager_ms, host_ms = eager_call_ms(ours, copies)
            torch_ms, torch_host_ms = (None, None) if base["ms"] is None else eager_call_ms(theirs, copies)
            eager = record(f"{name}_eager_call", shape, eager_ms, flops=flops, nbytes=nbytes,
                           baseline=None if torch_ms is None else ("torch._grouped_mm", torch_ms))
            eager.update(host_ms=host_ms, baseline_host_ms=torch_host_ms)
        benchmark.extra_info.update(row)
        _pedantic(benchmark, graph)
        return check

    _run(name, shape, body)


def _fp8_ceiling() -> float | None:
    """fp8 dense TFLOP/s (torch._scaled_mm 8192^3, tensor-wise scales) for the fp8 rows' FLOP floor, since
    the bf16 ceiling is no bound there; None where this torch or GPU has no fp8 mm."""
    if "tflops" not in _FP8_CEILING:
        try:
            ms = cuda_median_ms(fp8_dense_mm(8192, 8192, 8192, "tensorwise", "cuda"))
            _FP8_CEILING["tflops"] = 2 * 8192**3 / (ms * 1e-3) / 1e12
        except Exception:
            _FP8_CEILING["tflops"] = None
    return _FP8_CEILING["tflops"]


def _fp8_rooflines(cfg: Config, proj: str, bf16: Operands, flops: float, reps: int) -> dict[str, Any]:
    """cuBLAS's dense bf16 and fp8 mm at the row's M x N x K, and what fp8 buys cuBLAS there: the goal's
    1.6x held against the gain the vendor library gets on the same shape."""
    m, n, k = proj_dims(cfg, proj)
    dense = _dense((cfg, proj, "fwd"), bf16[0], bf16[1], flops, reps)
    entries = []
    for scaling in FP8_DENSE_SCALINGS:
        entries.append(_roofline(f"cublas_fp8_dense_{scaling}", fp8_dense_mm(m, n, k, scaling, "cuda"),
                                 FP8_DENSE_WHAT[scaling], _EQUAL_FLOPS, flops, reps))
        gc.collect()
        torch.cuda.empty_cache()
    gain = {e["name"]: None if e["ms"] is None or dense["ms"] is None else dense["ms"] / e["ms"]
            for e in entries}
    return {"baselines": [dense, *entries], "cublas_fp8_over_bf16": gain}


@pytest.mark.parametrize(("cfg", "proj", "routing"), SHAPES, ids=SHAPE_IDS)
def test_bench_grouped_gemm_fp8(benchmark: Any, cfg: Config, proj: str, routing: str) -> None:
    m, n, k = proj_dims(cfg, proj)
    shape = _shape(cfg, m, n, k)
    name = f"grouped_gemm_fp8_{proj}_{routing}"

    def body() -> str:
        from nmoe.fast import formats, gemm

        fn = _op(gemm, "grouped_gemm_fp8")
        e = cfg[3]
        counts = routed_counts(m, e, routing)
        offs = _offs(counts)
        flops, nbytes = gemm_flops(m, n, k), fp8_bytes(m, n, k, e)
        reps = _reps(flops)
        copies = input_copies(nbytes, ROTATE_BYTES)
        bf16 = [_pass_operands("fwd", m, n, k, e, s) for s in range(copies)]
        sets = [(*formats.quantize_mxfp8(x, FP8_ACT_BLOCK), *formats.quantize_mxfp8_weight(w))
                for x, w in bf16]
        xq, xs, wq, ws = sets[0]
        check = _check(
            _first_call("nmoe.fast.gemm.grouped_gemm_fp8", lambda: fn(xq, xs, wq, ws, offs)),
            lambda: gemm.grouped_gemm(formats.dequantize_mxfp8(xq, xs, FP8_ACT_BLOCK).bfloat16(),
                                      formats.dequantize_mxfp8_weight(wq, ws).bfloat16(), offs))
        bf16_ms = _FWD_MS.get((cfg, proj, routing))
        bf16_source = "this run's grouped_gemm_fwd row"
        if bf16_ms is None:
            bf16_ms = replay_median_ms(capture(_cycle(gemm.grouped_gemm, bf16, offs)), copies, reps=reps)
            bf16_source = "timed in this test"
        cublas = _fp8_rooflines(cfg, proj, bf16[0], flops, reps) if routing == "uniform" else {}
        del bf16
        graph = capture(_cycle(fn, sets, offs))
        ms = replay_median_ms(graph, copies, reps=reps)
        vs = "nmoe grouped_gemm (bf16)"
        row = record(name, shape, ms, nbytes=nbytes, baseline=(vs, bf16_ms))
        ceiling = _fp8_ceiling()
        if ceiling is not None:
            row["floor_ms"] = max(row["floor_ms"], flops / (ceiling * 1e12) * 1e3)
        goal_min = GOAL_FP8 if cfg[1] >= FP8_GOAL_MIN_H else None
        row.update(
            status="measured", routing=routing, max_group_rows=max(counts), input_copies=copies, reps=reps,
            flops=flops, tflops=_tflops(flops, ms), fp8_dense_TFLOPs=ceiling,
            floor_basis="bytes at the copy ceiling; FLOPs at fp8_dense_TFLOPs when measured",
            timing="GEMM only: x (1x128 blocks) and w (128x128 blocks) quantized by nmoe.fast.formats "
                   "before timing; quantization excluded",
            baseline_source=bf16_source, baseline_tflops=_tflops(flops, bf16_ms),
            goal=_goal(row["speedup"], goal_min, vs, check), check=check, **cublas,
        )
        if goal_min is not None:
            _count("fp8_goal_shapes", row["speedup"], check)
        benchmark.extra_info.update(row)
        _pedantic(benchmark, graph)
        return check

    _run(name, shape, body)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_bench_grouped_gemm_act(benchmark: Any, cfg: Config, routing: str, act: str) -> None:
    m, n, k = act_dims(cfg, act)
    shape = _shape(cfg, m, n, k)
    name = f"grouped_gemm_act_{act}_up_{routing}"

    def body() -> str:
        from nmoe.fast import activation, gemm

        fn = _op(gemm, "grouped_gemm_act")
        act_fn = _op(activation, act)
        e = cfg[3]
        counts = routed_counts(m, e, routing)
        offs = _offs(counts)
        flops, nbytes = gemm_flops(m, n, k), act_bytes(act, m, n, k, e)
        reps = _reps(flops)
        copies = input_copies(nbytes, ROTATE_BYTES)
        sets = [_pass_operands("fwd", m, n, k, e, s) for s in range(copies)]
        x0, w0 = sets[0]
        check = _check(_first_call("nmoe.fast.gemm.grouped_gemm_act", lambda: fn(x0, w0, offs, act)),
                       lambda: act_fn(gemm.grouped_gemm(x0, w0, offs)))
        graph = capture(_cycle(fn, sets, offs, act))
        ms = replay_median_ms(graph, copies, reps=reps)
        unfused = _cycle(lambda x, w: act_fn(gemm.grouped_gemm(x, w, offs)), sets)
        vs = f"nmoe grouped_gemm + nmoe.fast.activation.{act}"
        base = baseline(vs, unfused, copies, reps=reps)
        row = record(name, shape, ms, flops=flops, nbytes=nbytes, baseline=_pick(base))
        row.setdefault("speedup", None)
        row.update(
            status="measured", routing=routing, activation=act, max_group_rows=max(counts),
            input_copies=copies, reps=reps, baselines=[base],
            layout="swiglu: w13 [E, 2I, H], gate/up rows interleaved" if act == "swiglu" else
                   "relu2: w1 [E, I, H]",
            goal=_goal(row["speedup"], None, vs, check), check=check,
        )
        benchmark.extra_info.update(row)
        _pedantic(benchmark, graph)
        return check

    _run(name, shape, body)


def _summary(name: str, speedups: list[float], vs: str, per_shape: float, overall: float | None,
             expected: int) -> dict[str, Any]:
    """Goals are judged only over the full set of shapes; a partial run (or a wrong row) gets met = None."""
    if not speedups:
        return {"name": name, "shape": {}, "ms": None, "status": "not run",
                "reason": "no measured row with a correct output in this run"}
    g = geomean(speedups)
    complete = len(speedups) == expected
    return {
        "name": name, "shape": {}, "ms": None, "status": "summary", "n_shapes": len(speedups),
        "n_expected": expected, "complete": complete,
        "geomean_speedup": g, "min_speedup": min(speedups), "max_speedup": max(speedups),
        "shapes_meeting_goal": sum(s >= per_shape for s in speedups),
        "goal": {"speedup_vs": vs, "per_shape_min": per_shape, "geomean_min": overall,
                 "all_shapes_met": min(speedups) >= per_shape if complete else None,
                 "geomean_met": g >= overall if complete and overall is not None else None},
    }


def test_bench_grouped_gemm_summary() -> None:
    """Last in the file, so it sees every row above: geomean speedup per pass against its goal."""
    for pass_ in PASSES:
        append_row(_summary(f"grouped_gemm_{pass_}_summary", _SPEEDUPS.get(pass_, []), "torch._grouped_mm",
                            GOAL_SPEEDUP, GOAL_GEOMEAN, len(SHAPES)))
    for (pass_, routing), met in sorted(_MET.items()):
        rule = (f"frac_of_dense >= {GOAL_DENSE_FRAC}" if routing == "uniform" else
                f"speedup over torch._grouped_mm >= {GOAL_SPEEDUP}")
        append_row(goal_summary(f"grouped_gemm_{pass_}_{routing}_goal", met,
                                sum(1 for _, _, r in SHAPES if r == routing), rule))
    n_goal = sum(1 for c, _, _ in SHAPES if c[1] >= FP8_GOAL_MIN_H)
    row = _summary("grouped_gemm_fp8_summary", _SPEEDUPS.get("fp8_goal_shapes", []),
                   "nmoe grouped_gemm (bf16)", GOAL_FP8, None, n_goal)
    row["scope"] = f"rows with H >= {FP8_GOAL_MIN_H}"
    append_row(row)
