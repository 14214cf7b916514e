"""bench/gemmplan.py on CPU: the grouped GEMM bench's shapes, group sizes, FLOP/byte counts, rep budget,
geomean and baseline call shapes are right before a GPU run spends time on them."""

from __future__ import annotations

import itertools

import pytest
import torch
from benchmod import load_bench

plan = load_bench("gemmplan")


@pytest.mark.parametrize("routing", ["uniform", "zipf1.2"])
@pytest.mark.parametrize("cfg", plan.CONFIGS)
def test_routed_counts_cover_every_row(cfg: tuple[int, ...], routing: str) -> None:
    t, _, _, e, k = cfg
    c = plan.routed_counts(t * k, e, routing)
    assert len(c) == e and sum(c) == t * k and min(c) > 0
    if routing == "uniform":
        assert max(c) - min(c) <= 1
    else:
        assert all(a >= b for a, b in itertools.pairwise(c))
        assert c[0] > 100 * c[-1]


def test_zipf_counts_follow_the_power_law() -> None:
    c = plan.routed_counts(1_000_000, 8, "zipf1.2")
    assert c[1] == pytest.approx(c[3] * (4 / 2) ** 1.2, rel=1e-4)
    assert plan.routed_counts(10, 4, "uniform") == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="routing"):
        plan.routed_counts(10, 4, "skewed")


def test_projection_dims_flops_and_bytes() -> None:
    cfg = plan.CONFIGS[0]
    assert plan.proj_dims(cfg, "up") == (262144, 2048, 4096)
    assert plan.proj_dims(cfg, "down") == (262144, 4096, 1024)
    with pytest.raises(ValueError, match="projection"):
        plan.proj_dims(cfg, "gate")
    m, n, k = plan.proj_dims(cfg, "up")
    assert plan.gemm_flops(m, n, k) == 4398046511104.0
    assert plan.pass_bytes(m, n, k, 128) == 5368709120.0
    assert plan.fp8_bytes(256, 256, 512, 2) == 256 * 512 + 2 * 256 * 512 + 256 * 4 + 2 * 2 * 4 + 2 * 256 * 256


def test_activation_shapes() -> None:
    cfg = plan.CONFIGS[1]
    assert plan.act_dims(cfg, "swiglu") == (196608, 512, 1536)
    assert plan.act_dims(cfg, "relu2") == (196608, 256, 1536)
    assert plan.act_out_cols("swiglu", 512) == 256 and plan.act_out_cols("relu2", 256) == 256
    assert plan.act_bytes("swiglu", 4, 8, 16, 2) == 2 * (4 * 16 + 2 * 8 * 16 + 4 * 4)
    with pytest.raises(ValueError, match="activation"):
        plan.act_dims(cfg, "gelu")


def test_timed_reps_and_input_copies() -> None:
    assert plan.timed_reps(0.5, 20, 3, 250.0) == 20
    assert plan.timed_reps(6.0, 20, 3, 250.0) == 13
    assert plan.timed_reps(100.0, 20, 3, 250.0) == 5
    assert plan.timed_reps(100.0, 3, 3, 250.0) == 3
    assert plan.timed_reps(0.0, 7, 3, 250.0) == 7
    assert plan.input_copies(600e6, 256 * 2**20) == 1
    assert plan.input_copies(100 * 2**20, 256 * 2**20) == 3


def test_geomean() -> None:
    assert plan.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert plan.geomean([1.2]) == pytest.approx(1.2)
    for bad in ([], [1.0, 0.0]):
        with pytest.raises(ValueError, match="geomean"):
            plan.geomean(bad)


@pytest.mark.parametrize("pass_", ["fwd", "dgrad", "wgrad"])
def test_baselines_match_our_output_shapes_and_flops(pass_: str) -> None:
    m, n, k, e = 64, 48, 32, 4
    meta = {"device": "meta", "dtype": torch.bfloat16}
    offs = torch.empty(e, device="meta", dtype=torch.int32)
    a = torch.empty(m, k if pass_ == "fwd" else n, **meta)
    b = torch.empty(m, k, **meta) if pass_ == "wgrad" else torch.empty(e, n, k, **meta)
    ours = {"fwd": (m, n), "dgrad": (m, k), "wgrad": (e, n, k)}[pass_]
    assert tuple(plan.grouped_mm(pass_, a, b, offs).shape) == ours
    dense = {"fwd": ((m, n), k), "dgrad": ((m, k), n), "wgrad": ((n, k), m)}[pass_]
    out = plan.dense_mm(pass_, a, b)
    assert tuple(out.shape) == dense[0]
    assert 2 * out.shape[0] * out.shape[1] * dense[1] == plan.gemm_flops(m, n, k)


