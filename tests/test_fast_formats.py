"""nmoe.fast.formats: compile checks and op plumbing on CPU; on a GPU, every output bit (codes, scale bytes,
tensor scale, NaN payloads) against nmoe.reference.formats on random and adversarial data, plus separating
inputs for the fast path's mutations (mutation formulas written out here with numpy + ml_dtypes)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from torch import Tensor

from nmoe.fast import formats as fast
from nmoe.fast import op
from nmoe.fast.arch import SUPPORTED_ARCHS, ArchError
from nmoe.reference import formats as ref

ROOT = Path(__file__).resolve().parents[1]
F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]
U32 = npt.NDArray[np.uint32]
gpu = pytest.mark.gpu
GPU_CANONICAL_NAN = 0x7FFFFFFF  # what a GPU mul.rn.f32 writes for 0 * Inf
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}

# ---------------------------------------------------------------------------------------------------------
# Inputs. Every generator returns fp32 values exactly representable in bf16 unless it says otherwise.
# ---------------------------------------------------------------------------------------------------------
E4M3_POS: F32 = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
E4M3_MID: F32 = ((E4M3_POS[:-1] + E4M3_POS[1:]) / 2).astype(np.float32)  # exact: 5 significant bits
E2M1_MID = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
SPECIAL_F32: U32 = np.array(
    [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA00005,
     0x7FC01230, 0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x43E00000,
     0x43E80000, 0x43F00000, 0xC3E00001, 0x3C800000, 0x3B000000, 0x3A800000, 0x3F800000, 0x45280000],
    dtype=np.uint32)


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def bf16_exact(v: F32) -> F32:
    """v rounded to bf16 (values already on the bf16 grid stay unchanged)."""
    return np.asarray(torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16).float().numpy())


def random_rows(rows: int, k: int, seed: int, lo: int = -140, hi: int = 120) -> F32:
    """Normal data whose per-row magnitude spans 2^lo .. 2^hi (default: most of e8m0's range)."""
    r = rng(seed)
    mag = np.exp2(r.integers(lo, hi, (rows, 1))).astype(np.float32)
    return bf16_exact((r.standard_normal((rows, k)) * mag).astype(np.float32))


def adversarial_rows(k: int, seed: int, lo: int = -140, hi: int = 120) -> F32:
    """Rows mixing NaN (both signs, payloads), +-Inf, +-0, subnormals, +-max and 448 boundaries."""
    r = rng(seed)
    base = random_rows(24, k, seed, lo, hi)
    sp = SPECIAL_F32.view(np.float32)
    for i in range(base.shape[0]):
        pos = r.choice(k, size=r.integers(1, 4), replace=False)
        base[i, pos] = sp[r.integers(0, len(sp), len(pos))]
    return base


def tie_rows(k: int) -> F32:
    """Blocks whose amax is 448 * 2^e (scale exact), all other elements exact e4m3 midpoints times 2^e;
    the first row (e = -133) instead hits the scale byte's lower clamp (s is an fp32 subnormal)."""
    rows = []
    for e in (-133, -40, -7, 0, 9, 60, 119):
        mids = np.resize(np.concatenate([E4M3_MID, -E4M3_MID]), k)
        mids[:: min(k, 32)] = 448.0
        rows.append((mids * np.float32(2.0**e)).astype(np.float32))
    return np.stack(rows)


def zero_rows(k: int) -> F32:
    z = np.zeros((3, k), dtype=np.float32)
    z[1, ::3] = -0.0
    z[2, :] = -0.0
    z[2, k // 2:] = 1.5
    return z


def to_torch(v: F32, dtype: torch.dtype) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(v)).to(dtype)


def fp32_from_bits(bits: U32) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int32)).view(torch.float32)


def bits_of(t: Tensor) -> npt.NDArray[Any]:
    t = t.detach().contiguous().cpu()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(view).numpy()


