"""nmoe.fast.rope: compile checks and glue on CPU; bitwise GPU checks against a float64 oracle of the spec's
fp32 steps (each product exact in float64 and rounded once; a sum of two fp32 values rounded from float64 is
correctly rounded, 53 >= 2*24 + 2 bits; then one rounding to x's dtype, NaN canonical)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from torch import Tensor

from nmoe.fast import FAST_MODULES
from nmoe.fast import rope as fast_rope
from nmoe.fast.arch import SUPPORTED_ARCHS, ArchError
from nmoe.fast.rope import KERNELS, apply_rope, apply_rope_bwd, rope_inplace, row_pitch, table_plan
from nmoe.reference import rope as spec_rope

F64 = torch.float64
NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float32: 0x7FC00000}
INT_VIEW = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _f32(t: Tensor) -> Tensor:
    return t.to(torch.float32).to(F64)


def _round(v: Tensor, dtype: torch.dtype) -> Tensor:
    """fp32 value (held in float64) rounded once to dtype; bits with NaN canonical."""
    out = v.to(torch.float32).to(dtype)
    bits = out.view(INT_VIEW[dtype]).to(torch.int64) & (0xFFFF if dtype == torch.bfloat16 else 0xFFFFFFFF)
    return torch.where(torch.isnan(v), torch.full_like(bits, NAN_BITS[dtype]), bits)


def oracle(x: Tensor, cos: Tensor, sin: Tensor, sign: float = 1.0, sep: str = "") -> Tensor:
    """Expected bits of the rotation by sign*angle; `sep` names a mutant's formula for separating tests."""
    xd, c, s = x.cpu().to(F64), cos.cpu().to(F64), sign * sin.cpu().to(F64)
    x0, x1 = xd[..., 0::2], xd[..., 1::2]
    if sep == "pair_swapped":
        x0, x1 = x1, x0
    y0 = _f32(_f32(x0 * c) + _f32(x1 * s)) if sep == "sin_sign" else _f32(_f32(x0 * c) - _f32(x1 * s))
    y1 = _f32(_f32(x0 * s) + _f32(x1 * c))
    return _round(torch.stack((y0, y1), -1).flatten(-2), x.dtype)


def bits(t: Tensor) -> Tensor:
    mask = 0xFFFF if t.dtype == torch.bfloat16 else 0xFFFFFFFF
    return t.detach().cpu().contiguous().view(INT_VIEW[t.dtype]).to(torch.int64) & mask


