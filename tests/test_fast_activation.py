"""nmoe.fast.activation (relu2 fwd/bwd): compile checks on CPU; bitwise GPU checks against an independent
oracle (float64 math rounded once, by bracketing between representable bf16 values)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from fastcompile import compile_rows
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fast_gemm import child_env
from torch import Tensor

from nmoe.fast import FAST_MODULES, activation, op, runtime
from nmoe.fast.activation import KERNELS, relu2, relu2_bwd
from nmoe.fast.arch import SUPPORTED_ARCHS, ArchError

ROOT = Path(__file__).resolve().parents[1]
U16 = npt.NDArray[np.uint16]
U32 = npt.NDArray[np.uint32]
F64 = npt.NDArray[np.float64]

# ---------------------------------------------------------------------------------------------------
# Oracle: exact float64 math, then one round-to-nearest-even onto the bf16 grid found by bisection.
# NaN results are the spec's canonical quiet NaN 0x7FC0 (fp32: 0x7FC00000).
# ---------------------------------------------------------------------------------------------------
ALL_BF16: U16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
_GRID: F64 = (np.arange(0x7F80, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)
_MAX = float(_GRID[-1])
_OVERFLOW = _MAX + (_MAX - float(_GRID[-2])) / 2
FP32_MAX = float(np.finfo(np.float32).max)
NAN_BITS = 0x7FC0


def bf16_values(bits: U16) -> F64:
    with np.errstate(invalid="ignore"):
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def round_bf16(v: F64, nan_bits: int = NAN_BITS) -> U16:
    a = np.abs(v)
    hi = np.clip(np.searchsorted(_GRID, a, side="left"), 0, len(_GRID) - 1)
    lo = np.clip(hi - 1, 0, None)
    d_lo, d_hi = a - _GRID[lo], _GRID[hi] - a
    up = (_GRID[hi] == a) | (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    out = np.where(up, hi, lo).astype(np.uint32)
    out = np.where(a >= _OVERFLOW, 0x7F80, out)
    out = np.where(np.signbit(v), out | 0x8000, out)
    return np.where(np.isnan(v), nan_bits, out).astype(np.uint16)


def relu64(v: F64) -> F64:
    return np.where(v <= 0, 0.0, v)


def fwd_oracle(x: U16) -> U16:
    r = relu64(bf16_values(x))
    return round_bf16(r * r)


def two_r_fp32(x: F64) -> F64:
    """2*relu(x) is exact in fp32 except that it overflows to inf above fp32 max."""
    two_r = 2 * relu64(x)
    return np.where(two_r > FP32_MAX, np.inf, two_r)


def bwd_oracle(dy: U16, x: U16) -> U16:
    with np.errstate(invalid="ignore"):
        return round_bf16(bf16_values(dy) * two_r_fp32(bf16_values(x)))


def bits16(t: Tensor) -> U16:
    out: U16 = t.detach().contiguous().view(torch.int16).cpu().numpy().view(np.uint16).reshape(-1)
    return out


def bf16_tensor(bits: U16, device: str = "cuda") -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).to(device)


_SPECIAL_DY: U16 = np.array([0x0000, 0x8000, 0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x0001,
                             0x8001, 0x7F7F, 0xFF7F, 0x0080, 0x3A80, 0x2000, 0x4040], dtype=np.uint16)


def _dy_set(seed: int = 0) -> U16:
    rng = np.random.default_rng(seed)
    return np.concatenate([_SPECIAL_DY, rng.integers(0, 1 << 16, 16, dtype=np.uint32).astype(np.uint16)])


# ---------------------------------------------------------------------------------------------------
# CPU: declarations, compile checks, guard errors, fake/meta registration, the oracle itself.
# ---------------------------------------------------------------------------------------------------


RELU2_KERNELS = [k for k in KERNELS if k.op in ("relu2", "relu2_bwd")]


def test_fast_modules_list_activation() -> None:
    assert "nmoe.fast.activation" in FAST_MODULES


def test_kernels_declare_both_archs() -> None:
    names = sorted(k.name for k in RELU2_KERNELS)
    assert names == ["relu2_bwd", "relu2_bwd_f32", "relu2_fwd", "relu2_fwd_f32"]
    assert len({k.name for k in KERNELS}) == len(KERNELS)
    for spec in KERNELS:
        assert set(spec.expect) == set(spec.forbid) == set(SUPPORTED_ARCHS)
        for arch in SUPPORTED_ARCHS:
            assert spec.expect[arch], (spec.name, arch)
            for rx in (*spec.expect[arch], *spec.forbid[arch]):
                re.compile(rx)


def test_kernel_source_hash_covers_the_kernel_file() -> None:
    files = op.source_files(activation.RELU2_FWD.module)
    assert ROOT / "nmoe" / "fast" / "kernels" / "activation.py" in files
    digest = hashlib.sha256(b"".join(hashlib.sha256(p.read_bytes()).hexdigest().encode() for p in files))
    assert op.source_digest(activation.RELU2_FWD.module) == digest.hexdigest()


@pytest.fixture(scope="module")
def relu2_compile_rows() -> dict[str, list[dict[str, Any]]]:
    return compile_rows("nmoe.fast.activation", [k.name for k in RELU2_KERNELS])


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_compilecheck_relu2_ok_without_gpu(relu2_compile_rows: dict[str, list[dict[str, Any]]],
                                           arch: str) -> None:
    rows = relu2_compile_rows[arch]
    assert sorted(r["kernel"] for r in rows) == sorted(k.name for k in RELU2_KERNELS)
    for row in rows:
        assert row["status"] == "ok", row
        assert row["op"] == row["kernel"].removesuffix("_f32").removesuffix("_fwd"), row
        assert row["arch"] == arch and row["error"] is None
        assert row["instructions"] and all(row["instructions"].values()), row
        assert not any(row["forbidden"].values()), row
        assert row["seconds"] > 0


@pytest.mark.parametrize("call", [lambda t: relu2(t), lambda t: relu2_bwd(t, t)])
def test_cpu_tensors_are_refused_naming_reference(call: Any) -> None:
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        call(torch.ones(5, dtype=torch.bfloat16))


def test_custom_ops_have_fake_shapes_and_autograd() -> None:
    x = torch.empty(3, 5, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = torch.ops.nmoe.relu2(x)
    assert (y.shape, y.dtype, y.device.type) == (x.shape, x.dtype, "meta")
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and x.grad.dtype == x.dtype
    dx = torch.ops.nmoe.relu2_bwd(torch.empty(4, device="meta"), torch.empty(4, device="meta"))
    assert (dx.shape, dx.dtype) == ((4,), torch.float32)


def _b(*values: float) -> U16:
    return round_bf16(np.array(values, dtype=np.float64))


def test_oracle_rounding_hand_vectors() -> None:
    """RNE onto bf16 (8 significant bits), hand-derived; the oracle's own check."""
    u = 2.0**-7
    assert list(_b(1.0, 1 + u, 1 + u / 2, 1 + 3 * u / 2, 1 + u / 2 + 2**-30)) == [
        0x3F80, 0x3F81, 0x3F80, 0x3F82, 0x3F81]
    assert list(_b(-0.0, 0.0, 2.0**-133, 2.0**-134, 1.5 * 2.0**-133, -(2.0**-126))) == [
        0x8000, 0x0000, 0x0001, 0x0000, 0x0002, 0x8080]
    assert list(_b(_MAX, _OVERFLOW, np.nextafter(_OVERFLOW, 0), np.inf, -np.inf, np.nan)) == [
        0x7F7F, 0x7F80, 0x7F7F, 0x7F80, 0xFF80, NAN_BITS]


