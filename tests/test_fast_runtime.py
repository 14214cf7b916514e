"""nmoe.fast.runtime: arch guard, compile-cache keys, disk cache round trip, compilecheck usage."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import Tensor

from nmoe.fast import FAST_MODULES, compilecheck, op, runtime
from nmoe.fast.arch import ArchError, ArchNotImplemented
from nmoe.fast.runtime import CacheKey, KernelCache

ROOT = Path(__file__).resolve().parents[1]


class _OnDevice:
    """Stands in for a CUDA tensor on a CPU-only machine: the guard reads only `.device`."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


def _cuda(device: str = "cuda:0") -> Tensor:
    return cast(Tensor, _OnDevice(device))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_require_arch_rejects_non_cuda_naming_reference(device: str) -> None:
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        runtime.require_arch(torch.ones(2, device=device))


@pytest.mark.parametrize(("cap", "arch"), [((9, 0), "sm_90a"), ((10, 0), "sm_100a")])
def test_require_arch_maps_supported_capabilities(
    monkeypatch: pytest.MonkeyPatch, cap: tuple[int, int], arch: str
) -> None:
    monkeypatch.setattr(runtime, "_arch_by_index", {})
    monkeypatch.setattr(runtime, "_capability", lambda device: cap)
    assert runtime.require_arch(_cuda(), _cuda()) == arch


@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (12, 0), (10, 3)])
def test_require_arch_rejects_other_gpus_with_remedy(
    monkeypatch: pytest.MonkeyPatch, cap: tuple[int, int]
) -> None:
    monkeypatch.setattr(runtime, "_arch_by_index", {})
    monkeypatch.setattr(runtime, "_capability", lambda device: cap)
    monkeypatch.setattr(runtime, "_device_name", lambda device: "Some GPU")
    with pytest.raises(ArchError, match=rf"sm_{cap[0]}{cap[1]}.*nmoe\.reference"):
        runtime.require_arch(_cuda())


def test_require_arch_rejects_mixed_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "_arch_by_index", {})
    monkeypatch.setattr(runtime, "_capability", lambda device: (9, 0))
    with pytest.raises(ArchError, match="one GPU"):
        runtime.require_arch(_cuda("cuda:0"), _cuda("cuda:1"))
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        runtime.require_arch(_cuda("cuda:0"), torch.ones(1))


def test_require_arch_needs_a_tensor() -> None:
    with pytest.raises(ValueError, match="at least one"):
        runtime.require_arch()


def _key(**changes: object) -> CacheKey:
    args: dict[str, object] = {"kernel": "relu2_fwd", "source_sha256": "a" * 64, "arch": "sm_90a",
                               "specialisation": {"dtype": "bfloat16", "vec": 8}}
    args.update(changes)
    return runtime.cache_key(
        str(args["kernel"]), str(args["source_sha256"]), str(args["arch"]),
        cast(dict[str, object], args["specialisation"]),
    )


def test_cache_key_is_stable_and_order_free() -> None:
    assert _key() == _key(specialisation={"vec": 8, "dtype": "bfloat16"})
    assert _key().stem == _key().stem
    assert _key().stem.isidentifier()
    assert _key().dsl == runtime.dsl_version()


@pytest.mark.parametrize(
    "change",
    [
        {"source_sha256": "b" * 64},
        {"arch": "sm_100a"},
        {"kernel": "relu2_bwd"},
        {"specialisation": {"dtype": "float32", "vec": 8}},
        {"specialisation": {"dtype": "bfloat16", "vec": 1}},
        {"specialisation": {"dtype": "bfloat16", "vec": "8"}},
        {"specialisation": {"dtype": "bfloat16", "vec": 8, "extra": True}},
    ],
)
def test_cache_key_changes_with_source_arch_and_specialisation(change: dict[str, object]) -> None:
    assert _key(**change) != _key()
    assert _key(**change).stem != _key().stem


def test_cache_key_rejects_bad_arch_and_name() -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        _key(arch="sm_80")
    with pytest.raises(ValueError, match="identifier"):
        _key(kernel="relu2-fwd")


