"""nmoe.fast.optim (AdamW kernel, Muon with Newton-Schulz on tensor cores): compile checks and plumbing on
CPU; on a GPU, the parity contracts against float64 (AdamW bound, Muon ratio against a bf16 Newton-Schulz),
no host sync, and separating inputs for the catalogued mutations."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from torch import Tensor

from nmoe.fast import optim as fast
from nmoe.fast.arch import SUPPORTED_ARCHS, ArchError
from parity.entry import RATIO2_FP32
from parity.execute import compare_output
from parity.inputs import Inputs
from parity.ops import optim as po

gpu = pytest.mark.gpu
ADAMW = next(e for e in po.ENTRIES if e.name == "adamw")
MUON = next(e for e in po.ENTRIES if e.name == "muon")


def adamw_case(shape: tuple[int, ...], seed: int, step: int, lr: float = 1e-3, wd: float = 0.1,
               grad_dtype: torch.dtype = torch.float32) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=g) * 0.02
    grad = (torch.randn(shape, generator=g) * 1e-2).to(grad_dtype)
    m = torch.randn(shape, generator=g) * 1e-2
    v = (torch.randn(shape, generator=g, dtype=torch.float64) * 1e-2).square().float()
    return p, grad, m, v, torch.tensor([step, lr, wd], dtype=torch.float64)


def run_adamw(p: Tensor, grad: Tensor, m: Tensor, v: Tensor, step: int, lr: float, wd: float,
              scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    pc, mc, vc = p.cuda(), m.cuda(), v.cuda()
    fast.adamw_step(pc, grad.cuda(), mc, vc, step, lr, 0.9, 0.95, 1e-8, wd,
                    None if scale is None else scale.cuda())
    return pc.cpu(), mc.cpu(), vc.cpu()


def check_adamw(out: tuple[Tensor, Tensor, Tensor], p: Tensor, grad: Tensor, m: Tensor, v: Tensor, step: int,
                lr: float, wd: float, scale: Tensor | None = None) -> None:
    exp = po.adamw(Inputs((p, grad, m, v, step, lr, 0.9, 0.95, 1e-8, wd, scale)), ADAMW.contract)
    for got, e, name in zip(out, exp, ("p", "m", "v"), strict=True):
        assert e is not None
        verdict = compare_output(got, e, ADAMW.contract, name)
        assert verdict.passed, verdict.detail


def muon_inputs(shape: tuple[int, ...], seed: int, lr: float = 0.02, wd: float = 0.1,
                nesterov: bool = True) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=g) * 0.02
    grad = torch.randn(shape, generator=g) * 1e-2
    buf = torch.randn(shape, generator=g) * 1e-2
    return Inputs((p, grad, buf, lr, 0.95, wd, nesterov, 5))


def check_muon(inp: Inputs) -> None:
    p, grad, buf = (t.clone().cuda() for t in inp.args[:3])
    fast.muon_step(p, grad, buf, *inp.args[3:])
    exp = po.muon(inp, MUON.contract)
    for i, (got, e) in enumerate(zip((p.cpu(), buf.cpu()), exp, strict=True)):
        assert e is not None
        verdict = compare_output(got, e, MUON.contract_for("sm_90a", i), ("p", "buf")[i])
        assert verdict.passed, verdict.detail


# ---------------------------------------------------------------------------------------------------------
# CPU: declarations, compile checks, plumbing.
# ---------------------------------------------------------------------------------------------------------
def test_kernels_declare_both_archs() -> None:
    assert {k.op for k in fast.KERNELS} == {"adamw"}
    for spec in fast.KERNELS:
        assert set(spec.expect) == set(spec.forbid) == set(SUPPORTED_ARCHS)
        for arch in SUPPORTED_ARCHS:
            for rx in (*spec.expect[arch], *spec.forbid[arch]):
                re.compile(rx)


def test_compile_adamw_kernels_without_gpu() -> None:
    for arch, rows in compile_rows("nmoe.fast.optim").items():
        assert_rows_ok(rows, arch, len(fast.KERNELS))


def test_constants_match_the_papers() -> None:
    """Muon's quintic (Jordan et al.) and Moonlight's 0.2 * sqrt(max dim) RMS match, written here."""
    assert fast.NS5_COEFFS == (3.4445, -4.7750, 2.0315) and fast.NS5_EPS == 1e-7
    assert fast.muon_scale((1024, 4096)) == pytest.approx(0.2 * 64.0)


@pytest.mark.parametrize("call", [
    lambda: fast.adamw_step(*(torch.zeros(4) for _ in range(4)), 1, 1e-3, 0.9, 0.95, 1e-8, 0.0),
    lambda: fast.muon_step(*(torch.zeros(4, 4) for _ in range(3)), 0.02, 0.95, 0.0),
    lambda: fast.newton_schulz5(torch.zeros(4, 4)),
])
def test_cpu_tensors_are_refused_naming_reference(call: Callable[[], object]) -> None:
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        call()


@pytest.mark.parametrize(("call", "match"), [
    (lambda: fast.adamw_step(*(torch.zeros(4, dtype=torch.float64) for _ in range(4)), 1, 1e-3, 0.9, 0.95,
                             1e-8, 0.0), "fp32 master"),
    (lambda: fast.adamw_step(torch.zeros(4), torch.zeros(3), torch.zeros(4), torch.zeros(4), 1, 1e-3, 0.9,
                             0.95, 1e-8, 0.0), "grad"),
    (lambda: fast.adamw_step(*(torch.zeros(4) for _ in range(4)), 0, 1e-3, 0.9, 0.95, 1e-8, 0.0), "step=0"),
    (lambda: fast.adamw_step(torch.zeros(4), torch.zeros(4), torch.zeros(4, 2).mT[0], torch.zeros(4), 1, 1e-3,
                             0.9, 0.95, 1e-8, 0.0), "contiguous"),
    (lambda: fast.adamw_step(torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16),
                             torch.zeros(4), 1, 1e-3, 0.9, 0.95, 1e-8, 0.0), "both fp32 or both bf16"),
    (lambda: fast.muon_step(*(torch.zeros(4) for _ in range(3)), 0.02, 0.95, 0.0), "adamw_step"),
    (lambda: fast.newton_schulz5(torch.zeros(4)), "matrix"),
])
def test_bad_arguments_fail_loud_with_the_fix(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------------------
# GPU: parity contracts, no host sync.
# ---------------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("shape", [(1,), (3,), (7, 33), (1024, 1030), (4096, 7168)])
@pytest.mark.parametrize("step", [1, 10, 1000])
def test_adamw_within_the_parity_bound(shape: tuple[int, ...], step: int) -> None:
    p, grad, m, v, _ = adamw_case(shape, step + len(shape), step)
    check_adamw(run_adamw(p, grad, m, v, step, 1e-3, 0.1), p, grad, m, v, step, 1e-3, 0.1)


@gpu
def test_adamw_bf16_grads_misaligned_views_and_subnormals() -> None:
    p, grad, m, v, _ = adamw_case((8, 129), 5, 3, grad_dtype=torch.bfloat16)
    check_adamw(run_adamw(p, grad, m, v, 3, 3e-4, 0.0), p, grad, m, v, 3, 3e-4, 0.0)
    big = [t.cuda() for t in adamw_case((1001,), 6, 2)[:4]]
    views = [t[1:] for t in big]
    host = [t.cpu() for t in views]
    fast.adamw_step(views[0], views[1], views[2], views[3], 2, 1e-3, 0.9, 0.95, 1e-8, 0.1)
    check_adamw((views[0].cpu(), views[2].cpu(), views[3].cpu()), *host, 2, 1e-3, 0.1)
    p, grad, m, v, _ = adamw_case((64,), 7, 1)
    tiny = grad * 1e-18
    check_adamw(run_adamw(p, tiny, m, v, 1, 1e-3, 0.1), p, tiny, m, v, 1, 1e-3, 0.1)


@gpu
@pytest.mark.parametrize("shape", [(2, 2), (12, 5), (5, 12), (2, 64, 96), (1024, 2048), (2048, 1024)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_within_the_parity_contracts(shape: tuple[int, ...], nesterov: bool) -> None:
    check_muon(muon_inputs(shape, sum(shape), nesterov=nesterov))


@gpu
def test_newton_schulz_orthogonalises() -> None:
    g = torch.randn(256, 512, device="cuda")
    sv = torch.linalg.svdvals(fast.newton_schulz5(g).double())
    assert float(sv.min()) > 0.5 and float(sv.max()) < 1.3


@gpu
def test_steps_never_sync_the_host() -> None:
    p, grad, m, v = (t.cuda() for t in adamw_case((4096,), 8, 1)[:4])
    w, gw, buf = (t.cuda() for t in muon_inputs((64, 96), 9).args[:3])
    fast.adamw_step(p, grad, m, v, 1, 1e-3, 0.9, 0.95, 1e-8, 0.1)
    fast.muon_step(w, gw, buf, 0.02, 0.95, 0.1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast.adamw_step(p, grad, m, v, 2, 1e-3, 0.9, 0.95, 1e-8, 0.1)
        fast.muon_step(w, gw, buf, 0.02, 0.95, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------------------------------------------------
# Separating inputs for the mutations (mutations/catalog/fast_optim.py).
# ---------------------------------------------------------------------------------------------------------
def adamw64(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: int, lr: float, wd: float, *,
            bias: bool = True, decay_on_m: bool = False) -> Tensor:
    p, g, m, v = (t.double() for t in (p, g, m, v))
    b1, b2 = 0.9, 0.95
    if decay_on_m:
        m = m * (1 - lr * wd)
    else:
        p = p * (1 - lr * wd)
    m1 = b1 * m + (1 - b1) * g
    v1 = b2 * v + (1 - b2) * g * g
    bc1, bc2 = (1 - b1**step, 1 - b2**step) if bias else (1.0, 1.0)
    out: Tensor = p - lr * (m1 / bc1) / (torch.sqrt(v1 / bc2) + 1e-8)
    return out


def sep_adamw(step: int, wd: float, **mutant: bool) -> None:
    p, grad, m, v, _ = adamw_case((256,), 10 + step, step)
    exp = po.adamw(Inputs((p, grad, m, v, step, 1e-3, 0.9, 0.95, 1e-8, wd, None)), ADAMW.contract)
    assert exp[0] is not None
    bad = adamw64(p, grad, m, v, step, 1e-3, wd, **mutant).float()
    assert not compare_output(bad, exp[0], ADAMW.contract, "p").passed
    check_adamw(run_adamw(p, grad, m, v, step, 1e-3, wd), p, grad, m, v, step, 1e-3, wd)


@gpu
def test_sep_adamw_fast_grad_scale_ignored() -> None:
    """The clip factor read on the device multiplies g (fp32 and bf16 grads): with m and v already nonzero, a
    step on 0.3 g lands outside the contract of a step on g."""
    s = torch.tensor(0.3)
    for grad_dtype in (torch.float32, torch.bfloat16):
        p, grad, m, v, _ = adamw_case((1000,), 21, 4, grad_dtype=grad_dtype)
        unscaled = po.adamw(Inputs((p, grad, m, v, 4, 1e-3, 0.9, 0.95, 1e-8, 0.1, None)), ADAMW.contract)
        scaled = po.adamw(Inputs((p, grad, m, v, 4, 1e-3, 0.9, 0.95, 1e-8, 0.1, s)), ADAMW.contract)
        assert unscaled[1] is not None and scaled[1] is not None
        assert not compare_output(unscaled[1].value.float(), scaled[1], ADAMW.contract, "m").passed
        check_adamw(run_adamw(p, grad, m, v, 4, 1e-3, 0.1, s), p, grad, m, v, 4, 1e-3, 0.1, s)


@gpu
def test_sep_adamw_fast_low_copy_from_moment() -> None:
    """With p_low the kernel also writes the new master rounded to bf16 (equal to torch's rounding of the fast
    p, whole vectors and the tail), not another register's bits: here m rounds elsewhere than p."""
    p, grad, m, v, _ = adamw_case((1003,), 31, 2, grad_dtype=torch.bfloat16)
    pc, mc, vc = p.cuda(), m.cuda(), v.cuda()
    low = torch.empty(1003, dtype=torch.bfloat16, device="cuda")
    fast.adamw_step(pc, grad.cuda(), mc, vc, 2, 1e-3, 0.9, 0.95, 1e-8, 0.1, torch.tensor(0.5).cuda(), low)
    assert not torch.equal(mc.bfloat16(), pc.bfloat16()), "m and p round to different bf16 values"
    assert torch.equal(low.view(torch.int16), pc.bfloat16().view(torch.int16))
    check_adamw((pc.cpu(), mc.cpu(), vc.cpu()), p, grad, m, v, 2, 1e-3, 0.1, torch.tensor(0.5))


