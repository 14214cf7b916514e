"""nmoe.fast.norm (rmsnorm fwd/bwd): compile checks and plumbing on CPU; on a GPU, ulp(1) against float64
math written here (bf16/fp16 outputs), a derived fp32 bound, bwd error bounds, autograd/compile/graphs, and
separating inputs for the kernel's mutations."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from torch import Tensor

from nmoe.fast import norm as fast
from nmoe.fast import op, runtime
from nmoe.fast.arch import SUPPORTED_ARCHS, ArchError

ROOT = Path(__file__).resolve().parents[1]
F64 = npt.NDArray[np.float64]
gpu = pytest.mark.gpu
U = 2.0**-24


# ---------------------------------------------------------------------------------------------------------
# Oracle: float64 math on the exact input values, one rounding to the output dtype, ULP distances.
# ---------------------------------------------------------------------------------------------------------
def f64(t: Tensor) -> F64:
    return np.asarray(t.detach().cpu().double().numpy(), dtype=np.float64)


def rms_fwd64(x: F64, w: F64, eps: float) -> F64:
    with np.errstate(invalid="ignore", over="ignore"):
        r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
        out: F64 = x * r * w
    return out


def rms_bwd64(dy: F64, x: F64, w: F64, eps: float) -> tuple[F64, F64, F64, F64]:
    """(dx, dw) in float64 and their fp32 error budgets (units of |value|, following each fp32 step)."""
    d = x.shape[-1]
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    g = dy * w
    s = (g * x).mean(-1, keepdims=True)
    dx = r * (g - x * r * r * s)
    dw = (dy * x * r).reshape(-1, d).sum(0)
    mag_dx = r * np.abs(g) + r**3 * np.abs(x) * ((d + 1) * np.abs(g * x).mean(-1, keepdims=True)
                                                 + (d + 8) * np.abs(s)) + np.abs(dx) * ((d + 1) / 2 + 4)
    rows = x.reshape(-1, d).shape[0]
    mag_dw = np.abs(dy * x * r).reshape(-1, d).sum(0) * (rows + d / 2 + 4)
    return dx, dw, mag_dx, mag_dw


def ordered(bits: npt.NDArray[Any], width: int) -> npt.NDArray[np.int64]:
    """Sign-magnitude bit patterns mapped to integers that count representable values (+-0 -> 0)."""
    b = bits.astype(np.int64) & ((1 << width) - 1)
    sign = 1 << (width - 1)
    out: npt.NDArray[np.int64] = np.where(b & sign, -(b ^ sign), b)
    return out


def out_bits(t: Tensor) -> npt.NDArray[Any]:
    view = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return np.asarray(t.detach().contiguous().cpu().view(view).numpy())


_BF16_GRID: F64 = (np.arange(0x7F80, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def round_to(v: F64, dtype: torch.dtype) -> Tensor:
    """One correct (RNE) rounding of float64 to dtype. numpy converts to fp32/fp16 directly; bf16 goes by
    bracketing on the grid of all bf16 values (a detour through fp32 would round twice)."""
    if dtype == torch.float32:
        return torch.from_numpy(v.astype(np.float32))
    if dtype == torch.float16:
        return torch.from_numpy(v.astype(np.float16))
    a = np.abs(v)
    grid = _BF16_GRID
    hi = np.clip(np.searchsorted(grid, a, side="left"), 0, len(grid) - 1)
    lo = np.clip(hi - 1, 0, None)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    up = (grid[hi] == a) | (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    mag = np.where(up, hi, lo).astype(np.int64)
    overflow = a >= grid[-1] + (grid[-1] - grid[-2]) / 2
    signed = np.where(overflow, 0x7F80, mag) | np.where(np.signbit(v), 0x8000, 0)
    code = np.where(np.isnan(v), 0x7FC0, signed).astype(np.uint16)
    return torch.from_numpy(code.view(np.int16)).view(torch.bfloat16)


def ulp_dist(got: Tensor, want64: F64) -> int:
    """max |ordered(got) - ordered(round(want64))|; NaN must meet NaN, Inf the same Inf."""
    width = 8 * got.element_size()
    want = round_to(want64, got.dtype)
    gn = np.isnan(got.float().cpu().numpy())
    if (gn != np.isnan(want64)).any():
        return 1 << 40
    d = np.where(gn, 0, np.abs(ordered(out_bits(got), width) - ordered(out_bits(want), width)))
    return int(d.max()) if d.size else 0


# ---------------------------------------------------------------------------------------------------------
# CPU: declarations, compile checks, plumbing.
# ---------------------------------------------------------------------------------------------------------
def test_kernels_declare_both_archs() -> None:
    assert {k.op for k in fast.KERNELS} == {"rmsnorm", "rmsnorm_bwd", "add_rmsnorm", "add_rmsnorm_bwd"}
    assert len({k.name for k in fast.KERNELS}) == len(fast.KERNELS)
    for spec in fast.KERNELS:
        assert set(spec.expect) == set(spec.forbid) == set(SUPPORTED_ARCHS)
        for arch in SUPPORTED_ARCHS:
            assert any("rsqrt" in rx for rx in spec.forbid[arch])
            for rx in (*spec.expect[arch], *spec.forbid[arch]):
                re.compile(rx)


def test_kernel_source_hash_covers_the_kernel_file() -> None:
    assert ROOT / "nmoe" / "fast" / "kernels" / "norm.py" in op.source_files(fast.RMSNORM_FWD.module)


@pytest.mark.parametrize("d", [1, 7, 8, 64, 136, 512, 1536, 2048, 4096, 7168, 16384, 65536])
@pytest.mark.parametrize("vec", [1, 4, 8])
def test_row_plan_covers_the_row_within_limits(d: int, vec: int) -> None:
    if d % vec:
        return
    if d // vec > 64 * 1024:
        with pytest.raises(ValueError, match=r"nmoe\.reference"):
            fast.plan_row(d, vec)
        return
    p = fast.plan_row(d, vec)
    assert p.threads % 32 == 0 and 32 <= p.threads <= 1024 and p.nper * p.vec <= 64
    assert p.threads * p.nper * p.vec >= d > (p.threads - 32) * p.nper * p.vec - p.nper * p.vec * 32


def test_compile_rmsnorm_fwd_without_gpu() -> None:
    for arch, rows in compile_rows("nmoe.fast.norm", ["rmsnorm_fwd_d4096_b16_b16"]).items():
        assert_rows_ok(rows, arch, 1)


@pytest.mark.heavy
def test_compile_all_norm_kernels_without_gpu() -> None:
    for arch, rows in compile_rows("nmoe.fast.norm").items():
        assert_rows_ok(rows, arch, len(fast.KERNELS))


@pytest.mark.parametrize("call", [lambda x, w: fast.rmsnorm(x, w, 1e-6),
                                  lambda x, w: fast.rmsnorm_bwd(x, x, w, 1e-6)])
def test_cpu_tensors_are_refused_naming_reference(call: Callable[[Tensor, Tensor], object]) -> None:
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        call(torch.ones(3, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16))


@pytest.mark.parametrize(("call", "match"), [
    (lambda: fast.rmsnorm(torch.ones(3, 8), torch.ones(7), 1e-6), "1-D weight"),
    (lambda: fast.rmsnorm(torch.ones(3, 8), torch.ones(8), -1.0), "eps"),
    (lambda: fast.rmsnorm(torch.ones(3, 8, dtype=torch.float64), torch.ones(8), 1e-6), "nmoe.reference"),
    (lambda: fast.rmsnorm_bwd(torch.ones(3, 7), torch.ones(3, 8), torch.ones(8), 1e-6), "dy shape"),
    (lambda: fast.rmsnorm_bwd(torch.ones(3, 8).bfloat16(), torch.ones(3, 8), torch.ones(8), 1e-6), "cast dy"),
])
def test_bad_arguments_fail_loud_with_the_fix(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_custom_ops_have_fake_shapes_and_autograd() -> None:
    x = torch.empty(3, 5, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(64, device="meta", dtype=torch.float32, requires_grad=True)
    y = torch.ops.nmoe.rmsnorm(x, w, 1e-6)
    assert (y.shape, y.dtype) == (x.shape, torch.bfloat16)
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    assert (x.grad.shape, x.grad.dtype) == (x.shape, x.dtype)
    assert (w.grad.shape, w.grad.dtype) == ((64,), torch.float32)


def test_oracle_rounding_and_ulp_distance() -> None:
    v = np.array([1.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-40, -(2.0**-133), np.nan])
    got = round_to(v, torch.bfloat16)
    assert list(out_bits(got).astype(np.int64) & 0xFFFF) == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x8001, 0x7FC0]
    assert ulp_dist(torch.tensor([1.0, -1.0]).bfloat16(), np.array([1 + 2.0**-7, -1.0])) == 1
    assert ulp_dist(torch.tensor([2.0**-133]).bfloat16(), np.array([-(2.0**-133)])) == 2
    assert ulp_dist(torch.tensor([float("nan")]), np.array([1.0])) == 1 << 40


# ---------------------------------------------------------------------------------------------------------
# GPU: forward.
# ---------------------------------------------------------------------------------------------------------
WIDTHS = [1, 8, 64, 136, 512, 1536, 2048, 4096, 7168]


def make(t: int, d: int, dtype: torch.dtype, wdtype: torch.dtype, scale: float,
         seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, d, generator=g, dtype=torch.float64) * scale).to(dtype)
    w = (1.0 + 0.1 * torch.randn(d, generator=g, dtype=torch.float64)).to(wdtype)
    return x, w


@gpu
@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("scale", "eps"), [(1.0, 1e-6), (30.0, 1e-5), (1e-3, 1e-5)])
def test_rmsnorm_bf16_within_one_ulp_of_float64(d: int, wdtype: torch.dtype, scale: float,
                                                 eps: float) -> None:
    x, w = make(37, d, torch.bfloat16, wdtype, scale, d)
    y = fast.rmsnorm(x.cuda(), w.cuda(), eps)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert ulp_dist(y, rms_fwd64(f64(x), f64(w), eps)) <= 1


@gpu
@pytest.mark.parametrize("d", [8, 136, 4096])
def test_rmsnorm_fp16_within_one_ulp(d: int) -> None:
    x, w = make(19, d, torch.float16, torch.float16, 3.0, d)
    assert ulp_dist(fast.rmsnorm(x.cuda(), w.cuda(), 1e-6), rms_fwd64(f64(x), f64(w), 1e-6)) <= 1


def fp32_ulp_budget(d: int) -> int:
    """Sum of squares: <= nper*vec sequential terms + 5 butterfly levels + one add per warp, each <= u
    relative (all terms >= 0); sqrt halves it; mean, +eps, sqrt, 1/, *x, *w add one rounding each. One fp32
    ulp is >= u relative, so that many units of u bound the ULP distance (plus the final rounding)."""
    p = fast.plan_row(d, 4 if d % 4 == 0 else 1)
    return math.ceil((p.nper * p.vec + 5 + p.threads // 32) / 2 + 8)


@gpu
@pytest.mark.parametrize("d", [1, 64, 1536, 4096, 7168])
def test_rmsnorm_fp32_within_derived_bound(d: int) -> None:
    x, w = make(23, d, torch.float32, torch.float32, 2.0, d)
    y = fast.rmsnorm(x.cuda(), w.cuda(), 1e-6)
    assert ulp_dist(y, rms_fwd64(f64(x), f64(w), 1e-6)) <= fp32_ulp_budget(d)


@gpu
@pytest.mark.parametrize("case", ["nan", "inf", "denormal", "zero", "single_token"])
def test_rmsnorm_adversarial_rows(case: str) -> None:
    x, w = make(6, 512, torch.bfloat16, torch.bfloat16, 1.0, 3)
    if case == "nan":
        x[1, 7] = float("nan")
    elif case == "inf":
        x[2, 9], x[3, 0] = float("inf"), -float("inf")
    elif case == "denormal":
        x = (x.double() * 1e-39).to(torch.bfloat16)
    elif case == "zero":
        x[0] = 0.0
        x[4] = -0.0
    else:
        x = x[:1]
    assert ulp_dist(fast.rmsnorm(x.cuda(), w.cuda(), 1e-6), rms_fwd64(f64(x), f64(w), 1e-6)) <= 1


@gpu
def test_rmsnorm_leading_dims_noncontiguous_and_empty() -> None:
    x, w = make(4 * 6, 256, torch.bfloat16, torch.bfloat16, 1.0, 9)
    x3 = x.reshape(4, 6, 256)
    assert ulp_dist(fast.rmsnorm(x3.cuda(), w.cuda(), 1e-6), rms_fwd64(f64(x3), f64(w), 1e-6)) <= 1
    xt = x3.cuda().transpose(0, 1)
    assert ulp_dist(fast.rmsnorm(xt, w.cuda(), 1e-6), rms_fwd64(f64(xt), f64(w), 1e-6)) <= 1
    off = x.flatten().cuda()[1:1 + 5 * 256].reshape(5, 256)
    assert ulp_dist(fast.rmsnorm(off, w.cuda(), 1e-6), rms_fwd64(f64(off), f64(w), 1e-6)) <= 1
    empty = torch.empty(0, 256, device="cuda", dtype=torch.bfloat16)
    assert fast.rmsnorm(empty, w.cuda(), 1e-6).shape == (0, 256)


def test_row_pitch_reads_slices_in_place_and_copies_the_rest() -> None:
    base = torch.zeros(3, 5, 576, dtype=torch.bfloat16)
    assert fast.row_pitch(base[..., :512], 8) == 576
    assert fast.row_pitch(base[1:, :, :512], 8) == 576
    assert fast.row_pitch(base[:, 1:4, :512], 8) == 0
    assert fast.row_pitch(base, 8) == 0
    assert fast.row_pitch(base[..., 1:513], 8) == 0
    assert fast.row_pitch(base[:, ::2, :512], 8) == 0
    assert fast.row_pitch(base.transpose(0, 1)[..., :512], 8) == 0
    assert fast.row_pitch(torch.zeros(4, 7, dtype=torch.bfloat16)[:, :4], 8) == 0
    # a size-1 dim's stride says nothing: rows of the second batch lie 8 * 576 on, not 4 * 576
    assert fast.row_pitch(torch.zeros(2, 8, 576).as_strided((2, 1, 4, 512), (4608, 4608, 576, 1)), 4) == 0
    assert fast.row_pitch(torch.zeros(2, 4, 576).as_strided((2, 1, 4, 512), (2304, 7, 576, 1)), 4) == 576


@gpu
def test_rmsnorm_at_a_row_pitch_is_bitwise_the_contiguous_rows() -> None:
    """MLA's c_kv, 512 of each 576-wide row, read in place: fwd and bwd as on a contiguous copy."""
    base, w = make(2 * 300, 576, torch.bfloat16, torch.bfloat16, 1.0, 11)
    x = base.cuda().view(2, 300, 576)[..., :512]
    w = w[:512].cuda()
    dy = make(600, 512, torch.bfloat16, torch.bfloat16, 1.0, 12)[0].cuda().view(2, 300, 512)
    assert fast.row_pitch(x, 8) == 576
    assert torch.equal(fast.rmsnorm(x, w, 1e-6), fast.rmsnorm(x.contiguous(), w, 1e-6))
    for got, want in zip(fast.rmsnorm_bwd(dy, x, w, 1e-6), fast.rmsnorm_bwd(dy, x.contiguous(), w, 1e-6),
                         strict=True):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------------
