"""Host-side fast path on CPU (bench.hostcpu runs it with launches that do nothing): the plan memos check a
layout once and still refuse every bad call with the same message; the direct autograd path records what the
custom op's autograd records; the launcher packs its arguments as the compiled function reads them."""

from __future__ import annotations

import contextlib
import ctypes
import re
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from bench.hostcpu import cpu_as_gpu, host_us, steps
from nmoe.checkout import tree_pythonpath
from nmoe.fast import activation, op
from nmoe.fast.gemm import routing
from nmoe.fast.gemm import sm90 as gemm

BF = torch.bfloat16


@pytest.fixture(autouse=True)
def _cpu_as_gpu() -> Iterator[None]:
    gemm._PLANS.clear()
    activation._PLANS.clear()
    with cpu_as_gpu():
        yield
    gemm._PLANS.clear()
    activation._PLANS.clear()


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    calls: list[int] = []
    inner = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _inputs(m: int = 64, n: int = 32, k: int = 16, e: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    offs = torch.arange(1, e + 1, dtype=torch.int32) * (m // e)
    return torch.randn(m, k, dtype=BF), torch.randn(e, n, k, dtype=BF), offs


def _message(fn: Callable[[], object]) -> str:
    with pytest.raises((ValueError, TypeError)) as info:
        fn()
    return f"{type(info.value).__name__}: {info.value}"


def test_a_repeated_gemm_layout_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = _counting(monkeypatch, gemm, "_check")
    x, w, offs = _inputs()
    for _ in range(3):
        assert gemm.grouped_gemm(x, w, offs).shape == (64, 32)
    assert (len(checks), len(gemm._PLANS)) == (1, 1)
    gemm.grouped_gemm(x.clone(), w.clone(), offs.clone() + 0)
    assert len(checks) == 1, "new tensors of the same layout reuse the plan"


@pytest.mark.parametrize("change", ["stride", "shape", "dtype", "offs_dtype", "alignment"])
def test_a_changed_layout_misses_the_memo_and_is_checked_again(monkeypatch: pytest.MonkeyPatch,
                                                                change: str) -> None:
    checks = _counting(monkeypatch, gemm, "_check")
    x, w, offs = _inputs()
    gemm.grouped_gemm(x, w, offs)
    if change == "stride":
        x = x.t().contiguous().t()
    elif change == "shape":
        x = torch.randn(64, 24, dtype=BF)
    elif change == "dtype":
        x = x.float()
    elif change == "offs_dtype":
        offs = offs.long()
    else:
        x = torch.randn(64 * 16 + 1, dtype=BF)[1:].view(64, 16)
    with contextlib.suppress(ValueError):
        gemm.grouped_gemm(x, w, offs)
    assert len(checks) == 2, f"a changed {change} reused a plan"


@pytest.mark.parametrize(("bad", "match"), [
    (lambda x, w, offs: (x.float(), w, offs), "bfloat16"),
    (lambda x, w, offs: (x[:, :8].contiguous(), w, offs), r"R = w.shape"),
    (lambda x, w, offs: (x, w, offs.long()), "int32"),
    (lambda x, w, offs: (x, w, offs[:3]), "int32"),
    (lambda x, w, offs: (torch.randn(64 * 16 + 1, dtype=BF)[1:].view(64, 16), w, offs), "16-byte"),
])
def test_a_bad_call_after_a_good_one_raises_what_it_raised_before(
        bad: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]], match: str) -> None:
    x, w, offs = _inputs()
    args = bad(x, w, offs)
    fresh = _message(lambda: gemm.grouped_gemm(*args))
    gemm.grouped_gemm(x, w, offs)
    assert len(gemm._PLANS) == 1
    assert _message(lambda: gemm.grouped_gemm(*args)) == fresh
    assert re.search(match, fresh), fresh


