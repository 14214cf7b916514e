"""Spec tests of nmoe.reference.gemm against float64 oracles written here.

Bound (contract bound(1, 2)): |ref - f64| <= 1 ulp_bf16(ref) + 2·K·u32·(|A|·|B|), u32 = 2^-24, K the
reduction length. Quantized operands are dequantized here with ml_dtypes and the hand e2m1 table.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nmoe.reference import formats as F
from nmoe.reference import gemm as G

U32 = 2.0**-24
BF16 = torch.bfloat16
E2M1_TABLE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    out: np.ndarray = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return out


def e8m0_values(b: np.ndarray) -> np.ndarray:
    return np.where(b == 255, np.nan, np.ldexp(1.0, b.astype(np.int64) - 127))


def nvfp4_dequant_oracle(packed: np.ndarray, bs: np.ndarray, g: float) -> np.ndarray:
    """Low nibble first; (code·s_b) is exact, then one fp32 rounding for ·g."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    vals = np.where(codes & 8, -1.0, 1.0) * E2M1_TABLE[codes & 7]
    out: np.ndarray = (vals * np.repeat(e4m3_values(bs), 16, axis=-1) * np.float64(g)).astype(np.float32)
    return out.astype(np.float64)


def ulp_bf16(r: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 at |r| (subnormal spacing 2^-133 at and below 2^-126)."""
    a = r.double().abs()
    _, e = torch.frexp(a)
    spacing = torch.ldexp(torch.ones_like(a), (e - 8).clamp(min=-133))
    return torch.where(a > 0, spacing, torch.full_like(a, 2.0**-133))


def assert_bound(ref: torch.Tensor, f64: torch.Tensor, absab: torch.Tensor, k: int) -> None:
    assert ref.dtype == BF16 and ref.shape == f64.shape
    err = (ref.double() - f64).abs()
    lim = ulp_bf16(ref) + 2 * k * U32 * absab
    assert bool((err <= lim).all()), f"worst excess {float((err - lim).max())}"


def segments(offs: list[int]) -> list[tuple[int, int]]:
    return list(zip([0, *offs[:-1]], offs, strict=True))


def fwd64(x: torch.Tensor, w: torch.Tensor, offs: list[int]) -> torch.Tensor:
    """Grouped GEMM in float64 autograd-able ops; rows past offs[-1] stay zero."""
    parts = [torch.einsum("mk,nk->mn", x[s:t], w[e]) for e, (s, t) in enumerate(segments(offs))]
    tail = x.new_zeros(x.shape[0] - (offs[-1] if offs else 0), w.shape[1])
    return torch.cat([*parts, tail])


def offs_t(offs: list[int]) -> torch.Tensor:
    return torch.tensor(offs, dtype=torch.int32)


def rand_bf16(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(BF16)


def check_fwd(x: torch.Tensor, w: torch.Tensor, offs: list[int]) -> torch.Tensor:
    y = G.grouped_gemm(x, w, offs_t(offs))
    x64, w64 = x.double(), w.double()
    assert_bound(y, fwd64(x64, w64, offs), fwd64(x64.abs(), w64.abs(), offs), x.shape[1])
    tail = offs[-1] if offs else 0
    assert (y[tail:].float() == 0).all()
    return y


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.sampled_from([1, 7, 128, 200, 300]), n=st.integers(1, 24),
       counts=st.lists(st.integers(0, 9), min_size=1, max_size=5), slack=st.integers(0, 3))
def test_grouped_gemm_vs_f64(seed: int, k: int, n: int, counts: list[int], slack: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    offs = np.cumsum(counts).tolist()
    x = rand_bf16(gen, offs[-1] + slack, k)
    w = rand_bf16(gen, len(counts), n, k, scale=0.1)
    check_fwd(x, w, offs)


def test_empty_groups_one_row_groups_k1_and_tail() -> None:
    gen = torch.Generator().manual_seed(1)
    offs = [0, 1, 1, 2, 3, 3]
    x, w = rand_bf16(gen, 5, 1), rand_bf16(gen, 6, 4, 1)
    y = check_fwd(x, w, offs)
    for e, (s, t) in enumerate(segments(offs)):
        if t > s:
            assert torch.equal(y[s], F.to_bf16(x[s].float() * w[e, :, 0].float()))  # K=1: one exact product
    assert (y[3:].float() == 0).all()
    assert G.grouped_gemm(x[:0], w, offs_t([0] * 6)).shape == (0, 4)


def test_dgrad_wgrad_vs_autograd_of_f64_composition() -> None:
    gen = torch.Generator().manual_seed(2)
    offs = [3, 3, 40, 41, 170]
    m, k, n = 175, 130, 260
    x, w, dy = rand_bf16(gen, m, k), rand_bf16(gen, len(offs), n, k, scale=0.1), rand_bf16(gen, m, n)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    gx, gw = torch.autograd.grad((fwd64(x64, w64, offs) * dy.double()).sum(), (x64, w64))
    dx = G.grouped_gemm_dgrad(dy, w, offs_t(offs))
    dw = G.grouped_gemm_wgrad(dy, x, offs_t(offs))
    absdy = dy.double().abs()
    abs_dx = torch.zeros(m, k, dtype=torch.float64)
    abs_dw = torch.zeros(len(offs), n, k, dtype=torch.float64)
    for e, (s, t) in enumerate(segments(offs)):
        abs_dx[s:t] = absdy[s:t] @ w[e].double().abs()
        abs_dw[e] = absdy[s:t].t() @ x[s:t].double().abs()
    assert_bound(dx, gx, abs_dx, n)
    assert_bound(dw, gw, abs_dw, max(t - s for s, t in segments(offs)))
    assert (dx[170:].float() == 0).all() and (dw[1].float() == 0).all()


def test_quantized_grouped_gemm_fp8() -> None:
    gen = torch.Generator().manual_seed(3)
    offs = [5, 5, 12]
    x = torch.randn(14, 256, generator=gen)
    w = torch.randn(3, 128, 256, generator=gen) * 0.05
    xq, xs = F.quantize_mxfp8(x, 128)
    wq, ws = F.quantize_mxfp8_weight(w)
    y = G.grouped_gemm_fp8(xq, xs, wq, ws, offs_t(offs))
    xd = torch.from_numpy(e4m3_values(xq.numpy()) * np.repeat(e8m0_values(xs.numpy()), 128, -1))
    wsc = np.repeat(np.repeat(e8m0_values(ws.numpy()), 128, -1), 128, -2)
    wd = torch.from_numpy(e4m3_values(wq.numpy()) * wsc)
    assert_bound(y, fwd64(xd, wd, offs), fwd64(xd.abs(), wd.abs(), offs), 256)
    assert (y[12:].float() == 0).all()


def test_quantized_grouped_gemm_nvfp4() -> None:
    gen = torch.Generator().manual_seed(4)
    offs = [0, 9, 16]
    x = torch.randn(16, 64, generator=gen)
    w = torch.randn(3, 24, 64, generator=gen)
    xp, xb, xg = F.quantize_nvfp4(x)
    wp, wb, wg = F.quantize_nvfp4(w)
    y = G.grouped_gemm_nvfp4(xp, xb, xg, wp, wb, wg, offs_t(offs))
    x64 = torch.from_numpy(nvfp4_dequant_oracle(xp.numpy(), xb.numpy(), xg.item()))
    w64 = torch.from_numpy(nvfp4_dequant_oracle(wp.numpy(), wb.numpy(), wg.item()))
    assert_bound(y, fwd64(x64, w64, offs), fwd64(x64.abs(), w64.abs(), offs), 64)


@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
def test_grouped_gemm_act_is_act_of_bf16_gemm(activation: str) -> None:
    gen = torch.Generator().manual_seed(5)
    offs = [4, 4, 11]
    x, w = rand_bf16(gen, 13, 96), rand_bf16(gen, 3, 32, 96, scale=0.2)
    out = G.grouped_gemm_act(x, w, offs_t(offs), activation)
    y = check_fwd(x, w, offs).double()
    if activation == "relu2":
        want = torch.clamp(y, min=0) ** 2  # square of a bf16 value is exact in fp32: spec rounds once
        assert out.shape == (13, 32) and torch.equal(out, want.to(torch.float32).to(BF16))
    else:
        g, u = y[:, 0::2], y[:, 1::2]
        want = g / (1 + torch.exp(-g)) * u
        assert out.shape == (13, 16)
        assert bool(((out.double() - want).abs() <= ulp_bf16(out)).all())
    assert (out[11:].float() == 0).all()


def test_errors_name_the_fix() -> None:
    x, w = torch.zeros(4, 8, dtype=BF16), torch.zeros(2, 3, 8, dtype=BF16)
    with pytest.raises(ValueError, match="bfloat16"):
        G.grouped_gemm(x.float(), w, offs_t([2, 4]))
    with pytest.raises(ValueError, match="int32"):
        G.grouped_gemm(x, w, torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="int32"):
        G.grouped_gemm(x, w, offs_t([4]))
    with pytest.raises(ValueError, match="non-decreasing"):
        G.grouped_gemm(x, w, offs_t([3, 2]))
    with pytest.raises(ValueError, match="non-decreasing"):
        G.grouped_gemm(x, w, offs_t([2, 5]))
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        G.grouped_gemm(x[:, :4], w, offs_t([2, 4]))
    with pytest.raises(ValueError, match="dy"):
        G.grouped_gemm_dgrad(torch.zeros(4, 5, dtype=BF16), w, offs_t([2, 4]))
    with pytest.raises(ValueError, match="dy"):
        G.grouped_gemm_wgrad(torch.zeros(3, 3, dtype=BF16), x, offs_t([2, 4]))
    with pytest.raises(ValueError, match="unknown"):
        G.grouped_gemm_act(x, w, offs_t([2, 4]), "gelu")
    with pytest.raises(ValueError, match="multiple of the block 128"):
        q, s = F.quantize_mxfp8(torch.zeros(2, 64), 32)
        G.grouped_gemm_fp8(q, s, q, s, offs_t([2]))


# ----------------------------------------------------------------------------- separating inputs


def tiles_f32(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """Per-128-tile fp32 partial products x·w^T for one expert (exact for the data used here)."""
    return [x[:, k0:k0 + 128].float() @ w[:, k0:k0 + 128].float().t() for k0 in range(0, x.shape[1], 128)]


def test_sep_gemm_accumulate_bf16() -> None:
    """Row 0 separates an accumulator rounded to bf16 per tile; row 1 partial products rounded to bf16."""
    k = 16 * 128
    x = torch.zeros(2, k)
    x[0, 0] = 1.0
    x[0, 128::128] = 2.0**-9
    x[1, 0], x[1, 128], x[1, 129] = 1.0, 2.0**-8, 2.0**-20
    x, w = x.to(BF16), torch.ones(1, 1, k, dtype=BF16)
    parts = tiles_f32(x, w[0])
    correct = sum(parts, torch.zeros(2, 1)).to(BF16)
    acc_bf16 = torch.zeros(2, 1)
    for p in parts:
        acc_bf16 = (acc_bf16 + p).to(BF16).float()
    part_bf16 = sum((p.to(BF16).float() for p in parts), torch.zeros(2, 1)).to(BF16)
    assert correct[0] != acc_bf16.to(BF16)[0] and correct[1] != part_bf16[1]
    assert torch.equal(G.grouped_gemm(x, w, offs_t([2])), correct)
    assert correct.float().flatten().tolist() == [1.03125, 1 + 2.0**-7]


@pytest.mark.parametrize("k", [256, 300])
def test_sep_gemm_skip_last_k_tile(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    x = torch.randint(-3, 4, (3, k), generator=gen).to(BF16)
    w = torch.randint(-3, 4, (1, 2, k), generator=gen).to(BF16)
    x[:, -1], w[0, :, -1] = 2, 3
    parts = tiles_f32(x, w[0])
    correct, mutated = sum(parts, torch.zeros(3, 2)), sum(parts[:-1], torch.zeros(3, 2))
    assert not torch.equal(correct, mutated)
    assert torch.equal(G.grouped_gemm(x, w, offs_t([3])), correct.to(BF16))


def test_sep_gemm_group_boundary_off_by_one() -> None:
    """Integer data (exact everywhere); the mutant assigns each boundary row to the wrong neighbour."""
    offs = [2, 5, 5, 8]
    x = torch.arange(1, 11, dtype=torch.float32).repeat_interleave(3).reshape(10, 3).to(BF16)
    w = torch.stack([torch.full((2, 3), float(e + 1)) for e in range(4)]).to(BF16)
    dy = torch.ones(10, 2, dtype=BF16)

    def expert_of(r: int, shift: int) -> int | None:
        return next((e for e, (s, t) in enumerate(segments(offs)) if s + shift <= r < t + shift), None)

    def fwd(shift: int) -> torch.Tensor:
        rows = [x[r].float() @ w[e].float().t() if (e := expert_of(r, shift)) is not None else torch.zeros(2)
                for r in range(10)]
        return torch.stack(rows)

    correct = fwd(0)
    assert not torch.equal(correct, fwd(1)) and not torch.equal(correct, fwd(-1))
    assert torch.equal(G.grouped_gemm(x, w, offs_t(offs)).float(), correct)
    dx = torch.stack([dy[r].float() @ w[e].float() if (e := expert_of(r, 0)) is not None else torch.zeros(3)
                      for r in range(10)])
    assert torch.equal(G.grouped_gemm_dgrad(dy, w, offs_t(offs)).float(), dx)
    dw = torch.stack([dy[s:t].float().t() @ x[s:t].float() for s, t in segments(offs)])
    assert torch.equal(G.grouped_gemm_wgrad(dy, x, offs_t(offs)).float(), dw)