def assert_bitwise(got: tuple[Tensor, ...] | Tensor, want: tuple[Tensor, ...] | Tensor) -> None:
    gs = got if isinstance(got, tuple) else (got,)
    ws = want if isinstance(want, tuple) else (want,)
    assert len(gs) == len(ws)
    for g, w in zip(gs, ws, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        np.testing.assert_array_equal(bits_of(g), bits_of(w))


def cuda(*ts: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.cuda() for t in ts)


# ---------------------------------------------------------------------------------------------------------
# Mutation formulas (numpy + ml_dtypes), used only to prove that a test's data separates a mutant.
# ---------------------------------------------------------------------------------------------------------
def mx_np(x: F32, block: int, variant: str = "spec") -> tuple[U8, U8]:
    """MX-FP8 of fp32 x along the last dim; `variant` names a mutation (or "spec")."""
    xb = x.reshape(*x.shape[:-1], -1, block)
    fin = np.isfinite(xb)
    finite = fin.all(-1, keepdims=True)
    amax = np.where(fin, np.abs(xb), np.float32(0)).max(-1, keepdims=True).astype(np.float32)
    sbits = (amax / np.float32(448.0)).astype(np.float32).view(np.uint32).astype(np.int64)
    byte = (sbits >> 23) + ((sbits & 0x7FFFFF) != 0)
    if variant == "ceil_dropped":
        byte = (amax.view(np.uint32).astype(np.int64) >> 23) - 8
    byte = np.where(finite, np.clip(byte, 1, 254), 255)
    with np.errstate(over="ignore", invalid="ignore"):
        v = (xb * np.ldexp(np.float32(1.0), (127 - byte).astype(np.int32))).astype(np.float32)
    if variant != "inf_unclamped":
        v = np.clip(v, -448.0, 448.0)
    if variant == "ties_away":
        v = np.copysign(np.nextafter(np.abs(v), np.float32(np.inf)), v).astype(np.float32)
    if variant == "subnormals_flushed":
        v = np.where(np.abs(v) < 2.0**-6, np.copysign(np.float32(0), v), v).astype(np.float32)
    codes = v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    nan = np.isnan(xb)
    nan_code = 0x7F | (np.signbit(xb).astype(np.uint8) << 7) * (variant != "nan_unsigned")
    codes = np.where(nan, nan_code, codes).astype(np.uint8)
    if variant != "zero_block_signed":
        codes = np.where(finite & (amax == 0), np.uint8(0), codes)
    return codes.reshape(x.shape), byte.squeeze(-1).astype(np.uint8)


def f32_of(t: Tensor) -> F32:
    return np.asarray(t.detach().float().cpu().numpy(), dtype=np.float32)


# ---------------------------------------------------------------------------------------------------------
# CPU: declarations, compile checks, plumbing.
# ---------------------------------------------------------------------------------------------------------
REGISTRY_OPS = {"quantize_mxfp8_32", "quantize_mxfp8_128", "dequantize_mxfp8_32", "dequantize_mxfp8_128",
                "quantize_mxfp8_w128", "dequantize_mxfp8_w128", "quantize_nvfp4", "dequantize_nvfp4"}


def test_kernels_declare_both_archs_and_contract_names() -> None:
    assert {k.op for k in fast.KERNELS} == REGISTRY_OPS
    assert len({k.name for k in fast.KERNELS}) == len(fast.KERNELS)
    for spec in fast.KERNELS:
        assert set(spec.expect) == set(spec.forbid) == set(SUPPORTED_ARCHS)
        for arch in SUPPORTED_ARCHS:
            assert any("e4m3x2" in rx for rx in spec.forbid[arch])
            for rx in (*spec.expect[arch], *spec.forbid[arch]):
                re.compile(rx)


def test_kernel_source_hash_covers_the_kernel_file_and_constants() -> None:
    files = op.source_files(fast.KERNELS_BY_NAME["mx_quant"].module)
    assert {ROOT / "nmoe" / "fast" / "kernels" / "formats.py", ROOT / "nmoe" / "constants.py"} <= set(files)


def test_compile_mx_quant_without_gpu() -> None:
    for arch, rows in compile_rows("nmoe.fast.formats", ["mx_quant_b32"]).items():
        assert_rows_ok(rows, arch, 1)


@pytest.mark.heavy
def test_compile_all_format_kernels_without_gpu() -> None:
    for arch, rows in compile_rows("nmoe.fast.formats").items():
        assert_rows_ok(rows, arch, len(fast.KERNELS))


CALLS: list[Callable[[], object]] = [
    lambda: fast.quantize_mxfp8(torch.ones(2, 32), 32),
    lambda: fast.dequantize_mxfp8(torch.zeros(2, 32, dtype=torch.uint8), torch.ones(2, 1, dtype=torch.uint8),
                                  32),
    lambda: fast.quantize_mxfp8_weight(torch.ones(128, 128)),
    lambda: fast.dequantize_mxfp8_weight(torch.zeros(128, 128, dtype=torch.uint8),
                                         torch.ones(1, 1, dtype=torch.uint8)),
    lambda: fast.quantize_nvfp4(torch.ones(2, 16)),
    lambda: fast.dequantize_nvfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2, 1, dtype=torch.uint8),
                                  torch.tensor(1.0)),
]


@pytest.mark.parametrize("call", CALLS)
def test_cpu_tensors_are_refused_naming_reference(call: Callable[[], object]) -> None:
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        call()