def test_bf16_moment_kernels_round_their_stores_and_compile() -> None:
    names = {k.name for k in fast.KERNELS if k.name.endswith("_mbf16")}
    assert names == {"adamw_gbf16_scaled_low_mbf16", "adamw_gbf16_v1_scaled_low_mbf16"}


def _bf16_moments_step(shape: tuple[int, ...], seed: int, moments: torch.dtype) -> tuple[Tensor, ...]:
    """One trainer-shaped step (bf16 grad, clip factor, bf16 param) from moments that are bf16 values."""
    p, grad, m, v, _ = adamw_case(shape, seed, 3, grad_dtype=torch.bfloat16)
    pc, mc, vc = p.cuda(), m.bfloat16().to(moments).cuda(), v.bfloat16().to(moments).cuda()
    low = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    fast.adamw_step(pc, grad.cuda(), mc, vc, 3, 1e-3, 0.9, 0.95, 1e-8, 0.1, torch.tensor(0.7).cuda(), low)
    return pc, mc, vc, low


@gpu
@pytest.mark.parametrize("shape", [(1,), (7,), (1003,), (1024, 1030)])
def test_bf16_moments_are_the_fp32_moment_step_rounded_once(shape: tuple[int, ...]) -> None:
    """bf16 moments read exactly into fp32, so the step is the fp32-moment kernel's: p and the bf16 param
    bit for bit, the stored m and v its fp32 moments rounded to nearest even (whole vectors and the tail)."""
    want = _bf16_moments_step(shape, 41, torch.float32)
    got = _bf16_moments_step(shape, 41, torch.bfloat16)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
    assert torch.equal(got[3].view(torch.int16), want[3].view(torch.int16))
    for g, w in zip(got[1:3], want[1:3], strict=True):
        assert torch.equal(g.view(torch.int16), w.bfloat16().view(torch.int16))