# GPU: backward.
# ---------------------------------------------------------------------------------------------------------
def assert_bwd_bounds(dx: Tensor, dw: Tensor, dy: Tensor, x: Tensor, w: Tensor, eps: float) -> None:
    """|fast - f64| <= 1 ulp of the output dtype at the f64 value + u * (the fp32 error budget)."""
    dx64, dw64, mag_dx, mag_dw = rms_bwd64(f64(dy), f64(x), f64(w), eps)
    for got, want, mag in ((dx, dx64, mag_dx), (dw, dw64, mag_dw)):
        fin = torch.finfo(got.dtype)
        ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want), fin.smallest_normal)))) * fin.eps
        err = np.abs(f64(got) - want)
        assert (err <= ulp + U * mag).all(), float(np.max(err / (ulp + U * mag)))


@gpu
@pytest.mark.parametrize("d", [1, 8, 136, 1536, 4096, 7168])
@pytest.mark.parametrize(("t", "wdtype"), [(1, torch.bfloat16), (300, torch.bfloat16), (2000, torch.float32)])
def test_rmsnorm_bwd_within_error_budget(d: int, t: int, wdtype: torch.dtype) -> None:
    x, w = make(t, d, torch.bfloat16, wdtype, 2.0, d + t)
    dy = make(t, d, torch.bfloat16, wdtype, 1.0, d + t + 1)[0]
    dx, dw = fast.rmsnorm_bwd(dy.cuda(), x.cuda(), w.cuda(), 1e-6)
    assert (dx.dtype, dw.dtype, dx.shape, dw.shape) == (x.dtype, w.dtype, x.shape, w.shape)
    assert_bwd_bounds(dx, dw, dy, x, w, 1e-6)


