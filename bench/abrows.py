"""A/B rows of `nmoe prove`: each row times one public fast-op call of the tree on PYTHONPATH (BASE's or the
new one), so trees of any age can be timed; run as a worker that the driver (`nmoe.abtest.run_ab`) asks for
one sample at a time, which interleaves the trees. Only torch and the tree's public fast functions are used.

Protocol: `python bench/abrows.py`, run in the tree, prints {"ready": nmoe's path} (or {"error": why}), then
answers each stdin line `build ROW`, `time ROW` (one sample: {"ms": ...}) or `drop ROW` with one JSON line,
{"error": why} when the tree cannot do it; EOF ends it. One row at a time keeps the GPU memory to one row's.
Samples: CUDA rows are the median over INNER L2-flushed samples of REPLAYS back-to-back replays of a CUDA
graph of one call, per call; CPU rows the median over INNER perf_counter timings of one call."""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

Step = Callable[[], object]
INNER: Final = 7
REPLAYS: Final = 3
FLUSH_BYTES: Final = 256 * 2**20
ALIGN: Final = 128
EPS: Final = 1e-6
ROUTED_SCALE: Final = 2.446
T, H, I, E, K = 32768, 4096, 1024, 128, 8
M: Final = T * K
CPU_ELEMS: Final = 2**16


@dataclass(frozen=True)
class Row:
    """`floor` states the bytes or FLOPs one call must move or do (the bound the timing is read against)."""

    op: str
    timer: Literal["cuda", "cpu"]
    min_noise: float
    floor: str
    build: Callable[[], Step]


def _randn(*shape: int, seed: int, dtype: str = "bfloat16", scale: float = 1.0) -> Any:
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, device="cuda", generator=g) * scale
    return x.to(getattr(torch, dtype))


def _act(name: str, widths: tuple[int, ...]) -> Callable[[], Step]:
    def build() -> Step:
        from nmoe.fast import activation

        fn, args = getattr(activation, name), [_randn(M, w * I, seed=s) for s, w in enumerate(widths)]
        return lambda: fn(*args)

    return build


def _combine(bwd: bool) -> Step:
    import torch

    from nmoe.fast import combine as cb

    y = _randn(T, K, H, seed=0)
    w = torch.rand(T, K, device="cuda") + 0.05
    w = w / w.sum(-1, keepdim=True)
    other = _randn(T, H, seed=1)
    if bwd:
        return lambda: cb.combine_bwd(other, y, w, ROUTED_SCALE)
    return lambda: cb.combine(y, w, ROUTED_SCALE, other)


def _ids() -> Any:
    import torch

    g = torch.Generator(device="cuda").manual_seed(1)
    return torch.rand(T, E, device="cuda", generator=g).topk(K, dim=-1).indices


def _permute() -> Step:
    from nmoe.fast import dispatch

    x, ids = _randn(T, H, seed=2), _ids()
    return lambda: dispatch.permute(x, ids, E, ALIGN)


def _unpermute() -> Step:
    from nmoe.fast import dispatch

    p = dispatch.permute(_randn(T, H, seed=2), _ids(), E, ALIGN)
    return lambda: dispatch.unpermute(p.xp, p.slot, T, K)


def _router_topk() -> Step:
    from nmoe.fast import router

    logits, bias = _randn(T, E, seed=3, dtype="float32"), _randn(E, seed=4, dtype="float32", scale=0.01)
    return lambda: router.router_topk(logits, bias, K, "sigmoid")


def _quant(name: str, *args: object) -> Callable[[], Step]:
    def build() -> Step:
        from nmoe.fast import formats

        fn, x = getattr(formats, name), _randn(T, H, seed=5)
        return lambda: fn(x, *args)

    return build


def _dequant_mxfp8() -> Step:
    from nmoe.fast import formats

    codes, scales = formats.quantize_mxfp8(_randn(T, H, seed=5), 32)
    return lambda: formats.dequantize_mxfp8(codes, scales, 32)