@gpu
def test_sep_adamw_fast_bf16_moments_swapped() -> None:
    """m and v written into each other's bf16 store: they differ on this data, so the rounded-once check
    refuses the swap."""
    want = _bf16_moments_step((1003,), 42, torch.float32)
    assert not torch.equal(want[1].bfloat16(), want[2].bfloat16())
    got = _bf16_moments_step((1003,), 42, torch.bfloat16)
    assert torch.equal(got[1].view(torch.int16), want[1].bfloat16().view(torch.int16))
    assert torch.equal(got[2].view(torch.int16), want[2].bfloat16().view(torch.int16))


@gpu
def test_sep_muon_fast_grad_scale_ignored() -> None:
    """The fast Muon step multiplies g by the clip factor (the same fp32 product as stepping on g * s, bit for
    bit; with buf nonzero the two differ from the unscaled step) and rounds the new p into p_low."""
    inp = muon_inputs((64, 96), 13, wd=0.0)
    p, grad, buf = (t.cuda() for t in inp.args[:3])
    s = torch.tensor(0.3, device="cuda")
    runs = []
    for g, scale in ((grad, s), (grad * s, None), (grad, None)):
        pc, bc, low = p.clone(), buf.clone(), torch.empty_like(p, dtype=torch.bfloat16)
        fast.muon_step(pc, g, bc, *inp.args[3:], grad_scale=scale, p_low=low)
        assert torch.equal(low.view(torch.int16), pc.bfloat16().view(torch.int16))
        runs.append(pc)
    assert not torch.equal(runs[1], runs[2]), "the factor changes the step"
    assert torch.equal(runs[0], runs[1])


@gpu
def test_sep_adamw_fast_no_bias_correction() -> None:
    sep_adamw(1, 0.1, bias=False)


@gpu
def test_sep_adamw_fast_decay_on_m() -> None:
    sep_adamw(5, 0.1, decay_on_m=True)


@gpu
def test_sep_muon_fast_ns_coeffs_swapped() -> None:
    inp = muon_inputs((64, 96), 11, wd=0.0)
    p, grad, buf = (t.double() for t in inp.args[:3])
    u = grad + 0.95 * (0.95 * buf + grad)
    swapped = (2.0315, -4.7750, 3.4445)
    x = u / u.norm()
    for _ in range(5):
        a = x @ x.T
        x = swapped[0] * x + (swapped[1] * a + swapped[2] * a @ a) @ x
    bad = (p - 0.02 * 0.2 * math.sqrt(96) * x).float()
    exp = po.muon(inp, MUON.contract)
    assert exp[0] is not None and MUON.contract == RATIO2_FP32
    assert not compare_output(bad, exp[0], MUON.contract, "p").passed
    check_muon(inp)
