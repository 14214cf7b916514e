"""Every fast op's glue on CPU (bench.hostcpu.real_hosts): each launch site is called once and its values
checked against the real @cute.jit host (count; pointer, Int32, Int64, Float32 kinds), nothing compiled or
launched. The fast-model step (tests/test_fast_plans.py) also runs the training path's glue; the calls here
reach every Kernel of each arch on their own (the heavy test holds them to that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nmoe.checkout import tree_pythonpath

ROOT = Path(__file__).resolve().parents[1]
BF = torch.bfloat16


def _rdep_group(stack: Any) -> Any:
    """An RdepGroup whose IPC window and status word are CPU buffers (the driver calls stood in for); the
    group's own __init__ runs from its source with the device kept on the CPU."""
    import ctypes

    from bench.hostcpu import recompiled
    from nmoe.fast.rdep import group as rdep

    class CpuWindow:
        def __init__(self, nbytes: int, device: torch.device, rank: int, exchange: Any) -> None:
            self.buf = torch.zeros(nbytes, dtype=torch.uint8)
            self.own = self.buf.data_ptr()
            world = len(exchange(b""))
            bufs = [self.buf if r == rank else torch.zeros(nbytes, dtype=torch.uint8) for r in range(world)]
            self.bases = tuple(b.data_ptr() for b in bufs)
            stack.extend(bufs)

        def view(self) -> torch.Tensor:
            return self.buf

    class CpuStatus:
        def __init__(self, gpu: torch.device) -> None:
            self.words = (ctypes.c_int64 * 8)()
            self.device = ctypes.addressof(self.words)

        def read(self) -> tuple[int, ...]:
            return tuple(self.words)

    init = recompiled(rdep, "__init__", 'torch.device("cuda", torch.device(device).index or 0)',
                      "torch.device(device)", rdep.RdepGroup)
    saved = rdep.open_window, rdep.Status, rdep.RdepGroup.__init__
    rdep.open_window, rdep.Status, rdep.RdepGroup.__init__ = CpuWindow, CpuStatus, init  # type: ignore
    try:
        shape = rdep.RdepShape(world=2, n_experts=4, tokens=8, top_k=2, hidden=64, dtype=BF, capacity=32)
        return rdep.RdepGroup(shape, 1, torch.device("cpu"), lambda mine: [b"", b""])
    finally:
        rdep.open_window, rdep.Status, rdep.RdepGroup.__init__ = saved  # type: ignore


def _rdep_calls(group: Any) -> None:
    """rdep_dispatch (int32 and int64 ids) and rdep_return; the device index a CUDA group has is 0."""
    from bench.hostcpu import recompiled
    from nmoe.fast.rdep import group as rdep

    s = group.shape
    dispatch = recompiled(rdep, "rdep_dispatch", "launch(group.device.index,", "launch(0,")
    back = recompiled(rdep, "rdep_return", "launch(group.device.index,", "launch(0,")
    x = torch.randn(s.tokens, s.hidden, dtype=BF)
    for dtype in (torch.int32, torch.int64):
        dispatch(group, x, torch.randint(0, s.n_experts, (s.tokens, s.top_k), dtype=dtype))
    back(group, torch.randn(s.capacity, s.hidden, dtype=BF))


