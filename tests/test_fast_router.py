"""nmoe.fast.router (router_topk, expert_counts, bias_update) against the spec and an independent pinned-score
oracle."""

# torch's CPU sigmoid/softmax bits depend on the SIMD path and the element's position, so the spec and
# the kernel both score with a pinned formula (nmoe/reference/router.py::pinned_exp). Oracles: the spec,
# and an independent test-local oracle (pinned scores in torch fp32 ops + numpy lexsort selection).

from __future__ import annotations

import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from torch import Tensor

from nmoe.fast import router as fast
from nmoe.fast.arch import ArchError
from nmoe.reference import router as ref

ROOT = Path(__file__).resolve().parents[1]
gpu = pytest.mark.gpu
F32 = torch.float32
CANONICAL_NAN = 0x7FC00000


def _f32(bits: int) -> Tensor:
    return torch.tensor([bits], dtype=torch.int32).view(F32)[0]


LOG2E, LN2_HI, LN2_LO = _f32(0x3FB8AA3B), _f32(0x3F317200), _f32(0x35BFBE8E)
SHIFT = torch.tensor(12582912.0, dtype=F32)
TAYLOR = [torch.tensor(1.0 / m, dtype=F32) for m in (5040.0, 720.0, 120.0, 24.0, 6.0, 2.0)]
ONE = torch.tensor(1.0, dtype=F32)


def pinned_exp(x: Tensor) -> Tensor:
    xc = torch.clamp(x, -104.0, 89.0)
    nf = (xc * LOG2E + SHIFT) - SHIFT
    n = torch.nan_to_num(nf).to(torch.int32)
    r = (xc - nf * LN2_HI) - nf * LN2_LO
    q = TAYLOR[0].expand_as(r)
    for c in TAYLOR[1:]:
        q = q * r + c
    p = ONE + (r + (r * r) * q)
    a = n >> 1
    res = (p * ((a + 127) << 23).view(F32)) * ((n - a + 127) << 23).view(F32)
    res = torch.where(x < -104.0, 0.0, torch.where(x > 89.0, float("inf"), res))
    return torch.where(torch.isnan(x), x, res)


def pinned_scores(logits: Tensor, score_func: str) -> Tensor:
    if score_func == "sigmoid":
        return torch.div(ONE, ONE + pinned_exp(-logits))
    e = pinned_exp(logits - logits.amax(dim=-1, keepdim=True))
    total = torch.zeros(logits.shape[0], dtype=F32)
    for j in range(logits.shape[1]):
        total = total + e[:, j]
    return torch.div(e, total[:, None])


def _desc_order(v: np.ndarray) -> np.ndarray:
    """NaN first, then descending value, then ascending index (numpy lexsort: last key is primary)."""
    idx = np.broadcast_to(np.arange(v.shape[-1]), v.shape)
    return np.lexsort((idx, -v, ~np.isnan(v)), axis=-1)


