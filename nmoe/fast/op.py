"""One way to declare a fast op: its kernels (`Kernel`) and its torch custom op (`fast_op`).

A `Kernel` keys its compile cache on the specialisation the call passes and on every source file its kernel
module imports inside `nmoe` (found by walking the imports), and keeps one lean launcher per specialisation.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import hashlib
import importlib.util
import inspect
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, ParamSpec, TypeVar, cast

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.arch import SUPPORTED_ARCHS, ArchNotImplemented

PACKAGE = "nmoe"


def _origin(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{module} is missing from the installed nmoe package; reinstall nmoe")
    return Path(spec.origin)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def imports(module: str) -> frozenset[str]:
    """The `nmoe` modules `module` imports anywhere in its file; `from pkg import name` counts name where it
    is a module."""
    path = _origin(module)
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            subs = {f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")}
            found.update(subs or {base})
    return frozenset(m for m in found if m == PACKAGE or m.startswith(PACKAGE + "."))


@functools.cache
def source_files(module: str) -> tuple[Path, ...]:
    """`module`'s file and every `nmoe` source file it imports, transitively, in a stable order."""
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = _origin(name)
        todo.extend(sorted(imports(name) - seen.keys()))
    return tuple(seen[n] for n in sorted(seen))


@functools.cache
def source_digest(module: str) -> str:
    """One digest over the source files `module` compiles from: an imported helper file keys the cache too."""
    digest = hashlib.sha256()
    for path in source_files(module):
        digest.update(runtime.file_sha256(path).encode())
    return digest.hexdigest()


# A compiled CuTeDSL 4.8.1 function takes one C pointer per runtime argument, pointing at the value's storage
# (a device address, an integer, a float or a stream handle): a launcher keeps that storage and refills it.
_SLOT_TYPES: Mapping[str, type[ctypes._SimpleCData[Any]]] = {
    "Pointer": ctypes.c_void_p, "Int64": ctypes.c_int64, "Int32": ctypes.c_int32, "Float32": ctypes.c_float,
    "CUstream": ctypes.c_void_p,
}


def runtime_slots(host: Any) -> tuple[tuple[str, type[ctypes._SimpleCData[Any]]], ...]:
    """(name, ctypes type) of each argument the compiled `host` takes at run time (Constexprs are baked)."""
    fn = getattr(host, "__wrapped__", host)
    slots = []
    for p in inspect.signature(fn).parameters.values():
        raw = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
        text = raw.strip("'\"")
        if text.startswith("Constexpr"):
            continue
        ctype = _SLOT_TYPES.get(text.rpartition(".")[2])
        if ctype is None:
            raise TypeError(f"{getattr(fn, '__name__', fn)}: argument {p.name} is annotated {text!r}; a "
                            f"launcher passes only {', '.join(_SLOT_TYPES)} and Constexpr arguments")
        slots.append((p.name, ctype))
    if not slots or slots[-1][0] != "stream":
        raise TypeError(f"{getattr(fn, '__name__', fn)}: the last runtime argument must be the stream")
    return tuple(slots)


_PACK_CODES: Mapping[type[ctypes._SimpleCData[Any]], str] = {
    ctypes.c_void_p: "P", ctypes.c_int64: "q", ctypes.c_int32: "i", ctypes.c_float: "f",
}
"""struct codes of the slot types: native sizes and alignment, as the compiled function reads them."""