@gpu
def test_rmsnorm_bwd_fp32_and_deterministic() -> None:
    x, w = make(777, 4096, torch.float32, torch.float32, 1.0, 1)
    dy = make(777, 4096, torch.float32, torch.float32, 1.0, 2)[0]
    a = fast.rmsnorm_bwd(dy.cuda(), x.cuda(), w.cuda(), 1e-6)
    b = fast.rmsnorm_bwd(dy.cuda(), x.cuda(), w.cuda(), 1e-6)
    for u, v in zip(a, b, strict=True):
        assert torch.equal(out_bits_t(u), out_bits_t(v))
    assert_bwd_bounds(*a, dy, x, w, 1e-6)


def out_bits_t(t: Tensor) -> Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@gpu
def test_rmsnorm_autograd_compile_and_graph_use_the_bwd_kernel() -> None:
    x, w = make(64, 1536, torch.bfloat16, torch.float32, 1.0, 4)
    dy = make(64, 1536, torch.bfloat16, torch.float32, 1.0, 5)[0].cuda()
    want = fast.rmsnorm_bwd(dy, x.cuda(), w.cuda(), 1e-6)
    for fn in (fast.rmsnorm, torch.compile(fast.rmsnorm, fullgraph=True)):
        xg, wg = x.cuda().requires_grad_(True), w.cuda().requires_grad_(True)
        torch.autograd.backward(fn(xg, wg, 1e-6), dy)
        assert xg.grad is not None and wg.grad is not None
        assert torch.equal(out_bits_t(xg.grad), out_bits_t(want[0]))
        assert torch.equal(out_bits_t(wg.grad), out_bits_t(want[1]))
    xs, ws = x.cuda(), w.cuda()
    fast.rmsnorm(xs, ws, 1e-6)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fast.rmsnorm(xs, ws, 1e-6)
        g = fast.rmsnorm_bwd(dy, xs, ws, 1e-6)
    x2 = make(64, 1536, torch.bfloat16, torch.float32, 5.0, 6)[0]
    xs.copy_(x2.cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert ulp_dist(y, rms_fwd64(f64(x2), f64(w), 1e-6)) <= 1
    assert_bwd_bounds(*g, dy.cpu(), x2, w, 1e-6)


# ---------------------------------------------------------------------------------------------------------
# Separating inputs for the kernel mutations (anchors in nmoe/fast/kernels/norm.py).
# ---------------------------------------------------------------------------------------------------------
def sep_fwd(x: Tensor, w: Tensor, eps: float, mutant64: F64) -> None:
    want = rms_fwd64(f64(x), f64(w), eps)
    assert ulp_dist(round_to(mutant64, x.dtype), want) > 1
    assert ulp_dist(fast.rmsnorm(x.cuda(), w.cuda(), eps), want) <= 1


@gpu
def test_sep_rmsnorm_fast_eps_outside_sqrt() -> None:
    x, w = make(16, 512, torch.bfloat16, torch.bfloat16, 1e-3, 1)
    xd, wd = f64(x), f64(w)
    mutant = xd / (np.sqrt((xd * xd).mean(-1, keepdims=True)) + 1e-5) * wd
    sep_fwd(x, w, 1e-5, mutant)


@gpu
def test_sep_rmsnorm_fast_mean_over_d_minus_1() -> None:
    x, w = make(16, 8, torch.bfloat16, torch.bfloat16, 1.0, 2)
    xd, wd = f64(x), f64(w)
    mutant = xd / np.sqrt((xd * xd).sum(-1, keepdims=True) / 7 + 1e-6) * wd
    sep_fwd(x, w, 1e-6, mutant)


def sep_bwd(dy: Tensor, x: Tensor, w: Tensor, eps: float, mutant_dx: F64 | None,
            mutant_dw: F64 | None) -> None:
    dx64, dw64, _, _ = rms_bwd64(f64(dy), f64(x), f64(w), eps)
    if mutant_dx is not None:
        assert ulp_dist(round_to(mutant_dx, x.dtype), dx64) > 2
    if mutant_dw is not None:
        assert ulp_dist(round_to(mutant_dw, w.dtype), dw64) > 2
    dx, dw = fast.rmsnorm_bwd(dy.cuda(), x.cuda(), w.cuda(), eps)
    assert_bwd_bounds(dx, dw, dy, x, w, eps)


@gpu
def test_sep_rmsnorm_bwd_fast_dw_without_r() -> None:
    x, w = make(64, 256, torch.bfloat16, torch.float32, 30.0, 3)
    dy = make(64, 256, torch.bfloat16, torch.float32, 1.0, 4)[0]
    sep_bwd(dy, x, w, 1e-6, None, (f64(dy) * f64(x)).sum(0))


@gpu
def test_sep_rmsnorm_bwd_fast_projection_dropped() -> None:
    x, w = make(64, 256, torch.bfloat16, torch.float32, 1.0, 5)
    dy = x.clone()
    xd = f64(x)
    r = 1.0 / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6)
    sep_bwd(dy, x, w, 1e-6, r * f64(dy) * f64(w), None)


