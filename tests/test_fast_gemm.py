"""nmoe.fast.gemm (sm_90a grouped GEMM): PTX compile checks on CPU; on GPU the bound(1, 2) contract against a
float64 oracle written here: |fast - ref64| <= 1 ulp(bf16 at ref64) + 2 K 2^-24 (|A| |B|), elementwise.
The fused-activation forward is tested in test_fast_gemm_act."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from fastcompile import compile_rows
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nmoe.checkout import tree_pythonpath
from nmoe.fast import op, runtime
from nmoe.fast.arch import ArchError
from nmoe.fast.gemm import grouped_gemm, grouped_gemm_act, grouped_gemm_dgrad, grouped_gemm_wgrad
from nmoe.fast.gemm import sm90 as gemm
from nmoe.fast.gemm.routing import require, tile_upper_bound
from nmoe.fast.gemm.sm90 import KERNELS
from nmoe.fast.limits import GEMM_BN_CHOICES, GEMM_MAX_GROUPS

ROOT = Path(__file__).resolve().parents[1]
U_ACC = 2.0**-24
BK = 64
gpu = pytest.mark.gpu

# ---------------------------------------------------------------------------------------------------------
# Oracle: per-group float64 products (exact for bf16 inputs up to the K-term sum) and the contract bound.
# ---------------------------------------------------------------------------------------------------------


def child_env(extra: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH (tree_pythonpath, so the installed
    CuTeDSL stays reachable), `extra` set and `drop` unset, for a child."""
    env = {**os.environ, "PYTHONPATH": tree_pythonpath(ROOT, os.environ.get("PYTHONPATH")), **(extra or {})}
    return {k: v for k, v in env.items() if k not in drop}


def ends_to_ranges(ends: Sequence[int]) -> list[tuple[int, int]]:
    starts = [0, *ends[:-1]]
    return list(zip(starts, ends, strict=True))


def oracle(a: Tensor, b_of: Any, ends: Sequence[int], n: int) -> tuple[Tensor, Tensor]:
    """ref[rows of e] = a[rows] @ b_of(e) in float64 and mag = |a| @ |b|; rows past the last end stay 0."""
    ref = torch.zeros(a.shape[0], n, dtype=torch.float64, device=a.device)
    mag = torch.zeros_like(ref)
    for e, (s, t) in enumerate(ends_to_ranges(ends)):
        if t > s:
            b = b_of(e).double()
            ref[s:t] = a[s:t].double() @ b
            mag[s:t] = a[s:t].double().abs() @ b.abs()
    return ref, mag


def ulp_bf16(v: Tensor) -> Tensor:
    """bf16 spacing at |v|: 2^(floor(log2|v|) - 7), and the subnormal spacing 2^-133 below 2^-126."""
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0**-126))) - 7)


def excess(out: Tensor, ref: Tensor, mag: Tensor, k: int) -> Tensor:
    """Elementwise |out - ref| / allowed; <= 1 everywhere is the contract. NaN counts as a violation."""
    err = (out.double() - ref).abs()
    allowed = ulp_bf16(ref) + 2 * k * U_ACC * mag
    return torch.nan_to_num(err / allowed, nan=float("inf"))


def assert_bound(out: Tensor, ref: Tensor, mag: Tensor, k: int) -> None:
    ratio = excess(out, ref, mag, k)
    worst = float(ratio.max()) if ratio.numel() else 0.0
    if worst > 1:
        idx = int(ratio.argmax())
        r, c = divmod(idx, ratio.shape[1])
        pytest.fail(f"bound(1,2) violated: ratio {worst:.3g} at row {r} col {c}: out {float(out[r, c])} "
                    f"ref {float(ref[r, c])}")


def violates(candidate: Tensor, ref: Tensor, mag: Tensor, k: int) -> bool:
    return bool((excess(candidate, ref, mag, k) > 1).any())


def zipf_counts(m: int, e: int, s: float = 1.2) -> list[int]:
    p = [1.0 / (i + 1) ** s for i in range(e)]
    c = [int(m * q / sum(p)) for q in p]
    c[0] += m - sum(c)
    return c