def _rmsnorm(bwd: bool) -> Step:
    from nmoe.fast import norm

    x, dy = _randn(T, H, seed=6), _randn(T, H, seed=7)
    w = (1 + _randn(H, seed=8, dtype="float32", scale=0.1)).to(x.dtype)
    if bwd:
        return lambda: norm.rmsnorm_bwd(dy, x, w, EPS)
    return lambda: norm.rmsnorm(x, w, EPS)


def _gemm(pass_: str, n: int, k: int) -> Callable[[], Step]:
    """Uniform routing over E experts, M = T*K rows: fwd x[M,k] w[E,n,k]; dgrad dy[M,n] w; wgrad dy x."""

    def build() -> Step:
        import torch

        from nmoe.fast import gemm

        offs = torch.full((E,), M // E, dtype=torch.int64, device="cuda").cumsum(0).to(torch.int32)
        if pass_ == "wgrad":
            dy, x = _randn(M, n, seed=9), _randn(M, k, seed=10)
            return lambda: gemm.grouped_gemm_wgrad(dy, x, offs)
        w = _randn(E, n, k, seed=11, scale=k**-0.5)
        if pass_ == "dgrad":
            dy = _randn(M, n, seed=9)
            return lambda: gemm.grouped_gemm_dgrad(dy, w, offs)
        x = _randn(M, k, seed=10)
        return lambda: gemm.grouped_gemm(x, w, offs)

    return build


def _gathered(kind: str) -> Callable[[], Step]:
    """The MoE layer's gathering GEMMs, uniform routing, token rows read through permute's slot: up
    act(x[slot] @ w13), dgrad_down dout[slot] @ w2, wgrad_up dh^T x[slot], wgrad_down dout[slot]^T a."""

    def build() -> Step:
        import torch

        from nmoe.fast.dispatch import permute
        from nmoe.fast.gemm import sm90

        route = permute(torch.empty(T, 0, device="cuda", dtype=torch.bfloat16), _ids(), E, ALIGN)
        slot, offs, rows = route.slot, route.offs, route.slot.shape[0]
        if kind == "up":
            x, w13 = _randn(T, H, seed=10), _randn(E, 2 * I, H, seed=11, scale=H**-0.5)
            return lambda: sm90.grouped_gemm_act_gathered(x, slot, K, w13, offs, "swiglu")
        dout = _randn(T, H, seed=9)
        if kind == "dgrad_down":
            w2 = _randn(E, H, I, seed=11, scale=I**-0.5)
            return lambda: sm90.grouped_gemm_dgrad_gathered(dout, slot, K, w2, offs)
        if kind == "wgrad_up":
            dh, x = _randn(rows, 2 * I, seed=12), _randn(T, H, seed=10)
            return lambda: sm90.grouped_gemm_wgrad_gathered(dh, x, slot, K, offs)
        a = _randn(rows, I, seed=12)
        return lambda: sm90.grouped_gemm_wgrad_gathered(dout, a, slot, K, offs, side="dy")

    return build


def _moe_layer() -> Step:
    """The bf16 MoE layer's forward and backward (sigmoid router, swiglu, no shared expert)."""
    import torch

    from nmoe.config import ModelConfig
    from nmoe.fast.moe import moe_layer
    from nmoe.layout import MoEParams

    mc = ModelConfig(tokenizer="none", vocab_size=64, dim=H, moe_inter_dim=I, n_routed_experts=E,
                     n_activated_experts=K, n_shared_experts=0, route_scale=ROUTED_SCALE, permute_align=ALIGN,
                     activation="swiglu", score_func="sigmoid", expert_dtype="bf16")
    leaves = [_randn(T, H, seed=0), _randn(E, H, seed=1, scale=H**-0.5),
              _randn(E, 2 * I, H, seed=2, scale=H**-0.5), _randn(E, H, I, seed=3, scale=I**-0.5)]
    x, router_w, w13, w2 = (t.requires_grad_() for t in leaves)
    p = MoEParams(router_w=router_w, router_bias=torch.zeros(E, device="cuda"), w2=w2, w13=w13)
    dout = _randn(T, H, seed=4)
    return lambda: torch.autograd.grad(moe_layer(x, p, mc)[0], leaves, dout)


def _relu2_spec_cpu() -> Step:
    import torch

    from nmoe.reference import activation

    torch.set_num_threads(1)  # an idle worker's spinning thread pool would take the timed worker's core
    x = torch.randn(CPU_ELEMS, generator=torch.Generator().manual_seed(0))
    return lambda: activation.relu2(x)


def _gemm_floor(n: int, k: int) -> str:
    return f"{2 * M * n * k / 1e12:.2f} TFLOP (2MNK, M={M}, N={n}, K={k})"


_MI, _TH, _TKH = 2 * M * I, 2 * T * H, 2 * T * K * H
ROWS: Final[dict[str, Row]] = {
    "relu2_fwd": Row("relu2", "cuda", 0.01, f"{2 * _MI} B", _act("relu2", (1,))),
    "relu2_bwd": Row("relu2_bwd", "cuda", 0.01, f"{3 * _MI} B", _act("relu2_bwd", (1, 1))),
    "swiglu_fwd": Row("swiglu", "cuda", 0.01, f"{3 * _MI} B", _act("swiglu", (2,))),
    "swiglu_bwd": Row("swiglu_bwd", "cuda", 0.01, f"{5 * _MI} B", _act("swiglu_bwd", (1, 2))),
    "combine_fwd": Row("combine", "cuda", 0.01, f"{_TKH + 4 * T * K + 2 * _TH} B", lambda: _combine(False)),
    "combine_bwd": Row("combine_bwd", "cuda", 0.01, f"{2 * _TKH + _TH + 8 * T * K} B",
                       lambda: _combine(True)),
    "router_topk": Row("router_topk", "cuda", 0.01, f"{4 * T * E + 12 * T * K} B", _router_topk),
    "permute": Row("permute", "cuda", 0.01, f"~{_TH + 2 * (M + E * ALIGN) * H} B", _permute),
    "unpermute": Row("unpermute", "cuda", 0.01, f"~{4 * M * H} B", _unpermute),
    "quantize_mxfp8_b32": Row("quantize_mxfp8_32", "cuda", 0.01, f"{3 * T * H + T * H // 32} B",
                              _quant("quantize_mxfp8", 32)),
    "quantize_mxfp8_b128": Row("quantize_mxfp8_128", "cuda", 0.01, f"{3 * T * H + T * H // 128} B",
                               _quant("quantize_mxfp8", 128)),
    "quantize_mxfp8_weight": Row("quantize_mxfp8_w128", "cuda", 0.01, f"{3 * T * H} B",
                                 _quant("quantize_mxfp8_weight")),
    "quantize_nvfp4": Row("quantize_nvfp4", "cuda", 0.01, f"{_TH + T * H // 2 + T * H // 16} B",
                          _quant("quantize_nvfp4")),
    "dequantize_mxfp8_b32": Row("dequantize_mxfp8_32", "cuda", 0.01, f"{5 * T * H + T * H // 32} B",
                                _dequant_mxfp8),
    "rmsnorm_fwd": Row("rmsnorm", "cuda", 0.01, f"{2 * _TH} B", lambda: _rmsnorm(False)),
    "rmsnorm_bwd": Row("rmsnorm_bwd", "cuda", 0.01, f"{3 * _TH} B", lambda: _rmsnorm(True)),
    "grouped_gemm_fwd_up": Row("grouped_gemm", "cuda", 0.01, _gemm_floor(2 * I, H), _gemm("fwd", 2 * I, H)),
    "grouped_gemm_fwd_down": Row("grouped_gemm", "cuda", 0.01, _gemm_floor(H, I), _gemm("fwd", H, I)),
    "grouped_gemm_dgrad_up": Row("grouped_gemm_dgrad", "cuda", 0.01, _gemm_floor(2 * I, H),
                                 _gemm("dgrad", 2 * I, H)),
    "grouped_gemm_wgrad_up": Row("grouped_gemm_wgrad", "cuda", 0.01, _gemm_floor(2 * I, H),
                                 _gemm("wgrad", 2 * I, H)),
    "grouped_gemm_wgrad_down": Row("grouped_gemm_wgrad", "cuda", 0.01, _gemm_floor(H, I),
                                   _gemm("wgrad", H, I)),
    "gemm_act_gathered_up": Row("grouped_gemm_act", "cuda", 0.01, _gemm_floor(2 * I, H), _gathered("up")),
    "gemm_dgrad_gathered_down": Row("grouped_gemm_dgrad", "cuda", 0.01, _gemm_floor(I, H),
                                    _gathered("dgrad_down")),
    "gemm_wgrad_gathered_up": Row("grouped_gemm_wgrad", "cuda", 0.01, _gemm_floor(2 * I, H),
                                  _gathered("wgrad_up")),
    "gemm_wgrad_gathered_down": Row("grouped_gemm_wgrad", "cuda", 0.01, _gemm_floor(H, I),
                                    _gathered("wgrad_down")),
    "moe_layer_fwd_bwd": Row("moe_layer", "cuda", 0.01, f"{18 * T * I * H * K / 1e12:.1f} TFLOP (18TIHK)",
                             _moe_layer),
    "relu2_spec_cpu": Row("relu2", "cpu", 0.30, f"{8 * CPU_ELEMS} B (fp32 in and out)", _relu2_spec_cpu),
}


class _Timer:
    """One sample per call: the CUDA graph of the step replayed, or the step on the CPU."""

    def __init__(self, row: Row) -> None:
        self.step = row.build()
        self.timer = row.timer
        if row.timer == "cuda":
            import torch

            self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.step()
            torch.cuda.synchronize()
        self.sample()

    def sample(self) -> float:
        if self.timer == "cpu":
            times = []
            for _ in range(INNER):
                t0 = time.perf_counter()
                self.step()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        import torch

        times = []
        for _ in range(INNER):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(REPLAYS):
                self.graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / REPLAYS)
        return statistics.median(times)


