"""nmoe.fast.combine against the spec nmoe.reference.combine: bitwise on sm_90a/sm_100a GPUs; argument
checks, custom-op fakes and the no-FMA PTX/SASS evidence on CPU (compiles are `heavy`).
"""

from __future__ import annotations

import math
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from fastcompile import tool
from torch import Tensor

from nmoe.fast import combine as fast
from nmoe.fast import compilecheck, runtime
from nmoe.fast.arch import SUPPORTED_ARCHS
from nmoe.fast.compilecheck import Selection
from nmoe.reference import combine as ref
from parity.compare import ulp_of

BF16 = torch.bfloat16


def _bits(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.int16 if t.dtype == BF16 else torch.int32)


def _same_bits(got: Tensor, want: Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = _bits(got) != _bits(want)
    idx = torch.nonzero(diff)
    assert not bool(diff.any()), f"{int(diff.sum())}/{diff.numel()} differ, first at {idx[0].tolist()}"


def _inputs(t: int, k: int, h: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(t, k, h, generator=g) * 2).to(BF16)
    w = torch.softmax(torch.randn(t, k, generator=g, dtype=torch.float64), -1).float()
    shared = torch.randn(t, h, generator=g).to(BF16)
    return y, w, shared


def _cuda(x: Tensor | None) -> Tensor | None:
    return None if x is None else x.cuda()


def _fwd_matches(y: Tensor, w: Tensor, scale: float, shared: Tensor | None) -> Tensor:
    got = fast.combine(y.cuda(), w.cuda(), scale, _cuda(shared)).cpu()
    _same_bits(got, ref.combine(y, w, scale, shared))
    return got


# ------------------------------------------------------------------------------------------------------
# CPU: argument checks, fakes, declared PTX contract


def test_cpu_tensors_raise_arch_error() -> None:
    y, w, _ = _inputs(2, 2, 8, 0)
    with pytest.raises(runtime.ArchError, match=r"nmoe\.reference"):
        fast.combine(y, w, 1.0)
    with pytest.raises(runtime.ArchError, match=r"nmoe\.reference"):
        fast.combine_bwd(torch.zeros(2, 8, dtype=BF16), y, w, 1.0)


@pytest.mark.parametrize(("y", "w", "shared", "match"), [
    (torch.zeros(2, 8, dtype=BF16), torch.zeros(2, 1), None, r"y \[T,K,H\]"),
    (torch.zeros(2, 3, 8, dtype=BF16), torch.zeros(2, 2), None, r"w \[T,K\]"),
    (torch.zeros(2, 0, 8, dtype=BF16), torch.zeros(2, 0), None, "K must be >= 1"),
    (torch.zeros(2, 3, 8), torch.zeros(2, 3), None, "cast y to bf16"),
    (torch.zeros(2, 3, 8, dtype=BF16), torch.zeros(2, 3, dtype=BF16), None, "w.float()"),
    (torch.zeros(2, 3, 8, dtype=BF16), torch.zeros(2, 3), torch.zeros(2, 4, dtype=BF16), "shared"),
])
def test_bad_arguments_raise_value_error(y: Tensor, w: Tensor, shared: Tensor | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fast.combine(y, w, 1.0, shared)


def test_bwd_bad_dout_raises() -> None:
    y, w, _ = _inputs(2, 2, 8, 0)
    with pytest.raises(ValueError, match="dout"):
        fast.combine_bwd(torch.zeros(2, 4, dtype=BF16), y, w, 1.0)


def test_fakes_give_shapes_on_meta() -> None:
    y = torch.empty(5, 3, 16, dtype=BF16, device="meta")
    w = torch.empty(5, 3, device="meta")
    assert fast.combine(y, w, 2.0, torch.empty(5, 16, dtype=BF16, device="meta")).shape == (5, 16)
    dy, dw, dsh = fast.combine_bwd(torch.empty(5, 16, dtype=BF16, device="meta"), y, w, 2.0)
    assert (dy.shape, dw.shape, dsh.shape) == ((5, 3, 16), (5, 3), (5, 16))
    assert (dy.dtype, dw.dtype) == (BF16, torch.float32)


def test_routed_scale_rounds_like_the_spec() -> None:
    for s in (0.1, 1 / 3, 2.5, 1e-40, 3.5e38, 1e39):
        assert fast._scale_f32(s) == float(torch.tensor(s, dtype=torch.float32))


def test_kernel_specs_forbid_fma_and_expect_rn() -> None:
    names = {"combine_fwd", "combine_fwd_k1", "combine_bwd", "combine_gather_fwd"}
    rows = {"expert_rows_bwd_swiglu", "expert_rows_bwd_relu2"}
    assert {s.name for s in fast.KERNELS} == names | rows
    ops = {"combine_bwd": "combine_bwd", "combine_gather_fwd": "combine_gather"}
    for spec in fast.KERNELS:
        if spec.name in rows:
            # libdevice expf (swiglu) holds fma.rn: the expert rows' pass keeps the activations' forbid list.
            assert spec.op == "moe_layer" and r"\bcvt\.rn\.bf16\.f32\b" in spec.expect["sm_100a"]
            assert any(re.search(rx, "mul.rn.ftz.f32 %r1") for rx in spec.forbid["sm_90a"])
            continue
        assert spec.op == ops.get(spec.name, "combine")
        for arch in SUPPORTED_ARCHS:
            assert fast.FORBID_FMA in spec.forbid[arch]
            assert r"mul\.rn\.f32" in spec.expect[arch]
    forbid = fast.KERNELS[0].forbid["sm_100a"]
    bad = ("fma.rn.f32 %r1, %r2, %r3, %r4;", "fma.f32 %r1", "fma.rn.f32x2 %rd1", "mul.f32 %r1", "add.f32 %r")
    for line in bad:
        assert any(re.search(rx, line) for rx in forbid), line
    for line in ("mul.rn.f32 %r1, %r2, %r3;", "add.rn.f32 %r1", "fma.rn.f64 %fd1"):
        assert not any(re.search(rx, line) for rx in forbid), line


@pytest.mark.heavy
@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_compiles_without_gpu_and_sass_has_no_ffma(arch: str) -> None:
    """PTX: declared expect/forbid rows are ok. SASS (ptxas + nvdisasm where installed): the combine sums
    have no FFMA or half FMA. ptxas's HFMA2 of zero registers (-RZ, RZ) only loads a constant, and the expert
    rows' activations keep libdevice expf's and the IEEE division's FFMAs, as their PTX forbid list allows."""
    with tempfile.TemporaryDirectory() as d:
        rows = compilecheck.compile_rows([arch], Selection(modules=("nmoe.fast.combine",), ptx_dir=d))
        assert [r["status"] for r in rows] == ["ok"] * len(fast.KERNELS), rows
        ptxas, nvdisasm = tool("ptxas"), tool("nvdisasm")
        if ptxas is None or nvdisasm is None:
            pytest.skip(f"PTX checked; SASS not checked: ptxas={ptxas} nvdisasm={nvdisasm} not both found")
        for spec in (s for s in fast.KERNELS if not s.name.startswith("expert_rows_bwd")):
            ptx, cubin = Path(d) / arch / f"{spec.name}.ptx", Path(d) / arch / f"{spec.name}.cubin"
            subprocess.run([ptxas, f"-arch={arch}", str(ptx), "-o", str(cubin)], check=True, timeout=300)
            sass = subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True, text=True,
                                  timeout=300).stdout
            assert re.search(r"\bFMUL", sass), f"{spec.name}: no FMUL in SASS"
            fmas = [ln for ln in sass.splitlines() if re.search(r"\b[FH]FMA", ln)
                    and not re.search(r"\bHFMA2(\.MMA)? R\d+, -RZ, RZ,", ln)]
            assert not fmas, f"{spec.name} ({arch}): SASS has an FMA: {fmas[:3]}"


# ------------------------------------------------------------------------------------------------------
# GPU: bitwise against the spec


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "k", "h", "with_shared", "scale"), [
    (1, 1, 8, False, 1.0), (7, 2, 64, True, 2.5), (33, 6, 2048, True, 0.3), (5, 8, 130, True, 2.5),
    (3, 3, 1, False, 1.7), (64, 8, 7168, True, 2.5), (300, 4, 512, False, 0.3),
])
def test_fwd_random_bitwise(t: int, k: int, h: int, with_shared: bool, scale: float) -> None:
    y, w, shared = _inputs(t, k, h, seed=t * 131 + k)
    _fwd_matches(y, w, scale, shared if with_shared else None)


