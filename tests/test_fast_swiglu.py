"""nmoe.fast swiglu fwd/bwd (nmoe/fast/_swiglu.py) against the spec and an fp64 oracle: ulp(1) bf16 on
sm_90a/sm_100a GPUs (bitwise except where expf's last bits decide a bf16 rounding); CPU checks and compiles.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from test_fast_gemm import child_env
from torch import Tensor

from nmoe.fast import _swiglu as fast
from nmoe.fast import runtime
from nmoe.fast.arch import SUPPORTED_ARCHS
from nmoe.reference import activation as ref
from parity.compare import round_once, ulp_distance

ROOT = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16


def _oracle_fwd(h: Tensor) -> Tensor:
    """fp64 silu(g)*u, sigmoid as 1/(1+exp(-g)): written independently of the spec's exp(-|g|) form."""
    hd = h.double()
    g, u = hd[..., 0::2], hd[..., 1::2]
    return g / (1 + torch.exp(-g)) * u


def _oracle_bwd(dy: Tensor, h: Tensor) -> Tensor:
    hd, d = h.double(), dy.double()
    g, u = hd[..., 0::2], hd[..., 1::2]
    s = 1 / (1 + torch.exp(-g))
    return torch.stack((d * u * s * (1 + g * (1 - s)), d * g * s), dim=-1).flatten(-2)


def _max_ulp(got: Tensor, want: Tensor) -> float:
    return float(ulp_distance(got, want).max()) if got.numel() else 0.0


def _check(got: Tensor, spec: Tensor, oracle64: Tensor | None, min_bitwise: float = 0.998) -> None:
    """ulp(1) from the fp64 oracle rounded once and from the spec; nearly all elements bit-identical."""
    if oracle64 is not None:
        assert _max_ulp(got, round_once(oracle64, got.dtype)) <= 1
    assert _max_ulp(got, spec) <= 1
    if got.numel():
        same = (got.view(torch.int16) == spec.view(torch.int16)).double().mean().item()
        assert same >= min_bitwise, same


def _h(t: int, i: int, seed: int, scale: float = 2.0, dtype: torch.dtype = BF16) -> Tensor:
    return (torch.randn(t, 2 * i, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _dy(t: int, i: int, seed: int, dtype: torch.dtype = BF16) -> Tensor:
    return torch.randn(t, i, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)


# ------------------------------------------------------------------------------------------------------
# CPU


def test_cpu_tensors_raise_arch_error() -> None:
    with pytest.raises(runtime.ArchError, match=r"nmoe\.reference"):
        fast.swiglu(torch.zeros(2, 8, dtype=BF16))
    with pytest.raises(runtime.ArchError, match=r"nmoe\.reference"):
        fast.swiglu_bwd(torch.zeros(2, 4, dtype=BF16), torch.zeros(2, 8, dtype=BF16))


def test_bad_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="even last dim"):
        fast.swiglu(torch.zeros(2, 7, dtype=BF16))
    with pytest.raises(ValueError, match="bf16 or fp32"):
        fast.swiglu(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="last dim halved"):
        fast.swiglu_bwd(torch.zeros(2, 8, dtype=BF16), torch.zeros(2, 8, dtype=BF16))
    with pytest.raises(ValueError, match="one dtype"):
        fast.swiglu_bwd(torch.zeros(2, 4), torch.zeros(2, 8, dtype=BF16))


def test_fakes_give_shapes_on_meta() -> None:
    h = torch.empty(3, 5, 16, dtype=BF16, device="meta")
    assert fast.swiglu(h).shape == (3, 5, 8)
    assert fast.swiglu_bwd(torch.empty(3, 5, 8, dtype=BF16, device="meta"), h).shape == (3, 5, 16)


def test_kernel_specs() -> None:
    assert {s.name for s in fast.KERNELS} == {"swiglu_fwd", "swiglu_bwd", "swiglu_fwd_f32", "swiglu_bwd_f32"}
    for spec in fast.KERNELS:
        assert spec.op == spec.name.removesuffix("_f32").removesuffix("_fwd")
        for arch in SUPPORTED_ARCHS:
            expect, forbid = spec.expect[arch], spec.forbid[arch]
            assert r"\bmul\.rn\.f32\b" in expect and r"\brcp\.approx\.ftz\.f32\b" in expect
            assert r"\bdiv\.rn\.f32\b" in forbid, "the sigmoid's quotient is div.rn's fast path alone"


@pytest.mark.heavy
def test_compiles_without_gpu() -> None:
    names = [spec.name for spec in fast.KERNELS]
    for arch, rows in compile_rows("nmoe.fast.activation", names).items():
        assert_rows_ok(rows, arch, len(names))


# ------------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "i", "scale"), [(1, 1, 2.0), (24, 65, 2.0), (7, 32, 0.05), (256, 1408, 4.0),
                                               (3, 2048, 2.0)])
