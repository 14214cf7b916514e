"""nmoe.fast.loss (fused-linear cross-entropy): compile checks and plumbing on CPU; on a GPU, loss and
gradients within the parity contracts' float64 error budgets, no host sync, peak memory within the stated
formula, and separating inputs for the catalogued mutations."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from torch import Tensor

from nmoe.fast import loss as fast
from nmoe.fast import op
from nmoe.fast.arch import SUPPORTED_ARCHS, ArchError
from parity.compare import bound, gemm_radius
from parity.inputs import Inputs
from parity.ops import loss as pl

gpu = pytest.mark.gpu
IGN = -100


def make(t: int, d: int, v: int, seed: int, scale: float = 1.0, ignored: float = 0.25
         ) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(t, d, generator=g) * scale).bfloat16()
    w = (torch.randn(v, d, generator=g) / math.sqrt(d)).bfloat16()
    tg = torch.randint(0, v, (t,), generator=g)
    tg[torch.rand(t, generator=g) < ignored] = IGN
    return h, w, tg


def loss_radius(h: Tensor, w: Tensor, tg: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """(float64 loss, allowed absolute error) of the parity contract `cross_entropy`."""
    (e,) = pl.cross_entropy(Inputs((h, w, tg, IGN, chunk)), pl.CE)
    assert e is not None and e.mag is not None
    return e.value, gemm_radius(pl.CE, e.mag, e.k)


def check_loss(got: Tensor, h: Tensor, w: Tensor, tg: Tensor, chunk: int) -> None:
    want, rad = loss_radius(h, w, tg, chunk)
    v = bound(got.cpu(), want, rad, pl.CE.n, "loss")
    assert v.passed, v.detail


def check_grads(dh: Tensor, dw: Tensor, dloss: float, h: Tensor, w: Tensor, tg: Tensor, chunk: int) -> None:
    exp = pl.cross_entropy_bwd(Inputs((dloss, h, w, tg, IGN, chunk)), pl.CE_BWD)
    for got, e, name in zip((dh, dw), exp, ("dh", "dw"), strict=True):
        assert e is not None and e.mag is not None
        v = bound(got.cpu(), e.value, gemm_radius(pl.CE_BWD, e.mag, e.k), pl.CE_BWD.n, name)
        assert v.passed, v.detail


# ---------------------------------------------------------------------------------------------------------
# CPU: declarations, compile checks, plumbing.
# ---------------------------------------------------------------------------------------------------------
def test_kernels_declare_both_archs() -> None:
    assert {k.op for k in fast.KERNELS} == {"cross_entropy", "cross_entropy_bwd"}
    for spec in fast.KERNELS:
        assert set(spec.expect) == set(spec.forbid) == set(SUPPORTED_ARCHS)
        for arch in SUPPORTED_ARCHS:
            for rx in (*spec.expect[arch], *spec.forbid[arch]):
                re.compile(rx)


def test_kernel_source_hash_covers_the_kernel_file() -> None:
    files = op.source_files(fast.CE_FWD.module)
    assert any(p.name == "loss.py" and p.parent.name == "kernels" for p in files)


@pytest.fixture(scope="module")
def loss_rows() -> dict[str, list[dict[str, Any]]]:
    return compile_rows("nmoe.fast.loss")


def test_compile_loss_kernels_without_gpu(loss_rows: dict[str, list[dict[str, Any]]]) -> None:
    for arch, rows in loss_rows.items():
        assert_rows_ok(rows, arch, len(fast.KERNELS))


def test_sep_cross_entropy_bwd_fast_tile_barrier_dropped(loss_rows: dict[str, list[dict[str, Any]]]
                                                         ) -> None:
    """dlogits overwrite their own logits row: the grad kernel's PTX must load each tile, then barrier,
    then store; its forbid list tells that order from a dropped or late barrier."""
    load, bar, store = "ld.global.b32 %r1, [%rd1];\n", "bar.sync 0;\n", "st.global.b16 [%rd2], %rs1;\n"
    grad = next(k for k in fast.KERNELS if k.name == "ce_fwd_grad")
    for arch in SUPPORTED_ARCHS:
        hits = [[re.search(rx, ptx) is not None for rx in grad.forbid[arch]]
                for ptx in (bar + load + bar + store, bar + load + store, load + store + bar)]
        assert not any(hits[0]) and any(hits[1]) and any(hits[2])
        assert_rows_ok([r for r in loss_rows[arch] if r["kernel"] == "ce_fwd_grad"], arch, 1)


def test_peak_bytes_formula_at_the_production_shape() -> None:
    t, h, v = 8192, 2048, 201088
    assert fast.peak_bytes(t, v, h, 4096, False) == 4 * 4096 * v + 8 * t
    grad = fast.peak_bytes(t, v, h, 4096, True)
    assert grad == 4 * 4096 * v + 4 * v * h + 4 * t * h + 8 * t
    assert fast.peak_bytes(2 * t, v, h, 4096, True) - grad == 4 * t * h + 8 * t  # no [T, V] term


def test_cpu_tensors_are_refused_naming_reference() -> None:
    h, w, tg = make(4, 8, 16, 0)
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        fast.cross_entropy(h, w, tg)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: fast.cross_entropy(torch.ones(3, 8).bfloat16(), torch.ones(5, 7).bfloat16(),
                                torch.zeros(3, dtype=torch.int64)), r"\[V, D\]"),
    (lambda: fast.cross_entropy(torch.ones(3, 8).bfloat16(), torch.ones(5, 8).bfloat16(),
                                torch.zeros(2, dtype=torch.int64)), "targets"),
    (lambda: fast.cross_entropy(torch.ones(3, 8).bfloat16(), torch.ones(5, 8).bfloat16(),
                                torch.zeros(3, dtype=torch.int64), chunk=0), "chunk"),
    (lambda: fast.cross_entropy(torch.ones(3, 8), torch.ones(5, 8), torch.zeros(3, dtype=torch.int64)),
     r"nmoe\.reference\.loss"),
    (lambda: fast.cross_entropy(torch.ones(3, 8).bfloat16(),
                                torch.ones(1, 8).bfloat16().expand(2**31 - fast.THREADS * fast.UNROLL + 1, 8),
                                torch.zeros(3, dtype=torch.int64)), "int32 column index"),
    (lambda: fast.cross_entropy(torch.ones(3, 8).bfloat16(), torch.ones(0, 8).bfloat16(),
                                torch.zeros(3, dtype=torch.int64)), "vocab 0"),
])
def test_bad_arguments_fail_loud_with_the_fix(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_custom_op_has_fake_shapes_and_autograd() -> None:
    h = torch.empty(6, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(50, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    tg = torch.empty(6, device="meta", dtype=torch.int64)
    loss = fast.cross_entropy(h, w, tg)
    assert (loss.shape, loss.dtype) == ((), torch.float32)
    loss.backward()
    assert h.grad is not None and w.grad is not None
    assert (h.grad.shape, h.grad.dtype, w.grad.shape, w.grad.dtype) == (h.shape, h.dtype, w.shape, w.dtype)


def test_bwd_contract_carries_the_bf16_dlogits_rounding() -> None:
    """The bwd budget grows by 2^16 u per |dlogit| (one bf16 rounding); the spec's fp32 math sits inside."""
    h, w, tg = make(5, 16, 40, 1)
    exp = pl.cross_entropy_bwd(Inputs((1.0, h, w, tg, IGN, 3)), pl.CE_BWD)
    from nmoe.reference.loss import cross_entropy_bwd as ref_bwd

    for got, e in zip(ref_bwd(1.0, h, w, tg, IGN, 3), exp, strict=True):
        assert e is not None and e.mag is not None
        assert bound(got, e.value, gemm_radius(pl.CE_BWD, e.mag, e.k), pl.CE_BWD.n).passed