def test_oracle_relu2_hand_vectors() -> None:
    # 2^-64 squares to the bf16 subnormal 2^-128 = 32 * 2^-133 (flush-to-zero would lose it).
    x = np.array([0x4000, 0xC000, 0x8000, 0x7F7F, 0x7FC1, 0xFF81, 0x1F80, 0x0001], dtype=np.uint16)
    assert list(fwd_oracle(x)) == [0x4080, 0x0000, 0x0000, 0x7F80, NAN_BITS, NAN_BITS, 0x0020, 0x0000]
    dy = np.array([0x3F80, 0xBF80, 0x3A80, 0x0000, 0x3F80, 0xBF80], dtype=np.uint16)
    x = np.array([0x4000, 0x8000, 0x7F7F, 0x7F7F, 0x7FC1, 0xC000], dtype=np.uint16)
    # 2*max overflows fp32, so even a tiny dy gives inf; 0 * inf is NaN; -1 * +0 is -0.
    assert list(bwd_oracle(dy, x)) == [0x4080, 0x8000, 0x7F80, NAN_BITS, NAN_BITS, 0x8000]


# ---------------------------------------------------------------------------------------------------
# GPU: bitwise against the oracle.
# ---------------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu


@gpu
def test_relu2_fwd_all_bf16_patterns() -> None:
    y = relu2(bf16_tensor(ALL_BF16))
    assert y.dtype == torch.bfloat16 and y.shape == (1 << 16,)
    np.testing.assert_array_equal(bits16(y), fwd_oracle(ALL_BF16))


