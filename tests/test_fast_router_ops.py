"""nmoe.fast.router.router_logits (fp32 accumulate, forward-error bound against float64, and its gradient) and
bias_update (bitwise to the spec) on a GPU; argument checks on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from nmoe.reference import router as ref

gpu = pytest.mark.gpu
U32 = 2.0**-24


def _xw(t: int, h: int, e: int, dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, generator=g).to(dtype),
            (torch.randn(e, h, generator=g) * h**-0.5).to(dtype))


def _bound(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """(float64 x @ w^T, the fp32-accumulation bound (H+2) u |x| @ |w|^T)."""
    xd, wd = x.double(), w.double()
    return xd @ wd.T, (x.shape[1] + 2) * U32 * (xd.abs() @ wd.abs().T)


def _within(got: Tensor, x: Tensor, w: Tensor) -> None:
    exact, rad = _bound(x, w)
    assert got.dtype == torch.float32
    excess = (got.cpu().double() - exact).abs() - rad
    assert float(excess.max()) <= 0, f"outside the fp32 bound by {float(excess.max()):.3g}"


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_logits_within_fp32_bound(dtype: torch.dtype) -> None:
    from nmoe.fast.router import router_logits
    x, w = _xw(777, 2048, 256, dtype, 1)
    _within(router_logits(x.cuda(), w.cuda()), x, w)


@gpu
def test_router_logits_grad_vs_float64() -> None:
    from nmoe.fast.router import router_logits
    x, w = _xw(300, 1024, 64, torch.bfloat16, 2)
    g = torch.randn(300, 64, generator=torch.Generator().manual_seed(3))
    xc, wc = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    dx, dw = torch.autograd.grad(router_logits(xc, wc), (xc, wc), g.cuda())
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    for got, want in ((dx, g.double() @ w.double()), (dw, g.double().T @ x.double())):
        err = float((got.cpu().double() - want).norm() / want.norm())
        assert err < 2**-7, f"relative error {err:.3g}"


@gpu
def test_sep_router_fast_logits_bf16_rounded() -> None:
    """bf16 operands, fp32 result: at H=64 the fp32 bound is far below a bf16 rounding of most logits."""
    from nmoe.fast.router import router_logits
    x, w = _xw(512, 64, 128, torch.bfloat16, 4)
    exact, rad = _bound(x, w)
    assert float(((exact.to(torch.bfloat16).double() - exact).abs() > rad).double().mean()) > 0.5
    _within(router_logits(x.cuda(), w.cuda()), x, w)


def _counts(e: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.multinomial(1.0 / torch.arange(1, e + 1).double(), 4096 * 4, replacement=True, generator=g)
    return torch.bincount(ids, minlength=e)


@gpu
@pytest.mark.parametrize(("rate", "clamp"), [(1e-3, 1.0), (0.01, 0.03), (0.0, 0.5)])
def test_bias_update_bitwise(rate: float, clamp: float) -> None:
    from nmoe.fast.router import bias_update
    e = 256
    bias = (0.02 * torch.randn(e, generator=torch.Generator().manual_seed(5))).clamp(-clamp, clamp)
    counts = _counts(e, 6)
    got = bias_update(bias.cuda(), counts.cuda(), rate, clamp).cpu()
    assert torch.equal(got.view(torch.int32), ref.bias_update(bias, counts, rate, clamp).view(torch.int32))


@gpu
def test_sep_router_fast_bias_update_sign_flipped() -> None:
    """Zipf counts: hot experts (above the mean) move down, cold ones up; a flipped sign does the reverse."""
    from nmoe.fast.router import bias_update
    e, rate = 64, 1e-3
    bias, counts = torch.zeros(e), _counts(e, 7)
    want = ref.bias_update(bias, counts, rate, 1.0)
    hot = counts * e > counts.sum()
    assert bool(hot.any()) and bool((~hot).any())
    assert bool((want[hot] < 0).all()) and bool((want[~hot] > 0).all())
    got = bias_update(bias.cuda(), counts.cuda(), rate, 1.0).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize(("bias", "counts", "rate", "clamp", "match"), [
    (torch.zeros(4), torch.zeros(3, dtype=torch.int64), 0.1, 1.0, "must be"),
    (torch.zeros(4), torch.zeros(4, dtype=torch.int64), -0.1, 1.0, "rate >= 0"),
    (torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.int64), 0.1, 1.0, "fp32 bias"),
])
def test_bias_update_rejects(bias: Tensor, counts: Tensor, rate: float, clamp: float, match: str) -> None:
    from nmoe.fast.router import _check_bias_update
    with pytest.raises(ValueError, match=match):
        _check_bias_update(bias, counts, rate, clamp)


def test_router_logits_rejects_shapes() -> None:
    from nmoe.fast.router import _logits_dtype
    with pytest.raises(ValueError, match=r"need x \[T,H\], wr \[E,H\]"):
        _logits_dtype(torch.zeros(3, 4), torch.zeros(5, 6))
    assert _logits_dtype(torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(5, 4)) == torch.float32


def test_bias_update_glue_bitwise_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The glue is torch ops only: run it on CPU (device check bypassed) against the spec, int32 and int64
    counts, including experts exactly at the mean load (sign 0)."""
    import nmoe.fast.router as fr
    from nmoe.fast import runtime
    monkeypatch.setattr(runtime, "device_arch", lambda *t: (0, "sm_90a"))
    counts = torch.tensor([10, 10, 5, 15, 10, 0, 20, 10])
    assert int(counts.sum()) == 8 * 10
    bias = torch.tensor([0.01, -0.03, 0.025, 0.0, -0.005, 0.03, -0.029, 0.002])
    want = ref.bias_update(bias, counts, 0.01, 0.03)
    for c in (counts, counts.to(torch.int32)):
        got = fr._bias_update_impl(bias, c, 0.01, 0.03)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_router_logits_backward_glue_on_cpu() -> None:
    """The custom op's backward against autograd of the spec's fp32 product; None where no grad is asked."""
    from types import SimpleNamespace

    from nmoe.fast.router import _router_logits_backward
    x, w = _xw(40, 64, 16, torch.bfloat16, 10)
    g = torch.randn(40, 16, generator=torch.Generator().manual_seed(11))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.autograd.grad(ref.router_logits(xr, wr), (xr, wr), g)
    ctx = SimpleNamespace(saved_tensors=(x, w), needs_input_grad=(True, True))
    got = _router_logits_backward(ctx, g.t().contiguous().t())
    for a, b in zip(got, want, strict=True):
        assert a is not None and a.dtype == b.dtype == torch.bfloat16
        assert float((a.double() - b.double()).abs().max()) <= 2.0**-7 * float(b.double().abs().max())
    ctx = SimpleNamespace(saved_tensors=(x, w), needs_input_grad=(False, True))
    dx, dw = _router_logits_backward(ctx, g)
    assert dx is None and dw is not None