def test_fwd_bwd_random(t: int, i: int, scale: float) -> None:
    h, dy = _h(t, i, seed=t + i, scale=scale), _dy(t, i, seed=t + i)
    _check(fast.swiglu(h.cuda()).cpu(), ref.swiglu(h), _oracle_fwd(h))
    _check(fast.swiglu_bwd(dy.cuda(), h.cuda()).cpu(), ref.swiglu_bwd(dy, h), _oracle_bwd(dy, h))


def _specials(kind: str) -> list[float]:
    return {
        "nan": [math.nan, -math.nan],
        "inf": [math.inf, -math.inf],
        "denormal": [2.0**-130, -(2.0**-133), 9.2e-41, -1.0e-39],
        "max": [3.3895e38, -3.3895e38],
        "zero": [0.0, -0.0],
        "tail": [-88.0, -90.5, -95.0, -110.0, -300.0, 88.0, 95.0],
    }[kind]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nan", "inf", "denormal", "max", "zero", "tail"])
def test_adversarial(kind: str) -> None:
    g = torch.Generator().manual_seed(3)
    h, dy = _h(32, 96, seed=5), _dy(32, 96, seed=5)
    flat = h.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 8]
    vals = torch.tensor(_specials(kind))[torch.randint(len(_specials(kind)), (idx.numel(),), generator=g)]
    flat[idx] = vals.to(BF16)
    if kind == "tail":
        h[:, 1::2] = (h[:, 1::2].float() * 1e3).to(BF16)
    _check(fast.swiglu(h.cuda()).cpu(), ref.swiglu(h), _oracle_fwd(h), min_bitwise=0.99)
    # at ±max, fp32 d*u overflows in the spec's op order too: the fp64 oracle is not reachable there
    bwd_oracle = None if kind == "max" else _oracle_bwd(dy, h)
    _check(fast.swiglu_bwd(dy.cuda(), h.cuda()).cpu(), ref.swiglu_bwd(dy, h), bwd_oracle, 0.99)


@pytest.mark.gpu
def test_fp32_close_to_spec() -> None:
    """fp32 has no pinned contract. expf differs by a few ULP, so fwd stays within 16 ULP of the spec; bwd's
    1 + g*(1-s) cancels near silu's minimum (g ~ -1.28), so there the error is absolute: 16 ULP of its terms.
    """
    h, dy = _h(16, 200, seed=8, scale=4.0, dtype=torch.float32), _dy(16, 200, seed=8, dtype=torch.float32)
    assert _max_ulp(fast.swiglu(h.cuda()).cpu(), ref.swiglu(h)) <= 16
    got, want = fast.swiglu_bwd(dy.cuda(), h.cuda()).cpu().double(), ref.swiglu_bwd(dy, h).double()
    g, u, d = h[:, 0::2].double(), h[:, 1::2].double(), dy.double()
    scale = torch.stack(((d * u).abs() * (1 + g.abs()), (d * g).abs()), dim=-1).flatten(-2)
    assert bool(((got - want).abs() <= 16 * 2.0**-24 * (want.abs() + scale)).all())


@pytest.mark.gpu
def test_edge_shapes_and_layouts() -> None:
    assert fast.swiglu(torch.zeros(0, 16, dtype=BF16, device="cuda")).shape == (0, 8)
    assert fast.swiglu(torch.zeros(4, 0, dtype=BF16, device="cuda")).shape == (4, 0)
    assert fast.swiglu_bwd(torch.zeros(0, 8, dtype=BF16, device="cuda"),
                           torch.zeros(0, 16, dtype=BF16, device="cuda")).shape == (0, 16)
    h3 = _h(6, 40, seed=1).view(2, 3, 80)
    _check(fast.swiglu(h3.cuda()).cpu(), ref.swiglu(h3), _oracle_fwd(h3))
    h, dy = _h(5, 24, seed=2), _dy(5, 24, seed=2)
    buf = torch.empty(h.numel() + 1, dtype=BF16, device="cuda")
    hs = buf[1:].view(h.shape)
    hs.copy_(h.cuda())
    _check(fast.swiglu(hs).cpu(), ref.swiglu(h), _oracle_fwd(h))
    _check(fast.swiglu_bwd(dy.cuda(), hs).cpu(), ref.swiglu_bwd(dy, h), _oracle_bwd(dy, h))
    ht = _h(48, 8, seed=4).t().contiguous().t()
    _check(fast.swiglu(ht.cuda()).cpu(), ref.swiglu(ht), _oracle_fwd(ht))