def test_grouped_mm_wgrad_is_per_group_dy_t_x() -> None:
    g = torch.Generator().manual_seed(0)
    counts = [5, 0, 11, 16]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    dy = torch.randn(32, 16, generator=g).bfloat16()
    x = torch.randn(32, 24, generator=g).bfloat16()
    try:
        got = plan.grouped_mm("wgrad", dy, x, offs).float()
    except (NotImplementedError, RuntimeError) as err:
        pytest.skip(f"torch._grouped_mm has no CPU kernel in this torch: {err}")
    start = 0
    for i, end in enumerate(offs.tolist()):
        want = dy[start:end].float().t() @ x[start:end].float()
        torch.testing.assert_close(got[i], want, rtol=2e-2, atol=2e-2)
        start = end


@pytest.mark.parametrize("pass_", ["fwd", "dgrad", "wgrad"])
def test_batched_mm_is_each_equal_groups_own_product(pass_: str) -> None:
    m, n, k, e = 24, 8, 12, 3
    g = torch.Generator().manual_seed(1)
    a = torch.randn(m, k if pass_ == "fwd" else n, generator=g, dtype=torch.float64)
    b = torch.randn(m, k, generator=g, dtype=torch.float64) if pass_ == "wgrad" else \
        torch.randn(e, n, k, generator=g, dtype=torch.float64)
    got = plan.batched_mm(pass_, a, b, e)
    rows = m // e
    for i in range(e):
        ai = a[i * rows:(i + 1) * rows]
        if pass_ == "wgrad":
            want = ai.t() @ b[i * rows:(i + 1) * rows]
        else:
            want = ai @ (b[i].t() if pass_ == "fwd" else b[i])
        torch.testing.assert_close(got[i].reshape(want.shape), want)
    with pytest.raises(ValueError, match="uniform routing only"):
        plan.batched_mm(pass_, a[:m - 1], b[:m - 1] if pass_ == "wgrad" else b, e)


def test_fp8_dense_mm_is_the_scaled_product() -> None:
    """Tensor-wise on the CPU (torch's CPU _scaled_mm has no block scales): the e4m3 codes' own product."""
    torch.manual_seed(3)
    got = plan.fp8_dense_mm(8, 128, 256, "tensorwise", "cpu")()
    assert got.shape == (8, 128) and got.dtype == torch.bfloat16
    torch.manual_seed(3)
    a = torch.randn(8, 256).to(torch.float8_e4m3fn).double()
    b = torch.randn(128, 256).to(torch.float8_e4m3fn).double()
    torch.testing.assert_close(got.double(), (a @ b.t()).bfloat16().double(), rtol=2**-7, atol=0)


def test_fp8_dense_block_scales_are_outer_dim_major_per_block() -> None:
    sa, sb = plan.fp8_dense_scales(384, 512, 1024, "blockwise", "cpu")
    assert sa.shape == (384, 8) and sa.stride() == (1, 384)
    assert sb.shape == (8, 4) and sb.stride() == (1, 8)
    assert all(s.shape == () for s in plan.fp8_dense_scales(384, 512, 1024, "tensorwise", "cpu"))
    with pytest.raises(ValueError, match="unknown"):
        plan.fp8_dense_scales(1, 1, 1, "rowwise", "cpu")


def test_goal_summary_is_met_only_when_every_row_is() -> None:
    rule = "frac_of_dense >= 0.97"
    full = plan.goal_summary("g", [True, True], 2, rule)
    assert full["shapes_meeting_goal"] == 2 and full["goal"]["all_shapes_met"] is True
    assert plan.goal_summary("g", [True, False], 2, rule)["goal"]["all_shapes_met"] is False
    partial = plan.goal_summary("g", [True], 2, rule)
    assert partial["goal"]["all_shapes_met"] is None and partial["n_expected"] == 2
    wrong = plan.goal_summary("g", [True, None], 2, rule)
    assert wrong["goal"]["all_shapes_met"] is None and wrong["shapes_meeting_goal"] == 1