@gpu
def test_relu2_bwd_all_x_patterns_times_dy_set() -> None:
    dys = _dy_set()
    dy, x = np.repeat(dys, 1 << 16), np.tile(ALL_BF16, len(dys))
    dx = relu2_bwd(bf16_tensor(dy), bf16_tensor(x))
    np.testing.assert_array_equal(bits16(dx), bwd_oracle(dy, x))


@gpu
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (8,), (9,), (2047,), (2048,), (2049,), (123457,),
                                   (3, 5, 7), (0, 4), (64, 33)])
def test_relu2_any_size(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(shape) + len(shape))
    n = int(np.prod(shape))
    xb = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    gb = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    x, g = bf16_tensor(xb).view(shape), bf16_tensor(gb).view(shape)
    y, dx = relu2(x), relu2_bwd(g, x)
    assert y.shape == dx.shape == shape
    np.testing.assert_array_equal(bits16(y), fwd_oracle(xb))
    np.testing.assert_array_equal(bits16(dx), bwd_oracle(gb, xb))


@gpu
@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 5000), offset=st.integers(0, 9), seed=st.integers(0, 2**31 - 1))
def test_relu2_random_sizes_and_offsets(n: int, offset: int, seed: int) -> None:
    """Offsets that break 16-byte alignment take the scalar specialisation; results stay bitwise."""
    rng = np.random.default_rng(seed)
    xb = rng.integers(0, 1 << 16, n + offset, dtype=np.uint32).astype(np.uint16)
    gb = rng.integers(0, 1 << 16, n + offset, dtype=np.uint32).astype(np.uint16)
    x, g = bf16_tensor(xb)[offset:], bf16_tensor(gb)[offset:]
    np.testing.assert_array_equal(bits16(relu2(x)), fwd_oracle(xb[offset:]))
    np.testing.assert_array_equal(bits16(relu2_bwd(g, x)), bwd_oracle(gb[offset:], xb[offset:]))


@gpu
def test_relu2_non_contiguous_input() -> None:
    xb = np.random.default_rng(3).integers(0, 1 << 16, 64 * 33, dtype=np.uint32).astype(np.uint16)
    x = bf16_tensor(xb).view(64, 33).t()
    y = relu2(x)
    assert y.shape == (33, 64) and y.is_contiguous()
    np.testing.assert_array_equal(bits16(y), fwd_oracle(xb.reshape(64, 33).T.ravel()))


_F32_SPECIALS = np.array(
    [0x00000000, 0x80000000, 0x3F800000, 0xBF800000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
     0xFFC00005, 0x7FC00123, 0x7F7FFFFF, 0xFF7FFFFF, 0x00800000, 0x00000001, 0x80000001, 0x1A000000,
     0x1A400000, 0x1F800000, 0x5F800000, 0x5F7FFFFF, 0x3FB504F3, 0x40490FDB],
    dtype=np.uint32)


def _f32(bits: U32) -> npt.NDArray[np.float32]:
    return bits.view(np.float32)


def fwd_oracle_f32(xb: U32) -> U32:
    """fp32 in and out: exact float64 product rounded once; every NaN is the canonical 0x7FC00000."""
    with np.errstate(invalid="ignore", over="ignore"):
        r = relu64(_f32(xb).astype(np.float64))
        out = (r * r).astype(np.float32).view(np.uint32)
    return np.where(np.isnan(r), np.uint32(0x7FC00000), out).astype(np.uint32)


def bwd_oracle_f32(dyb: U32, xb: U32) -> U32:
    """Exact float64 product rounded once; every NaN (operand or 0*inf) is the canonical 0x7FC00000."""
    with np.errstate(invalid="ignore", over="ignore"):
        p = _f32(dyb).astype(np.float64) * two_r_fp32(_f32(xb).astype(np.float64))
        out = p.astype(np.float32).view(np.uint32)
    return np.where(np.isnan(p), np.uint32(0x7FC00000), out).astype(np.uint32)