def _specials(kind: str) -> list[float]:
    return {
        "nan": [math.nan, -math.nan],
        "inf": [math.inf, -math.inf],
        "denormal": [2.0**-130, -(2.0**-133), 2.0**-126, 9.2e-41],
        "max": [3.3895e38, -3.3895e38, 1.7e38],
        "zero": [0.0, -0.0],
    }[kind]


def _sprinkle(x: Tensor, values: list[float], g: torch.Generator, frac: float = 0.1) -> Tensor:
    x = x.clone()
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(frac * flat.numel()))]
    vals = torch.tensor(values, dtype=torch.float32)[torch.randint(len(values), (idx.numel(),), generator=g)]
    flat[idx] = vals.to(x.dtype)
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nan", "inf", "denormal", "max", "zero"])
def test_fwd_adversarial_bitwise(kind: str) -> None:
    g = torch.Generator().manual_seed(7)
    y, w, shared = _inputs(16, 4, 256, seed=11)
    y = _sprinkle(y, _specials(kind), g)
    shared = _sprinkle(shared, _specials(kind), g)
    w = _sprinkle(w, [*_specials(kind), 2.0**-140], g, frac=0.2)
    for scale in (2.5, 1e-30):
        _fwd_matches(y, w, scale, shared)
        _fwd_matches(y, w, scale, None)