def _portable_calls() -> None:
    """Each op front built for every arch, once per kernel variant its glue can pick."""
    from nmoe.fast import attention, combine, dispatch, formats, loss, norm, optim, rope, router
    from nmoe.fast.activation import relu2, swiglu

    t, h, k, e = 16, 128, 2, 4
    x = torch.randn(t, h, dtype=BF, requires_grad=True)
    relu2(x).sum().backward()
    swiglu(torch.randn(t, 2 * h, dtype=BF, requires_grad=True)).sum().backward()
    w = torch.ones(h, dtype=BF, requires_grad=True)
    norm.rmsnorm(x, w, 1e-6).sum().backward()
    torch.autograd.backward(norm.add_rmsnorm(x, torch.randn(t, h, dtype=BF), w, 1e-6),
                            [torch.ones(t, h, dtype=BF)] * 2)
    cos, sin = torch.ones(t, 1, 32, dtype=torch.float32), torch.zeros(t, 1, 32, dtype=torch.float32)
    q = torch.randn(1, t, 2, 64, dtype=BF, requires_grad=True)
    rope.apply_rope(q, cos, sin).sum().backward()
    logits = torch.randn(t, e, dtype=torch.float32)
    weights, ids = router.router_topk(logits, torch.zeros(e), k, "softmax")
    router.router_topk(logits, torch.zeros(e), k, "sigmoid", 2, 1)
    router.expert_counts(ids, e)
    perm, row_of = dispatch.permute_rows(x.detach(), ids, e, 1)
    dispatch.permute(x.detach().new_empty(t, 0), ids, e, 1)
    yp = torch.randn(perm.xp.shape[0], h, dtype=BF)
    y = dispatch.unpermute(yp, perm.slot, t, k)
    combine.combine(y, weights, 1.5)
    combine.combine(y, weights, 1.5, torch.randn(t, h, dtype=BF))
    combine.combine_bwd(torch.randn(t, h, dtype=BF), y, weights, 1.5)
    combine.combine_gather(yp, perm.slot.view(t, k).to(torch.int32), weights, 1.5)
    dispatch.spread_rows(x.detach(), perm.slot, row_of)
    dispatch.embedding_bwd(x.detach(), ids[:, 0], e)
    rows = perm.xp.shape[0]
    combine.expert_rows_bwd(torch.randn(rows, h, dtype=BF), torch.randn(rows, 2 * h, dtype=BF),
                            torch.ones(rows, dtype=torch.float32), "swiglu")
    kv, k_pe = torch.randn(1, t, 2, 64 + 64, dtype=BF), torch.randn(1, t, 32, dtype=BF)
    attention.mla_k(kv, k_pe, 64)
    attention.mla_kv_grad(torch.randn(1, t, 2, 64 + 32, dtype=BF), torch.zeros_like(kv), 64)
    head = torch.randn(256, h, dtype=BF)
    targets = torch.randint(0, 256, (t,))
    with torch.no_grad():
        loss.cross_entropy(x, head, targets)
    loss.cross_entropy_bwd(1.0, x, head, targets)
    for g_dtype in (torch.float32, BF):
        p = torch.randn(h, dtype=torch.float32)
        optim.adamw_step(p, torch.randn(h, dtype=g_dtype), torch.zeros(h), torch.zeros(h), 1, 1e-3, 0.9, 0.95,
                         1e-8, 0.1)
    formats.dequantize_mxfp8(*formats.quantize_mxfp8(x.detach(), 32), 32)
    formats.dequantize_mxfp8_weight(*formats.quantize_mxfp8_weight(torch.randn(e, h, h, dtype=BF)))
    formats.dequantize_nvfp4(*formats.quantize_nvfp4(x.detach()))


def _sm90_calls() -> None:
    """The sm_90a GEMM glue: forward (plain and each fused activation), dgrad, wgrad, the forms that gather
    token rows through slot, and MXFP8."""
    from nmoe.fast import formats
    from nmoe.fast.gemm import sm90, sm90_fp8

    t, h, e = 16, 128, 4
    offs = torch.tensor([4, 8, 12, 16], dtype=torch.int32)
    wg = torch.randn(e, h, h, dtype=BF)
    xg = torch.randn(t, h, dtype=BF, requires_grad=True)
    sm90.grouped_gemm(xg, wg, offs)
    sm90.grouped_gemm_dgrad(torch.randn(t, h, dtype=BF), wg, offs)
    sm90.grouped_gemm_wgrad(torch.randn(t, h, dtype=BF), xg.detach(), offs)
    sm90.grouped_gemm_act(xg.detach(), torch.randn(e, 2 * h, h, dtype=BF), offs, "swiglu")
    sm90.grouped_gemm_act(xg.detach(), wg, offs, "relu2")
    slot = torch.arange(t, dtype=torch.int64)
    sm90.grouped_gemm_act_gathered(xg.detach(), slot, 1, torch.randn(e, 2 * h, h, dtype=BF), offs, "swiglu")
    sm90.grouped_gemm_act_gathered(xg.detach(), slot, 1, torch.randn(e, 2 * h, h, dtype=BF), offs, "swiglu",
                                   keep_h=False)
    sm90.grouped_gemm_dgrad_gathered(torch.randn(t, h, dtype=BF), slot, 1, wg, offs)
    sm90.grouped_gemm_wgrad_gathered(torch.randn(t, h, dtype=BF), xg.detach(), slot, 1, offs)
    sm90.grouped_gemm_wgrad_gathered(torch.randn(t, h, dtype=BF), xg.detach(), slot, 1, offs, side="dy")
    xq, xs = formats.quantize_mxfp8(xg.detach(), 128)
    wq, ws = formats.quantize_mxfp8_weight(wg)
    sm90_fp8.grouped_gemm_fp8(xq, xs, wq, ws, offs)