def test_bwd_budget_covers_a_probability_flushed_to_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits 0 and -96: p = e^-96 ~ 2e-42 lies below fp32's least normal, where a flush-to-zero exp (as
    GPU kernels use) returns 0; dw's row 1 is then 0 instead of ~1.3e-40, an absolute error no relative
    budget covers. The underflow terms admit it; without them the same output fails."""
    h = torch.tensor([[64.0]]).bfloat16()
    w = torch.tensor([[0.0], [-1.5]]).bfloat16()
    inp = Inputs((1.0, h, w, torch.tensor([0]), IGN, 4))
    ftz_dw = torch.zeros(2, 1).bfloat16()

    def verdict() -> bool:
        _, e = pl.cross_entropy_bwd(inp, pl.CE_BWD)
        assert e is not None and e.mag is not None
        assert float(e.value[1, 0]) > float(torch.finfo(torch.bfloat16).smallest_normal) * 2.0**-8
        return bound(ftz_dw, e.value, gemm_radius(pl.CE_BWD, e.mag, e.k), pl.CE_BWD.n).passed

    assert verdict()
    for name in ("TINY_U", "BF16_SUB_U", "F32_SUB_U"):
        monkeypatch.setattr(pl, name, 0.0)
    assert not verdict()

def test_bf16_rounding_budget_covers_every_fp32_to_bf16_rounding() -> None:
    """ml_dtypes rounds every fp32 mantissa of one binade (scale-free): the worst relative error is just
    under 2^-8, twice the 2^-9 a half-ULP-at-the-top estimate gives, and inside BF16_IN_U."""
    import ml_dtypes
    import numpy as np

    x = (1.0 + np.arange(2**23, dtype=np.float64) * 2.0**-23).astype(np.float32)
    rel = np.abs(x.astype(ml_dtypes.bfloat16).astype(np.float64) - x) / x
    assert 2.0**-9 < rel.max() <= pl.BF16_IN_U * 2.0**-24


# ---------------------------------------------------------------------------------------------------------
# GPU: values, gradients, memory, no host sync.
# ---------------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize(("t", "d", "v", "chunk"), [(1, 8, 5, 4096), (13, 32, 300, 3), (64, 64, 1000, 16),
                                                    (257, 128, 8191, 100), (512, 256, 32768, 4096)])
def test_loss_and_grads_within_float64_budget(t: int, d: int, v: int, chunk: int) -> None:
    check_budget_case(t, d, v, chunk)


def check_budget_case(t: int, d: int, v: int, chunk: int) -> None:
    """Loss and its autograd gradients on seeded inputs, each within its parity contract's budget."""
    h, w, tg = make(t, d, v, t + v)
    hc, wc = h.cuda().requires_grad_(), w.cuda().requires_grad_()
    loss = fast.cross_entropy(hc, wc, tg.cuda(), IGN, chunk)
    check_loss(loss, h, w, tg, chunk)
    loss.backward()
    assert hc.grad is not None and wc.grad is not None
    check_grads(hc.grad, wc.grad, 1.0, h, w, tg, chunk)


