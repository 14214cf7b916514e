"""Fast-path runtime: arch guard, CuTeDSL import, PTX checks, the compile cache (nmoe.fast.op declares ops).

Nothing here imports `cutlass` at module import: the DSL fixes its target arch at its first import.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch
from torch import Tensor

from nmoe.fast.arch import SUPPORTED_ARCHS, ArchError, arch_of, check_arch
from nmoe.outpaths import user_cache_dir

CACHE_ENV = "NMOE_KERNEL_CACHE"


@dataclass(frozen=True)
class KernelSpec:
    """One compiled kernel of a fast op, checkable for PTX instructions on a machine without a GPU."""

    op: str
    name: str
    compile: Callable[[str], str]
    expect: Mapping[str, tuple[str, ...]]
    forbid: Mapping[str, tuple[str, ...]]
    launched_here: bool = True
    """Built and launched by nmoe, so it starts with prims.await_upstream (flash-attn-4's kernels are not)."""


# 128-bit global accesses: sm_90a spells them v4.b32, sm_100a also v2.b64.
LD128 = r"\bld\.global(\.nc)?\.(v4\.(b|f|u)32|v2\.(b|u)64)\b"
ST128 = r"\bst\.global\.(v4\.(b|f|u)32|v2\.(b|u)64)\b"


def portable_spec(op: str, name: str, compile: Callable[[str], str], expect: tuple[str, ...],
                  forbid: tuple[str, ...],
                  per_arch: Mapping[str, tuple[str, ...]] | None = None) -> KernelSpec:
    """A kernel built for every supported arch: its PTX names the .target and holds `expect` (plus
    per_arch[arch]) and nothing of `forbid`."""
    return KernelSpec(
        op=op, name=name, compile=compile,
        expect={a: (rf"\.target {a}\b", *expect, *(per_arch or {}).get(a, ())) for a in SUPPORTED_ARCHS},
        forbid={a: forbid for a in SUPPORTED_ARCHS},
    )


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


_arch_by_index: dict[int, str] = {}


def _arch_of_index(index: int) -> str:
    arch = _arch_by_index.get(index)
    if arch is None:
        device = torch.device("cuda", index)
        major, minor = _capability(device)
        found = arch_of((major, minor))
        if found is None:
            raise ArchError(
                f"nmoe.fast needs sm_90a (H100/H200) or sm_100a (B200); {_device_name(device)} on {device} "
                f"is sm_{major}{minor}. Run on a supported GPU, or use nmoe.reference for the spec math"
            )
        arch = _arch_by_index[index] = found
    return arch


def device_arch(*tensors: Tensor) -> tuple[int, str]:
    """(device index, arch "sm_90a" | "sm_100a") of the one CUDA device holding all tensors, else raise;
    the arch is read once per device."""
    if not tensors:
        raise ValueError("require_arch needs at least one tensor")
    device = tensors[0].device
    for t in tensors:
        d = t.device
        if d.type != "cuda":
            raise ArchError(
                f"nmoe.fast runs on CUDA tensors on sm_90a/sm_100a GPUs, got a tensor on {d}; "
                "for CPU use the spec ops in nmoe.reference (same names and signatures)"
            )
        if d != device:
            raise ArchError(f"fast op inputs are on {device} and {d}; move them to one GPU")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, _arch_of_index(index)


def require_arch(*tensors: Tensor) -> str:
    """The arch ("sm_90a" | "sm_100a") of the one CUDA device holding all tensors, else raise."""
    return device_arch(*tensors)[1]


# CuTeDSL 4.8.1 facts the fast path is built on (each also noted where it bites):
# - compiling needs no GPU: host args are fake (cute.runtime.make_ptr(dtype, 0, gmem, assumed_align=16)
#   for pointers, cutlass.Int64(0) for scalars, cuda.CUstream(0)); Constexpr args are baked in and a
#   compiled function is then called with the dynamic args only.
# - the DSL re-parses each @cute.jit/@cute.kernel function's source, so kernels live in real files.
# - pointer alignment (assumed_align) is what lets loads/stores become 128-bit vectors.
# - no fast-math: float compares are ordered except != (unordered); mul.f32 without .ftz.
def dsl_arch() -> str:
    """The arch the imported DSL compiles for (read at its import from CUTE_DSL_ARCH, else the GPU)."""
    from cutlass.cutlass_dsl import CuTeDSL

    return str(CuTeDSL._get_dsl().envar.arch)


def import_cutlass(arch: str) -> None:
    """Import cutlass targeting `arch`, or check that the already-imported DSL targets it.

    CuTeDSL reads CUTE_DSL_ARCH once, at import; with neither it nor a GPU it silently picks sm_100a.
    """
    check_arch(arch)
    if "cutlass" not in sys.modules:
        preset = os.environ.get("CUTE_DSL_ARCH")
        if preset not in (None, "", arch):
            raise ArchError(f"CUTE_DSL_ARCH={preset} but {arch} was requested; unset it or set it to {arch}")
        os.environ["CUTE_DSL_ARCH"] = arch
        import cutlass  # noqa: F401
    current = dsl_arch()
    if current != arch:
        raise ArchError(
            f"CuTeDSL in this process targets {current}, not {arch} (it fixes the arch at first import); "
            f"compile {arch} in a fresh process, e.g. python -m nmoe.fast.compilecheck --arch {arch}"
        )


def compile_ptx(host: Any, args: tuple[Any, ...]) -> str:
    """Compile a @cute.jit host function and return its PTX; needs no GPU.

    --keep-ptx writes into --dump-dir only if that directory already exists (else silently nothing).
    """
    import cutlass.cute as cute

    with tempfile.TemporaryDirectory(prefix="nmoe-ptx-") as d:
        cute.compile(host, *args, options=f"--keep-ptx --dump-dir={d}")
        paths = sorted(glob.glob(os.path.join(d, "*.ptx")))
        if not paths:
            raise RuntimeError(f"CuTeDSL wrote no PTX for {getattr(host, '__name__', host)}; rerun with "
                               "CUTE_DSL_LOG_TO_CONSOLE=1 to see the compile log")
        return "\n".join(Path(p).read_text() for p in paths)


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@functools.cache
def kernel_module(name: str, arch: str) -> ModuleType:
    """The CuTeDSL kernel module `name`, imported with the DSL targeting `arch`."""
    import_cutlass(arch)
    return importlib.import_module(name)


@functools.cache
def dsl_version() -> str:
    """Read once: importlib.metadata parses the installed metadata on every call (milliseconds)."""
    return importlib.metadata.version("nvidia-cutlass-dsl")


@dataclass(frozen=True)
class CacheKey:
    """Compiled artifacts depend on the kernel source, the arch, the specialisation and the DSL version."""

    kernel: str
    source_sha256: str
    arch: str
    specialisation: tuple[tuple[str, str], ...]
    dsl: str

    @property
    def digest(self) -> str:
        text = repr((self.kernel, self.source_sha256, self.arch, self.specialisation, self.dsl))
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    @property
    def stem(self) -> str:
        return f"nmoe_{self.kernel}_{self.arch}_{self.digest}"


def cache_key(kernel: str, source_sha256: str, arch: str, specialisation: Mapping[str, object]) -> CacheKey:
    check_arch(arch)
    if not kernel.isidentifier():
        raise ValueError(f"kernel name {kernel!r} must be a Python identifier (it names exported symbols)")
    spec = tuple(sorted((k, repr(v)) for k, v in specialisation.items()))
    return CacheKey(kernel, source_sha256, arch, spec, dsl_version())


@dataclass(frozen=True)
class CacheEvent:
    key: CacheKey
    how: Literal["compile", "disk"]
    seconds: float


def default_cache_dir() -> Path | None:
    """NMOE_KERNEL_CACHE=off disables the disk cache; a path moves it; unset means the user cache dir."""
    value = os.environ.get(CACHE_ENV, "")
    if value.lower() in ("off", "0", "none"):
        return None
    if value:
        return Path(value)
    return user_cache_dir() / "kernels"


class KernelCache:
    """Compiled kernels in memory, plus exported objects on disk so a new process skips the compile."""
    # CuTeDSL 4.8.1 exports a compiled function (host launcher + cubin) with export_to_c(dir, name, prefix) as
    # one .o, and cutlass.cute.runtime.load_module(path) links it back in-process without a compiler.

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.events: list[CacheEvent] = []
        self._compiled: dict[CacheKey, Any] = {}
        self._executors: dict[CacheKey, Any] = {}
        self._lock = threading.RLock()

    def path(self, key: CacheKey) -> Path | None:
        return None if self.directory is None else self.directory / f"{key.stem}.o"

    def compiled(self, key: CacheKey, build: Callable[[], Any]) -> Any:
        with self._lock:
            fn = self._compiled.get(key)
            if fn is None:
                fn = self._load(key)
                if fn is None:
                    t0 = time.perf_counter()
                    fn = build()
                    self.events.append(CacheEvent(key, "compile", time.perf_counter() - t0))
                    self._store(key, fn)
                self._compiled[key] = fn
            return fn

    def executor(self, key: CacheKey, build: Callable[[], Any]) -> Any:
        """CuTeDSL's CUDA-dialect functions load a context-free cudaLibrary onto every device, so one
        executor serves all GPUs; it launches on the current device, which the launcher sets."""
        with self._lock:
            ex = self._executors.get(key)
            if ex is None:
                ex = self.compiled(key, build).to()
                self._executors[key] = ex
            return ex

    def _load(self, key: CacheKey) -> Any:
        path = self.path(key)
        if path is None or not path.exists():
            return None
        from cutlass.cute.runtime import load_module

        t0 = time.perf_counter()
        try:
            fn = getattr(load_module(str(path)), key.stem)
        except Exception as e:
            raise RuntimeError(
                f"cached kernel {path} failed to load ({e}); delete it or set {CACHE_ENV}=off"
            ) from e
        self.events.append(CacheEvent(key, "disk", time.perf_counter() - t0))
        return fn

    def _store(self, key: CacheKey, fn: Any) -> None:
        path = self.path(key)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as d:
            try:
                fn.export_to_c(d, key.stem, function_prefix=key.stem)
            except Exception as e:
                raise RuntimeError(
                    f"exporting {key.stem} to the kernel cache {path.parent} failed ({e}); "
                    f"set {CACHE_ENV}=off to keep compiled kernels in memory only"
                ) from e
            os.replace(os.path.join(d, f"{key.stem}.o"), path)


_cache: KernelCache | None = None
_cache_lock = threading.Lock()


def kernel_cache() -> KernelCache:
    global _cache
    with _cache_lock:
        if _cache is None:
            _cache = KernelCache(default_cache_dir())
        return _cache


@functools.cache
def sm_count(index: int) -> int:
    """Multiprocessors of CUDA device `index`, read once per device."""
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def vector_aligned(t: Tensor, nbytes: int) -> Tensor:
    """Contiguous `t` starting on an `nbytes` boundary, as vector loads read it (a copy if a view starts
    mid-vector); unlike TMA, vector kernels take any such copy, so none is refused."""
    t = t.contiguous()
    return t if t.data_ptr() % nbytes == 0 else t.clone()


def tma_aligned(op: str, name: str, t: Tensor) -> Tensor:
    """Contiguous `t` whose base is 16-byte aligned, as TMA needs; a sliced view is refused with the fix."""
    t = t.contiguous()
    if t.data_ptr() % 16:
        raise ValueError(f"{op}: {name} starts at a non-16-byte-aligned address (a sliced view); pass "
                         f"{name}.clone() so TMA can read it")
    return t