def _sm100_calls() -> None:
    """The sm_100a GEMM glue for bf16, MXFP8 (1x32 and 1x128 / 128x128 scales) and NVFP4."""
    from nmoe.fast.gemm import sm100

    m, n, k, e = 256, 256, 256, 4
    u8 = torch.uint8
    offs = torch.tensor([64, 128, 192, 256], dtype=torch.int32)
    sm100.grouped_gemm(torch.randn(m, k, dtype=BF), torch.randn(e, n, k, dtype=BF), offs)
    codes, wcodes = torch.zeros(m, k, dtype=u8), torch.zeros(e, n, k, dtype=u8)
    sm100.grouped_gemm_fp8(codes, torch.zeros(m, k // 32, dtype=u8), wcodes,
                           torch.zeros(e, n, k // 32, dtype=u8), offs)
    sm100.grouped_gemm_fp8(codes, torch.zeros(m, k // 128, dtype=u8), wcodes,
                           torch.zeros(e, n // 128, k // 128, dtype=u8), offs)
    one = torch.ones(1, dtype=torch.float32)
    sm100.grouped_gemm_nvfp4(torch.zeros(m, k // 2, dtype=u8), torch.zeros(m, k // 16, dtype=u8), one,
                             torch.zeros(e, n, k // 2, dtype=u8), torch.zeros(e, n, k // 16, dtype=u8), one,
                             offs)


def probe(arch: str) -> dict[str, Any]:
    """Run one arch's calls under real_hosts; the launches by kernel name, and every Kernel of the arch."""
    from bench.hostcpu import cpu_as_gpu, cpu_matmuls, real_hosts
    from nmoe.fast import op, runtime

    runtime.import_cutlass(arch)
    calls: dict[str, int] = {}
    keep: list[Any] = []
    with cpu_as_gpu(arch=arch), cpu_matmuls(), real_hosts(calls):
        _portable_calls()
        _rdep_calls(_rdep_group(keep))
        _sm100_calls() if arch == "sm_100a" else _sm90_calls()
    import importlib
    import pkgutil

    import nmoe.fast

    for info in pkgutil.walk_packages(nmoe.fast.__path__, "nmoe.fast."):
        if not info.name.startswith("nmoe.fast.kernels"):
            importlib.import_module(info.name)
    fast = [m for m in list(sys.modules.values()) if m.__name__.startswith("nmoe.fast")]
    held = [v for m in fast for v in vars(m).values()]
    held += [v for table in held if isinstance(table, dict) for v in table.values()]
    kernels = {v.name for v in held if type(v) is op.Kernel and arch in v.archs}
    return {"launched": calls, "kernels": sorted(kernels)}


def _run(arch: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    env.update(PYTHONPATH=tree_pythonpath(ROOT, env.get("PYTHONPATH")), CUTE_DSL_ARCH=arch)
    code = f"import json, tests.test_fast_abi as t; print(json.dumps(t.probe({arch!r})))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_every_kernel_of_an_arch_is_launched_with_its_hosts_arguments(arch: str) -> None:
    """Every Kernel the fast path holds for `arch` is launched at least once from its glue, and every launch
    passes what its real host takes (a mismatch raises inside the probe)."""
    out = _run(arch)
    assert out["kernels"], "no kernel found"
    assert sorted(out["launched"]) == out["kernels"], (sorted(out["launched"]), out["kernels"])


def _host() -> Any:
    """A host's runtime signature as runtime_slots reads it (annotations as the DSL's type names)."""
    scope: dict[str, Any] = {}
    exec("def host(a: 'Pointer', n: 'Int32', off: 'Int64', s: 'Float32', stream: 'CUstream'): pass", scope)
    return scope["host"]


@pytest.mark.parametrize(("values", "message"), [
    ((1, 2, 0.5), "takes 4 arguments before the stream, got"),
    ((1, 2, 3, 0.5, 9), "takes 4 arguments before the stream, got"),
    ((None, 2, 3, 0.5), "argument a .* must be a Python int"),
    (("ptr", 2, 3, 0.5), "argument a .* must be a Python int"),
    ((0x10, 2, 3, 0.5), "argument a .* lies in no live tensor"),
    (("x", 2.0, 3, 0.5), "argument n .* must be a Python int"),
    (("x", 2, "x", 0.5), "argument off .* a pointer in a value slot"),
    (("x", "x", 3, 0.5), "argument n .* a pointer in a value slot"),
    (("x", 2, 3, "x"), "argument s .* a pointer in a value slot"),
    (("x", 2, 3, None), "argument s .* must be a Python number"),
])
def test_a_checked_launcher_refuses_what_its_host_does_not_take(values: tuple[Any, ...],
                                                                message: str) -> None:
    """The probe's check itself: each wrong kind or count raises and counts nothing; right values pass."""
    from bench.hostcpu import CheckedLauncher, cpu_as_gpu
    from nmoe.fast import op

    x = torch.zeros(4)
    calls: dict[str, int] = {}
    launch = CheckedLauncher("k", op.runtime_slots(_host()), calls)
    with cpu_as_gpu():
        with pytest.raises(TypeError, match=message):
            launch(0, *(x.data_ptr() if v == "x" else v for v in values))
        assert calls == {}
        launch(0, x.data_ptr() + 4, 2, 3, 0.5)
        launch(0, 0, -1, 2**40, 1)
    assert calls == {"k": 2}