@gpu
def test_bwd_function_and_dloss_scaling() -> None:
    h, w, tg = make(40, 64, 500, 3)
    dh, dw = fast.cross_entropy_bwd(0.5, h.cuda(), w.cuda(), tg.cuda(), IGN, 16)
    check_grads(dh, dw, 0.5, h, w, tg, 16)
    hc, wc = h.cuda().requires_grad_(), w.cuda().requires_grad_()
    (fast.cross_entropy(hc, wc, tg.cuda(), IGN, 16) * 3.0).backward()
    assert hc.grad is not None and wc.grad is not None
    check_grads(hc.grad, wc.grad, 3.0, h, w, tg, 16)


@gpu
def test_no_kept_token_gives_zero_loss_and_zero_grads() -> None:
    h, w, _ = make(9, 32, 70, 4)
    tg = torch.full((9,), IGN, dtype=torch.int64)
    hc, wc = h.cuda().requires_grad_(), w.cuda().requires_grad_()
    loss = fast.cross_entropy(hc, wc, tg.cuda(), IGN, 4)
    loss.backward()
    assert float(loss) == 0.0 and not math.isnan(float(loss))
    assert hc.grad is not None and wc.grad is not None
    assert not hc.grad.any() and not wc.grad.any()


@gpu
def test_large_logits_do_not_overflow() -> None:
    h, w, tg = make(32, 64, 2000, 5, scale=80.0, ignored=0.0)
    loss = fast.cross_entropy(h.cuda(), w.cuda(), tg.cuda(), IGN, 8)
    assert math.isfinite(float(loss))
    check_loss(loss, h, w, tg, 8)