@pytest.mark.gpu
def test_cuda_graph_replay() -> None:
    sh = _h(64, 1024, seed=1).cuda()
    fast.swiglu(sh)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fast.swiglu(sh)
    for seed in (2, 3):
        h = _h(64, 1024, seed=seed)
        sh.copy_(h)
        graph.replay()
        torch.cuda.synchronize()
        _check(out.cpu(), ref.swiglu(h), _oracle_fwd(h))


@pytest.mark.gpu
def test_autograd_and_opcheck() -> None:
    h, dy = _h(12, 256, seed=6), _dy(12, 256, seed=6)
    hc = h.cuda().requires_grad_()
    torch.autograd.backward(fast.swiglu(hc), dy.cuda())
    assert hc.grad is not None
    assert torch.equal(hc.grad.view(torch.int16), fast.swiglu_bwd(dy.cuda(), h.cuda()).view(torch.int16))
    _check(hc.grad.cpu(), ref.swiglu_bwd(dy, h), _oracle_bwd(dy, h))
    torch.library.opcheck(torch.ops.nmoe.swiglu.default, (h.cuda(),))
    torch.library.opcheck(torch.ops.nmoe.swiglu_bwd.default, (dy.cuda(), h.cuda()))


# ------------------------------------------------------------------------------------------------------
# GPU: separating inputs for the fast-path mutations


@pytest.mark.gpu
def test_sep_swiglu_fast_concat_layout() -> None:
    """Mutant reads each 16-wide chunk (8 bf16 outputs' worth) as [8 gates | 8 ups] instead of pairs."""
    h = _h(8, 64, seed=31)
    chunks = h.view(8, 8, 16)
    mutant_h = torch.stack((chunks[..., :8], chunks[..., 8:]), dim=-1).reshape(8, 128)
    correct, mutant = ref.swiglu(h), ref.swiglu(mutant_h)
    assert _max_ulp(correct, mutant) > 1
    _check(fast.swiglu(h.cuda()).cpu(), correct, _oracle_fwd(h))


@pytest.mark.gpu
def test_sep_swiglu_fast_du_not_silu() -> None:
    """Mutant returns dup = dy*g (drops sigmoid) instead of dy*silu(g)."""
    h, dy = _h(8, 64, seed=32), _dy(8, 64, seed=32)
    correct = ref.swiglu_bwd(dy, h)
    mutant = correct.clone()
    mutant[:, 1::2] = (dy.float() * h[:, 0::2].float()).to(BF16)
    assert _max_ulp(correct, mutant) > 1
    _check(fast.swiglu_bwd(dy.cuda(), h.cuda()).cpu(), correct, _oracle_bwd(dy, h))


# ------------------------------------------------------------------------------------------------------
# The sigmoid's quotient (swiglu.unit_quotient) against IEEE division, over every fp32 e in [0, 1]