def test_offs_values_are_checked_on_every_call_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(routing.CHECK_OFFS_ENV, "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    routing.offs_check_enabled.cache_clear()
    try:
        x, w, offs = _inputs()
        gemm.grouped_gemm(x, w, offs)
        with pytest.raises(ValueError, match="non-decreasing"):
            gemm.grouped_gemm(x, w, torch.tensor([32, 16, 48, 64], dtype=torch.int32))
        with pytest.raises(ValueError, match="<= 64 rows"):
            gemm.grouped_gemm(x, w, torch.tensor([16, 32, 48, 65], dtype=torch.int32))
        assert len(gemm._PLANS) == 1
    finally:
        routing.offs_check_enabled.cache_clear()


def test_gemm_plans_keep_the_empty_and_zero_cases() -> None:
    offs = _inputs()[2]
    y = gemm.grouped_gemm_wgrad(torch.zeros(0, 32, dtype=BF), torch.zeros(0, 16, dtype=BF), offs)
    assert y.shape == (4, 32, 16) and not y.any()
    assert gemm.grouped_gemm(torch.zeros(8, 0, dtype=BF), torch.zeros(4, 32, 0, dtype=BF), offs).eq(0).all()


def test_a_strided_input_is_copied_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, offs = _inputs()
    strided = x.t().contiguous().t()
    copies = _counting(monkeypatch, gemm, "tma_aligned")
    for _ in range(3):
        gemm.grouped_gemm(strided, w, offs)
    plan = next(iter(gemm._PLANS.values()))
    assert (plan.a_ready, plan.w_ready) == (False, True)
    assert len(copies) == 2 + 3, "the plan checks both inputs once; every call copies the strided x"


def test_relu2_plan_follows_dtype_and_alignment() -> None:
    x = torch.randn(8, 64, dtype=BF)
    activation.relu2(x)
    activation.relu2(x.clone())
    assert len(activation._PLANS) == 1
    activation.relu2(x.float())
    odd = torch.randn(8 * 64 + 1, dtype=BF)[1:].view(8, 64)
    activation.relu2(odd)
    assert len(activation._PLANS) == 3
    launches = {dict(k[1:]).get("vec") for k in activation.RELU2_FWD._launchers}
    assert launches == {8, 4, 1}
    with pytest.raises(ValueError, match="bf16 or fp32"):
        activation.relu2(x.half())
    with pytest.raises(ValueError, match="shapes"):
        activation.relu2_bwd(x, torch.randn(8, 32, dtype=BF))


def _scale_op(name: str) -> op.FastOp[[Tensor, Tensor], Tensor]:
    """A fast op with a torch impl, so the direct and the dispatched autograd paths can be compared."""

    def impl(x: Tensor, s: Tensor) -> Tensor:
        return x * s

    fast = op.fast_op(name, impl, lambda x, s: torch.empty_like(x))

    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, s = ctx.saved_tensors
        return (grad * s if ctx.needs_input_grad[0] else None,
                (grad * x).sum().reshape(s.shape) if ctx.needs_input_grad[1] else None)

    fast.autograd(backward, op.save_inputs(0, 1))
    return fast


def test_direct_autograd_records_what_the_custom_op_records() -> None:
    fast = _scale_op("test_plans_scale")
    x0, s0 = torch.randn(5, 3), torch.tensor(1.5)
    grads = []
    for call in (fast, fast.op):
        x, s = x0.clone().requires_grad_(), s0.clone().requires_grad_()
        y = call(x, s)
        assert y.grad_fn is not None
        y.backward(torch.ones_like(y))
        grads.append((y.detach(), x.grad, s.grad))
    assert type(fast(x0.clone().requires_grad_(), s0).grad_fn).__name__ == "nmoe_test_plans_scaleBackward"
    for a, b in zip(*grads, strict=True):
        assert a is not None and b is not None and torch.equal(a, b)
    x = x0.clone().requires_grad_()
    s = s0.clone()
    fast(x, s).sum().backward()
    assert x.grad is not None and s.grad is None


def test_profiled_and_gradless_calls_take_their_routes() -> None:
    x = torch.randn(4, 8, dtype=BF)
    assert op._route((x,)) == op._DIRECT
    assert op._route((x.requires_grad_(),)) == op._RECORD
    with torch.no_grad():
        assert op._route((x,)) == op._DIRECT
    with torch.autograd.profiler.profile():
        assert op._route((x,)) == op._DISPATCH
    assert op._route((torch.empty(4, device="meta"),)) == op._DISPATCH


def test_every_gemm_launch_passes_its_kernels_argument_count() -> None:
    """Each sm_90a GEMM op reaches its launcher with as many values as bench.hostcpu.LAUNCH_VALUES says its
    host takes (test_fast_runtime holds those counts to the real hosts): wgrad takes no activation pointer."""
    x, w, offs = _inputs(n=256)
    dy = torch.randn(64, 256, dtype=BF)
    for _ in range(2):
        assert gemm.grouped_gemm(x, w, offs).shape == (64, 256)
        assert gemm.grouped_gemm_act(x, w, offs, "swiglu").shape == (64, 128)
        assert gemm.grouped_gemm_dgrad(dy, w, offs).shape == (64, 16)
        assert gemm.grouped_gemm_wgrad(dy, x, offs).shape == (4, 256, 16)
    dw = torch.empty(4, 256, 16, dtype=BF)
    gemm._launch_wgrad(dy, x, offs, dw)
    gemm._launch("test", x, w, offs, torch.empty(64, 256, dtype=BF), True)


def test_gemm_autograd_runs_dgrad_and_wgrad(monkeypatch: pytest.MonkeyPatch) -> None:
    dgrad = _counting(monkeypatch, gemm, "_dgrad_impl")
    wgrad = _counting(monkeypatch, gemm, "_wgrad_impl")
    monkeypatch.setattr(gemm._dgrad_op, "impl", gemm._dgrad_impl)
    monkeypatch.setattr(gemm._wgrad_op, "impl", gemm._wgrad_impl)
    x, w, offs = _inputs()
    y = gemm.grouped_gemm(x.requires_grad_(), w, offs)
    assert type(y.grad_fn).__name__ == "nmoe_grouped_gemmBackward"
    y.backward(torch.ones_like(y))
    assert x.grad is not None and x.grad.shape == x.shape
    assert (len(dgrad), len(wgrad)) == (1, 0)
    y = gemm.grouped_gemm(x, w.requires_grad_(), offs)
    y.backward(torch.ones_like(y))
    assert w.grad is not None and w.grad.shape == w.shape
    assert (len(dgrad), len(wgrad)) == (2, 1)


class _Recorder:
    def run_compiled_program(self, args: list[Any]) -> None:
        self.args = list(args)


def test_launcher_packs_each_argument_at_its_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0xABC)
    slots = (("p", ctypes.c_void_p), ("i", ctypes.c_int32), ("q", ctypes.c_int64), ("f", ctypes.c_float),
             ("j", ctypes.c_int32), ("stream", ctypes.c_void_p))
    recorder = _Recorder()
    launch = op.Launcher(recorder, slots)
    values = (0x7F00_0000_1000, -5, 2**40, 2.5, 7)
    launch(0, *values)
    read = [ctypes.cast(a, ctypes.POINTER(t)).contents.value
            for a, (_, t) in zip(recorder.args, slots, strict=True)]
    assert read == [*values, 0xABC]
    seen: list[int] = []

    def other_thread() -> None:
        launch(0, 1, 2, 3, 4.0, 5)
        seen.append(recorder.args[0].value)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert seen and seen[0] != read and recorder.args[0].value == seen[0]
    launch(0, *values)
    assert recorder.args[0].value != seen[0], "each thread packs into its own storage"
    with pytest.raises(TypeError, match="takes 5 arguments"):
        launch(0, 1, 2)
    with pytest.raises(struct.error):
        launch(0, 1, 2**31, 3, 4.0, 5)


