"""nmoe.fast.runtime: arch guard, compile-cache keys, disk cache round trip, compilecheck usage."""

from __future__ import annotations

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

from nmoe.fast import compilecheck, runtime
from nmoe.fast.arch import ArchError
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
    monkeypatch.setattr(runtime, "_capability", lambda device: cap)
    assert runtime.require_arch(_cuda(), _cuda()) == arch


@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (12, 0), (10, 3)])
def test_require_arch_rejects_other_gpus_with_remedy(
    monkeypatch: pytest.MonkeyPatch, cap: tuple[int, int]
) -> None:
    monkeypatch.setattr(runtime, "_capability", lambda device: cap)
    monkeypatch.setattr(runtime, "_device_name", lambda device: "Some GPU")
    with pytest.raises(ArchError, match=rf"sm_{cap[0]}{cap[1]}.*nmoe\.reference"):
        runtime.require_arch(_cuda())


def test_require_arch_rejects_mixed_devices(monkeypatch: pytest.MonkeyPatch) -> None:
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
    k = activation._kernels(arch)
    import cutlass.cute as cute
    key = runtime.cache_key("relu2_fwd", activation._source_sha256(), arch, {"dtype": "bfloat16", "vec": 8})
    def build():
        host, args = k.compile_args("relu2_fwd", {"dtype": "bfloat16", "vec": 8})
        return cute.compile(host, *args)
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
    assert compilecheck.main(["--arch", "sm_90a", "--ops", "no_such_op"]) == 2
    assert "unknown ops ['no_such_op']; known ops: " in capsys.readouterr().err
    assert "CUTE_DSL_ARCH" not in os.environ


_PTX_OK = ".target sm_90a\n\tld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];\n\tmul.f32 %r5, %r1, %r1;\n"


def _spec(ptx: str | Exception, expect: tuple[str, ...] = (r"\.target sm_90a", r"mul\.f32"),
          forbid: tuple[str, ...] = (r"\.ftz\b",)) -> runtime.KernelSpec:
    def compile_(arch: str) -> str:
        if isinstance(ptx, Exception):
            raise ptx
        return ptx

    return runtime.KernelSpec(op="toy", name="toy_fwd", compile=compile_, expect={"sm_90a": expect},
                              forbid={"sm_90a": forbid})


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


_LAUNCH_PROBE = """
    import contextlib, json
    import torch
    from nmoe.fast import activation, runtime

    calls = []

    class Cache:
        def executor(self, key, build):
            build()
            spec = dict(key.specialisation)
            return lambda *args: calls.append((key.kernel, spec, [type(a).__name__ for a in args], args[-2:]))

    runtime.require_arch = lambda *ts: "sm_90a"
    runtime.kernel_cache = lambda: Cache()
    runtime.current_stream = lambda device: "stream"
    torch.cuda.device = lambda device: contextlib.nullcontext()
    x = torch.ones(1000, dtype=torch.bfloat16)
    activation._launch("relu2_fwd", (x,), torch.empty_like(x))
    print(json.dumps(calls))
"""


def test_launch_compiles_with_the_spec_and_passes_pointers_scalars_stream() -> None:
    """runtime.launch wiring without a GPU: a real compile from compile_args(kernel, spec), then typed
    pointers from pointers(kernel, addresses, spec), the scalars and the stream, in that order."""
    proc = _python(_LAUNCH_PROBE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [(kernel, spec, types, tail)] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert kernel == "relu2_fwd" and spec == {"dtype": "'bfloat16'", "vec": "8"}
    assert len(types) == 4 and tail == [1000, "stream"]