def tables(s: int, d: int, seed: int, span: float = 100.0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    ang = ((torch.rand(s, d // 2, generator=g, dtype=F64) * 2 - 1) * span).to(torch.float32).to(F64)
    return torch.cos(ang).to(torch.float32), torch.sin(ang).to(torch.float32)


def randx(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=F64) * 3).to(dtype)


# ---------------------------------------------------------------------------------------------------
# CPU: declarations, compiles, glue checks, the YaRN tables against the spec.
# ---------------------------------------------------------------------------------------------------


def test_rope_is_a_fast_module_with_kernels_for_both_archs() -> None:
    assert "nmoe.fast.rope" in FAST_MODULES
    assert {k.op for k in KERNELS} == {"rope", "rope_bwd"}
    for spec in KERNELS:
        assert set(spec.expect) == set(spec.forbid) == set(SUPPORTED_ARCHS)


@pytest.fixture(scope="module")
def rope_rows() -> dict[str, list[dict[str, Any]]]:
    return compile_rows("nmoe.fast.rope")


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_compilecheck_rope_ok_without_gpu(rope_rows: dict[str, list[dict[str, Any]]], arch: str) -> None:
    assert_rows_ok(rope_rows[arch], arch, len(KERNELS))


def test_table_plan_positions_and_inner_dims() -> None:
    x = torch.empty(2, 5, 3, 8)
    assert table_plan(x, torch.empty(5, 1, 4), torch.empty(5, 1, 4)) == fast_rope.TablePlan(5, 3)
    assert table_plan(torch.empty(2, 3, 5, 8), torch.empty(1, 5, 4), torch.empty(1, 5, 4)) == \
        fast_rope.TablePlan(5, 1)
    assert table_plan(x, torch.empty(4), torch.empty(4)) == fast_rope.TablePlan(1, 1)


@pytest.mark.parametrize(("x", "cos", "match"), [
    (torch.empty(2, 5, 7), torch.empty(5, 3), "even"),
    (torch.empty(2, 5, 8), torch.empty(5, 3), r"x.shape\[-1\] // 2"),
    (torch.empty(2, 5, 8), torch.empty(5, 4, dtype=F64), "fp32"),
    (torch.empty(2, 5, 3, 8), torch.empty(5, 3, 4), "position only"),
    (torch.empty(2, 6, 8), torch.empty(5, 4), "slice the tables"),
])
def test_table_plan_refuses_what_the_kernel_cannot_index(x: Tensor, cos: Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        table_plan(x, cos, cos.clone())


def test_row_pitch_of_contiguous_tensors_and_last_dim_slices() -> None:
    q = torch.empty(2, 5, 3, 192)
    assert row_pitch(q) == 192 and row_pitch(q[..., 128:]) == 192 and row_pitch(q[..., :64]) == 192
    assert row_pitch(q[:, :, 1:2, 128:]) == 3 * 192 and row_pitch(torch.empty(4, 6, 8)[:, ::2]) == 16
    assert row_pitch(torch.empty(1, 1, 8)) == 8


@pytest.mark.parametrize("x", [torch.empty(4, 6, 8).transpose(0, 1), torch.empty(4, 6, 8)[:, :3],
                               torch.empty(4, 8, 2).transpose(1, 2), torch.empty(3, 8)[:, ::2]])
def test_row_pitch_refuses_rows_at_uneven_pitch(x: Tensor) -> None:
    with pytest.raises(ValueError, match="one pitch"):
        row_pitch(x)


@pytest.mark.parametrize("call", [apply_rope, apply_rope_bwd])
def test_cpu_tensors_are_refused_naming_reference(call: Any) -> None:
    cos, sin = tables(4, 8, 0)
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        call(torch.ones(2, 4, 8, dtype=torch.bfloat16), cos, sin)


def test_fake_shapes_and_autograd_on_meta() -> None:
    x = torch.empty(2, 3, 4, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    c = torch.empty(4, 4, device="meta")
    y = torch.ops.nmoe.apply_rope(x, c, c)
    assert (y.shape, y.dtype) == (x.shape, x.dtype)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_oracle_matches_the_spec_on_cpu() -> None:
    """The oracle's own check, against the spec's torch ops (NaN/inf cases included)."""
    for dtype in (torch.bfloat16, torch.float32):
        x = randx((2, 3, 6, 8), dtype, 1)
        x[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        cos, sin = tables(6, 8, 2)
        assert torch.equal(bits(spec_rope.apply_rope(x, cos, sin)), oracle(x, cos, sin))
        assert torch.equal(bits(spec_rope.apply_rope_bwd(x, cos, sin)), oracle(x, cos, sin, -1.0))


# ---------------------------------------------------------------------------------------------------
# GPU: bitwise against the oracle.
# ---------------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float32]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "tshape"), [
    ((2, 16, 128, 64), (128, 32)),        # [B, H, S, D], MLA's q_pe
    ((2, 1, 128, 64), (128, 32)),         # MLA's shared k_pe
    ((2, 128, 16, 64), (128, 1, 32)),     # [B, S, H, D], flash-attention layout
    ((3, 7, 6), (7, 3)),                  # D not a multiple of the vector: one pair per thread
    ((5, 8), (5, 4)),
    ((0, 4, 8), (4, 4)),
])
def test_rope_fwd_bwd_bitwise(dtype: torch.dtype, shape: tuple[int, ...], tshape: tuple[int, ...]) -> None:
    s, d = tshape[0], shape[-1]
    cos, sin = tables(s, d, sum(shape))
    cos, sin = cos.view(tshape), sin.view(tshape)
    x = randx(shape, dtype, len(shape))
    xg, cg, sg = x.cuda(), cos.cuda(), sin.cuda()
    assert torch.equal(bits(apply_rope(xg, cg, sg)), oracle(x, cos, sin))
    assert torch.equal(bits(apply_rope_bwd(xg, cg, sg)), oracle(x, cos, sin, -1.0))


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_specials_and_denormals(dtype: torch.dtype) -> None:
    x = randx((4, 32, 64), dtype, 9)
    flat = x.view(-1)
    vals = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-38, 3e38]
    flat[: len(vals) * 40] = torch.tensor(vals, dtype=dtype).repeat(40)
    cos, sin = tables(32, 64, 4, span=1e4)
    cos[0, :4] = torch.tensor([0.0, -0.0, 1.0, -1.0])
    y = apply_rope(x.cuda(), cos.cuda(), sin.cuda())
    assert torch.equal(bits(y), oracle(x, cos, sin))


@gpu
def test_rope_unaligned_and_strided_inputs() -> None:
    base = randx((1 + 2 * 24 * 64,), torch.bfloat16, 3).cuda()
    x = base[1:].view(2, 24, 64)
    cos, sin = tables(24, 64, 5)
    assert torch.equal(bits(apply_rope(x, cos.cuda(), sin.cuda())), oracle(x, cos, sin))
    xt = randx((2, 64, 24), torch.bfloat16, 6).cuda().transpose(1, 2)
    assert torch.equal(bits(apply_rope(xt, cos.cuda(), sin.cuda())), oracle(xt, cos, sin))


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_inplace_rotates_a_column_slice_where_it_lies(dtype: torch.dtype, inverse: bool) -> None:
    """MLA's q heads [B, S, H, 128 + 64]: the rope part rotated in place, bitwise apply_rope(_bwd) of its
    copy; the nope part untouched."""
    q = randx((2, 32, 3, 192), dtype, 21)
    cos, sin = tables(32, 64, 22)
    c3, s3 = cos.view(32, 1, 32), sin.view(32, 1, 32)
    qg = q.cuda()
    rope_inplace(qg[..., 128:], c3.cuda(), s3.cuda(), inverse=inverse)
    assert torch.equal(bits(qg[..., 128:]), oracle(q[..., 128:], c3, s3, -1.0 if inverse else 1.0))
    assert torch.equal(bits(qg[..., :128]), bits(q[..., :128]))


@gpu
def test_rope_inplace_passes_opcheck() -> None:
    """The schema declares the in-place write (mutates x), and the fake agrees with the kernel."""
    q = torch.randn(2, 8, 3, 192, device="cuda").to(torch.bfloat16)
    cos, sin = tables(8, 64, 25)
    args = (q[..., 128:], cos.view(8, 1, 32).cuda(), sin.view(8, 1, 32).cuda(), False)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.nmoe.rope_inplace.default, args, test_utils=tests)


@gpu
def test_rope_inplace_refuses_misaligned_rows() -> None:
    q = torch.zeros(4, 3, 100, device="cuda", dtype=torch.bfloat16)
    cos, sin = tables(3, 64, 0)
    with pytest.raises(ValueError, match="vectors"):
        rope_inplace(q[..., 36:], cos.cuda(), sin.cuda())


@gpu
def test_rope_autograd_and_torch_compile() -> None:
    x = randx((2, 4, 64, 64), torch.bfloat16, 7).cuda().requires_grad_(True)
    g = randx((2, 4, 64, 64), torch.bfloat16, 8)
    cos, sin = tables(64, 64, 6)
    cg, sg = cos.cuda(), sin.cuda()
    torch.autograd.backward(apply_rope(x, cg, sg), g.cuda())
    assert x.grad is not None and torch.equal(bits(x.grad), oracle(g, cos, sin, -1.0))
    x.grad = None
    compiled = torch.compile(lambda t: apply_rope(t, cg, sg).float().sum(), fullgraph=True)
    torch.autograd.backward(compiled(x))
    assert x.grad is not None
    assert torch.equal(bits(x.grad), oracle(torch.ones(g.shape, dtype=torch.bfloat16), cos, sin, -1.0))


@gpu
def test_rope_refuses_fp16_and_fp64() -> None:
    cos, sin = tables(4, 8, 0)
    for dtype in (torch.float16, torch.float64):
        with pytest.raises(ValueError, match="bf16 or fp32"):
            apply_rope(torch.ones(4, 8, device="cuda", dtype=dtype), cos.cuda(), sin.cuda())


# ---------------------------------------------------------------------------------------------------
# Separating inputs for the GPU mutations of the rope kernel (anchors in nmoe/fast/kernels/rope.py).
# ---------------------------------------------------------------------------------------------------


def _sep_data(layout: str = "bhsd") -> tuple[Tensor, Tensor, Tensor]:
    shape = (2, 4, 16, 64) if layout == "bhsd" else (2, 16, 4, 64)
    x = randx(shape, torch.float32, 11)
    cos, sin = tables(16, 64, 12)
    return x, cos, sin


def _sep_fwd(sep: str) -> None:
    x, cos, sin = _sep_data()
    correct = oracle(x, cos, sin)
    assert not torch.equal(oracle(x, cos, sin, sep=sep), correct)
    assert torch.equal(bits(apply_rope(x.cuda(), cos.cuda(), sin.cuda())), correct)


@gpu
def test_sep_rope_fast_sin_sign_flipped() -> None:
    _sep_fwd("sin_sign")


@gpu
def test_sep_rope_fast_pair_swapped() -> None:
    _sep_fwd("pair_swapped")
    x, cos, sin = _sep_data()
    correct = oracle(x, cos, sin, -1.0)
    assert not torch.equal(oracle(x, cos, sin, -1.0, sep="pair_swapped"), correct)
    assert torch.equal(bits(apply_rope_bwd(x.cuda(), cos.cuda(), sin.cuda())), correct)


@gpu
def test_sep_rope_fast_table_row_ignores_inner() -> None:
    x, cos, sin = _sep_data("bshd")
    c3, s3 = cos.view(16, 1, 32), sin.view(16, 1, 32)
    correct = oracle(x, c3, s3)
    wrong_rows = torch.arange(16 * 4) % 16  # row index of [B*S*H] taken mod S
    cw, sw = cos[wrong_rows].view(16, 4, 32), sin[wrong_rows].view(16, 4, 32)
    assert not torch.equal(oracle(x, cw, sw), correct)
    assert torch.equal(bits(apply_rope(x.cuda(), c3.cuda(), s3.cuda())), correct)


@gpu
def test_sep_rope_fast_bwd_not_inverse() -> None:
    x, cos, sin = _sep_data()
    correct = oracle(x, cos, sin, -1.0)
    assert not torch.equal(oracle(x, cos, sin), correct)
    assert torch.equal(bits(apply_rope_bwd(x.cuda(), cos.cuda(), sin.cuda())), correct)


@gpu
def test_sep_rope_fast_pitch_ignored() -> None:
    q = randx((2, 16, 2, 192), torch.float32, 23)
    cos, sin = tables(16, 64, 24)
    c3, s3 = cos.view(16, 1, 32), sin.view(16, 1, 32)
    correct = oracle(q[..., 128:], c3, s3)
    wrong = q.clone().view(-1)
    n = q[..., 128:].numel()
    rows_at_d = oracle(wrong[128:128 + n].view(q[..., 128:].shape), c3, s3)
    wrong[128:128 + n] = rows_at_d.to(torch.int32).view(torch.float32).view(-1)
    assert not torch.equal(bits(wrong.view(q.shape)[..., 128:]), correct)
    qg = q.cuda()
    rope_inplace(qg[..., 128:], c3.cuda(), s3.cuda())
    assert torch.equal(bits(qg[..., 128:]), correct)