@pytest.mark.gpu
def test_fwd_rounding_ties_hand_derived() -> None:
    """1 + 2^-8 and 1 + 3*2^-8 are bf16 ties: RNE gives 1 and 1 + 2^-6; -0 stays -0 without shared."""
    y = torch.tensor([[[1.0, 1.0, -0.0]], [[2.0**-8, 3 * 2.0**-8, -0.0]]]).transpose(0, 1).to(BF16)
    w = torch.ones(1, 2)
    got = _fwd_matches(y.contiguous(), w, 1.0, None)
    assert _bits(got).tolist() == _bits(torch.tensor([[1.0, 1 + 2.0**-6, -0.0]]).to(BF16)).tolist()


@pytest.mark.gpu
def test_fwd_edge_shapes_and_layouts() -> None:
    empty = fast.combine(torch.zeros(0, 4, 64, dtype=BF16, device="cuda"), torch.zeros(0, 4, device="cuda"),
                         2.0)
    assert empty.shape == (0, 64)
    assert fast.combine(torch.zeros(3, 2, 0, dtype=BF16, device="cuda"), torch.ones(3, 2, device="cuda"),
                        1.0).shape == (3, 0)
    y, w, shared = _inputs(9, 3, 96, seed=3)
    _fwd_matches(y[:1, :1], w[:1, :1], 2.5, shared[:1])
    # non-contiguous y and a 2-byte offset (no 128-bit vectors)
    yt = y.transpose(0, 1).contiguous().transpose(0, 1)
    got = fast.combine(yt.cuda(), w.cuda(), 2.5, shared.cuda()).cpu()
    _same_bits(got, ref.combine(y, w, 2.5, shared))
    buf = torch.empty(y.numel() + 1, dtype=BF16, device="cuda")
    ys = buf[1:].view(y.shape)
    ys.copy_(y.cuda())
    _same_bits(fast.combine(ys, w.cuda(), 2.5, shared.cuda()).cpu(), ref.combine(y, w, 2.5, shared))


