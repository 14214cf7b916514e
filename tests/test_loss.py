"""Spec tests of reference/loss.py against float64 log_softmax and hand-written gradients."""

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nmoe.reference.loss import cross_entropy, cross_entropy_bwd

IGN = -100


def gen(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def targets_with_ignored(t: int, v: int, seed: int, n_ignored: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    tg = torch.randint(0, v, (t,), generator=g)
    tg[torch.randperm(t, generator=g)[:n_ignored]] = IGN
    return tg


def oracle64(h: Tensor, w: Tensor, tg: Tensor) -> Tensor:
    logp = torch.log_softmax(h.double() @ w.double().T, dim=-1)
    keep = tg != IGN
    return -logp[keep].gather(1, tg[keep].unsqueeze(1)).sum() / keep.sum()


def oracle64_grads(h: Tensor, w: Tensor, tg: Tensor) -> tuple[Tensor, Tensor]:
    """d/dlogits = (softmax - onehot) / n_kept on kept rows."""
    h64, w64 = h.double(), w.double()
    p = torch.softmax(h64 @ w64.T, dim=-1)
    keep = tg != IGN
    onehot = torch.zeros_like(p)
    onehot[keep, tg[keep]] = 1.0
    d = (p - onehot) * keep.unsqueeze(1) / keep.sum()
    return d @ w64, d.T @ h64


@settings(max_examples=10, deadline=None)
@given(
    t=st.integers(1, 13),
    d=st.integers(1, 9),
    v=st.integers(2, 17),
    chunk=st.integers(1, 6),
    n_ign=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_fwd_bwd_match_float64_oracle(t: int, d: int, v: int, chunk: int, n_ign: int, seed: int) -> None:
    n_ign = min(n_ign, t - 1)
    h, w = gen((t, d), seed), gen((v, d), seed + 1)
    tg = targets_with_ignored(t, v, seed + 2, n_ign)
    loss = cross_entropy(h, w, tg, IGN, chunk)
    assert loss.dtype == torch.float64 and loss.dim() == 0
    assert torch.allclose(loss, oracle64(h, w, tg), rtol=1e-12)
    dh, dw = cross_entropy_bwd(1.0, h, w, tg, IGN, chunk)
    odh, odw = oracle64_grads(h, w, tg)
    assert torch.allclose(dh, odh, rtol=1e-10, atol=1e-13)
    assert torch.allclose(dw, odw, rtol=1e-10, atol=1e-13)


def test_fp32_bf16_inputs_give_fp32_loss() -> None:
    h, w = gen((37, 16), 1).bfloat16(), gen((50, 16), 2).bfloat16()
    tg = targets_with_ignored(37, 50, 3, 5)
    loss = cross_entropy(h, w, tg, IGN, chunk=8)
    assert loss.dtype == torch.float32
    assert abs(float(loss) - float(oracle64(h, w, tg))) <= 1e-5 * float(oracle64(h, w, tg))
    dh, dw = cross_entropy_bwd(torch.tensor(2.0), h, w, tg, IGN, chunk=8)
    assert dh.dtype == dw.dtype == torch.bfloat16
    odh, odw = oracle64_grads(h, w, tg)
    assert torch.allclose(dh.double(), 2 * odh, rtol=2**-7, atol=1e-4)
    assert torch.allclose(dw.double(), 2 * odw, rtol=2**-7, atol=1e-4)


def test_hand_vector() -> None:
    # logits [0, ln 3] -> p = [1/4, 3/4]; target 1 -> loss ln(4/3); token 2 ignored.
    h = torch.tensor([[1.0], [5.0]], dtype=torch.float64)
    w = torch.tensor([[0.0], [torch.log(torch.tensor(3.0)).item()]], dtype=torch.float64)
    loss = cross_entropy(h, w, torch.tensor([1, IGN]), IGN, chunk=1)
    assert torch.allclose(loss, torch.log(torch.tensor(4.0 / 3.0, dtype=torch.float64)), rtol=1e-15)


def test_all_ignored_is_zero_with_zero_grads() -> None:
    h, w = gen((4, 3), 5), gen((6, 3), 6)
    tg = torch.full((4,), IGN)
    loss = cross_entropy(h, w, tg, IGN, chunk=2)
    assert float(loss) == 0.0
    dh, dw = cross_entropy_bwd(1.0, h, w, tg, IGN, chunk=2)
    assert not dh.any() and not dw.any()


class _CEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor, tg: Tensor) -> Tensor:
        ctx.save_for_backward(h, w, tg)
        return cross_entropy(h, w, tg, IGN, chunk=3)

    @staticmethod
    def backward(ctx: Any, dloss: Tensor) -> tuple[Tensor, Tensor, None]:
        h, w, tg = ctx.saved_tensors
        dh, dw = cross_entropy_bwd(dloss, h, w, tg, IGN, chunk=3)
        return dh, dw, None


def test_gradcheck_fwd_and_explicit_bwd() -> None:
    h, w = gen((7, 4), 7).requires_grad_(), gen((9, 4), 8).requires_grad_()
    tg = targets_with_ignored(7, 9, 9, 2)
    fwd = lambda a, b: cross_entropy(a, b, tg, IGN, chunk=3)  # noqa: E731
    assert torch.autograd.gradcheck(fwd, (h, w), fast_mode=True)
    assert torch.autograd.gradcheck(lambda a, b: _CEFn.apply(a, b, tg), (h, w))  # type: ignore[no-untyped-call]


def test_errors_name_the_fix() -> None:
    h, w = torch.zeros(3, 4), torch.zeros(5, 4)
    with pytest.raises(ValueError, match="outside"):
        cross_entropy(h, w, torch.tensor([0, 5, 1]), IGN, chunk=2)
    with pytest.raises(ValueError, match="outside"):
        cross_entropy_bwd(1.0, h, w, torch.tensor([0, -2, 1]), IGN, chunk=2)
    with pytest.raises(ValueError, match=r"\[V, D\]"):
        cross_entropy(h, torch.zeros(5, 3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="targets"):
        cross_entropy(h, w, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="chunk"):
        cross_entropy(h, w, torch.tensor([0, 1, 2]), IGN, chunk=0)


def test_sep_ce_ignored_tokens_counted() -> None:
    h, w = gen((10, 5), 10), gen((8, 5), 11)
    tg = targets_with_ignored(10, 8, 12, 4)
    logp = torch.log_softmax(h @ w.T, dim=-1)
    keep = tg != IGN
    nll = -logp[keep].gather(1, tg[keep].unsqueeze(1)).sum()
    correct, mutated = nll / keep.sum(), nll / tg.numel()
    assert not torch.allclose(correct, mutated, rtol=1e-3)
    assert torch.allclose(cross_entropy(h, w, tg, IGN, chunk=4), correct, rtol=1e-12)
    dh, _ = cross_entropy_bwd(1.0, h, w, tg, IGN, chunk=4)
    assert torch.allclose(dh, oracle64_grads(h, w, tg)[0], rtol=1e-10, atol=1e-13)


def test_sep_ce_no_max_subtraction() -> None:
    # fp32 logits near 200: exp(200) overflows fp32 (max ~3.4e38), so lse without max subtraction is inf.
    h = (gen((6, 4), 13) * 0.1 + 10.0).float()
    w = (gen((7, 4), 14) * 0.1 + 5.0).float()
    tg = targets_with_ignored(6, 7, 15, 1)
    logits = h @ w.T
    keep = tg != IGN
    picked = logits[keep].gather(1, tg[keep].unsqueeze(1)).squeeze(1)
    m = logits[keep].amax(-1, keepdim=True)
    correct = (m.squeeze(1) + torch.log(torch.exp(logits[keep] - m).sum(-1)) - picked).mean()
    mutated = (torch.log(torch.exp(logits[keep]).sum(-1)) - picked).mean()
    assert torch.isfinite(correct) and not torch.isfinite(mutated)
    loss = cross_entropy(h, w, tg, IGN, chunk=4)
    assert torch.isfinite(loss)
    assert abs(float(loss) - float(oracle64(h, w, tg))) <= 1e-4
    dh, dw = cross_entropy_bwd(1.0, h, w, tg, IGN, chunk=4)
    assert bool(torch.isfinite(dh).all() and torch.isfinite(dw).all())
    odh, odw = oracle64_grads(h, w, tg)
    assert torch.allclose(dh.double(), odh, rtol=1e-4, atol=1e-5)
    assert torch.allclose(dw.double(), odw, rtol=1e-4, atol=1e-5)