def test_import_cutlass_rejects_unknown_arch() -> None:
    with pytest.raises(ValueError, match="sm_90a, sm_100a"):
        runtime.import_cutlass("sm_89")


def test_memory_cache_builds_once() -> None:
    cache = KernelCache(None)
    built: list[object] = []

    def build() -> object:
        built.append(object())
        return built[-1]

    first = cache.compiled(_key(), build)
    assert cache.compiled(_key(), build) is first
    assert len(built) == 1
    assert [e.how for e in cache.events] == ["compile"]
    assert cache.path(_key()) is None
    cache.compiled(_key(arch="sm_100a"), build)
    assert len(built) == 2


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(runtime.CACHE_ENV, "off")
    assert runtime.default_cache_dir() is None
    monkeypatch.setenv(runtime.CACHE_ENV, str(tmp_path / "k"))
    assert runtime.default_cache_dir() == tmp_path / "k"
    monkeypatch.delenv(runtime.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert runtime.default_cache_dir() == tmp_path / "nmoe" / "kernels"


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("CUTE_DSL_ARCH", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


_PROBE = """
    import json, sys
    from pathlib import Path
    from nmoe.fast import activation, runtime
    arch, d = sys.argv[1], Path(sys.argv[2])
    runtime.import_cutlass(arch)
    import cutlass.cute as cute
    key = activation.RELU2_FWD.key(arch, dtype="bfloat16", vec=8)
    def build():
        host, fake = activation.RELU2_FWD.host_args(arch, dtype="bfloat16", vec=8)
        return cute.compile(host, *fake)
    def fail():
        raise AssertionError("compiled although the disk cache holds the kernel")
    first, second = runtime.KernelCache(d), runtime.KernelCache(d)
    first.compiled(key, build)
    loaded = second.compiled(key, fail)
    assert callable(getattr(loaded, "to"))
    try:
        runtime.import_cutlass("sm_100a")
        refused = ""
    except runtime.ArchError as e:
        refused = str(e)
    print(json.dumps({"events": [(e.how, e.seconds) for e in first.events + second.events],
                      "files": sorted(p.name for p in d.iterdir()), "stem": key.stem, "refused": refused}))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One fresh process (CuTeDSL fixes its arch at import): compile, export, reload, switch arch."""
    proc = _python(_PROBE, "sm_90a", str(tmp_path_factory.mktemp("kernels")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_disk_cache_round_trip_without_gpu(probe: dict[str, Any]) -> None:
    """A real CuTeDSL compile is exported to disk, and a fresh cache loads it instead of compiling."""
    assert [how for how, _ in probe["events"]] == ["compile", "disk"]
    assert probe["files"] == [f"{probe['stem']}.o"]
    (_, compile_s), (_, load_s) = probe["events"]
    assert load_s < compile_s


def test_import_cutlass_refuses_a_second_arch(probe: dict[str, Any]) -> None:
    assert "targets sm_90a, not sm_100a" in probe["refused"]
    assert "fresh process" in probe["refused"]


def test_compilecheck_usage_errors_exit_2(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    with pytest.raises(SystemExit) as exc:
        compilecheck.main(["--arch", "sm_80"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        compilecheck.main(["--arch", "sm_90a", "--ops", "no_such_op"])
    assert exc.value.code == 2
    assert "no kernels named or declared for ['no_such_op']; `--list`" in capsys.readouterr().err
    assert "CUTE_DSL_ARCH" not in os.environ


_PTX_OK = ".target sm_90a\n\tld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];\n\tmul.f32 %r5, %r1, %r1;\n"


def _spec(ptx: str | Exception, expect: tuple[str, ...] = (r"\.target sm_90a", r"mul\.f32"),
          forbid: tuple[str, ...] = (r"\.ftz\b",)) -> runtime.KernelSpec:
    def compile_(arch: str) -> str:
        if isinstance(ptx, Exception):
            raise ptx
        return ptx

    return runtime.KernelSpec(op="toy", name="toy_fwd", compile=compile_, expect={"sm_90a": expect},
                              forbid={"sm_90a": forbid}, launched_here=False)


def test_compilecheck_row_ok() -> None:
    row = compilecheck.check(_spec(_PTX_OK), "sm_90a")
    assert row["status"] == "ok" and row["error"] is None
    assert row["instructions"] == {r"\.target sm_90a": True, r"mul\.f32": True}
    assert row["forbidden"] == {r"\.ftz\b": False}
    assert set(row) >= {"op", "kernel", "arch", "status", "seconds", "instructions", "error"}


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (_spec(_PTX_OK.replace("mul.f32", "mul.ftz.f32")), "forbidden present"),
        (_spec(_PTX_OK, expect=(r"cvt\.rn\.bf16x2\.f32",)), "missing"),
        (_spec(RuntimeError("boom")), "RuntimeError: boom"),
        (_spec(_PTX_OK, expect=()), "no expected instructions"),
    ],
)
def test_compilecheck_row_fails(spec: runtime.KernelSpec, needle: str) -> None:
    row = compilecheck.check(spec, "sm_90a")
    assert row["status"] == "fail"
    assert needle in row["error"]


_ABI_PROBE = """
    import ctypes, json
    from nmoe.fast import op, runtime
    from nmoe.fast.combine import COMBINE_FWD
    runtime.import_cutlass("sm_90a")
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import BFloat16
    from cutlass.cute.runtime import make_ptr
    host, fake = COMBINE_FWD.host_args("sm_90a", k=8, vec=8, shared=True)
    compiled = cute.compile(host, *fake)
    slots = op.runtime_slots(host)
    class Recorder:
        def run_compiled_program(self, args):
            self.args = list(args)
    recorder = Recorder()
    launcher = op.Launcher(recorder, slots)
    values = (0x1000, 0x2000, 0x3000, 0x4000, 7, 4096, 2.5)
    import torch
    torch._C._cuda_getCurrentRawStream = lambda device: 0xABC
    torch._C._cuda_getDevice = lambda: 0
    launcher(0, *values)
    recorder_args = recorder.args
    ptr = lambda a: make_ptr(BFloat16, a, cute.AddressSpace.gmem, assumed_align=16)
    ptrs = [ptr(a) for a in values[:4]]
    exe, keep = compiled.generate_execution_args(*ptrs, *values[4:], cuda.CUstream(0xABC))
    read = lambda args: [ctypes.cast(a, ctypes.POINTER(t)).contents.value for a, (_, t) in zip(args, slots)]
    raw = lambda args, slots: [ctypes.string_at(a.value if isinstance(a, ctypes.c_void_p) else a,
                                                ctypes.sizeof(t)).hex() for a, (_, t) in zip(args, slots)]
    from nmoe.fast.router import EXPERT_COUNTS
    from cutlass import Int64
    host32, fake32 = EXPERT_COUNTS.host_args("sm_90a", E=64, ids_bits=64)
    slots32 = op.runtime_slots(host32)
    launcher32 = op.Launcher(recorder, slots32)
    launcher32(0, 0x5000, 0x6000, -7)
    ours32 = raw(recorder.args, slots32)
    ptrs32 = [make_ptr(Int64, a, cute.AddressSpace.gmem, assumed_align=8) for a in (0x5000, 0x6000)]
    exe32, keep32 = cute.compile(host32, *fake32).generate_execution_args(*ptrs32, -7, cuda.CUstream(0xABC))
    int32 = {"slots": [n for n, _ in slots32], "n_exe": len(exe32), "ours": ours32,
             "dsl": raw(exe32, slots32)}
    import importlib, pkgutil
    import nmoe.fast.kernels as kernels
    hosts = {}
    for m in pkgutil.walk_packages(kernels.__path__, "nmoe.fast.kernels."):
        mod = importlib.import_module(m.name)
        for name in dir(mod):
            if name.endswith("_host") and callable(getattr(mod, name)):
                hosts[f"{m.name}.{name}"] = len(op.runtime_slots(getattr(mod, name)))
    from bench.hostcpu import LAUNCH_VALUES
    from nmoe.fast import activation
    from nmoe.fast.gemm import sm90
    specs = {sm90.FWD: dict(n=256, k=128, bn=128, act="none"), sm90.DGRAD: dict(n=256, k=128, bn=128),
             sm90.WGRAD: dict(n=256, k=128, bn=128, ld=384),
             activation.RELU2_FWD: dict(dtype="bfloat16", vec=8),
             activation.RELU2_BWD: dict(dtype="bfloat16", vec=8)}
    values = {kern.name: len(op.runtime_slots(kern.host_args("sm_90a", **spec)[0])) - 1
              for kern, spec in specs.items()}
    print(json.dumps({"slots": [n for n, _ in slots], "n_exe": len(exe), "ours": read(recorder_args),
                      "dsl": read(exe), "hosts": hosts, "values": values, "bench": LAUNCH_VALUES,
                      "int32": int32, "bytes": [raw(recorder_args, slots), raw(exe, slots)]}))
"""


def test_launcher_fills_the_arguments_the_dsl_would_pass() -> None:
    """The launcher's argument storage holds byte for byte what CuTeDSL's own packing produces (addresses,
    int32/int64 scalars, the fp32 scale, the stream) on real compiles, and bench.hostcpu's hosts match."""
    proc = _python(_ABI_PROBE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["slots"] == ["py", "pw", "pshared", "pout", "t_rows", "h", "scale", "stream"]
    assert out["n_exe"] == len(out["slots"]) and out["ours"] == out["dsl"]
    assert len(out["hosts"]) >= 20 and all(n >= 2 for n in out["hosts"].values()), out["hosts"]
    assert out["bytes"][0] == out["bytes"][1]
    int32 = out["int32"]
    assert int32["slots"] == ["pids", "pcounts", "n_slots", "stream"]
    assert int32["n_exe"] == 4 and int32["ours"] == int32["dsl"], int32
    assert out["values"] == out["bench"], "bench.hostcpu's stand-in hosts must take what the real hosts take"


def test_source_files_follow_imports_inside_the_package() -> None:
    """The cache key's files come from the kernel module's imports (transitively), never a hand list."""
    module = "nmoe.fast.kernels.sm90.grouped_gemm_fp8"
    names = {p.relative_to(ROOT).as_posix() for p in op.source_files(module)}
    assert {"nmoe/fast/kernels/sm90/grouped_gemm_fp8.py", "nmoe/fast/kernels/sm90/grouped_gemm.py",
            "nmoe/fast/kernels/formats.py", "nmoe/constants.py", "nmoe/fast/kernels/activation.py",
            "nmoe/fast/kernels/swiglu.py", "nmoe/fast/kernels/prims.py", "nmoe/fast/limits.py"} <= names
    assert not any(n.startswith(("nmoe/reference", "nmoe/train", "nmoe/fast/gemm")) for n in names)
    digest = hashlib.sha256()
    for path in op.source_files(module):
        digest.update(runtime.file_sha256(path).encode())
    assert op.source_digest(module) == digest.hexdigest()


def test_source_files_resolve_relative_and_submodule_imports(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "nmoe_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nfrom .c import value\nimport os\n")
    (pkg / "b.py").write_text("")
    (pkg / "c.py").write_text("from nmoe_probe.b import *\nvalue = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(op, "PACKAGE", "nmoe_probe")
    op.source_files.cache_clear()
    op.imports.cache_clear()
    try:
        assert [p.name for p in op.source_files("nmoe_probe.a")] == ["a.py", "b.py", "c.py"]
    finally:
        op.source_files.cache_clear()
        op.imports.cache_clear()


def _host(**annotations: str) -> Any:
    """A stand-in host function whose parameters carry the annotation strings a kernel file writes."""
    def host(*args: Any) -> None: ...

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    host.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, kind, annotation=a) for n, a in annotations.items()])
    return host


def test_runtime_slots_refuse_an_unknown_argument_type() -> None:
    host = _host(px="Pointer", n="Int64", v="Constexpr[int]", stream="cuda.CUstream")
    assert [n for n, _ in op.runtime_slots(host)] == ["px", "n", "stream"]
    with pytest.raises(TypeError, match=r"cute\.Tensor"):
        op.runtime_slots(_host(px="Pointer", t="cute.Tensor", stream="cuda.CUstream"))
    with pytest.raises(TypeError, match="stream"):
        op.runtime_slots(_host(px="Pointer"))


def test_every_kernel_spec_names_a_registry_op() -> None:
    """KernelSpec.op joins a compile row to its parity op, so it must be a registry name."""
    from parity.registry import REGISTRY

    specs = [s for m in FAST_MODULES for s in importlib.import_module(m).KERNELS]
    assert specs and {s.op for s in specs} <= set(REGISTRY), {s.op for s in specs} - set(REGISTRY)
    assert len({s.name for s in specs}) == len(specs)


def test_gemm_front_refuses_missing_pairs_with_a_remedy(monkeypatch: pytest.MonkeyPatch) -> None:
    from nmoe.fast import gemm

    monkeypatch.setattr(runtime, "_arch_by_index", {0: "sm_100a"})
    with pytest.raises(ArchNotImplemented, match=r"dgrad: no sm_100a kernel: .*torch\._grouped_mm"):
        gemm.grouped_gemm_dgrad(_cuda(), _cuda(), _cuda())
    monkeypatch.setattr(runtime, "_arch_by_index", {0: "sm_90a"})
    with pytest.raises(ArchNotImplemented, match=r"nvfp4: no sm_90a kernel: .*B200"):
        gemm.grouped_gemm_nvfp4(*(_cuda() for _ in range(7)))
    assert gemm.implemented_archs("grouped_gemm") == ("sm_90a", "sm_100a")


def test_fast_package_never_imports_the_spec_parity_trainer_or_data() -> None:
    """docs/design.md's rule, read with ast (imports inside functions count): no fallback to the spec."""
    root = ROOT / "nmoe" / "fast"
    found = [f"{m}: {n}" for p in sorted(root.rglob("*.py"))
             for m in [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")]
             for n in sorted(op.imports(m))
             if n.startswith(("nmoe.reference", "nmoe.train", "nmoe.data", "parity"))]
    assert found == []


def test_no_path_imports_in_the_shared_top_level_modules() -> None:
    """docs/design.md: the modules both paths build on (one model definition among them) import no package."""
    shared = ("nmoe.constants", "nmoe.layout", "nmoe.config", "nmoe.modeldef")
    found = [f"{m}: {n}" for m in shared for n in sorted(op.imports(m))
             if n.startswith(("nmoe.reference", "nmoe.fast", "nmoe.train", "nmoe.data", "parity"))]
    assert found == []
    assert "nmoe.layout" in op.imports("nmoe.modeldef")


def test_fast_package_has_no_import_cycles() -> None:
    """Every import inside nmoe (module level or in a function), read with ast: the graph must be acyclic."""
    root = ROOT / "nmoe"
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for p in root.rglob("*.py")]
    graph = {m: op.imports(m) for m in modules}
    state: dict[str, int] = {}

    def visit(m: str, path: tuple[str, ...]) -> None:
        if state.get(m) == 2:
            return
        assert state.get(m) != 1, " -> ".join((*path, m))
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            visit(n, (*path, m))
        state[m] = 2

    for m in sorted(graph):
        visit(m, ())


def test_fast_op_routes_meta_cpu_and_grad_calls_through_the_dispatcher() -> None:
    """The direct eager path is for plain CUDA tensors recording no grad; everything else meets the op."""
    from nmoe.fast.activation import relu2

    cpu = torch.ones(4, dtype=torch.bfloat16)
    assert not op._eager((cpu,))
    assert not op._eager((torch.empty(4, device="meta"),))
    assert not op._eager((cpu.float().requires_grad_(),))
    assert relu2(torch.empty(3, 8, dtype=torch.bfloat16, device="meta")).shape == (3, 8)
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        relu2(cpu)