def _why(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" ({where.filename}:{where.lineno})" if where else ""
    return f"{type(e).__name__}: {lines[0][:400] if lines else ''}{at}"


def _say(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def _answer(timers: dict[str, _Timer], verb: str, name: str) -> dict[str, Any]:
    """One command: `build` a row (inputs, compile, graph), `time` it once, or `drop` it (frees memory)."""
    if name not in ROWS:
        return {"row": name, "error": f"row {name!r} unknown; known: {', '.join(ROWS)}"}
    if verb == "build":
        timers[name] = _Timer(ROWS[name])
        return {"row": name, "built": True}
    if verb == "drop":
        if timers.pop(name, None) is not None and ROWS[name].timer == "cuda":
            import torch

            torch.cuda.empty_cache()
        return {"row": name, "dropped": True}
    if verb == "time" and name in timers:
        return {"row": name, "ms": timers[name].sample()}
    return {"row": name, "error": f"command {verb!r} on row {name!r} not understood (build it first)"}


def main(argv: list[str]) -> int:
    try:
        import nmoe
    except ImportError as e:
        _say({"error": f"the tree under test {Path.cwd()} has no importable nmoe: {_why(e)}"})
        return 2
    if Path.cwd().resolve() not in Path(nmoe.__file__).resolve().parents:
        _say({"error": f"nmoe came from {nmoe.__file__}, not from the tree under test {Path.cwd()}"})
        return 2
    _say({"ready": nmoe.__file__})
    timers: dict[str, _Timer] = {}
    for line in sys.stdin:
        verb, _, name = line.strip().partition(" ")
        try:
            _say(_answer(timers, verb, name))
        except Exception as e:
            timers.pop(name, None)
            _say({"row": name, "error": _why(e)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