@pytest.mark.parametrize(("call", "match"), [
    (lambda: fast.quantize_mxfp8(torch.ones(2, 32, dtype=torch.float64), 32), "float32 explicitly"),
    (lambda: fast.quantize_mxfp8(torch.ones(2, 32), 64), "use 32"),
    (lambda: fast.quantize_mxfp8(torch.ones(2, 48), 32), "pad it"),
    (lambda: fast.quantize_mxfp8(torch.tensor(1.0), 32), "0-dim"),
    (lambda: fast.dequantize_mxfp8(torch.zeros(2, 32, dtype=torch.uint8), torch.ones(2, 2, dtype=torch.uint8),
                                   32), "quantize_mxfp8's pair"),
    (lambda: fast.dequantize_mxfp8(torch.zeros(2, 32), torch.ones(2, 1, dtype=torch.uint8), 32), "uint8"),
    (lambda: fast.quantize_mxfp8_weight(torch.ones(128, 130)), "pad it"),
    (lambda: fast.quantize_mxfp8_weight(torch.ones(128)), r"\[\.\.\., N, K\]"),
    (lambda: fast.dequantize_mxfp8_weight(torch.zeros(128, 128, dtype=torch.uint8),
                                          torch.ones(2, 1, dtype=torch.uint8)), "pair"),
    (lambda: fast.quantize_nvfp4(torch.ones(2, 24)), "pad it"),
    (lambda: fast.dequantize_nvfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2, 1, dtype=torch.uint8),
                                   torch.tensor([1.0])), "0-dim fp32"),
    (lambda: fast.dequantize_nvfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2, 2, dtype=torch.uint8),
                                   torch.tensor(1.0)), "quantize_nvfp4's outputs"),
])
def test_bad_arguments_fail_loud_with_the_fix(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_custom_ops_have_fake_shapes() -> None:
    x = torch.empty(3, 4, 256, device="meta", dtype=torch.bfloat16)
    codes, scales = torch.ops.nmoe.quantize_mxfp8(x, 32)
    assert (codes.shape, codes.dtype, scales.shape) == ((3, 4, 256), torch.uint8, (3, 4, 8))
    assert torch.ops.nmoe.dequantize_mxfp8(codes, scales, 32).shape == (3, 4, 256)
    wc, ws = torch.ops.nmoe.quantize_mxfp8_weight(torch.empty(2, 256, 384, device="meta"))
    assert (wc.shape, ws.shape) == ((2, 256, 384), (2, 2, 3))
    assert torch.ops.nmoe.dequantize_mxfp8_weight(wc, ws).dtype == torch.float32
    p, bs, g = torch.ops.nmoe.quantize_nvfp4(x)
    assert (p.shape, bs.shape, g.shape, g.dtype) == ((3, 4, 128), (3, 4, 16), (), torch.float32)
    assert torch.ops.nmoe.dequantize_nvfp4(p, bs, g).shape == (3, 4, 256)


@pytest.mark.parametrize("seed", [0, 1])
def test_mutation_formulas_spec_variant_equals_reference(seed: int) -> None:
    """The numpy MX-FP8 model used to build separating inputs is itself the spec on all input kinds."""
    for x in (random_rows(8, 128, seed), adversarial_rows(128, seed), tie_rows(128), zero_rows(128)):
        for block in (32, 128):
            codes, scales = mx_np(x, block)
            rc, rs = ref.quantize_mxfp8(torch.from_numpy(x), block)
            np.testing.assert_array_equal(codes, rc.numpy())
            np.testing.assert_array_equal(scales, rs.numpy())


def test_tie_rows_are_exact_ties() -> None:
    """Every non-anchor element of tie_rows[1:] lands halfway between two e4m3 values after scaling."""
    x = tie_rows(128)
    assert (mx_np(x, 32)[1][0] == 1).all()
    x = x[1:]
    _, scales = mx_np(x, 32)
    scaled = x.reshape(6, 4, 32) * np.ldexp(np.float32(1), 127 - scales.astype(np.int32))[..., None]
    rounded = scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    body = np.abs(scaled) != 448
    assert np.all(np.isin(np.abs(scaled[body]), E4M3_MID)) and np.all(rounded[body] != scaled[body])


# ---------------------------------------------------------------------------------------------------------
# GPU: MX-FP8 along K.
# ---------------------------------------------------------------------------------------------------------
# fp16 covers 2^-24 .. 65504: its rows stay inside that range so they are not all zeros and Infs.
RANGE = {"bf16": (-140, 120), "fp32": (-140, 120), "fp16": (-20, 12)}


def mx_inputs(k: int, seed: int, dtype: str) -> dict[str, F32]:
    lo, hi = RANGE[dtype]
    return {"random": random_rows(64, k, seed, lo, hi), "adversarial": adversarial_rows(k, seed, lo, hi),
            "ties": tie_rows(k), "zero": zero_rows(k), "single_row": random_rows(1, k, seed + 7, lo, hi)}


@gpu
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("case", ["random", "adversarial", "ties", "zero", "single_row"])
def test_quantize_mxfp8_bitwise(block: int, dtype: str, case: str) -> None:
    x = to_torch(mx_inputs(256, block, dtype)[case], DTYPES[dtype])
    assert_bitwise(fast.quantize_mxfp8(x.cuda(), block), ref.quantize_mxfp8(x, block))


@gpu
@pytest.mark.parametrize("block", [32, 128])
def test_quantize_mxfp8_all_bf16_patterns(block: int) -> None:
    """All 65536 bf16 bit patterns, in shuffled order and sorted by magnitude (dense ties and subnormals)."""
    allb = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    order = np.argsort(np.abs((allb.astype(np.uint32) << 16).view(np.float32)), kind="stable")
    for bits in (rng(block).permutation(allb), allb[order]):
        x = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).reshape(256, 256)
        assert_bitwise(fast.quantize_mxfp8(x.cuda(), block), ref.quantize_mxfp8(x, block))