class Launcher:
    """One compiled specialisation, called with the runtime arguments in order (device addresses as ints)
    and the stream last. The arguments are packed in one call into fixed storage laid out like a C struct
    (one per calling thread, so no lock), whose field addresses the compiled function reads."""

    def __init__(self, executor: Any, slots: tuple[tuple[str, type[ctypes._SimpleCData[Any]]], ...]) -> None:
        self._executor = executor
        self._run = executor.run_compiled_program
        self._capi: Any = getattr(executor, "capi_func", None)
        self._result = getattr(executor, "cuda_result", None)
        codes = [_PACK_CODES[ctype] for _, ctype in slots]
        self._format = "@" + "".join(codes)
        self._ends = [struct.calcsize("@" + "".join(codes[: i + 1])) for i in range(len(codes))]
        self._sizes = [struct.calcsize("@" + c) for c in codes]
        self._n_values = len(slots) - 1
        self._local = threading.local()

    def _storage(self) -> tuple[ctypes.Array[ctypes.c_char], list[ctypes.c_void_p], Any]:
        buffer = ctypes.create_string_buffer(max(self._ends))
        base = ctypes.addressof(buffer)
        fields = zip(self._ends, self._sizes, strict=True)
        args = [ctypes.c_void_p(base + end - size) for end, size in fields]
        storage = (buffer, args, self._packed(args))
        self._local.storage = storage
        return storage

    def _packed(self, args: list[ctypes.c_void_p]) -> Any:
        """A CuTeDSL 4.8.1 JitExecutor's own argument array for this storage, copied once: it never changes,
        so later calls hand it straight to the compiled function (None: another executor, called per call)."""
        pack = getattr(self._executor, "_get_invoke_packed_args", None)
        if pack is None or self._capi is None:
            return None
        filled = pack(args)
        return (ctypes.c_void_p * len(filled))(*filled)

    def _failed(self, code: int) -> None:
        import cuda.bindings.runtime as cudart
        from cutlass.base_dsl.runtime import cuda as cuda_helpers

        raise cuda_helpers.create_cuda_runtime_error(code, cudart.cudaError_t)

    def __call__(self, device: int, *values: int | float) -> None:
        if len(values) != self._n_values:
            raise TypeError(f"launcher takes {self._n_values} arguments (it adds the stream itself), "
                            f"got {len(values)}")
        try:
            buffer, args, packed = self._local.storage
        except AttributeError:
            buffer, args, packed = self._storage()
        struct.pack_into(self._format, buffer, 0, *values, torch._C._cuda_getCurrentRawStream(device))
        if torch._C._cuda_getDevice() != device:
            with torch.cuda.device(device):
                self._run(args)
        elif packed is None:
            self._run(args)
        else:
            self._capi(packed)
            if self._result is not None and self._result.value:
                self._failed(self._result.value)


@dataclass(frozen=True)
class Kernel:
    """One compiled kernel of a fast op: the kernel `module`, the compile-cache `name` and `build(module,
    **spec) -> (host, fake args)`; `launcher(arch, **spec)` compiles once per specialisation."""

    module: str
    name: str
    build: Callable[..., tuple[Any, tuple[Any, ...]]]
    archs: tuple[str, ...] = SUPPORTED_ARCHS
    front: str = ""
    _launchers: dict[tuple[Any, ...], Launcher] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def by_name(cls, module: str, name: str) -> Kernel:
        """A kernel of a module whose compile_args(name, spec) builds every kernel it holds."""
        return cls(module, name, functools.partial(_compile_args_by_name, name))

    def kernels(self, arch: str) -> ModuleType:
        if arch not in self.archs:
            where = f"; call {self.front}, which picks the kernel for the GPU" if self.front else ""
            built = "/".join(self.archs)
            raise ArchNotImplemented(f"{self.name} is a {built} kernel, not built for {arch}{where}")
        return runtime.kernel_module(self.module, arch)

    def host_args(self, arch: str, **spec: Any) -> tuple[Any, tuple[Any, ...]]:
        """The @cute.jit host function and fake compile arguments of one specialisation (for PTX checks)."""
        return self.build(self.kernels(arch), **spec)

    def ptx(self, arch: str, **spec: Any) -> str:
        return runtime.compile_ptx(*self.host_args(arch, **spec))

    def compiler(self, **spec: Any) -> Compiler:
        """arch -> PTX of one specialisation, for a KernelSpec."""
        return Compiler(self, tuple(spec.items()))

    def key(self, arch: str, **spec: Any) -> runtime.CacheKey:
        return runtime.cache_key(self.name, source_digest(self.module), arch, spec)

    def launcher(self, arch: str, **spec: Any) -> Launcher:
        memo = (arch, *spec.items())
        hit = self._launchers.get(memo)
        if hit is not None:
            return hit
        host, fake = self.host_args(arch, **spec)

        def compile_now() -> Any:
            import cutlass.cute as cute

            return cute.compile(host, *fake)

        launcher = Launcher(runtime.kernel_cache().executor(self.key(arch, **spec), compile_now),
                            runtime_slots(host))
        self._launchers[memo] = launcher
        return launcher


@dataclass(frozen=True, eq=False)
class Compiler:
    """A KernelSpec's compile: arch -> PTX of one specialisation; it names the `kernel` (and so the module
    whose import graph is the op's kernel sources)."""

    kernel: Kernel
    spec: tuple[tuple[str, Any], ...]

    def __call__(self, arch: str) -> str:
        return self.kernel.ptx(arch, **dict(self.spec))


def _compile_args_by_name(name: str, kernels: ModuleType, **spec: Any) -> tuple[Any, tuple[Any, ...]]:
    return cast(tuple[Any, tuple[Any, ...]], kernels.compile_args(name, spec))