def _f32_tensor(bits: U32) -> Tensor:
    return torch.from_numpy(bits.view(np.int32).copy()).view(torch.float32).cuda()


def _bits32(t: Tensor) -> U32:
    out: U32 = t.view(torch.int32).cpu().numpy().view(np.uint32)
    return out


@gpu
def test_relu2_fp32_bitwise() -> None:
    rng = np.random.default_rng(11)
    rand = np.concatenate([rng.integers(0, 1 << 32, 40000, dtype=np.uint64).astype(np.uint32),
                           rng.standard_normal(40000).astype(np.float32).view(np.uint32)])
    xb = np.concatenate([_F32_SPECIALS, rand])
    np.testing.assert_array_equal(_bits32(relu2(_f32_tensor(xb))), fwd_oracle_f32(xb))
    dyb = np.concatenate([np.repeat(_F32_SPECIALS, len(_F32_SPECIALS)), rng.permutation(rand)])
    xb2 = np.concatenate([np.tile(_F32_SPECIALS, len(_F32_SPECIALS)), rand])
    np.testing.assert_array_equal(_bits32(relu2_bwd(_f32_tensor(dyb), _f32_tensor(xb2))),
                                  bwd_oracle_f32(dyb, xb2))


@gpu
def test_relu2_rejects_other_dtypes_and_shapes() -> None:
    with pytest.raises(ValueError, match="bf16 or fp32"):
        relu2(torch.ones(4, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="bf16 or fp32"):
        relu2_bwd(torch.ones(4, device="cuda", dtype=torch.bfloat16), torch.ones(4, device="cuda"))
    with pytest.raises(ValueError, match="shapes"):
        relu2_bwd(torch.ones(4, device="cuda"), torch.ones(5, device="cuda"))


@gpu
def test_relu2_autograd_uses_bwd_kernel() -> None:
    rng = np.random.default_rng(5)
    xb = rng.integers(0, 1 << 16, 4099, dtype=np.uint32).astype(np.uint16)
    gb = rng.integers(0, 1 << 16, 4099, dtype=np.uint32).astype(np.uint16)
    x = bf16_tensor(xb).requires_grad_(True)
    torch.autograd.backward(relu2(x), bf16_tensor(gb))
    assert x.grad is not None
    np.testing.assert_array_equal(bits16(x.grad), bwd_oracle(gb, xb))


@gpu
def test_relu2_under_torch_compile() -> None:
    xb = np.random.default_rng(6).integers(0, 0x7F00, 10000, dtype=np.uint32).astype(np.uint16)
    x = bf16_tensor(xb).requires_grad_(True)
    compiled = torch.compile(lambda t: relu2(t).float().sum(), fullgraph=True)
    torch.autograd.backward(compiled(x))
    assert x.grad is not None
    np.testing.assert_array_equal(bits16(x.grad), bwd_oracle(np.full_like(xb, 0x3F80), xb))


@gpu
def test_relu2_cuda_graph_capture_and_replay() -> None:
    rng = np.random.default_rng(8)
    first, second = (rng.integers(0, 1 << 16, 100003, dtype=np.uint32).astype(np.uint16) for _ in range(2))
    x = bf16_tensor(first)
    relu2(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = relu2(x)
    x.copy_(bf16_tensor(second))
    graph.replay()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(bits16(y), fwd_oracle(second))


@gpu
def test_relu2_orders_with_torch_on_a_side_stream() -> None:
    n = 1 << 26
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        x = torch.full((n,), 3.0, device="cuda", dtype=torch.bfloat16)
        x.mul_(-1).add_(5.0)
        y = relu2(x)
    stream.synchronize()
    assert bool((y == 4.0).all())


@gpu
def test_disk_cache_round_trip_on_gpu(tmp_path: Path) -> None:
    code = (
        "import hashlib, json, numpy as np, torch\n"
        "from nmoe.fast import activation, runtime\n"
        "x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()\n"
        "y = activation.relu2(x).view(torch.int16).cpu().numpy()\n"
        "print(json.dumps({'sha': hashlib.sha256(y.tobytes()).hexdigest(),\n"
        "                  'how': [e.how for e in runtime.kernel_cache().events]}))\n"
    )
    env = child_env({runtime.CACHE_ENV: str(tmp_path)})
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0]["how"] == ["compile"] and runs[1]["how"] == ["disk"]
    expected = hashlib.sha256(fwd_oracle(ALL_BF16).view(np.int16).tobytes()).hexdigest()
    assert runs[0]["sha"] == runs[1]["sha"] == expected


# ---------------------------------------------------------------------------------------------------
# Separating inputs for the GPU mutations of the relu2 kernel (anchors in nmoe/fast/kernels/activation.py):
# each test first shows the correct and the mutated formula differ on its data, then checks the kernel.
# ---------------------------------------------------------------------------------------------------


@gpu
def test_sep_relu2_fast_square_dropped() -> None:
    mutated = round_bf16(relu64(bf16_values(ALL_BF16)))
    correct = fwd_oracle(ALL_BF16)
    assert (mutated != correct).any()
    np.testing.assert_array_equal(bits16(relu2(bf16_tensor(ALL_BF16))), correct)


@gpu
def test_sep_relu2_fast_nan_to_zero() -> None:
    """PTX max.f32 semantics: relu(NaN) = 0, so NaN inputs would give 0 instead of the NaN bits."""
    def relu_max(v: F64) -> F64:
        return np.where(v > 0, v, 0.0)

    v = bf16_values(ALL_BF16)
    mutated_fwd = round_bf16(relu_max(v) ** 2)
    dy = np.full_like(ALL_BF16, 0x3F80)
    mutated_bwd = round_bf16(1.0 * np.where(2 * relu_max(v) > FP32_MAX, np.inf, 2 * relu_max(v)))
    correct_fwd, correct_bwd = fwd_oracle(ALL_BF16), bwd_oracle(dy, ALL_BF16)
    assert (mutated_fwd != correct_fwd).any() and (mutated_bwd != correct_bwd).any()
    x = bf16_tensor(ALL_BF16)
    np.testing.assert_array_equal(bits16(relu2(x)), correct_fwd)
    np.testing.assert_array_equal(bits16(relu2_bwd(bf16_tensor(dy), x)), correct_bwd)


@gpu
@pytest.mark.parametrize("n", [5, 13, 2048 * 3 + 7])
def test_sep_relu2_fast_tail_dropped(n: int) -> None:
    """Outputs start as a sentinel; a kernel that skips the last n % 8 elements leaves it there."""
    rng = np.random.default_rng(n)
    xb = rng.integers(0, 0x7F00, n, dtype=np.uint32).astype(np.uint16)
    gb = rng.integers(0, 0x7F00, n, dtype=np.uint32).astype(np.uint16)
    sentinel = np.full(n, 0x1234, dtype=np.uint16)
    for kernel, ins, correct in (("relu2_fwd", (xb,), fwd_oracle(xb)),
                                 ("relu2_bwd", (gb, xb), bwd_oracle(gb, xb))):
        mutated = correct.copy()
        mutated[n - n % 8:] = sentinel[n - n % 8:]
        assert (mutated != correct).any()
        out = bf16_tensor(sentinel)
        activation._launch(getattr(activation, kernel.upper()), tuple(bf16_tensor(b) for b in ins), out)
        np.testing.assert_array_equal(bits16(out), correct)


@gpu
def test_sep_relu2_fast_nan_bits_canonical() -> None:
    """The GPU's own cvt writes NaN as 0x7FFF; the spec's canonical NaN is 0x7FC0."""
    r = relu64(bf16_values(ALL_BF16))
    mutated, correct = round_bf16(r * r, nan_bits=0x7FFF), fwd_oracle(ALL_BF16)
    assert (mutated != correct).any()
    np.testing.assert_array_equal(bits16(relu2(bf16_tensor(ALL_BF16))), correct)


@gpu
def test_sep_relu2_fast_bwd_factor_dropped() -> None:
    dys = _dy_set(1)
    dy, x = np.repeat(dys, 1 << 16), np.tile(ALL_BF16, len(dys))
    with np.errstate(invalid="ignore"):
        mutated = round_bf16(bf16_values(dy) * relu64(bf16_values(x)))
    correct = bwd_oracle(dy, x)
    assert (mutated != correct).any()
    np.testing.assert_array_equal(bits16(relu2_bwd(bf16_tensor(dy), bf16_tensor(x))), correct)