@gpu
def test_sep_rmsnorm_bwd_fast_dw_partial_dropped() -> None:
    """More rows than CTAs: dw summed from the first CTA's partial alone misses most rows."""
    t, d = 5000, 256
    x, w = make(t, d, torch.bfloat16, torch.float32, 1.0, 6)
    dy = make(t, d, torch.bfloat16, torch.float32, 1.0, 7)[0]
    plan = fast.plan_row(d, 8, fast.BWD_TARGET_THREADS)
    ctas = min(t, runtime.sm_count(torch.cuda.current_device()) * max(1, 1024 // plan.threads))
    assert ctas < t
    xd, dyd = f64(x), f64(dy)
    r = 1.0 / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6)
    sep_bwd(dy, x, w, 1e-6, None, (dyd * xd * r)[::ctas].sum(0))


@gpu
def test_sep_rmsnorm_fast_pitch_ignored() -> None:
    """Rows read at d instead of their pitch are other rows' columns: the outputs differ beyond 1 ulp."""
    base, w = make(64, 576, torch.bfloat16, torch.bfloat16, 1.0, 13)
    x = base[:, :512]
    packed = base.flatten()[:64 * 512].view(64, 512)
    want = rms_fwd64(f64(x), f64(w[:512]), 1e-6)
    assert ulp_dist(round_to(rms_fwd64(f64(packed), f64(w[:512]), 1e-6), x.dtype), want) > 1
    assert ulp_dist(fast.rmsnorm(base.cuda()[:, :512], w[:512].cuda(), 1e-6), want) <= 1


def test_sep_rmsnorm_fast_pitch_of_one_row_pair() -> None:
    """Rows 1-3 of each batch of a [3, 5, 576] slice: the second row follows the first at 576, but the
    next batch's rows start 5 * 576 on, not 3 * 576, so no one pitch reaches them all."""
    x = torch.zeros(3, 5, 576, dtype=torch.bfloat16)[:, 1:4, :512]
    assert x.stride(-2) == 576 and x.stride(0) != x.shape[1] * 576
    assert fast.row_pitch(x, 8) == 0