def test_hostcpu_times_every_step() -> None:
    result = host_us(steps(), calls=3, samples=1)
    assert set(result) == {"torch_empty_like", "relu2", "grouped_gemm", "grouped_gemm_autograd"}
    assert all(us > 0 for us in result.values())


_EXECUTOR_PROBE = """
    import ctypes, json, os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from cutlass.base_dsl.jit_executor import JitExecutor
    from nmoe.fast import op
    seen = []
    code = [0]
    def entry(packed):
        arr = ctypes.cast(packed, ctypes.POINTER(ctypes.c_void_p))
        seen.append([arr[i] for i in range(7)])
        ctypes.cast(arr[6], ctypes.POINTER(ctypes.c_int32))[0] = code[0]
        return 0
    class Module:
        capi_func = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p)(entry)
        capi_func.restype = ctypes.c_int32
    executor = JitExecutor(Module(), None, False)
    slots = (("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("m", ctypes.c_int32), ("h", ctypes.c_int64),
             ("s", ctypes.c_float), ("stream", ctypes.c_void_p))
    launch = op.Launcher(executor, slots)
    torch._C._cuda_getCurrentRawStream = lambda device: 0xABC
    torch._C._cuda_getDevice = lambda: 0
    read = lambda ptrs: [ctypes.cast(p, ctypes.POINTER(t)).contents.value for p, (_, t) in zip(ptrs, slots)]
    out = {"direct": [], "dsl": []}
    for values in ((0x1000, 0x2000, 7, 2**40, 0.5), (0x3000, 0x4000, -1, 3, 2.0)):
        launch(0, *values)
        out["direct"].append(read(seen[-1][:6]))
        args = [ctypes.c_void_p(p) for p in seen[-1][:6]]
        executor.run_compiled_program(args)
        out["dsl"].append(seen[-1])
        out["direct_raw"] = seen[-2]
    out["packed_once"] = launch._local.storage[2] is not None
    code[0] = 2
    try:
        launch(0, 1, 2, 3, 4, 5.0)
    except Exception as e:
        out["error"] = type(e).__name__ + ": " + str(e)
    print(json.dumps(out))
"""


