"""Programmatic dependent launch (limits.FAST_PDL): every kernel nmoe launches takes the launch attribute and
waits for the grid before it as its first step (prims.await_upstream), checked in the source on CPU and, with
the limit forced on in a fresh process, in the PTX of kernels compiled for both arches."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from test_fast_gemm import child_env

from nmoe.fast import attention, compilecheck, limits
from nmoe.fast.arch import SUPPORTED_ARCHS
from nmoe.fast.compilecheck import PDL_WAIT, PDL_WAIT_FIRST, pdl_rules
from nmoe.fast.runtime import KernelSpec
from nmoe.provenance import REPO_ROOT

KERNELS_DIR = REPO_ROOT / "nmoe" / "fast" / "kernels"


def _is_kernel(node: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Attribute) and d.attr == "kernel" for d in node.decorator_list)


def pdl_findings(src: str) -> tuple[int, list[str]]:
    """(kernels, problems) of one source file: a @cute.kernel whose first statement after its docstring is
    not await_upstream(), or a .launch(...) without use_pdl=PDL."""
    tree = ast.parse(src)
    kernels, problems = 0, []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and _is_kernel(node):
            kernels += 1
            body = node.body
            doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            first = body[1] if doc and len(body) > 1 else body[0]
            call = first.value if isinstance(first, ast.Expr) else None
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "await_upstream"):
                problems.append(f"{node.name}: first statement is not await_upstream()")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "launch":
            pdl = [k for k in node.keywords if k.arg == "use_pdl"]
            if not (pdl and isinstance(pdl[0].value, ast.Name) and pdl[0].value.id == "PDL"):
                problems.append(f"line {node.lineno}: .launch(...) without use_pdl=PDL")
    return kernels, problems


GOOD = '''
@cute.kernel
def k(p: Pointer) -> None:
    """doc"""
    await_upstream()
    x = p[0]

@cute.jit
def host(p: Pointer, stream: cuda.CUstream) -> None:
    k(p).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream, use_pdl=PDL)
'''


def test_sep_launch_fast_pdl_kernel_unawaited() -> None:
    """Every kernel awaits upstream first, every launch takes the attribute: hand vectors, then the tree."""
    bad = GOOD.replace("    await_upstream()\n", "").replace(", use_pdl=PDL", "")
    assert pdl_findings(GOOD) == (1, [])
    assert pdl_findings(bad)[1] == ["k: first statement is not await_upstream()",
                                    "line 9: .launch(...) without use_pdl=PDL"]
    files = sorted(p for p in KERNELS_DIR.rglob("*.py") if "@cute.kernel" in p.read_text())
    total = 0
    for path in files:
        kernels, problems = pdl_findings(path.read_text())
        assert not problems, (path.name, problems)
        total += kernels
    assert len(files) >= 18 and total >= 47, (len(files), total)


def _spec(launched_here: bool) -> KernelSpec:
    return KernelSpec("op", "k", lambda arch: "", {}, {}, launched_here)


GOOD_PTX = "ld.param.u64 %rd1, [p];\nmov.u32 %r1, %tid.x;\ngriddepcontrol.wait;\nld.global.u32 %r2, [%rd1];"
NO_WAIT_PTX = GOOD_PTX.replace("griddepcontrol.wait;\n", "")


def test_pdl_rules_follow_the_limit_and_spare_flash_attention() -> None:
    late = "ld.global.u32 %r2, [%rd1];\ngriddepcontrol.wait;"
    tma_first = "cp.async.bulk.tensor.4d.shared::cluster.global [a], [b];\ngriddepcontrol.wait;"
    assert not re.search(PDL_WAIT_FIRST, late) and not re.search(PDL_WAIT_FIRST, tma_first)
    assert re.search(PDL_WAIT, late) and re.search(PDL_WAIT, GOOD_PTX)
    assert not re.search(PDL_WAIT, NO_WAIT_PTX)
    want = ((PDL_WAIT_FIRST,), ()) if limits.FAST_PDL else ((), (PDL_WAIT,))
    assert pdl_rules(_spec(True)) == want
    assert pdl_rules(_spec(False)) == ((), ())
    assert all(not s.launched_here for s in attention.KERNELS if s.name.startswith("fa4_"))


def _under_pdl(module: str, args: Sequence[str], cache: str,
               timeout: float) -> subprocess.CompletedProcess[str]:
    """`module`.main(args) in a fresh process with limits.FAST_PDL on (kernels and PTX rules read it at
    import), its kernels in `cache`: the disk cache keys sources, not the limit's value."""
    code = (f"import sys\nfrom nmoe.fast import limits\nlimits.FAST_PDL = True\nimport {module}\n"
            f"raise SystemExit({module}.main(sys.argv[1:]))")
    env = child_env({"NMOE_KERNEL_CACHE": cache}, drop=("CUTE_DSL_ARCH",))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          env=env, timeout=timeout)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_sep_launch_fast_pdl_wait_dropped(arch: str) -> None:
    """Under PDL the compiled kernels wait before any memory access: the rule tells a late or absent wait
    from a first one, then holds on two kernels compiled with the limit on."""
    assert re.search(PDL_WAIT_FIRST, GOOD_PTX) and not re.search(PDL_WAIT_FIRST, NO_WAIT_PTX)
    names = ("combine_gather_fwd", "spread_rows_v128")
    p = _under_pdl("nmoe.fast.compilecheck", ["--arch", arch, "--json", "--kernels", ",".join(names)], "off",
                   compilecheck.TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert sorted(r["kernel"] for r in rows) == sorted(names), rows
    for r in rows:
        assert r["status"] == "ok", r
        assert r["instructions"].get(PDL_WAIT_FIRST) is True, r


def test_limit_keys_the_kernel_cache() -> None:
    """An edit of FAST_PDL must not reuse kernels compiled the other way: limits.py is in prims' sources."""
    from nmoe.fast.op import source_files

    assert Path(limits.__file__).resolve() in {p.resolve() for p in source_files("nmoe.fast.kernels.prims")}


UNDER_PDL_TESTS = ("tests/test_fast_moe_graph.py", "tests/test_fast_moe.py", "-k",
                   "(graph and not fp8) or (values_and_grads and gathered and bf16)")
"""The routing graphs, the bf16 layer's one-graph replays and its values and gradients: 7 tests."""


@pytest.mark.gpu
def test_layer_and_routing_graphs_pass_under_pdl(tmp_path: Path) -> None:
    """With the limit on (a fresh process, its kernels compiled into their own cache: the disk cache keys
    sources, not the limit's value), the layer and routing GPU tests pass as they do with it off."""
    workers = ["-n", "4"] if importlib.util.find_spec("xdist") else []
    args = ["-q", "-p", "no:cacheprovider", "-m", "gpu", *workers, *UNDER_PDL_TESTS]
    p = _under_pdl("pytest", args, str(tmp_path / "kernels"), 1800)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert re.search(r"\b7 passed\b", p.stdout) and " failed" not in p.stdout, p.stdout[-2000:]
