"""nmoe.fast.norm's add_rmsnorm (a block's residual add and the rmsnorm after it, one pass over the rows) and
its backward (the stream's gradient added in the norm's backward kernel): on a GPU, bit for bit the
composition the spec pins (torch's add and the fast rmsnorm), autograd, and the kernel mutations' inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bf16_oracle import bf16_nearest as bf16
from torch import Tensor

from nmoe.fast import norm as fast

gpu = pytest.mark.gpu
BF = torch.bfloat16


def rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).cuda()


def rms64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return np.asarray(x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w)


CASES = [(1, 8, BF, BF), (37, 2048, BF, BF), (64, 1536, BF, torch.float32), (5, 7168, BF, BF),
         (16, 4096, torch.float32, torch.float32), (300, 136, BF, BF)]


@gpu
@pytest.mark.parametrize(("t", "d", "xd", "wd"), CASES)
def test_forward_is_the_composition_bit_for_bit(t: int, d: int, xd: torch.dtype, wd: torch.dtype) -> None:
    h, a, w = rand((t, d), xd, t), rand((t, d), xd, t + 1, 0.3), rand((d,), wd, t + 2, 0.1) + 1
    s, y = fast.add_rmsnorm(h, a, w, 1e-6)
    assert torch.equal(s, h + a)
    assert torch.equal(y, fast.rmsnorm(h + a, w, 1e-6))


@gpu
@pytest.mark.parametrize(("t", "d", "xd", "wd"), CASES)
def test_backward_is_the_composition_bit_for_bit(t: int, d: int, xd: torch.dtype, wd: torch.dtype) -> None:
    s, w = rand((t, d), xd, t + 3), rand((d,), wd, t + 4, 0.1) + 1
    ds, dy = rand((t, d), xd, t + 5), rand((t, d), xd, t + 6)
    dh, dw = fast.add_rmsnorm_bwd(ds, dy, s, w, 1e-6)
    dx, dw_norm = fast.rmsnorm_bwd(dy, s, w, 1e-6)
    assert torch.equal(dh, ds + dx) and torch.equal(dw, dw_norm)


@gpu
def test_autograd_gives_both_inputs_the_composed_gradient() -> None:
    t, d = 48, 2048
    leaves = [rand((t, d), BF, 7), rand((t, d), BF, 8, 0.3), rand((d,), BF, 9, 0.1) + 1]
    gs, gy = rand((t, d), BF, 10), rand((t, d), BF, 11)
    fused = [x.clone().requires_grad_() for x in leaves]
    s, y = fast.add_rmsnorm(fused[0], fused[1], fused[2], 1e-6)
    torch.autograd.backward([s, y], [gs, gy])
    plain = [x.clone().requires_grad_() for x in leaves]
    s2 = plain[0] + plain[1]
    torch.autograd.backward([s2, fast.rmsnorm(s2, plain[2], 1e-6)], [gs, gy])
    for f, p in zip(fused, plain, strict=True):
        assert f.grad is not None and p.grad is not None and torch.equal(f.grad, p.grad)


@gpu
def test_sep_rmsnorm_fast_add_norm_of_unrounded_sum() -> None:
    """The norm reads the stream as stored (rounded): normed before that rounding, many outputs move."""
    t, d = 64, 2048
    h, a, w = rand((t, d), BF, 12), rand((t, d), BF, 13, 0.3), rand((d,), BF, 14, 0.1) + 1
    hd, ad, wd = (x.double().cpu().numpy() for x in (h, a, w))
    rounded, exact = bf16(rms64(bf16(hd + ad), wd, 1e-6)), bf16(rms64(hd + ad, wd, 1e-6))
    assert int((rounded != exact).sum()) >= 100
    s, y = fast.add_rmsnorm(h, a, w, 1e-6)
    assert torch.equal(y, fast.rmsnorm(s, w, 1e-6))


@gpu
def test_sep_rmsnorm_bwd_fast_add_dx_unrounded() -> None:
    """The norm's dx is rounded before ds joins it (autograd's separate add): added unrounded, the second
    rounding lands elsewhere on many outputs."""
    t, d = 64, 2048
    s, w = rand((t, d), BF, 15), rand((d,), BF, 16, 0.1) + 1
    ds, dy = rand((t, d), BF, 17), rand((t, d), BF, 18)
    sd, wd, dyd, dsd = (x.double().cpu().numpy() for x in (s, w, dy, ds))
    r = 1.0 / np.sqrt((sd * sd).mean(-1, keepdims=True) + 1e-6)
    g = dyd * wd
    dx64 = r * (g - sd * r * r * (g * sd).mean(-1, keepdims=True))
    assert int((bf16(dsd + bf16(dx64)) != bf16(dsd + dx64)).sum()) >= 100
    dh, _ = fast.add_rmsnorm_bwd(ds, dy, s, w, 1e-6)
    assert torch.equal(dh, ds + fast.rmsnorm_bwd(dy, s, w, 1e-6)[0])
