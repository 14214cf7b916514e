"""Host time of the fast ops' Python on a machine without a GPU: `python -m bench.hostcpu`.

CPU tensors stand in for CUDA ones: the eager-route and device checks are recompiled from their own source
with the device type swapped, the arch table says sm_90a, and every kernel's launcher is a real
`nmoe.fast.op.Launcher` around an executor that launches nothing. Everything else (checks, plan memos,
allocation, argument packing, autograd recording) runs as on the GPU, so a change's host cost shows here;
the launch itself and the CUDA allocator do not (bench/test_bench_launch.py times those on the GPU).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nmoe.fast import op, runtime

# Runtime values each launched kernel takes (the launcher adds the stream).
LAUNCH_VALUES = {"grouped_gemm_fwd": 9, "grouped_gemm_dgrad": 9, "grouped_gemm_wgrad": 12, "relu2_fwd": 3,
                 "relu2_bwd": 4}


class _NoLaunch:
    def run_compiled_program(self, args: list[Any]) -> None:
        return None


def _dsl_executor() -> Any:
    """A CuTeDSL JitExecutor whose compiled entry is a C function that reads nothing (libc labs): the DSL's
    own per-call Python runs, the launch does not."""
    import ctypes

    from cutlass.base_dsl.jit_executor import JitExecutor

    class Module:
        capi_func = ctypes.CDLL(None).labs

    Module.capi_func.restype = ctypes.c_int32
    return JitExecutor(Module(), None, False)


def recompiled(module: Any, name: str, old: str, new: str, owner: Any = None) -> Callable[..., Any]:
    """`module.name` (or `owner.name`, a method) rebuilt from its own source in `module`'s globals with
    `old` replaced by `new` (which must occur)."""
    source = textwrap.dedent(inspect.getsource(getattr(module if owner is None else owner, name)))
    if old not in source:
        raise RuntimeError(f"{module.__name__}.{name} no longer contains {old!r}; update bench/hostcpu.py")
    scope: dict[str, Any] = {}
    exec(compile(source.replace(old, new), f"<hostcpu {name}>", "exec"), vars(module), scope)
    return scope[name]  # type: ignore[no-any-return]


@contextmanager
def cpu_as_gpu(dsl: bool = False, arch: str = "sm_90a") -> Iterator[None]:
    """CPU tensors take the fast ops' eager CUDA path on an `arch` GPU, with launches that do nothing; with
    `dsl`, through a real CuTeDSL executor (its Python included; cutlass must be imported for `arch`), else
    through a stand-in that returns at once."""
    saved: list[tuple[Any, str, Any]] = []
    absent = object()

    def patch(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name, absent)))
        setattr(obj, name, value)

    route = "_route" if hasattr(op, "_route") else "_eager"
    patch(op, route, recompiled(op, route, "not a.is_cuda", "not a.is_cpu"))
    device_arch = recompiled(runtime, "device_arch", 'd.type != "cuda"', 'd.type != "cpu"')
    patch(runtime, "device_arch", device_arch)
    patch(runtime, "_arch_by_index", {0: arch})
    patch(runtime, "sm_count", lambda index: 132)
    patch(torch.cuda, "current_device", lambda: 0)
    patch(torch._C, "_cuda_getDevice", lambda: 0)
    patch(torch._C, "_cuda_getCurrentRawStream", lambda device: 0)

    def host_args(self: op.Kernel, arch: str, **spec: Any) -> tuple[Any, tuple[Any, ...]]:
        values = (f"v{i}: 'Pointer'" for i in range(LAUNCH_VALUES[self.name]))
        params = ", ".join([*values, "stream: 'CUstream'"])
        scope: dict[str, Any] = {}
        exec(f"def {self.name}_host({params}) -> None: pass", scope)
        return scope[f"{self.name}_host"], ()

    class NoCompile:
        def executor(self, key: runtime.CacheKey, build: Callable[[], Any]) -> Any:
            return _dsl_executor() if dsl else _NoLaunch()

    patch(op.Kernel, "host_args", host_args)
    patch(runtime, "kernel_cache", NoCompile)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is absent:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def _storages() -> list[tuple[int, int]]:
    """(first byte, end) of every live tensor's storage."""
    import gc
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        objects = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
    spans = {(s.data_ptr(), s.data_ptr() + s.nbytes()) for t in objects for s in (t.untyped_storage(),)}
    return sorted(spans)