@gpu
@pytest.mark.parametrize("block", [32, 128])
def test_quantize_mxfp8_fp32_random_bit_patterns(block: int) -> None:
    r = rng(3 + block)
    bits = np.concatenate([SPECIAL_F32, r.integers(0, 1 << 32, 4096 * 64 - len(SPECIAL_F32),
                                                   dtype=np.uint64).astype(np.uint32)])
    x = fp32_from_bits(r.permutation(bits)).reshape(-1, 4096)
    assert_bitwise(fast.quantize_mxfp8(x.cuda(), block), ref.quantize_mxfp8(x, block))


@gpu
@pytest.mark.parametrize("shape", [(32,), (5, 3, 128), (1, 4096), (0, 64), (3000, 96)])
def test_quantize_mxfp8_shapes_and_leading_dims(shape: tuple[int, ...]) -> None:
    x = torch.from_numpy(rng(len(shape)).standard_normal(shape).astype(np.float32)).bfloat16()
    assert_bitwise(fast.quantize_mxfp8(x.cuda(), 32), ref.quantize_mxfp8(x, 32))


@gpu
def test_quantize_mxfp8_misaligned_and_strided_views() -> None:
    base = to_torch(random_rows(9, 257, 5), torch.bfloat16)
    for x in (base.flatten()[1:1 + 8 * 256].reshape(8, 256), base[:, :256]):
        assert_bitwise(fast.quantize_mxfp8(x.cuda(), 32), ref.quantize_mxfp8(x, 32))


@gpu
@pytest.mark.parametrize("block", [32, 128])
def test_dequantize_mxfp8_every_code_with_every_scale_byte(block: int) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 256 // block)
    assert_bitwise(fast.dequantize_mxfp8(codes.cuda(), scales.cuda(), block),
                   ref.dequantize_mxfp8(codes, scales, block))


@gpu
def test_mxfp8_round_trip_through_fast_ops() -> None:
    x = to_torch(random_rows(32, 512, 11), torch.bfloat16)
    codes, scales = fast.quantize_mxfp8(x.cuda(), 128)
    assert_bitwise(fast.dequantize_mxfp8(codes, scales, 128),
                   ref.dequantize_mxfp8(*ref.quantize_mxfp8(x, 128), 128))


# ---------------------------------------------------------------------------------------------------------
# GPU: MX-FP8 weights (128 x 128 blocks).
# ---------------------------------------------------------------------------------------------------------
def weight_inputs(seed: int) -> dict[str, F32]:
    r = rng(seed)
    w = random_rows(2 * 256, 384, seed).reshape(2, 256, 384)
    adv = w.copy()
    flat = adv.reshape(-1)
    sp = SPECIAL_F32.view(np.float32)
    flat[r.choice(flat.size, 40, replace=False)] = sp[r.integers(0, len(sp), 40)]
    ties = np.tile(tie_rows(384)[:, None, :], (1, 128, 1))[:2].reshape(2, 128, 384)
    zero = np.zeros((1, 128, 256), dtype=np.float32)
    zero[0, 5:9, 130:140] = -0.0
    return {"random": w, "adversarial": adv, "ties": ties, "zero": zero,
            "one_block": random_rows(128, 128, seed + 1)}


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("case", ["random", "adversarial", "ties", "zero", "one_block"])
def test_quantize_mxfp8_weight_bitwise(dtype: str, case: str) -> None:
    w = to_torch(weight_inputs(7)[case], DTYPES[dtype])
    assert_bitwise(fast.quantize_mxfp8_weight(w.cuda()), ref.quantize_mxfp8_weight(w))