def test_launcher_hands_a_jit_executor_its_own_argument_array() -> None:
    """With a CuTeDSL JitExecutor the launcher calls the compiled entry with the array the executor itself
    would build (same argument pointers, the result slot last), reads the values back at their types, and
    raises the DSL's CUDA error for a failed launch."""
    import json
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": tree_pythonpath(root, os.environ.get("PYTHONPATH"))}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_EXECUTOR_PROBE)], capture_output=True,
                          text=True, env=env, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["packed_once"]
    assert out["direct"] == [[0x1000, 0x2000, 7, 2**40, 0.5, 0xABC], [0x3000, 0x4000, -1, 3, 2.0, 0xABC]]
    assert out["direct_raw"][:7] == out["dsl"][-1][:7]
    assert "cudaErrorMemoryAllocation" in out["error"], out["error"]


_MODEL_PROBE = """
    import json, torch
    from nmoe.fast import runtime
    runtime.import_cutlass("sm_90a")
    from bench.hostcpu import cpu_as_gpu, cpu_matmuls, real_hosts
    from nmoe.config import load_config
    class FA4:
        @staticmethod
        def _flash_attn_fwd(q, k, v, softmax_scale, causal, return_lse):
            return v + 0 * (q.sum() + k.sum()), None
        @staticmethod
        def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, deterministic, dv=None):
            return torch.zeros_like(q), torch.zeros_like(k), dout.clone() if dv is None else dv.copy_(dout)
    launched = {}
    with cpu_as_gpu(), cpu_matmuls(), real_hosts(launched):
        from nmoe.fast import attention, model as fast_model
        attention.flash_interface = lambda arch: FA4
        fast_model.model_device = lambda device: torch.device("cpu")
        cfg = load_config("configs/tiny-gpu.toml", env={},
                          overrides=["--model.tokenizer=none", "--model.vocab_size=512"]).model
        m = fast_model.Model(cfg)
        tok = torch.randint(0, cfg.vocab_size, (2, 129))
        m(tok[:, :-1], tok[:, 1:]).backward()
        m.update_router_bias()
        from nmoe.fast.optim import adamw_step
        for p in (m.head, m.layers[1].ffn.w_up):
            state = (torch.zeros_like(p), torch.zeros_like(p))
            adamw_step(p.data, p.grad, *state, 1, 1e-3, 0.9, 0.95, 1e-8, 0.1)
    print(json.dumps({"launched": sorted(launched),
                      "no_grad": [n for n, p in m.named_parameters() if p.grad is None]}))
"""


@pytest.mark.heavy
def test_a_fast_model_step_reaches_every_launcher_with_its_hosts_arguments() -> None:
    """A fast-model training step and AdamW on CPU (tiny-gpu shape, FA4 a stand-in): every kernel launched
    gets the argument count and types its real @cute.jit host takes (outputs are zeros, nothing computed)."""
    import json
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    env["PYTHONPATH"] = tree_pythonpath(root, env.get("PYTHONPATH"))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_MODEL_PROBE)], capture_output=True,
                          text=True, env=env, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["no_grad"] == []
    assert {"grouped_gemm_fwd", "grouped_gemm_dgrad", "grouped_gemm_wgrad", "router_topk", "permute",
            "grouped_gemm_gather", "spread", "expert_rows_bwd", "combine_gather_fwd", "rmsnorm_fwd",
            "rmsnorm_bwd", "add_rmsnorm_fwd", "add_rmsnorm_bwd", "rope_fwd", "rope_bwd", "swiglu_fwd",
            "swiglu_bwd", "ce_fwd", "adamw"} <= set(out["launched"]), out["launched"]