def test_router_logits_backward_runs_full_fp32_under_a_tf32_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process allowing TF32 ("high") still gets full-precision router gradients and keeps its setting."""
    from types import SimpleNamespace

    from nmoe.fast.router import _router_logits_backward

    seen: list[str] = []
    mm = torch.mm

    def spy(a: Tensor, b: Tensor) -> Tensor:
        seen.append(torch.get_float32_matmul_precision())
        return mm(a, b)

    x, w = _xw(8, 16, 4, torch.float32, 12)
    ctx = SimpleNamespace(saved_tensors=(x, w), needs_input_grad=(True, True))
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        monkeypatch.setattr(torch, "mm", spy)
        _router_logits_backward(ctx, torch.ones(8, 4))
        assert seen == ["highest", "highest"] and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(prev)


def test_sep_router_fast_logits_grad_lo_dropped() -> None:
    """bf16 operands: the fp32 gradient enters the GEMMs as two bf16 halves. Every g here is 1 + 2^-8 + 2^-10
    (times a power of two), which bf16 rounds up by 3 * 2^-10 relative: on positive x and w, g's high half
    alone shifts every sum by that much, most of a bf16 step, so most results round elsewhere."""
    from types import SimpleNamespace

    from nmoe.fast.router import _router_logits_backward
    gen = torch.Generator().manual_seed(13)
    t, h, e = 256, 128, 32
    x = (1 + torch.rand(t, h, generator=gen)).to(torch.bfloat16)
    w = (1 + torch.rand(e, h, generator=gen)).to(torch.bfloat16)
    g = (1 + 2.0**-8 + 2.0**-10) * 2.0 ** torch.randint(-2, 3, (t, e), generator=gen).float()
    hi = g.to(torch.bfloat16).double()
    for name, want, mutant in (("dx", g.double() @ w.double(), hi @ w.double()),
                               ("dw", g.double().T @ x.double(), hi.T @ x.double())):
        agree = float((mutant.to(torch.bfloat16) == want.to(torch.bfloat16)).double().mean())
        assert agree < 0.8, f"{name}: the high half alone rounds like the exact sum ({agree:.2f})"
    ctx = SimpleNamespace(saved_tensors=(x, w), needs_input_grad=(True, True))
    dx, dw = _router_logits_backward(ctx, g)
    assert dx is not None and dw is not None
    for name, got, want in (("dx", dx, g.double() @ w.double()), ("dw", dw, g.double().T @ x.double())):
        agree = float((got == want.to(torch.bfloat16)).double().mean())
        assert agree >= 0.99, f"{name}: {agree:.3f} of the results round like the exact sum"