def oracle_topk(logits: Tensor, bias: Tensor, k: int, score_func: str, n_groups: int = 1,
                topk_groups: int = 1) -> tuple[Tensor, Tensor]:
    scores = pinned_scores(logits, score_func).numpy()
    biased = scores + bias.numpy().astype(np.float32)
    t, e = biased.shape
    if n_groups > 1:
        g = np.sort(biased.reshape(t, n_groups, e // n_groups), axis=-1)
        gscore = g[..., -1] + g[..., -2]
        keep = np.zeros((t, n_groups), dtype=bool)
        np.put_along_axis(keep, _desc_order(gscore)[:, :topk_groups], True, axis=1)
        biased = np.where(np.repeat(keep, e // n_groups, axis=1), biased, np.float32(-np.inf))
    ids = _desc_order(biased)[:, :k]
    picked = np.take_along_axis(scores, ids, axis=1)
    denom = picked[:, 0].copy()
    for j in range(1, k):
        denom = denom + picked[:, j]
    with np.errstate(invalid="ignore", divide="ignore"):
        w = picked / denom[:, None]
    w = np.where(np.isnan(w), np.array([CANONICAL_NAN], dtype=np.int32).view(np.float32), w)
    return torch.from_numpy(np.ascontiguousarray(w)), torch.from_numpy(ids.astype(np.int64))


@cache
def agreeing_pool() -> Tensor:
    """fp32 logits whose torch sigmoid equals the pinned one on both the SIMD and the scalar path."""
    g = torch.Generator().manual_seed(1234)
    cand = torch.cat([torch.randn(8192, generator=g) * 3, torch.tensor([-100.0, -95.0, 0.0, 50.0, 120.0]),
                      torch.randint(-64, 64, (256,), generator=g).to(F32) / 8])
    vec = torch.sigmoid(cand)
    scalar = torch.stack([torch.sigmoid(v.reshape(1)) for v in cand]).reshape(-1)
    want = pinned_scores(cand[:, None], "sigmoid").reshape(-1)
    w = want.view(torch.int32)
    ok = (vec.view(torch.int32) == w) & (scalar.view(torch.int32) == w)
    return cand[ok]


def pool_logits(t: int, e: int, seed: int) -> Tensor:
    pool = agreeing_pool()
    g = torch.Generator().manual_seed(seed)
    return pool[torch.randint(0, pool.numel(), (t, e), generator=g)]


def _bits(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.int32)


def _assert_same(got: tuple[Tensor, Tensor], want: tuple[Tensor, Tensor]) -> None:
    w, i = got[0].cpu(), got[1].cpu()
    assert i.dtype == torch.int64 and w.dtype == F32
    rows = (i != want[1]).any(1).nonzero().view(-1)[:8].tolist()
    assert torch.equal(i, want[1]), f"ids differ in rows {rows}"
    bad = _bits(w) != _bits(want[0])
    assert not bool(bad.any()), f"weights differ at {bad.nonzero()[:8].tolist()}"


# ------------------------------------------------------------------ CPU: oracle and argument checks


def test_pinned_exp_is_within_1_1_ulp_of_exp() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(400_000, generator=g) * 175 - 87, torch.randn(100_000, generator=g)])
    got = pinned_exp(x).double()
    want = torch.exp(x.double())
    ulp = (torch.nextafter(want.float().abs(), torch.tensor(float("inf"))) - want.float().abs()).double()
    assert float(((got - want).abs() / ulp).max()) < 1.1
    special = torch.tensor([0.0, -0.0, float("-inf"), float("inf"), float("nan"), -104.5, 89.5, 88.7])
    got_sp = pinned_exp(special)
    assert got_sp[:2].tolist() == [1.0, 1.0] and got_sp[2] == 0.0 and got_sp[5] == 0.0
    assert torch.isinf(got_sp[3]) and torch.isinf(got_sp[6]) and torch.isnan(got_sp[4])
    assert torch.isfinite(got_sp[7])


def test_oracle_matches_reference_where_scores_agree() -> None:
    """The test oracle is itself checked against the spec on the agreeing-logit domain."""
    for e, k, ng, tg, seed in [(16, 4, 4, 2, 0), (40, 5, 1, 1, 1), (8, 8, 1, 1, 2), (32, 3, 8, 3, 3)]:
        logits = pool_logits(64, e, seed)
        bias = torch.randn(e, generator=torch.Generator().manual_seed(seed)) * 0.05
        want = ref.router_topk(logits, bias, k, "sigmoid", ng, tg)
        _assert_same(oracle_topk(logits, bias, k, "sigmoid", ng, tg), want)


@pytest.mark.parametrize("func", ["sigmoid", "softmax"])
def test_oracle_matches_reference_on_any_logits(func: str) -> None:
    """The independent test oracle and the spec agree bit for bit wherever the logits come from."""
    for e, k, ng, tg, seed in [(16, 4, 4, 2, 0), (40, 5, 1, 1, 1), (8, 8, 1, 1, 2), (32, 3, 8, 3, 3)]:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(64, e, generator=g) * 6
        bias = torch.randn(e, generator=g) * 0.05
        want = ref.router_topk(logits, bias, k, func, ng, tg)
        _assert_same(oracle_topk(logits, bias, k, func, ng, tg), want)


def test_agreeing_pool_is_large_and_covers_saturation() -> None:
    pool = agreeing_pool()
    assert pool.numel() > 2000
    assert bool((pool < -90).any()) and bool((pool > 40).any())


@pytest.mark.parametrize(
    ("shape", "k", "func", "ng", "tg", "match"),
    [((4,), 1, "sigmoid", 1, 1, "fp32 \\[T,E\\]"), ((2, 8), 9, "sigmoid", 1, 1, "k=9"),
     ((2, 8), 2, "relu", 1, 1, "score_func"), ((2, 8), 2, "sigmoid", 3, 1, "divide"),
     ((2, 8), 2, "sigmoid", 8, 1, "group size"), ((2, 8), 2, "sigmoid", 4, 5, "topk_groups"),
     ((2, 8), 5, "sigmoid", 4, 2, "k=5"), ((2, 2048), 2, "sigmoid", 1, 1, "E <= 1024"),
     ((2, 64), 33, "sigmoid", 1, 1, "k <= 32"), ((2, 128), 2, "sigmoid", 64, 2, "n_groups <= 32")],
)
def test_check_topk_args_rejects_like_the_spec(shape: tuple[int, ...], k: int, func: str, ng: int, tg: int,
                                               match: str) -> None:
    logits = torch.zeros(shape)
    with pytest.raises(ValueError, match=match):
        fast.check_topk_args(logits, torch.zeros(shape[-1]), k, func, ng, tg)


def test_check_topk_args_rejects_fp64_and_bad_bias() -> None:
    with pytest.raises(ValueError, match="float\\(\\)"):
        fast.check_topk_args(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(8), 2, "sigmoid", 1, 1)
    with pytest.raises(ValueError, match="bias"):
        fast.check_topk_args(torch.zeros(2, 8), torch.zeros(7), 2, "sigmoid", 1, 1)


def test_cpu_tensors_are_rejected_naming_the_reference() -> None:
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        fast.router_topk(torch.zeros(2, 8), torch.zeros(8), 2, "sigmoid")
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        fast.expert_counts(torch.zeros(2, 2, dtype=torch.int64), 8)
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        fast.bias_update(torch.zeros(8), torch.zeros(8, dtype=torch.int64), 1e-3, 1.0)


def test_kernel_specs_cover_both_archs() -> None:
    names = {s.name for s in fast.KERNELS}
    assert {"router_topk_sigmoid_e256_k8_g8", "router_topk_softmax_e64_k6", "expert_counts_e256"} <= names
    for s in fast.KERNELS:
        assert set(s.expect) == set(s.forbid) == {"sm_90a", "sm_100a"}


@pytest.mark.heavy
def test_kernels_compile_without_gpu() -> None:
    for arch, rows in compile_rows("nmoe.fast.router").items():
        assert_rows_ok(rows, arch, len(fast.KERNELS))


# ------------------------------------------------------------------ GPU: bitwise parity

CASES = [  # (T, E, k, n_groups, topk_groups)
    (1, 256, 8, 8, 4), (333, 256, 8, 8, 4), (1000, 64, 6, 1, 1), (17, 24, 3, 4, 2), (5, 8, 1, 1, 1),
    (129, 40, 5, 1, 1), (64, 1024, 32, 32, 4), (7, 32, 32, 1, 1), (50, 160, 4, 20, 3), (3, 2, 1, 1, 1),
]


def _bias(e: int, seed: int, kind: str) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "zipf":
        return -torch.log(torch.arange(1, e + 1, dtype=F32)) * 0.3
    return torch.randn(e, generator=g) * 0.05


@gpu
@pytest.mark.parametrize("bias_kind", ["random", "zipf"])
@pytest.mark.parametrize(("t", "e", "k", "ng", "tg"), CASES)
def test_topk_bitwise_vs_reference(t: int, e: int, k: int, ng: int, tg: int, bias_kind: str) -> None:
    logits = pool_logits(t, e, seed=t * 7 + e)
    bias = _bias(e, t + e, bias_kind)
    want = ref.router_topk(logits, bias, k, "sigmoid", ng, tg)
    _assert_same(fast.router_topk(logits.cuda(), bias.cuda(), k, "sigmoid", ng, tg), want)


@gpu
@pytest.mark.parametrize("func", ["sigmoid", "softmax"])
@pytest.mark.parametrize(("t", "e", "k", "ng", "tg"), CASES)
def test_topk_bitwise_vs_pinned_oracle(t: int, e: int, k: int, ng: int, tg: int, func: str) -> None:
    g = torch.Generator().manual_seed(e * 31 + k)
    logits = torch.randn(t, e, generator=g) * 4
    bias = _bias(e, t, "random")
    got = fast.router_topk(logits.cuda(), bias.cuda(), k, func, ng, tg)
    _assert_same(got, oracle_topk(logits, bias, k, func, ng, tg))


@gpu
@pytest.mark.parametrize("func", ["sigmoid", "softmax"])
def test_topk_adversarial_values(func: str) -> None:
    """Saturation, +-inf, exact ties, -inf biases and all-equal rows, with and without groups."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 64, generator=g).round()
    logits[0] = 0.0
    logits[1] = -200.0
    logits[2, ::3] = float("inf") if func == "sigmoid" else 80.0
    logits[3, ::5] = float("-inf")
    logits[4] = float("-inf")
    logits[5, 7] = float("inf")
    logits[6, :] = torch.arange(64, dtype=F32) % 4
    logits[7] = 1e-40
    bias = torch.zeros(64)
    bias[10] = float("-inf")
    bias[20] = 3.0
    for ng, tg, k in [(1, 1, 8), (8, 2, 8), (16, 16, 6), (1, 1, 1)]:
        got = fast.router_topk(logits.cuda(), bias.cuda(), k, func, ng, tg)
        _assert_same(got, oracle_topk(logits, bias, k, func, ng, tg))


@gpu
@pytest.mark.parametrize("func", ["sigmoid", "softmax"])
@pytest.mark.parametrize(("t", "e", "k", "ng", "tg"), CASES)
def test_topk_bitwise_vs_reference_on_any_logits(t: int, e: int, k: int, ng: int, tg: int, func: str) -> None:
    """The spec pins the score formula, so ids and weights match it bit for bit on arbitrary logits."""
    g = torch.Generator().manual_seed(e * 17 + k)
    logits = torch.randn(t, e, generator=g) * 4
    bias = _bias(e, t + 1, "random")
    want = ref.router_topk(logits, bias, k, func, ng, tg)
    _assert_same(fast.router_topk(logits.cuda(), bias.cuda(), k, func, ng, tg), want)


@gpu
def test_ties_break_to_lower_id_in_experts_and_groups() -> None:
    logits = torch.zeros(3, 64)
    got_w, got_i = fast.router_topk(logits.cuda(), torch.zeros(64).cuda(), 4, "sigmoid")
    assert got_i.cpu().tolist() == [[0, 1, 2, 3]] * 3
    assert got_w.cpu().eq(0.25).all()
    _, gi = fast.router_topk(logits.cuda(), torch.zeros(64).cuda(), 4, "sigmoid", 8, 2)
    assert gi.cpu().tolist() == [[0, 1, 2, 3]] * 3


def _tied_top() -> None:
    """Experts 3 and 35 (one lane's) and 40 (another lane's) tie on top: the lowest id goes first, both
    within a lane (_beats) and across lanes (the warp's id reduction); highest first would pick 40, 35."""
    logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(77))
    logits[:, 40] = logits[:, 35] = logits[:, 3] = 60.0
    bias = torch.zeros(64)
    correct = oracle_topk(logits, bias, 2, "sigmoid")[1]
    ids_desc = -np.arange(64)[None, :].repeat(16, 0)
    high_first = np.lexsort((ids_desc, -pinned_scores(logits, "sigmoid").numpy()))
    mutated = torch.from_numpy(high_first[:, :2].astype(np.int64))
    assert correct.eq(torch.tensor([3, 35])).all() and mutated.eq(torch.tensor([40, 35])).all()
    assert torch.equal(fast.router_topk(logits.cuda(), bias.cuda(), 2, "sigmoid")[1].cpu(), correct)


@gpu
def test_sep_router_fast_tie_breaks_high() -> None:
    _tied_top()


@gpu
def test_sep_router_fast_redux_tie_high() -> None:
    _tied_top()


@gpu
def test_sep_router_fast_group_top1_only() -> None:
    """Group 0 holds the best expert but its top-2 sum ranks below groups 1 and 2."""
    logits = torch.tensor([[3.0, -3.0, 1.0, 1.0, 1.2, 0.9, -5.0, -5.0]])
    bias = torch.zeros(8)
    s = pinned_scores(logits, "sigmoid")[0]
    top2 = [float(s[2 * g] + s[2 * g + 1]) for g in range(4)]
    top1 = [float(max(s[2 * g], s[2 * g + 1])) for g in range(4)]
    assert sorted(range(4), key=lambda g: -top2[g])[:2] != sorted(range(4), key=lambda g: -top1[g])[:2]
    want = oracle_topk(logits, bias, 2, "sigmoid", 4, 2)
    assert want[1].tolist() == ref.router_topk(logits, bias, 2, "sigmoid", 4, 2)[1].tolist() == [[4, 2]]
    _assert_same(fast.router_topk(logits.cuda(), bias.cuda(), 2, "sigmoid", 4, 2), want)


@gpu
def test_sep_router_fast_weights_biased() -> None:
    logits = pool_logits(32, 16, seed=3)
    bias = torch.linspace(-0.5, 0.5, 16)
    w, ids = oracle_topk(logits, bias, 4, "sigmoid")
    biased_w = torch.gather(pinned_scores(logits, "sigmoid") + bias, 1, ids)
    biased_w = biased_w / biased_w.sum(1, keepdim=True)
    assert not torch.equal(w, biased_w)
    _assert_same(fast.router_topk(logits.cuda(), bias.cuda(), 4, "sigmoid"), (w, ids))


@gpu
def test_bias_update_makes_no_host_sync() -> None:
    bias, counts = torch.zeros(64).cuda(), torch.randint(0, 100, (64,)).cuda()
    fast.bias_update(bias, counts, 1e-3, 1.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast.bias_update(bias, counts, 1e-3, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
def test_router_makes_no_host_sync() -> None:
    logits = torch.randn(512, 256).cuda()
    bias = torch.zeros(256).cuda()
    fast.router_topk(logits, bias, 8, "sigmoid", 8, 4)
    fast.expert_counts(torch.zeros(4, 2, dtype=torch.int64).cuda(), 256)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, ids = fast.router_topk(logits, bias, 8, "sigmoid", 8, 4)
        fast.expert_counts(ids, 256)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
def test_custom_ops_pass_opcheck() -> None:
    logits = torch.randn(33, 64).cuda()
    bias = torch.randn(64).cuda() * 0.01
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.nmoe.router_topk.default, (logits, bias, 6, "sigmoid", 4, 2),
                          test_utils=tests)
    ids = torch.randint(0, 64, (33, 6)).cuda()
    torch.library.opcheck(torch.ops.nmoe.expert_counts.default, (ids, 64), test_utils=tests)


@gpu
@pytest.mark.parametrize(("t", "k", "e", "dtype", "kind"), [
    (1, 1, 1, torch.int64, "uniform"), (1000, 8, 256, torch.int64, "zipf"),
    (513, 6, 64, torch.int32, "uniform"), (4096, 8, 1024, torch.int64, "one"),
    (0, 4, 8, torch.int64, "uniform"), (3000, 2, 16, torch.int32, "empty"),
])
def test_expert_counts_bitwise_vs_reference(t: int, k: int, e: int, dtype: torch.dtype, kind: str) -> None:
    g = torch.Generator().manual_seed(t + e)
    if kind == "zipf":
        p = 1.0 / torch.arange(1, e + 1, dtype=torch.float64)
        ids = torch.multinomial(p, t * k, replacement=True, generator=g).view(t, k)
    elif kind == "one":
        ids = torch.full((t, k), e - 1)
    elif kind == "empty":
        ids = torch.randint(0, e // 2, (t, k), generator=g) * 2
    else:
        ids = torch.randint(0, e, (t, k), generator=g)
    ids = ids.to(dtype)
    got = fast.expert_counts(ids.cuda(), e).cpu()
    assert got.dtype == torch.int64 and torch.equal(got, ref.expert_counts(ids, e))


def _run_expecting_abort(code: str, message: str) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode != 0, out.stdout + out.stderr
    assert message in out.stdout + out.stderr, out.stdout + out.stderr


@gpu
def test_nan_logits_abort_the_kernel_like_the_spec_raises() -> None:
    with pytest.raises(ValueError, match="NaN"):
        ref.router_topk(torch.tensor([[0.0, float("nan")]]), torch.zeros(2), 1, "sigmoid")
    _run_expecting_abort("""
        import torch
        from nmoe.fast.router import router_topk
        lg = torch.zeros(4, 64, device="cuda"); lg[2, 9] = float("nan")
        router_topk(lg, torch.zeros(64, device="cuda"), 2, "sigmoid")
        torch.cuda.synchronize()
    """, "NaN in logits row 2")


@gpu
def test_expert_counts_out_of_range_aborts_like_the_spec_raises() -> None:
    with pytest.raises(ValueError, match=r"outside|lie in"):
        ref.expert_counts(torch.tensor([[5]]), 5)
    _run_expecting_abort("""
        import torch
        from nmoe.fast.router import expert_counts
        expert_counts(torch.tensor([[1, 5]], device="cuda"), 5)
        torch.cuda.synchronize()
    """, "expert id 5 of slot 1")