K = TypeVar("K")
V = TypeVar("V")
PLAN_MEMO_MAX = 4096
"""Layouts a glue module keeps validated launch plans for; past it the memo starts over (routings never key
it, so only a workload of ever-new shapes gets there). Kept out of limits.py, which kernel sources import."""


def remember(memo: dict[K, V], key: K, plan: V) -> V:
    """Keep a validated launch plan under its layout key; a memo past PLAN_MEMO_MAX layouts starts over."""
    if len(memo) >= PLAN_MEMO_MAX:
        memo.clear()
    memo[key] = plan
    return plan


P = ParamSpec("P")
SetupContext = Callable[[Any, tuple[Any, ...], Any], None]
R = TypeVar("R")


_DISPATCH, _DIRECT, _RECORD = 0, 1, 2


def _route(args: tuple[Any, ...]) -> int:
    """How an eager call runs: through the op (a trace, a mode, the profiler, a functorch transform, a
    meta/fake/CPU or subclass tensor), directly, or under the op's autograd.Function (grad to record)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return _DISPATCH
    if torch._C._autograd._profiler_enabled() or torch._C._is_torch_function_mode_enabled():
        return _DISPATCH
    if torch._C._are_functorch_transforms_active():
        return _DISPATCH
    grad = torch.is_grad_enabled()
    route = _DIRECT
    for a in args:
        if isinstance(a, Tensor):
            if type(a) is not Tensor or not a.is_cuda:
                return _DISPATCH
            if grad and a.requires_grad:
                route = _RECORD
    return route


def _eager(args: tuple[Any, ...]) -> bool:
    """Whether the impl may skip the dispatcher and autograd: plain CUDA tensors, no grad to record."""
    return _route(args) == _DIRECT


def _function(name: str, impl: Callable[..., Any], backward: Callable[..., Any],
              setup_context: SetupContext) -> type[torch.autograd.Function]:
    """The op's autograd pair as one autograd.Function: an eager call that records grad meets the same
    forward, setup_context and backward without the dispatcher's two Python kernels in between."""

    def forward(ctx: Any, *args: Any) -> Any:
        out = impl(*args)
        setup_context(ctx, args, out)
        return out

    return type(f"nmoe_{name}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


class FastOp(Generic[P, R]):
    """A fast op as one opaque torch custom op (typed outputs, shape-only fake, optional autograd pair).
    Plain eager CUDA calls skip the dispatcher (it adds host time only): the impl runs directly, or under the
    pair's autograd.Function when an input records grad."""

    def __init__(self, name: str, impl: Callable[P, R], fake: Callable[P, R],
                 mutates: tuple[str, ...] = ()) -> None:
        self.name = name
        self.impl = impl
        self.op = torch.library.custom_op(f"nmoe::{name}", mutates_args=mutates)(impl)
        self.op.register_fake(fake)
        self.function: type[torch.autograd.Function] | None = None
        self._record: Callable[..., Any] | None = None

    def autograd(self, backward: Callable[..., Any], setup_context: SetupContext) -> None:
        self.op.register_autograd(backward, setup_context=setup_context)
        self.function = _function(self.name, self.impl, backward, setup_context)
        self._record = self.function.apply

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if not kwargs:
            route = _route(args)
            if route == _DIRECT:
                return self.impl(*args, **kwargs)
            if route == _RECORD and self._record is not None:
                return cast(R, self._record(*args))
        return cast(R, self.op(*args, **kwargs))


def fast_op(name: str, impl: Callable[P, R], fake: Callable[P, R],
            mutates: tuple[str, ...] = ()) -> FastOp[P, R]:
    """nmoe::<name> with `impl` on CUDA and `fake` for torch.compile / CUDA-graph shape propagation; `mutates`
    names the arguments it writes in place."""
    return FastOp(name, impl, fake, mutates)


def save_inputs(*indices: int) -> SetupContext:
    """A setup_context that saves the tensor inputs at `indices` and keeps the rest on ctx.inputs."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*(inputs[i] for i in indices))
        ctx.inputs = tuple(None if i in indices else x for i, x in enumerate(inputs))

    return setup_context


def elementwise_pair(fwd: FastOp[[Tensor], Tensor], bwd: FastOp[[Tensor, Tensor], Tensor]) -> None:
    """Autograd of fwd(x) is bwd(dy, x)."""

    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return bwd(grad, x)

    fwd.autograd(backward, save_inputs(0))