_QUOTIENT_PROBE = r'''
import json, sys
from nmoe.fast import runtime
runtime.import_cutlass("sm_90a")
import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.runtime import make_ptr
from nmoe.fast.kernels.prims import add_rn, div_rn, f2i, fma_rn, i2f, mul_rn, rcp_approx
from nmoe.fast.kernels.swiglu import unit_quotient

THREADS, BLOCKS = 256, 2048


@cute.jit
def uncorrected(num, den):
    r = rcp_approx(den)
    return mul_rn(num, fma_rn(r, fma_rn(-den, r, 1.0), r))


@cute.kernel
def check(pbad: cute.Pointer, last: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    ours, cut = Int32(0), Int32(0)
    for i in range(bidx * THREADS + tidx, last + 1, THREADS * BLOCKS):
        e = i2f(i)
        den = add_rn(1.0, e)
        for num in (1.0, e):
            ieee = f2i(div_rn(num, den))
            if f2i(unit_quotient(num, den)) != ieee:
                ours = ours + 1
            if f2i(uncorrected(num, den)) != ieee:
                cut = cut + 1
    bad = cute.make_tensor(pbad, cute.make_layout(2))
    cute.arch.atomic_add((bad.iterator + 0).llvm_ptr, ours, sem="relaxed", scope="gpu")
    cute.arch.atomic_add((bad.iterator + 1).llvm_ptr, cut, sem="relaxed", scope="gpu")


@cute.jit
def run(pbad: cute.Pointer, last: Int32, stream: cuda.CUstream):
    check(pbad, last).launch(grid=[BLOCKS, 1, 1], block=[THREADS, 1, 1], stream=stream)


LAST = 0x3F800000
ptr = make_ptr(Int32, 16, cute.AddressSpace.gmem, assumed_align=4)
compiled = cute.compile(run, ptr, Int32(LAST), cuda.CUstream(0))
if sys.argv[1:] == ["--compile-only"]:
    print(json.dumps({"compiled": True}))
    raise SystemExit(0)
import torch
bad = torch.zeros(2, dtype=torch.int32, device="cuda")
compiled(make_ptr(Int32, bad.data_ptr(), cute.AddressSpace.gmem, assumed_align=4), Int32(LAST),
         cuda.CUstream(torch.cuda.current_stream().cuda_stream))
torch.cuda.synchronize()
print(json.dumps({"ours": int(bad[0]), "uncorrected": int(bad[1]), "pairs": 2 * (LAST + 1)}))
'''


def _rn32(x: Fraction) -> Fraction:
    """x rounded once to fp32 (nearest, ties to even, subnormal spacing below 2^-126), exactly."""
    if x == 0:
        return x
    mag = abs(x)
    top = mag.numerator.bit_length() - mag.denominator.bit_length()
    top -= Fraction(2) ** top > mag
    ulp = Fraction(2) ** (max(top, -126) - 23)
    units = mag / ulp
    n = units.numerator // units.denominator
    n += (units - n > Fraction(1, 2)) or (units - n == Fraction(1, 2) and n % 2 == 1)
    return (n * ulp) if x > 0 else -(n * ulp)


def _f32_step(x: Fraction, toward: float) -> Fraction:
    """The fp32 next to fp32 x in the direction of `toward`."""
    return Fraction(float(np.nextafter(np.float32(x), np.float32(toward))))


def test_unit_quotient_rounds_like_ieee_division() -> None:
    """unit_quotient's sequence in exact arithmetic, each op rounded once to fp32: from any reciprocal seed
    within an ulp of 1/(1 + e) (whatever MUFU's last bit) it returns the correctly rounded (1 or e)/(1 + e);
    separating: without its correction step it misses some. The kernel itself is held to div.rn on a GPU."""
    rng = random.Random(11)
    es = [_rn32(Fraction(2.0 ** rng.uniform(-30, 0))) for _ in range(3000)]
    tiny = Fraction(2) ** -24
    es += [Fraction(0), Fraction(1), tiny, _f32_step(tiny, 1), Fraction(2) ** -149,
           _f32_step(Fraction(1), 0), Fraction(1, 2)]
    uncorrected_misses = 0
    for e in es:
        den = _rn32(1 + e)
        for num in (Fraction(1), e):
            want = _rn32(num / den)
            rcp = _rn32(1 / den)
            for seed in (_f32_step(rcp, 0), rcp, _f32_step(rcp, 2)):
                y = _rn32(seed * _rn32(1 - den * seed) + seed)
                q = _rn32(num * y)
                assert _rn32(y * _rn32(num - den * q) + q) == want, (e, num, seed)
                uncorrected_misses += q != want
    assert uncorrected_misses > 0


def _quotient_probe(tmp_path: Path, *args: str) -> dict[str, int]:
    script = tmp_path / "quotient.py"
    script.write_text(_QUOTIENT_PROBE)
    env = child_env({"CUTE_DSL_ARCH": "sm_90a"})
    proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, int] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.heavy
def test_quotient_probe_compiles(tmp_path: Path) -> None:
    """The GPU proof below compiles without a GPU, so a broken probe shows on CPU, not first on a lease."""
    assert _quotient_probe(tmp_path, "--compile-only") == {"compiled": True}


@pytest.mark.gpu
def test_sep_swiglu_fast_quotient_uncorrected(tmp_path: Path) -> None:
    """Separating: the refined reciprocal times num, uncorrected, misses div.rn.f32 on some of the 2^31
    (num, 1 + e) pairs the sigmoid divides (num 1 or e, e every fp32 in [0, 1]); unit_quotient misses none."""
    out = _quotient_probe(tmp_path)
    assert out["uncorrected"] > 0, out
    assert out["ours"] == 0, out