@pytest.mark.gpu
def test_fwd_cuda_graph_replay() -> None:
    y, w, shared = _inputs(40, 6, 1024, seed=5)
    sy, sw, ss = y.cuda(), w.cuda(), shared.cuda()
    fast.combine(sy, sw, 2.5, ss)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fast.combine(sy, sw, 2.5, ss)
    for seed in (6, 7):
        y2, w2, sh2 = _inputs(40, 6, 1024, seed=seed)
        sy.copy_(y2)
        sw.copy_(w2)
        ss.copy_(sh2)
        graph.replay()
        torch.cuda.synchronize()
        _same_bits(out.cpu(), ref.combine(y2, w2, 2.5, sh2))


def _dw_within_bound(dw: Tensor, dout: Tensor, y: Tensor, w: Tensor, scale: float) -> None:
    """dw = sum_h g*y in fp32, order unpinned: |dw - dw64| <= ulp + 2*H*2^-24*sum|g*y| (g rounded first)."""
    g64 = (dout.float() * torch.tensor(scale, dtype=torch.float32)).double()
    prod = g64[:, None, :] * y.double()
    dw64, mag = prod.sum(-1), prod.abs().sum(-1)
    err = (dw.double() - dw64).abs()
    allowed = ulp_of(dw64, torch.float32) + 2 * y.shape[2] * 2.0**-24 * mag
    finite = torch.isfinite(dw64)
    assert bool((err[finite] <= allowed[finite]).all()), float((err / allowed)[finite].max())
    assert bool((torch.isnan(dw) == torch.isnan(dw64)).all())
    assert torch.equal(dw[~finite & ~torch.isnan(dw64)], dw64[~finite & ~torch.isnan(dw64)].float())


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "k", "h", "kind"), [
    (1, 1, 8, None), (13, 6, 2048, None), (5, 3, 130, None), (64, 8, 7168, None),
    (16, 4, 256, "nan"), (16, 4, 256, "inf"), (16, 4, 256, "denormal"), (16, 4, 256, "zero"),
])
def test_bwd_explicit_matches_spec(t: int, k: int, h: int, kind: str | None) -> None:
    y, w, dout = _inputs(t, k, h, seed=h + k)
    if kind is not None:
        g = torch.Generator().manual_seed(1)
        y, dout = _sprinkle(y, _specials(kind), g), _sprinkle(dout, _specials(kind), g)
    dy, dw, dsh = fast.combine_bwd(dout.cuda(), y.cuda(), w.cuda(), 2.5)
    rdy, _, rdsh = ref.combine_bwd(dout, y, w, 2.5)
    _same_bits(dy.cpu(), rdy)
    _same_bits(dsh.cpu(), rdsh)
    _dw_within_bound(dw.cpu(), dout, y, w, 2.5)


@pytest.mark.gpu
def test_bwd_edge_shapes() -> None:
    def zb(*shape: int) -> Tensor:
        return torch.zeros(*shape, dtype=BF16, device="cuda")

    dy, dw, _ = fast.combine_bwd(zb(0, 8), zb(0, 2, 8), torch.zeros(0, 2, device="cuda"), 1.0)
    assert dy.shape == (0, 2, 8) and dw.shape == (0, 2)
    dy, dw, _ = fast.combine_bwd(zb(3, 0), zb(3, 2, 0), torch.ones(3, 2, device="cuda"), 1.0)
    assert dy.shape == (3, 2, 0) and torch.equal(dw.cpu(), torch.zeros(3, 2))