@gpu
def test_production_vocab_and_determinism() -> None:
    h, w, tg = make(40, 64, 201088, 6)
    hc, wc = h.cuda(), w.cuda()
    a = fast.cross_entropy_bwd(1.0, hc, wc, tg.cuda(), IGN, 16)
    b = fast.cross_entropy_bwd(1.0, hc, wc, tg.cuda(), IGN, 16)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    check_loss(fast.cross_entropy(hc, wc, tg.cuda(), IGN, 16), h, w, tg, 16)
    check_grads(*a, 1.0, h, w, tg, 16)


@gpu
def test_forward_and_backward_never_sync_the_host() -> None:
    h, w, tg = make(64, 64, 1000, 7)
    hc, wc, tc = h.cuda().requires_grad_(), w.cuda().requires_grad_(), tg.cuda()
    fast.cross_entropy(hc, wc, tc, IGN, 16).backward()  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast.cross_entropy(hc, wc, tc, IGN, 16).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
@pytest.mark.parametrize("grad", [False, True])
def test_peak_memory_within_the_stated_formula(grad: bool) -> None:
    t, d, v, chunk = 2048, 512, 50000, 512
    h, w, tg = make(t, d, v, 8)
    hc, wc, tc = h.cuda().requires_grad_(grad), w.cuda().requires_grad_(grad), tg.cuda()
    fast.cross_entropy(hc, wc, tc, IGN, chunk)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fast.cross_entropy(hc, wc, tc, IGN, chunk)
    if grad:
        loss.backward()
    peak = torch.cuda.max_memory_allocated() - base
    workspace = 64 << 20  # cuBLAS workspace and the allocator's 2 MiB rounding
    assert peak <= fast.peak_bytes(t, v, d, chunk, grad) + (2 * t * d + 2 * v * d if grad else 0) + workspace
    assert peak < 4 * t * v  # never the fp32 logits of all tokens


# ---------------------------------------------------------------------------------------------------------
# Separating inputs for the mutations (mutations/catalog/fast_loss.py).
# ---------------------------------------------------------------------------------------------------------
def lse_rows(h: Tensor, w: Tensor) -> Tensor:
    return torch.logsumexp(h.double() @ w.double().T, dim=-1)


def sep_loss(h: Tensor, w: Tensor, tg: Tensor, chunk: int, mutant64: float) -> None:
    want, rad = loss_radius(h, w, tg, chunk)
    assert abs(mutant64 - float(want)) > 4 * float(rad) + 1e-6 or not math.isfinite(mutant64)
    check_loss(fast.cross_entropy(h.cuda(), w.cuda(), tg.cuda(), IGN, chunk), h, w, tg, chunk)


def per_token(h: Tensor, w: Tensor, tg: Tensor) -> Tensor:
    logits = h.double() @ w.double().T
    safe = torch.where(tg == IGN, 0, tg)
    return lse_rows(h, w) - logits.gather(1, safe[:, None]).squeeze(1)


@gpu
def test_sep_cross_entropy_fast_ignore_not_excluded() -> None:
    h, w, tg = make(16, 32, 100, 9, ignored=0.5)
    kept = tg != IGN
    mutant = float(per_token(h, w, tg).sum() / kept.sum())  # ignored rows scored against token 0
    sep_loss(h, w, tg, 4, mutant)


@gpu
def test_sep_cross_entropy_fast_max_not_subtracted() -> None:
    h, w, tg = make(8, 64, 300, 10, scale=200.0, ignored=0.0)
    logits = h.double() @ w.double().T
    assert float(logits.amax()) > 89.0  # exp overflows fp32 there
    sep_loss(h, w, tg, 4, math.inf)


@gpu
def test_sep_cross_entropy_fast_chunk_tail_dropped() -> None:
    h, w, tg = make(10, 32, 100, 11, ignored=0.0)
    mutant = float(per_token(h, w, tg)[:8].sum() / 10)
    sep_loss(h, w, tg, 4, mutant)


@gpu
def test_sep_cross_entropy_fast_mean_over_t() -> None:
    h, w, tg = make(16, 32, 100, 12, ignored=0.5)
    kept = tg != IGN
    mutant = float(per_token(h, w, tg)[kept].sum() / 16)
    sep_loss(h, w, tg, 4, mutant)