@gpu
def test_dequantize_mxfp8_weight_every_code_with_every_scale_byte() -> None:
    """256 blocks (16 x 16), block b holding all 256 codes 64 times with scale byte b."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(64).reshape(128, 128)
    codes = codes.repeat(16, 16)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    assert_bitwise(fast.dequantize_mxfp8_weight(*cuda(codes, scales)),
                   ref.dequantize_mxfp8_weight(codes, scales))


@gpu
def test_mxfp8_weight_stacks_past_65535_rows() -> None:
    """E x N rows of an expert stack (here 65664) past the grid's y limit: both kernels put rows on x."""
    w = torch.randn(513, 128, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    codes, scales = ref.quantize_mxfp8_weight(w)
    assert_bitwise(fast.quantize_mxfp8_weight(w.cuda()), (codes, scales))
    want = ref.dequantize_mxfp8_weight(codes, scales)
    assert_bitwise(fast.dequantize_mxfp8_weight(*cuda(codes, scales)), want)


# ---------------------------------------------------------------------------------------------------------
# GPU: NVFP4.
# ---------------------------------------------------------------------------------------------------------
def nvfp4_tie_rows() -> F32:
    """g = 1 exactly (tensor amax 2688); block b has amax 6*v_b so s_b = v_b, and its other elements are
    e2m1 midpoints times v_b: every one an exact tie of x/(s_b*g)."""
    v = E4M3_POS[1:][::4]
    rows = np.zeros((len(v) + 1, 16), dtype=np.float32)
    rows[0, 0] = 2688.0
    for i, vb in enumerate(v, start=1):
        rows[i, 0] = 6 * vb
        rows[i, 1:8] = E2M1_MID * vb
        rows[i, 8:15] = -E2M1_MID * vb
        rows[i, 15] = -0.0
    return rows


def nvfp4_inputs(seed: int, dtype: str) -> dict[str, F32]:
    lo, hi = RANGE[dtype]
    tiny = np.zeros((2, 32), dtype=np.float32)
    tiny[0, 3] = np.float32(1e-40)
    nan_blocks = random_rows(4, 64, seed, lo, hi)
    nan_blocks[1, 17], nan_blocks[2, 40], nan_blocks[3, 0] = np.nan, np.inf, -np.inf
    return {"random": random_rows(64, 256, seed, lo, hi), "adversarial": adversarial_rows(256, seed, lo, hi),
            "ties": nvfp4_tie_rows(), "zero": zero_rows(64), "tiny": tiny, "nan_blocks": nan_blocks,
            "single_row": random_rows(1, 16, seed, lo, hi),
            "denormal": np.full((2, 32), 3e-39, dtype=np.float32)}


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("case", ["random", "adversarial", "ties", "zero", "tiny", "nan_blocks", "single_row",
                                  "denormal"])
def test_quantize_nvfp4_bitwise(dtype: str, case: str) -> None:
    x = to_torch(nvfp4_inputs(5, dtype)[case], DTYPES[dtype])
    assert_bitwise(fast.quantize_nvfp4(x.cuda()), ref.quantize_nvfp4(x))


@gpu
@pytest.mark.parametrize("where", [0, 12345, -1])
def test_quantize_nvfp4_tensor_amax_reduces_over_many_ctas(where: int) -> None:
    """8M elements (grid-stride, many warps' atomics); the max sits at the start, middle or very end."""
    x = torch.from_numpy(rng(where % 97).standard_normal((2048, 4096)).astype(np.float32))
    x.view(-1)[where] = 77777.0
    x.view(-1)[where - 5] = float("inf")
    assert_bitwise(fast.quantize_nvfp4(x.cuda()), ref.quantize_nvfp4(x))


@gpu
def test_quantize_nvfp4_all_bf16_patterns() -> None:
    allb = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = allb[(allb & 0x7F80) != 0x7F80]
    order = np.argsort(np.abs((finite.astype(np.uint32) << 16).view(np.float32)), kind="stable")
    for bits in (finite[order][-(len(finite) // 16) * 16:], allb):
        x = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).reshape(-1, 256)
        assert_bitwise(fast.quantize_nvfp4(x.cuda()), ref.quantize_nvfp4(x))


@gpu
@pytest.mark.parametrize("g", [1.0, 3.0517578e-05, 1e-41, 0.0, -0.0, 2.5e38, float("inf"), -float("inf"),
                               float("nan"), "nan-payload"])
def test_dequantize_nvfp4_every_byte_with_every_scale(g: float | str) -> None:
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1).reshape(256 * 32, 8)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat_interleave(32)[:, None]
    ts = fp32_from_bits(np.array([0xFFA01234], dtype=np.uint32))[0] if g == "nan-payload" else torch.tensor(g)
    assert_bitwise(fast.dequantize_nvfp4(*cuda(packed, scales, ts)), ref.dequantize_nvfp4(packed, scales, ts))


@gpu
def test_quantize_ops_capture_in_cuda_graph_and_compile() -> None:
    """No host sync anywhere (NVFP4's amax stays on the device): graph capture and fullgraph compile work."""
    x1, x2 = (to_torch(random_rows(64, 256, s), torch.bfloat16).cuda() for s in (1, 2))
    fast.quantize_nvfp4(x1)
    fast.quantize_mxfp8(x1, 32)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nv = fast.quantize_nvfp4(x1)
        mx = fast.quantize_mxfp8(x1, 32)
    x1.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(nv, ref.quantize_nvfp4(x2.cpu()))
    assert_bitwise(mx, ref.quantize_mxfp8(x2.cpu(), 32))
    compiled = torch.compile(lambda t: fast.dequantize_nvfp4(*fast.quantize_nvfp4(t)), fullgraph=True)
    assert_bitwise(compiled(x2), ref.dequantize_nvfp4(*ref.quantize_nvfp4(x2.cpu())))


# ---------------------------------------------------------------------------------------------------------
# Separating inputs for the fast path's GPU mutations (anchors in nmoe/fast/kernels/formats.py): each test
# shows that the mutated formula and the spec differ on its data, then checks the kernel.
# ---------------------------------------------------------------------------------------------------------
def sep_mx(x: F32, block: int, variant: str) -> None:
    spec, mutant = mx_np(x, block), mx_np(x, block, variant)
    assert any((a != b).any() for a, b in zip(spec, mutant, strict=True))
    got = fast.quantize_mxfp8(torch.from_numpy(x).cuda(), block)
    np.testing.assert_array_equal(got[0].cpu().numpy(), spec[0])
    np.testing.assert_array_equal(got[1].cpu().numpy(), spec[1])


@gpu
def test_sep_mxfp8_fast_scale_ceil_dropped() -> None:
    """The kernel reads the byte off amax's bits (biased - 8 + [mantissa > 1.75's]); without the +1 it
    would floor instead of ceil whenever amax's mantissa exceeds 1.75's (a quarter of random blocks)."""
    sep_mx(random_rows(16, 128, 1), 32, "ceil_dropped")


@gpu
def test_sep_mxfp8_fast_nan_sign_dropped() -> None:
    x = random_rows(4, 64, 2)
    x[:, 5] = -np.nan
    sep_mx(x, 32, "nan_unsigned")


@gpu
def test_sep_mxfp8_fast_zero_block_keeps_sign() -> None:
    sep_mx(zero_rows(128), 32, "zero_block_signed")


@gpu
def test_sep_mxfp8_fast_ties_away() -> None:
    sep_mx(tie_rows(128), 32, "ties_away")


@gpu
def test_sep_mxfp8_fast_subnormals_flushed() -> None:
    sep_mx(tie_rows(128), 128, "subnormals_flushed")


@gpu
def test_sep_mxfp8_fast_inf_not_clamped() -> None:
    x = random_rows(4, 64, 3)
    x[1, 7], x[2, 40] = np.inf, -np.inf
    sep_mx(x, 32, "inf_unclamped")


def block_bytes(w: F32, rows: npt.NDArray[np.bool_]) -> U8:
    """Scale bytes of the 128x128 blocks of w [N, K], reading only the block rows where `rows` is set."""
    n, k = w.shape
    wb = np.where(rows[None, :, None, None], w.reshape(n // 128, 128, k // 128, 128), np.float32(0))
    return mx_np(np.ascontiguousarray(wb.transpose(0, 2, 1, 3)).reshape(n // 128, k // 128, -1), 128 * 128)[1]


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_sep_mxfp8_weight_fast_one_warp_amax(dtype: str) -> None:
    """Each block's max sits in block row 14, loaded by warp 7 (bf16) / warp 6 (fp32), never by warp 0
    (rows = 0, 1 mod 16 for bf16, 0 mod 8 for fp32): warp 0 alone would see a smaller amax."""
    w = (rng(4).standard_normal((256, 384)) * 1e-3).astype(np.float32)
    w[14::128] *= np.float32(1e3)
    warp0 = (np.arange(128) % 16 < 2) if dtype == "bf16" else (np.arange(128) % 8 == 0)
    assert (block_bytes(w, np.ones(128, dtype=bool)) != block_bytes(w, warp0)).all()
    x = to_torch(w, DTYPES[dtype])
    assert_bitwise(fast.quantize_mxfp8_weight(x.cuda()), ref.quantize_mxfp8_weight(x))


@gpu
def test_sep_mxfp8_fast_dequant_nan_scale_ignored() -> None:
    """Scale byte 255 decodes to NaN (0x7FC00000); 2^(255-127) read as a plain exponent would be +Inf."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)[None]
    scales = torch.full((1, 8), 255, dtype=torch.uint8)
    with np.errstate(invalid="ignore"):
        mutant = e4m3_np(codes.numpy()) * np.float32(np.inf)
    want = ref.dequantize_mxfp8(codes, scales, 32)
    assert not np.array_equal(mutant.view(np.uint32), bits_of(want).view(np.uint32))
    assert_bitwise(fast.dequantize_mxfp8(codes.cuda(), scales.cuda(), 32), want)


def e4m3_np(codes: U8) -> F32:
    with np.errstate(invalid="ignore"):
        out: F32 = np.asarray(codes, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return out


def nvfp4_np(x: F32, variant: str = "spec") -> tuple[U8, U8]:
    """NVFP4 (finite x) per the pinned fp32 op order; variants: "round_up" (s_b rounded up), "recip"."""
    xb = x.reshape(*x.shape[:-1], -1, 16).astype(np.float32)
    g = np.float32(np.abs(x).max() / np.float32(2688.0))
    amax_b = np.abs(xb).max(-1, keepdims=True)
    s_real = np.minimum((amax_b / np.float32(6.0)) / g, np.float32(448)).astype(np.float32)
    s8 = s_real.astype(ml_dtypes.float8_e4m3fn)
    if variant == "round_up":
        up = (s8.view(np.uint8) + 1).view(ml_dtypes.float8_e4m3fn)
        s8 = np.where(s8.astype(np.float32) < s_real, up, s8)
    denom = (s8.astype(np.float32) * g).astype(np.float32)
    ok = denom > 0
    safe = np.where(ok, denom, np.float32(1))
    q = (xb * (np.float32(1) / safe)) if variant == "recip" else (xb / safe)
    q = np.clip(q.astype(np.float32), -6, 6)
    mag = np.abs(q).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 7
    codes = np.where(ok, mag | (np.signbit(q).astype(np.uint8) << 3), 0).astype(np.uint8).reshape(x.shape)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), s8.view(np.uint8).squeeze(-1)


def sep_nv(x: F32, variant: str) -> None:
    spec, mutant = nvfp4_np(x), nvfp4_np(x, variant)
    want = ref.quantize_nvfp4(torch.from_numpy(x))
    np.testing.assert_array_equal(spec[0], want[0].numpy())
    np.testing.assert_array_equal(spec[1], want[1].numpy())
    assert any((a != b).any() for a, b in zip(spec, mutant, strict=True))
    assert_bitwise(fast.quantize_nvfp4(torch.from_numpy(x).cuda()), want)


@gpu
def test_sep_nvfp4_fast_scale_round_up() -> None:
    sep_nv((rng(9).standard_normal((8, 256)) * 3).astype(np.float32), "round_up")


def ulp_neighbours(x: np.float32, n: int) -> list[np.float32]:
    bits = int(np.array(x, dtype=np.float32).view(np.uint32))
    return [np.float32(np.array(bits + d, dtype=np.uint32).view(np.float32)) for d in range(-n, n + 1)]


def recip_separating_block() -> F32:
    """g = 1; a block with s_b = v whose element x gives e2m1(x/v) != e2m1(x * fp32(1/v)), found by search."""
    one = np.float32(1)
    for v in E4M3_POS[8:]:
        for t in E2M1_MID:
            for x in ulp_neighbours(np.float32(t * v), 3):
                a = np.float32(x / v)
                b = np.float32(x * (one / v))
                ea, eb = (np.array([a, b]).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 7)
                if ea != eb:
                    rows = np.zeros((2, 16), dtype=np.float32)
                    rows[0, 0] = 2688.0
                    rows[1, 0], rows[1, 1] = 6 * v, x
                    return rows
    raise AssertionError("no separating (v, x) pair for the reciprocal mutation")


@gpu
def test_sep_nvfp4_fast_reciprocal_multiply() -> None:
    sep_nv(recip_separating_block(), "recip")


@gpu
def test_sep_nvfp4_fast_amax_includes_nonfinite() -> None:
    """An Inf outside a block's reach must not enter g: with it, g would be Inf (bits 0x7F800000/2688)."""
    x = (rng(10).standard_normal((4, 64))).astype(np.float32)
    x[3, 3] = np.inf
    finite = np.where(np.isfinite(x), np.abs(x), 0).max() / np.float32(2688)
    assert np.float32(finite) != np.float32(np.inf) / np.float32(2688)
    assert_bitwise(fast.quantize_nvfp4(torch.from_numpy(x).cuda()), ref.quantize_nvfp4(torch.from_numpy(x)))


@gpu
def test_sep_nvfp4_fast_nan_block_scale_not_7f() -> None:
    x = random_rows(2, 32, 12)
    x[0, 4] = np.nan
    _, s = nvfp4_np(np.nan_to_num(x, nan=0.0))
    want = ref.quantize_nvfp4(torch.from_numpy(x))
    assert int(want[1][0, 0]) == 0x7F != int(s[0, 0])
    assert_bitwise(fast.quantize_nvfp4(torch.from_numpy(x).cuda()), want)


@gpu
def test_sep_nvfp4_fast_dequant_zero_times_inf() -> None:
    """0 * Inf: x86 gives 0xFFC00000, the GPU's mul.rn.f32 0x7FFFFFFF; the spec pins 0x7FC00000."""
    packed = torch.tensor([[0x80, 0x10, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    scales = torch.tensor([[0x38]], dtype=torch.uint8)
    want = ref.dequantize_nvfp4(packed, scales, torch.tensor(float("inf")))
    got_bits = int(bits_of(want).view(np.uint32)[0, 0])
    assert got_bits == 0x7FC00000 and got_bits != GPU_CANONICAL_NAN
    assert_bitwise(fast.dequantize_nvfp4(*cuda(packed, scales, torch.tensor(float("inf")))), want)


def test_nvfp4_mutation_formulas_spec_variant_equals_reference() -> None:
    for x in ((rng(9).standard_normal((8, 256)) * 3).astype(np.float32), nvfp4_tie_rows(),
              recip_separating_block()):
        want = ref.quantize_nvfp4(torch.from_numpy(x))
        got = nvfp4_np(x)
        np.testing.assert_array_equal(got[0], want[0].numpy())
        np.testing.assert_array_equal(got[1], want[1].numpy())


def test_nvfp4_tie_rows_are_exact_ties() -> None:
    x = nvfp4_tie_rows()
    g = np.float32(2688.0) / np.float32(2688.0)
    scales = ref.quantize_nvfp4(torch.from_numpy(x))[1].numpy()
    s = e4m3_np(scales[1:, 0])
    q = x[1:, 1:15] / (s[:, None] * g)
    assert np.all(np.isin(np.abs(q), E2M1_MID))


def spec_byte(amax_bits: U32) -> npt.NDArray[np.int64]:
    s = (amax_bits.view(np.float32) / np.float32(448.0)).astype(np.float32).view(np.uint32).astype(np.int64)
    out: npt.NDArray[np.int64] = np.clip((s >> 23) + ((s & 0x7FFFFF) != 0), 1, 254)
    return out


def division_free_byte(amax_bits: U32) -> npt.NDArray[np.int64]:
    """The kernel's formula (kernels/formats.py mx_byte): no fp32 division."""
    a = amax_bits.astype(np.int64)
    out: npt.NDArray[np.int64] = np.clip((a >> 23) - 8 + ((a & 0x7FFFFF) > 0x600000), 1, 254)
    return out


def kernel_mag_byte(v: F32) -> npt.NDArray[np.int64]:
    """The kernel's e4m3 magnitude (kernels/formats.py e4m3_mag_byte): above 2^-6 Veltkamp's split of
    m * 2^-120, whose bits are code << 20 (the fma is exact in float64 then rounded once); below, one
    fp32 add of 2^14, whose byte 0 is the code."""
    m = np.minimum(np.abs(v), np.float32(448.0))
    c_m = (m * np.float32(1048577 * 2.0**-120)).astype(np.float32)
    d = (m.astype(np.float64) * 2.0**-120 - c_m.astype(np.float64)).astype(np.float32)
    normal = ((c_m + d).astype(np.float32).view(np.uint32) >> 20).astype(np.int64)
    sub = (m + np.float32(16384.0)).astype(np.float32).view(np.uint32).astype(np.int64)
    out: npt.NDArray[np.int64] = np.where(m.view(np.uint32) < 0x3C800000, sub, normal) & 0xFF
    return out


def finite_chunks(step: int) -> list[U32]:
    """Non-negative finite fp32 bit patterns: every `step`-th one plus all within 4096 of each binade edge."""
    strided = np.arange(0, 0x7F800000, step, dtype=np.uint32)
    edges = (np.arange(0, 255, dtype=np.uint32)[:, None] << 23) + np.arange(-4096, 4096)[None, :]
    edges = edges.ravel()
    return [strided, edges[(edges >= 0) & (edges < 0x7F800000)].astype(np.uint32)]


@pytest.mark.parametrize("step", [997, pytest.param(1, marks=pytest.mark.heavy)])
def test_division_free_scale_byte_equals_spec(step: int) -> None:
    """Proof obligation of mx_byte: equal to the spec's byte for every finite amax (step 1: all 2^31-2^23)."""
    for chunk in finite_chunks(step):
        for part in np.array_split(chunk, max(1, chunk.size >> 24)):
            np.testing.assert_array_equal(division_free_byte(part), spec_byte(part))


@pytest.mark.parametrize("step", [997, pytest.param(61, marks=pytest.mark.heavy)])
def test_kernel_e4m3_rounding_equals_spec(step: int) -> None:
    """Proof obligation of e4m3_mag_byte against the spec's e4m3_encode of clamp(|v|, 448) (checked for
    all 2^31 - 2^23 finite non-negative fp32 values once, against ml_dtypes, in 60 s of numpy)."""
    for chunk in finite_chunks(step):
        for part in np.array_split(chunk, max(1, chunk.size >> 22)):
            v = part.view(np.float32)
            want = ref.e4m3_encode(torch.from_numpy(v.copy())).numpy().astype(np.int64)
            np.testing.assert_array_equal(kernel_mag_byte(v), want)