@pytest.mark.gpu
def test_autograd_and_opcheck() -> None:
    y, w, shared = _inputs(10, 4, 320, seed=9)
    dout = torch.randn(10, 320, generator=torch.Generator().manual_seed(2)).to(BF16)
    yc, wc, sc = (x.cuda().requires_grad_() for x in (y, w, shared))
    out = fast.combine(yc, wc, 2.5, sc)
    torch.autograd.backward(out, dout.cuda())
    rdy, _, _ = ref.combine_bwd(dout, y, w, 2.5)
    assert yc.grad is not None and wc.grad is not None and sc.grad is not None
    _same_bits(yc.grad.cpu(), rdy)
    _same_bits(sc.grad.cpu(), dout)
    _dw_within_bound(wc.grad.cpu(), dout, y, w, 2.5)
    torch.library.opcheck(torch.ops.nmoe.combine.default, (y.cuda(), w.cuda(), 2.5, shared.cuda()))
    torch.library.opcheck(torch.ops.nmoe.combine_bwd.default, (dout.cuda(), y.cuda(), w.cuda(), 2.5))


# ------------------------------------------------------------------------------------------------------
# GPU: separating inputs for the fast-path mutations (correct and mutated formulas written here)


@pytest.mark.gpu
def test_sep_combine_fast_fma_contracted() -> None:
    """acc = -rn(w1*y1) exactly cancels rn(w1*y1); an FMA keeps the product's low bits instead."""
    g = torch.Generator().manual_seed(4)
    w1 = (0.5 + torch.rand(64, generator=g, dtype=torch.float64) / 2).float()
    y1 = (1 + torch.randint(0, 128, (64,), generator=g) * 2.0**-7 + 2.0**-7).to(BF16)
    exact = w1.double() * y1.double()
    keep = exact != exact.float().double()
    w1, y1, exact = w1[keep], y1[keep], exact[keep]
    n = w1.numel()
    w = torch.stack([-(exact.float()), w1], dim=1)
    y = torch.stack([torch.ones(n, dtype=BF16), y1], dim=1)[:, :, None].expand(n, 2, 8).contiguous()
    correct = ((w[:, 0] * y[:, 0, 0].float()) + (w[:, 1] * y[:, 1, 0].float())).to(BF16)
    fused = (exact - exact.float().double()).float().to(BF16)
    assert n > 32 and bool((_bits(correct) != _bits(fused)).all())
    got = _fwd_matches(y, w, 1.0, None)
    _same_bits(got[:, 0], correct)


@pytest.mark.gpu
def test_sep_combine_fast_scale_folded() -> None:
    """w1 = -(w0 + tiny): the sum cancels exactly before scaling; folded weights round first, keep noise."""
    g = torch.Generator().manual_seed(21)
    w0 = (0.5 + torch.rand(256, generator=g, dtype=torch.float64) / 2).float()
    w1 = -(w0.double() * (1 + 2.0**-20)).float()
    w = torch.stack([w0, w1], dim=1)
    y = torch.ones(256, 2, 8, dtype=BF16)
    s32 = torch.tensor(0.3, dtype=torch.float32)
    correct = ((w0 + w1) * s32).to(BF16)
    mutant = ((w0 * s32) + (w1 * s32)).to(BF16)
    assert int((_bits(correct) != _bits(mutant)).sum()) > 16
    got = _fwd_matches(y, w, 0.3, None)
    _same_bits(got[:, 0], correct)


@pytest.mark.gpu
def test_sep_combine_fast_bwd_scale_dropped() -> None:
    y, w, dout = _inputs(8, 3, 256, seed=22)
    gs = dout.float() * torch.tensor(2.5, dtype=torch.float32)
    correct = (gs[:, None, :] * w[:, :, None]).to(BF16)
    mutant = (dout.float()[:, None, :] * w[:, :, None]).to(BF16)
    assert bool((_bits(correct) != _bits(mutant)).any())
    dy, _, _ = fast.combine_bwd(dout.cuda(), y.cuda(), w.cuda(), 2.5)
    _same_bits(dy.cpu(), correct)