@gpu
def test_sep_cross_entropy_bwd_fast_onehot_dropped() -> None:
    h, w, tg = make(16, 32, 100, 13, ignored=0.0)
    p = torch.softmax(h.double() @ w.double().T, dim=-1) / 16
    exp = pl.cross_entropy_bwd(Inputs((1.0, h, w, tg, IGN, 4)), pl.CE_BWD)
    assert exp[0] is not None and exp[0].mag is not None
    rad = gemm_radius(pl.CE_BWD, exp[0].mag, exp[0].k)
    assert not bound((p @ w.double()).bfloat16(), exp[0].value, rad, pl.CE_BWD.n).passed
    dh, dw = fast.cross_entropy_bwd(1.0, h.cuda(), w.cuda(), tg.cuda(), IGN, 4)
    check_grads(dh, dw, 1.0, h, w, tg, 4)


@gpu
def test_sep_cross_entropy_bwd_fast_dw_chunk_overwritten() -> None:
    h, w, tg = make(16, 32, 100, 14, ignored=0.0)
    exp = pl.cross_entropy_bwd(Inputs((1.0, h, w, tg, IGN, 4)), pl.CE_BWD)
    assert exp[1] is not None and exp[1].mag is not None
    rad = gemm_radius(pl.CE_BWD, exp[1].mag, exp[1].k)
    dlogits = torch.softmax(h.double() @ w.double().T, dim=-1)
    dlogits[torch.arange(16), tg] -= 1.0
    last_chunk_only = (dlogits[12:] / 16).T @ h[12:].double()
    assert not bound(last_chunk_only.bfloat16(), exp[1].value, rad, pl.CE_BWD.n).passed
    dh, dw = fast.cross_entropy_bwd(1.0, h.cuda(), w.cuda(), tg.cuda(), IGN, 4)
    check_grads(dh, dw, 1.0, h, w, tg, 4)


@gpu
def test_a_target_outside_the_vocab_aborts_where_the_spec_raises() -> None:
    """The spec raises naming the target; the kernel cannot raise, so it traps, and a CUDA error surfaces at
    the next sync (run in a child: a trapped context is unusable)."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    from nmoe.reference.loss import cross_entropy as ref_ce

    h, w = torch.ones(2, 8).bfloat16(), torch.ones(5, 8).bfloat16()
    with pytest.raises(ValueError, match="target 5 is outside"):
        ref_ce(h, w, torch.tensor([0, 5]), IGN, 4)
    code = textwrap.dedent("""
        import torch
        from nmoe.fast.loss import cross_entropy
        h, w = torch.ones(2, 8, device="cuda").bfloat16(), torch.ones(5, 8, device="cuda").bfloat16()
        cross_entropy(h, w, torch.tensor([0, 5], device="cuda"), -100, 4)
        torch.cuda.synchronize()
        print("no error")
    """)
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "no error" not in out.stdout, out.stdout + out.stderr
    assert "CUDA error" in out.stdout + out.stderr, out.stderr[-2000:]


def _scale_case(n: int) -> Tensor:
    """fp32 gradients with bf16 rounding ties, overflow past bf16's max, subnormals, infinities and NaN."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3.0
    specials = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.4e38, 1e-40, -1e-42, math.inf, -math.inf,
                             math.nan])
    m = min(n, specials.numel())
    g[:m] = specials[:m]
    return g


@gpu
@pytest.mark.parametrize("n", [1, 7, 8, 4099, 2048 * 33 + 5])
def test_scale_is_torchs_fp32_product_rounded_once_bitwise(n: int) -> None:
    """ce_scale against torch's mixed-dtype mul (fp32 product, one RNE rounding to bf16), every vector tail
    length; NaN positions agree (the kernel writes the canonical NaN)."""
    g, s = _scale_case(n).cuda(), torch.tensor(0.37, device="cuda")
    got = fast._scaled(g, s)
    want = torch.mul(g, s, out=torch.empty(n, dtype=torch.bfloat16, device="cuda"))
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@gpu
def test_sep_cross_entropy_bwd_fast_scale_ignored() -> None:
    """dloss 0.37 moves every nonzero gradient: the unscaled rounding differs from the scaled one."""
    g, s = _scale_case(4099).cuda(), torch.tensor(0.37, device="cuda")
    scaled = torch.mul(g, s, out=torch.empty(4099, dtype=torch.bfloat16, device="cuda"))
    assert not torch.equal(g.bfloat16()[8:], scaled[8:])
    assert torch.equal(fast._scaled(g, s)[8:], scaled[8:])