def uniform_counts(m: int, e: int) -> list[int]:
    return [m // e + (1 if i < m % e else 0) for i in range(e)]


def cumsum(counts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        acc += c
        out.append(acc)
    return out


def make(m: int, n: int, k: int, e: int, seed: int, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * scale).to(torch.bfloat16).cuda()
    w = (torch.randn(e, n, k, generator=g) * scale).to(torch.bfloat16).cuda()
    return x, w


def into_nan(shapes: Sequence[tuple[int, int]], op: Callable[[], Any]) -> Any:
    """op()'s results, its bf16 outputs (torch.empty, in `shapes`' order) handed blocks the caching
    allocator just held NaN in, so an output element the kernel never writes shows."""
    junk = [torch.full(s, float("nan"), dtype=torch.bfloat16, device="cuda") for s in shapes]
    del junk
    out = op()
    torch.cuda.synchronize()
    return out


def offs_of(ends: Sequence[int]) -> Tensor:
    return torch.tensor(list(ends), dtype=torch.int32, device="cuda")


def check_fwd(m: int, n: int, k: int, counts: Sequence[int], seed: int = 0, bn: int | None = None) -> None:
    x, w = make(m, n, k, len(counts), seed)
    ends = cumsum(counts)
    if bn is None:
        y = grouped_gemm(x, w, offs_of(ends))
    else:
        y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemm._launch("test", x, w, offs_of(ends), y, True, bn)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    ref, mag = oracle(x, lambda e: w[e].t(), ends, n)
    assert_bound(y, ref, mag, k)


def wgrad_oracle(dy: Tensor, x: Tensor, ends: Sequence[int]) -> tuple[Tensor, Tensor]:
    """ref[e] = dy[rows of e]^T @ x[rows of e] in float64 (zeros for empty groups) and |dy|^T @ |x|."""
    ref = torch.zeros(len(ends), dy.shape[1], x.shape[1], dtype=torch.float64, device=dy.device)
    mag = torch.zeros_like(ref)
    for e, (s, t) in enumerate(ends_to_ranges(ends)):
        ref[e] = dy[s:t].double().t() @ x[s:t].double()
        mag[e] = dy[s:t].double().abs().t() @ x[s:t].double().abs()
    return ref, mag


def assert_wgrad_bound(dw: Tensor, ref: Tensor, mag: Tensor, ends: Sequence[int]) -> None:
    for e, (s, t) in enumerate(ends_to_ranges(ends)):
        assert_bound(dw[e], ref[e], mag[e], max(t - s, 1))


def check_wgrad(m: int, n: int, k: int, counts: Sequence[int], seed: int = 0, bn: int | None = None) -> None:
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    ends = cumsum(counts)
    if bn is None:
        dw = grouped_gemm_wgrad(dy, x, offs_of(ends))
    else:
        dw = torch.full((len(counts), n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemm._launch_wgrad(dy, x, offs_of(ends), dw, bn)
    assert dw.shape == (len(counts), n, k) and dw.dtype == torch.bfloat16
    ref, mag = wgrad_oracle(dy, x, ends)
    assert_wgrad_bound(dw, ref, mag, ends)


def check_dgrad(m: int, n: int, k: int, counts: Sequence[int], seed: int = 0, bn: int | None = None) -> None:
    _, w = make(0, n, k, len(counts), seed)
    dy = torch.randn(m, n, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16).cuda()
    ends = cumsum(counts)
    if bn is None:
        dx = grouped_gemm_dgrad(dy, w, offs_of(ends))
    else:
        dx = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemm._launch("test", dy, w, offs_of(ends), dx, False, bn)
    assert dx.shape == (m, k)
    ref, mag = oracle(dy, lambda e: w[e], ends, k)
    assert_bound(dx, ref, mag, n)


# ---------------------------------------------------------------------------------------------------------
# CPU: declarations, compile checks, refusals, fake shapes, the oracle and the schedule bound.
# ---------------------------------------------------------------------------------------------------------


def test_kernels_declare_sm90_only() -> None:
    assert {s.op for s in KERNELS} == {"grouped_gemm", "grouped_gemm_dgrad", "grouped_gemm_wgrad",
                                       "grouped_gemm_act"}
    assert len({s.name for s in KERNELS}) == len(KERNELS) >= 3
    fused = {s.name for s in KERNELS if s.op == "grouped_gemm_act" and "gathered" not in s.name}
    assert fused == {f"grouped_gemm_act_{a}_n{bn}" for a in gemm.ACTIVATIONS for bn in GEMM_BN_CHOICES} | {
        "grouped_gemm_act_swiglu_pingpong", "grouped_gemm_act_swiglu_deferred_n256"}
    gathered = {s.name for s in KERNELS if "gathered" in s.name}
    assert gathered == {"grouped_gemm_act_gathered_swiglu_n256", "grouped_gemm_act_gathered_relu2_n128",
                        "grouped_gemm_act_gathered_relu2_n128_k288",
                        "grouped_gemm_act_gathered_relu2_n128_deferred",
                        "grouped_gemm_act_gathered_swiglu_pingpong",
                        "grouped_gemm_act_gathered_swiglu_n256_dynamic",
                        "grouped_gemm_act_gathered_swiglu_n256_act_only_dynamic",
                        "grouped_gemm_act_gathered_swiglu_n256_deferred",
                        "grouped_gemm_act_gathered_swiglu_n256_act_only_deferred",
                        "grouped_gemm_dgrad_gathered_n256", "grouped_gemm_dgrad_gathered_n256_deferred",
                        "grouped_gemm_dgrad_gathered_n256_dynamic",
                        "grouped_gemm_dgrad_gathered_n256_spill_dynamic",
                        "grouped_gemm_dgrad_gathered_n128_spill_k_tail",
                        "grouped_gemm_wgrad_gathered_x_n256", "grouped_gemm_wgrad_gathered_x_n128",
                        "grouped_gemm_wgrad_gathered_dy_n128",
                        "grouped_gemm_wgrad_gathered_dy_accumulate_n256",
                        "grouped_gemm_wgrad_gathered_x_on_m_n256",
                        "grouped_gemm_wgrad_gathered_x_on_m_accumulate_n128",
                        "grouped_gemm_wgrad_gathered_x_on_m_dynamic_n256",
                        "grouped_gemm_wgrad_gathered_dy_accumulate_dynamic_n128"}
    for spec in KERNELS:
        if spec.name.startswith(("grouped_gemm_act_gathered", "grouped_gemm_dgrad_gathered")):
            assert any("cp\\.async\\.cg" in rx for rx in spec.expect["sm_90a"]), spec.name
            assert any("tensor\\.2d\\.shared::cta\\.global" in rx for rx in spec.forbid["sm_90a"]), spec.name
    for spec in KERNELS:
        assert set(spec.expect) == set(spec.forbid) == {"sm_90a"}
        assert any("wgmma" in rx for rx in spec.expect["sm_90a"])
        assert any("cp\\.async\\.bulk\\.tensor" in rx for rx in spec.expect["sm_90a"])
        for rx in (*spec.expect["sm_90a"], *spec.forbid["sm_90a"]):
            re.compile(rx)


@pytest.fixture(scope="module")
def gemm_compile_rows() -> dict[str, list[dict[str, Any]]]:
    return compile_rows("nmoe.fast.gemm.sm90")


def test_sm90a_kernels_compile_without_gpu(gemm_compile_rows: dict[str, list[dict[str, Any]]]) -> None:
    rows = gemm_compile_rows["sm_90a"]
    assert [r["kernel"] for r in rows] == [s.name for s in KERNELS]
    for row in rows:
        assert row["status"] == "ok", row
        assert all(row["instructions"].values()) and not any(row["forbidden"].values()), row


def test_sm100a_compile_refuses_naming_the_remedy(gemm_compile_rows: dict[str, list[dict[str, Any]]]) -> None:
    for row in gemm_compile_rows["sm_100a"]:
        assert row["status"] == "not run"
        assert "sm_90a kernel, not built for sm_100a" in row["error"], row
        assert "nmoe.fast.gemm.grouped_gemm" in row["error"], row


def test_sm100a_dispatch_raises() -> None:
    with pytest.raises(ArchError, match=r"sm_90a kernel, called on sm_100a.*nmoe\.fast\.gemm\.grouped_gemm,"):
        require("grouped_gemm", "sm_100a", "sm_90a")


def test_cpu_tensors_are_refused_naming_reference() -> None:
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    w = torch.zeros(2, 8, 8, dtype=torch.bfloat16)
    offs = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        grouped_gemm(x, w, offs)
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        grouped_gemm_dgrad(x, w, offs)
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        grouped_gemm_wgrad(x, x, offs)


@pytest.mark.parametrize(("x", "w", "offs", "match"), [
    ((4, 8), (2, 8, 8), torch.int64, "int32"),
    ((4, 16), (2, 8, 8), torch.int32, r"R = w.shape"),
    ((4, 12), (2, 8, 12), torch.int32, "multiple of 8"),
])
def test_bad_inputs_raise_with_fix(x: tuple[int, ...], w: tuple[int, ...], offs: torch.dtype,
                                   match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gemm._check("grouped_gemm", torch.zeros(x, dtype=torch.bfloat16),
                    torch.zeros(w, dtype=torch.bfloat16), torch.zeros(w[0], dtype=offs), "x", 2)
    with pytest.raises(ValueError, match="bfloat16"):
        gemm._check("grouped_gemm", torch.zeros(4, 8), torch.zeros(2, 8, 8, dtype=torch.bfloat16),
                    torch.zeros(2, dtype=torch.int32), "x", 2)


def test_wgrad_bad_inputs_raise_with_fix() -> None:
    bf = torch.bfloat16
    with pytest.raises(ValueError, match=r"dy \[M, N\] and x \[M, K\]"):
        gemm._check_wgrad(torch.zeros(4, 8, dtype=bf), torch.zeros(5, 8, dtype=bf),
                          torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 8"):
        gemm._check_wgrad(torch.zeros(4, 12, dtype=bf), torch.zeros(4, 8, dtype=bf),
                          torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        gemm._check_wgrad(torch.zeros(4, 8, dtype=bf), torch.zeros(4, 8, dtype=bf), torch.zeros(2))
    with pytest.raises(ValueError, match="split the experts"):
        gemm._check_wgrad(torch.zeros(4, 8, dtype=bf), torch.zeros(4, 8, dtype=bf),
                          torch.zeros(GEMM_MAX_GROUPS + 1, dtype=torch.int32))


def test_custom_ops_have_fake_shapes() -> None:
    x = torch.empty(5, 24, device="meta", dtype=torch.bfloat16)
    w = torch.empty(3, 40, 24, device="meta", dtype=torch.bfloat16)
    offs = torch.empty(3, device="meta", dtype=torch.int32)
    y = torch.ops.nmoe.grouped_gemm(x, w, offs)
    assert (y.shape, y.dtype) == ((5, 40), torch.bfloat16)
    dy = torch.empty(5, 40, device="meta", dtype=torch.bfloat16)
    dx = torch.ops.nmoe.grouped_gemm_dgrad(dy, w, offs)
    assert dx.shape == (5, 24)
    dw = torch.ops.nmoe.grouped_gemm_wgrad(dy, x, offs)
    assert (dw.shape, dw.dtype) == ((3, 40, 24), torch.bfloat16)
    for act, width in (("swiglu", 20), ("relu2", 40)):
        a, h = torch.ops.nmoe.grouped_gemm_act(x, w, offs, act)
        assert (a.shape, h.shape, a.dtype, h.dtype) == ((5, width), (5, 40), torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_fused_autograd_keeps_h_and_differentiates_x_and_w(act: str) -> None:
    x = torch.empty(5, 24, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(3, 40, 24, device="meta", dtype=torch.bfloat16, requires_grad=True)
    a, h = torch.ops.nmoe.grouped_gemm_act(x, w, torch.empty(3, device="meta", dtype=torch.int32), act)
    assert a.requires_grad and not h.requires_grad
    torch.autograd.backward(a, torch.empty_like(a))
    assert x.grad is not None and w.grad is not None
    assert (x.grad.shape, w.grad.shape) == ((5, 24), (3, 40, 24))


def test_fused_activation_refuses_unknown_activation_and_odd_n() -> None:
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    offs = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="'swiglu' or 'relu2'"):
        grouped_gemm_act(x, torch.zeros(2, 8, 8, dtype=torch.bfloat16), offs, "gelu")
    with pytest.raises(ValueError, match=r"even N.*interleave w1 and w3 into w13"):
        grouped_gemm_act(x, torch.zeros(2, 7, 8, dtype=torch.bfloat16), offs, "swiglu")
    with pytest.raises(ValueError, match="'swiglu' or 'relu2'"):
        torch.ops.nmoe.grouped_gemm_act(x.to("meta"), torch.empty(2, 8, 8, device="meta"), offs.to("meta"),
                                        "silu")
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        grouped_gemm_act(x, torch.zeros(2, 8, 8, dtype=torch.bfloat16), offs, "relu2")


_BROKEN_PAIRING = """
from nmoe.fast import runtime
runtime.import_cutlass("sm_90a")
import cutlass.cute as cute
from nmoe.fast.kernels.sm90 import tiles as g
right = g.store_copy

def column_major_threads(bn, width, n_threads=g.CONSUMER_THREADS):
    atom, tiled = right(bn, width, n_threads)
    rows = n_threads // (bn // g.VEC)
    threads = cute.make_layout((rows, bn // g.VEC), stride=(1, rows))
    wrong = cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, width)))
    return (atom, tiled) if width == g.VEC else (atom, wrong)

@cute.jit
def main():
    g.check_pairing(128, "swiglu")
    g.check_pairing(256, "relu2")
    print("correct pairing accepted", flush=True)
    g.store_copy = column_major_threads
    g.check_pairing(128, "swiglu")

cute.compile(main)
"""


def test_epilogue_pairing_check_rejects_misaligned_output_chunks(tmp_path: Path) -> None:
    """The trace-time pairing proof accepts the real store copies and rejects a transposed output copy."""
    (tmp_path / "broken_pairing.py").write_text(_BROKEN_PAIRING)
    env = child_env()
    env.pop("CUTE_DSL_ARCH", None)
    proc = subprocess.run([sys.executable, "broken_pairing.py"], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=600)
    assert "correct pairing accepted" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode != 0 and "swiglu epilogue pairing broken" in proc.stdout + proc.stderr


def test_kernel_source_hash_covers_the_kernel_file() -> None:
    kernels = ROOT / "nmoe" / "fast" / "kernels"
    shared = {kernels / f"{m}.py" for m in ("activation", "swiglu", "prims")}
    assert {kernels / "sm90" / "grouped_gemm.py", *shared} <= set(op.source_files(gemm.FWD.module))
    assert {kernels / "sm90" / "grouped_gemm_wgrad.py", kernels / "sm90" / "grouped_gemm.py",
            *shared} <= set(op.source_files(gemm.WGRAD.module))


def count_tiles(ends: Sequence[int], m: int, n: int, bn: int, cm: int = 1) -> int:
    """Independent count of the kernel's work list: each block of cm x 128 rows of each group and of the
    tail."""
    tiles, start = 0, 0
    for end in [*ends, m]:
        tiles += len(range(start, end, 128 * cm)) * len(range(0, n, bn))
        start = end
    return tiles


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 700), min_size=1, max_size=40), tail=st.integers(0, 300),
       n=st.sampled_from([8, 128, 200, 256, 4096]), bn=st.sampled_from([128, 256]),
       cm=st.sampled_from([1, 2]))
def test_grid_bound_covers_every_routing(counts: list[int], tail: int, n: int, bn: int, cm: int) -> None:
    ends = cumsum(counts)
    m = ends[-1] + tail
    assert tile_upper_bound(m, n, len(counts), bn, cm) >= count_tiles(ends, m, n, bn, cm)


@pytest.mark.parametrize("sms", [132, 133, 8])
def test_fwd_grid_is_whole_clusters_one_cta_per_sm(monkeypatch: pytest.MonkeyPatch, sms: int) -> None:
    """A cluster launch needs a grid of whole clusters: never more CTAs than SMs, never a lone CTA."""
    monkeypatch.setattr(runtime, "sm_count", lambda index: sms)
    for m, n_groups in ((1, 1), (300, 2), (262144, 128)):
        for cm in (1, 2):
            ctas = gemm.fwd_ctas(0, m, 2048, n_groups, 256, cm)
            assert ctas % cm == 0 and cm <= ctas <= sms


def test_oracle_ulp_and_bound_hand_values() -> None:
    v = torch.tensor([1.0, 1.5, 2.0, 255.0, 256.0, 0.0, 2.0**-130, -3.0], dtype=torch.float64)
    assert ulp_bf16(v).tolist() == [2.0**-7, 2.0**-7, 2.0**-6, 1.0, 2.0, 2.0**-133, 2.0**-133, 2.0**-6]
    ref = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    mag = torch.tensor([[2.0**20, 0.0]], dtype=torch.float64)
    # allowed = 2^-7 + 2*8*2^-24*2^20 = 2^-7 + 1 for the first element; exactly 2^-133 for the zero.
    assert float(excess(torch.tensor([[2.0, 0.0]]), ref, mag, 8)[0, 0]) == pytest.approx(1 / (1 + 2.0**-7))
    assert violates(torch.tensor([[1.0, 2.0**-132]]), ref, mag, 8)
    assert not violates(torch.tensor([[1.0, 0.0]]), ref, mag, 8)


def test_uniform_and_zipf_counts() -> None:
    assert uniform_counts(10, 4) == [3, 3, 2, 2]
    z = zipf_counts(1000, 8)
    assert sum(z) == 1000 and z == sorted(z, reverse=True) and z[0] > 3 * z[-1]


# ---------------------------------------------------------------------------------------------------------
# GPU: the forward and dgrad against the float64 oracle.
# ---------------------------------------------------------------------------------------------------------


@gpu
def test_fwd_uniform() -> None:
    check_fwd(2048, 512, 1024, uniform_counts(2048, 8))


@gpu
def test_fwd_zipf_skewed() -> None:
    check_fwd(4000, 512, 1024, zipf_counts(4000, 32), seed=1)


@gpu
def test_fwd_empty_and_one_row_groups_and_ragged_m() -> None:
    counts = [0, 1, 0, 0, 129, 1, 2, 127, 0, 1, 300, 0]
    check_fwd(sum(counts) + 5, 512, 1024, counts, seed=2)


@gpu
@pytest.mark.parametrize("bn", [128, 256])
def test_fwd_both_tile_widths_and_ragged_n_k(bn: int) -> None:
    counts = [130, 0, 257, 3, 64]
    check_fwd(sum(counts) + 2, 200, 72, counts, seed=3, bn=bn)
    check_fwd(sum(counts), 512, 1024, counts, seed=4, bn=bn)


@gpu
def test_fwd_wide_tile_default_for_large_n() -> None:
    assert gemm.pick_bn(4096) == 256
    check_fwd(1000, 4096, 256, zipf_counts(1000, 8), seed=5)


@gpu
def test_fwd_rows_past_last_end_are_zero() -> None:
    counts = [0, 5, 0]
    x, w = make(300, 136, 72, 3, seed=6)
    y = torch.full((300, 136), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm._launch("test", x, w, offs_of(cumsum(counts)), y, True)
    assert bool((y[5:] == 0).all())
    ref, mag = oracle(x, lambda e: w[e].t(), cumsum(counts), 136)
    assert_bound(y, ref, mag, 72)


@gpu
@pytest.mark.parametrize("counts", [[0, 0, 0], [333], [0, 0, 333]])
def test_fwd_degenerate_routings(counts: list[int]) -> None:
    check_fwd(333, 256, 128, counts, seed=7)


@gpu
def test_fwd_many_groups() -> None:
    counts = zipf_counts(6000, 256)
    check_fwd(6000, 256, 256, counts, seed=8)


@gpu
@settings(max_examples=8, deadline=None)
@given(counts=st.lists(st.integers(0, 300), min_size=1, max_size=12), tail=st.integers(0, 130),
       nk=st.sampled_from([(136, 72), (256, 256)]), seed=st.integers(0, 2**31 - 1))
def test_fwd_random_routings(counts: list[int], tail: int, nk: tuple[int, int], seed: int) -> None:
    m = sum(counts) + tail
    if m == 0:
        return
    check_fwd(m, nk[0], nk[1], counts, seed=seed)


@gpu
@pytest.mark.parametrize("counts", [[500, 0, 1, 700], zipf_counts(3000, 16)])
def test_dgrad(counts: list[int]) -> None:
    check_dgrad(sum(counts) + 3, 512, 1024, counts, seed=9)


@gpu
@pytest.mark.parametrize("bn", [128, 256])
def test_dgrad_ragged_and_both_widths(bn: int) -> None:
    check_dgrad(700, 136, 200, [0, 300, 1, 390], seed=10, bn=bn)


@gpu
@pytest.mark.parametrize("counts", [[500, 0, 1, 63, 64, 65, 700], zipf_counts(3000, 16), [0, 0, 0]])
def test_wgrad(counts: list[int]) -> None:
    check_wgrad(sum(counts) + 7, 256, 512, counts, seed=19)


@gpu
@pytest.mark.parametrize("bn", [128, 256])
def test_wgrad_ragged_and_both_widths(bn: int) -> None:
    check_wgrad(900, 136, 200, [0, 300, 1, 129, 0, 400], seed=20, bn=bn)


@gpu
def test_wgrad_long_group() -> None:
    check_wgrad(20000, 128, 256, [17000, 3000], seed=21)


@gpu
def test_autograd_uses_dgrad_and_wgrad() -> None:
    counts = [100, 0, 156]
    ends = cumsum(counts)
    x, w = make(260, 256, 128, 3, seed=11)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    dy = torch.randn(260, 256, device="cuda").to(torch.bfloat16)
    torch.autograd.backward(grouped_gemm(xr, wr, offs_of(ends)), dy)
    assert xr.grad is not None and wr.grad is not None
    ref, mag = oracle(dy, lambda e: w[e], ends, 128)
    assert_bound(xr.grad, ref, mag, 256)
    wref, wmag = wgrad_oracle(dy, x, ends)
    assert_wgrad_bound(wr.grad, wref, wmag, ends)


@gpu
def test_routing_change_needs_no_sync_and_no_recompile() -> None:
    x, w = make(1024, 256, 256, 8, seed=12)
    first = offs_of(cumsum(uniform_counts(1024, 8)))
    grouped_gemm(x, w, first)
    compiles = [ev for ev in runtime.kernel_cache().events if ev.how == "compile"]
    ends = cumsum(zipf_counts(1000, 8))
    second = offs_of(ends)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = grouped_gemm(x, w, second)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [ev for ev in runtime.kernel_cache().events if ev.how == "compile"] == compiles
    ref, mag = oracle(x, lambda e: w[e].t(), ends, 256)
    assert_bound(y, ref, mag, 256)


@gpu
def test_cuda_graph_replay_follows_new_offs() -> None:
    x, w = make(1024, 256, 256, 8, seed=13)
    offs = offs_of(cumsum(uniform_counts(1024, 8)))
    grouped_gemm(x, w, offs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped_gemm(x, w, offs)
    ends = cumsum([0, 500, 3, 0, 0, 200, 1, 250])
    offs.copy_(offs_of(ends))
    graph.replay()
    torch.cuda.synchronize()
    ref, mag = oracle(x, lambda e: w[e].t(), ends, 256)
    assert_bound(y, ref, mag, 256)


@gpu
def test_under_torch_compile() -> None:
    x, w = make(512, 256, 128, 4, seed=14)
    ends = cumsum([100, 200, 0, 150])
    y = torch.compile(lambda a, b, o: grouped_gemm(a, b, o), fullgraph=True)(x, w, offs_of(ends))
    ref, mag = oracle(x, lambda e: w[e].t(), ends, 256)
    assert_bound(y, ref, mag, 128)


# ---------------------------------------------------------------------------------------------------------
# Separating inputs for the GPU mutations of the kernels (anchors in nmoe/fast/kernels/sm90/: grouped_gemm.py,
# epilogue.py, tiles.py):
# each test first shows the correct and the mutated formula differ beyond the bound, then checks the kernel.
# ---------------------------------------------------------------------------------------------------------


def _swamping_inputs(m: int, n: int, k: int, e: int) -> tuple[Tensor, Tensor]:
    """Each row sums 1024 + (k - 1)/64: after the first K tile every tile adds ~1, below half a bf16 ulp."""
    x = torch.ones(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.full((e, n, k), 2.0**-6, dtype=torch.bfloat16, device="cuda")
    w[:, :, 0] = 1024.0
    return x, w


@gpu
def test_sep_gemm_fast_accumulate_bf16() -> None:
    m, n, k, counts = 300, 256, 4096, [100, 200]
    x, w = _swamping_inputs(m, n, k, 2)
    ends = cumsum(counts)
    ref, mag = oracle(x, lambda e: w[e].t(), ends, n)
    tiles = [oracle(x[:, t:t + BK], lambda e, t=t: w[e, :, t:t + BK].t(), ends, n)[0]
             for t in range(0, k, BK)]
    acc = tiles[0] + tiles[1]
    acc = acc.to(torch.bfloat16).double()
    for tile in tiles[2:]:
        acc = (acc + tile).to(torch.bfloat16).double()
    assert violates(acc, ref, mag, k)
    assert_bound(grouped_gemm(x, w, offs_of(ends)), ref, mag, k)


@gpu
@pytest.mark.parametrize("k", [200, 256])
def test_sep_gemm_fast_skip_last_k_tile(k: int) -> None:
    counts = [130, 70]
    x, w = make(200, 256, k, 2, seed=15)
    ends = cumsum(counts)
    ref, mag = oracle(x, lambda e: w[e].t(), ends, 256)
    last = (k - 1) // BK * BK
    mutated, _ = oracle(x[:, :last], lambda e: w[e, :, :last].t(), ends, 256)
    assert violates(mutated, ref, mag, k)
    assert_bound(grouped_gemm(x, w, offs_of(ends)), ref, mag, k)


@gpu
def test_sep_gemm_fast_group_boundary_off_by_one() -> None:
    counts = [129, 0, 1, 200, 77]
    m = sum(counts) + 4
    x, w = make(m, 256, 128, len(counts), seed=16)
    ends = cumsum(counts)
    ref, mag = oracle(x, lambda e: w[e].t(), ends, 256)
    shifted, prev = [], 0
    for end in ends:
        prev = max(prev, min(max(end - 1, 0), m))
        shifted.append(prev)
    mutated, _ = oracle(x, lambda e: w[e].t(), shifted, 256)
    assert violates(mutated, ref, mag, 128)
    assert_bound(grouped_gemm(x, w, offs_of(ends)), ref, mag, 128)


def check_unwritten_caught(counts: Sequence[int], m: int, n: int, k: int, seed: int, region: Any,
                           bn: int | None = None) -> None:
    """A mutant leaving `region` of the NaN-filled output unwritten breaks the bound; the kernel keeps it."""
    x, w = make(m, n, k, len(counts), seed=seed)
    ends = cumsum(counts)
    ref, mag = oracle(x, lambda e: w[e].t(), ends, n)
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    mutated = ref.clone()
    mutated[region] = float("nan")
    assert violates(mutated, ref, mag, k)
    gemm._launch("test", x, w, offs_of(ends), y, True, bn)
    assert_bound(y, ref, mag, k)


@gpu
def test_sep_gemm_fast_tail_not_zeroed() -> None:
    check_unwritten_caught([40, 0, 60], 250, 256, 128, 17, slice(100, None))


@gpu
def test_sep_gemm_fast_cluster_rank_dropped() -> None:
    """A cluster's CTAs take side-by-side M tiles: group 0's second tile (rows 128..255) is its unit's second
    CTA's; groups of odd tile counts also leave a CTA past its group's end, which must store nothing."""
    check_unwritten_caught([300, 60], 370, 256, 128, 23, slice(128, 256))


@gpu
def test_sep_gemm_fast_ragged_n_dropped() -> None:
    check_unwritten_caught([90, 150], 240, 200, 64, 18, (slice(None), slice(128, None)), 128)


MASK_COUNTS = [70, 100, 30]


def _mask_case(seed: int, k: int) -> tuple[Tensor, Tensor, list[int], Tensor, Tensor]:
    """Three groups that end inside a 64-row box, 20 tail rows after them: dy [m, 136], x [m, k]."""
    m = sum(MASK_COUNTS) + 20
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(m, 136, generator=g).to(torch.bfloat16).cuda()
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    ends = cumsum(MASK_COUNTS)
    ref, mag = wgrad_oracle(dy, x, ends)
    return dy, x, ends, ref, mag


def _assert_mask_separates(dy: Tensor, x: Tensor, ends: list[int], ref: Tensor, mag: Tensor,
                           mutated: Tensor) -> None:
    """The mutated sums break the bound on some group, and the kernel's hold it on every group."""
    assert any(violates(mutated[e], ref[e], mag[e], t - s) for e, (s, t) in enumerate(ends_to_ranges(ends)))
    assert_wgrad_bound(grouped_gemm_wgrad(dy, x, offs_of(ends)), ref, mag, ends)


@gpu
def test_sep_gemm_fast_wgrad_mask_dropped() -> None:
    """Unmasked, the last 64-row box of a group also reduces the next group's rows (or the tail rows)."""
    dy, x, ends, ref, mag = _mask_case(22, 72)
    mutated = torch.zeros_like(ref)
    for e, (s, t) in enumerate(ends_to_ranges(ends)):
        t_box = s + -(-(t - s) // BK) * BK
        mutated[e] = dy[s:t_box].double().t() @ x[s:t_box].double()
    _assert_mask_separates(dy, x, ends, ref, mag, mutated)


@gpu
def test_sep_gemm_fast_wgrad_mask_last_chunk_kept() -> None:
    """A mask that leaves each row's last 16-byte chunk keeps the next group's rows in dw[e, j, l] wherever j
    and l both sit in their tile's last 8 columns (n = k = 136: 128-wide tiles, both chunks hold data)."""
    dy, x, ends, ref, mag = _mask_case(23, 136)
    last = (torch.arange(136, device=dy.device) % 128 >= 120).double()
    mutated = ref.clone()
    for e, (s, t) in enumerate(ends_to_ranges(ends)):
        t_box = min(s + -(-(t - s) // BK) * BK, dy.shape[0])
        mutated[e] += dy[t:t_box].double().t() @ x[t:t_box].double() * last[:, None] * last[None, :]
    _assert_mask_separates(dy, x, ends, ref, mag, mutated)