class CheckedLauncher(op.Launcher):
    """A launcher of a real host that launches nothing and refuses values that do not fit it: the count, an
    int per pointer/integer slot and a number per Float32 one, a pointer inside a live tensor (or 0), and
    no tensor's start address in a value slot."""

    def __init__(self, name: str, slots: tuple[tuple[str, Any], ...], calls: dict[str, int]) -> None:
        super().__init__(_NoLaunch(), slots)
        self.name, self.slots, self.calls = name, slots[:-1], calls

    def __call__(self, device: int, *values: int | float) -> None:
        import ctypes

        if len(values) != len(self.slots):
            raise TypeError(f"{self.name}: its host takes {len(self.slots)} arguments before the stream, got "
                            f"{len(values)}")
        if type(device) is not int:
            raise TypeError(f"{self.name}: device must be an int index, got {device!r}")
        spans = _storages()
        starts = {a for a, _ in spans if a}
        for (arg, ctype), v in zip(self.slots, values, strict=True):
            where = f"{self.name}: argument {arg} ({ctype.__name__})"
            if ctype is ctypes.c_float and type(v) not in (int, float):
                raise TypeError(f"{where} must be a Python number, got {type(v).__name__} {v!r}")
            if ctype is not ctypes.c_float and type(v) is not int:
                raise TypeError(f"{where} must be a Python int, got {type(v).__name__} {v!r}")
            if ctype is ctypes.c_void_p and v and not any(a <= v <= e for a, e in spans):
                raise TypeError(f"{where} = {v:#x} lies in no live tensor: not a device address")
            if ctype is not ctypes.c_void_p and v in starts:
                raise TypeError(f"{where} = {v:#x} is a tensor's address: a pointer in a value slot")
        super().__call__(device, *values)
        self.calls[self.name] = self.calls.get(self.name, 0) + 1


@contextmanager
def real_hosts(calls: dict[str, int]) -> Iterator[None]:
    """Inside cpu_as_gpu (cutlass imported for its arch): every Kernel.launcher is a CheckedLauncher of its
    real @cute.jit host, nothing compiled; `calls` counts the launches by kernel name."""
    saved = op.Kernel.launcher

    def launcher(self: op.Kernel, arch: str, **spec: Any) -> op.Launcher:
        host, _ = self.build(self.kernels(arch), **spec)
        return CheckedLauncher(self.name, op.runtime_slots(host), calls)

    op.Kernel.launcher = launcher  # type: ignore[method-assign]
    try:
        yield
    finally:
        op.Kernel.launcher = saved  # type: ignore[method-assign]


@contextmanager
def cpu_matmuls() -> Iterator[None]:
    """torch.mm/addmm taking `out_dtype` (a CUDA-only overload) on CPU as fp32 products, and torch.empty as
    zeros so that no glue check reads garbage."""
    mm, addmm, empty, empty_like = torch.mm, torch.addmm, torch.empty, torch.empty_like

    def mm_cpu(a: torch.Tensor, b: torch.Tensor, out_dtype: Any = None, out: Any = None) -> torch.Tensor:
        r = mm(a.float(), b.float()) if out_dtype is not None else mm(a, b)
        return r if out is None else out.copy_(r)

    def addmm_cpu(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out_dtype: Any = None,
                  out: Any = None) -> torch.Tensor:
        r = addmm(c.float(), a.float(), b.float()) if out_dtype is not None else addmm(c, a, b)
        return r if out is None else out.copy_(r)

    torch.mm, torch.addmm = mm_cpu, addmm_cpu  # type: ignore[assignment]
    torch.empty, torch.empty_like = torch.zeros, torch.zeros_like  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.mm, torch.addmm, torch.empty, torch.empty_like = mm, addmm, empty, empty_like


def host_us(steps: dict[str, Callable[[], object]], calls: int, samples: int,
            stat: Callable[[list[float]], float] = statistics.median) -> dict[str, float]:
    """`stat` (the median) over `samples` of µs per call; each sample runs every step in turn, so noise hits
    all alike."""
    for step in steps.values():
        for _ in range(max(1, calls // 10)):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(samples):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: stat(ts) for name, ts in times.items()}


def steps() -> dict[str, Callable[[], object]]:
    """The launch bench's calls (bench/test_bench_launch.py) on CPU tensors of the same shapes."""
    from nmoe.fast import gemm
    from nmoe.fast.activation import relu2

    bf16 = torch.bfloat16
    x, w = torch.randn(256, 128, dtype=bf16), torch.randn(4, 128, 128, dtype=bf16)
    offs = torch.tensor([64, 128, 192, 256], dtype=torch.int32)
    tiny = torch.randn(8, 64, dtype=bf16)
    xg = x.clone().requires_grad_()
    return {
        "torch_empty_like": lambda: torch.empty_like(tiny),
        "relu2": lambda: relu2(tiny),
        "grouped_gemm": lambda: gemm.grouped_gemm(x, w, offs),
        "grouped_gemm_autograd": lambda: gemm.grouped_gemm(xg, w, offs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=2000, help="calls per sample")
    parser.add_argument("--samples", type=int, default=15, help="samples; the median is reported")
    parser.add_argument("--min", action="store_true", help="report the fastest sample, not the median")
    parser.add_argument("--no-dsl", action="store_true",
                        help="launch through a stand-in, not a CuTeDSL executor (no cutlass import)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if not args.no_dsl:
        runtime.import_cutlass("sm_90a")
    with cpu_as_gpu(dsl=not args.no_dsl):
        result = host_us(steps(), args.calls, args.samples, min if args.min else statistics.median)
    if args.json:
        print(json.dumps({"us_per_call": result, "calls": args.calls, "samples": args.samples,
                          "stat": "min" if args.min else "median"}))
    else:
        for name, us in result.items():
            print(f"{name:24s} {us:8.2f} us/call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
