"""The ping-pong fwd/dgrad schedule (each consumer warpgroup its own 128 x pingpong_bn(act) tile, epilogues
under the other's MMAs): every output bit equal to the cooperative 128 x 128 tile's, whose bounds
test_fast_gemm pins (the same K order per element), on ragged, skewed and empty routings, fused, gathered."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from test_fast_gemm import ROOT, child_env
from torch import Tensor

from nmoe.fast.dispatch import permute
from nmoe.fast.gemm import sm90
from nmoe.fast.limits import pingpong_bn

gpu = pytest.mark.gpu
PP = pingpong_bn("none")

# (rows, N, K, group sizes): even and uneven unit counts per CTA, empty and one-row groups, rows past the
# last end, ragged N and K (two K boxes, so the two warpgroups' epilogues overlap), many groups.
CASES = [
    (4096, 512, 1024, [512] * 8),
    (4000, 512, 1024, [1600, 900, 600, 400, 250, 150, 60, 40]),
    (585, 256, 128, [0, 1, 0, 0, 129, 1, 2, 127, 0, 1, 300, 0]),
    (556, 200, 72, [130, 0, 257, 3, 64]),
    (6000, 256, 256, [40] * 140 + [400]),
]
IDS = [f"M{c[0]}N{c[1]}K{c[2]}G{len(c[3])}" for c in CASES]


def _ends(counts: Sequence[int]) -> Tensor:
    return torch.tensor(torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def _inputs(m: int, n: int, k: int, groups: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(groups, n, k, generator=g) / k**0.5).to(torch.bfloat16).cuda()
    return x, w


def _both(a: Tensor, w: Tensor, offs: Tensor, width: int, w_k_major: bool, act: str = "none",
          act_width: int = 0) -> list[tuple[Tensor, ...]]:
    """(out[, act out]) of the cooperative 128-wide and the ping-pong (pingpong_bn(act)-wide) launch, outputs
    starting as NaN."""
    runs = []
    for pingpong in (False, True):
        out = torch.full((a.shape[0], width), float("nan"), dtype=torch.bfloat16, device="cuda")
        act_out = torch.full((a.shape[0], act_width), float("nan"), dtype=torch.bfloat16, device="cuda")
        sm90._launch("test", a, w, offs, out, w_k_major, pingpong_bn(act) if pingpong else 128,
                     act_out=act_out if act != "none" else None,
                     activation=act, pingpong=pingpong)
        runs.append((out, act_out) if act != "none" else (out,))
    return runs


def _same_bits(got: Sequence[Tensor], want: Sequence[Tensor]) -> None:
    torch.cuda.synchronize()
    for g, w in zip(got, want, strict=True):
        assert not bool(torch.isnan(g).any()), "an output element was never written"
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)), "ping-pong differs from cooperative"


def test_schedule_pingpong_tiles_are_192_wide() -> None:
    """128 with a fused activation, whose epilogue would spill at 192."""
    assert PP == 192
    assert sm90.schedule("op", 4096, 4096, None, True, act="swiglu") == (128, True)
    assert sm90.schedule("op", 4096, 512, act="relu2") == (128, True)
    with pytest.raises(ValueError, match="ping-pong tiles are 128 wide, not 192"):
        sm90.schedule("op", 4096, 512, 192, True, act="swiglu")
    assert sm90.schedule("op", 4096, 4096, None, True) == (192, True)
    assert sm90.schedule("op", 4096, 512, None, False) == (256, False)
    assert sm90.schedule("op", 4096, 512, 128, False) == (128, False)
    with pytest.raises(ValueError, match="ping-pong tiles are 192 wide, not 256"):
        sm90.schedule("op", 4096, 512, 256, True)
    default = (192, True) if sm90.GEMM_GATHER_PINGPONG else (256, False)
    assert sm90.schedule("op", 4096, 512, gathered=True) == default


def test_schedule_pingpong_by_reduction_length() -> None:
    """TMA-fed fwd/dgrad: ping-pong up to GEMM_PINGPONG_MAX_K (the down projection's K = I, the up dgrad's
    K = 2I), cooperative above it (K = H), unless a width other than the ping-pong tile's is asked for."""
    cap = sm90.GEMM_PINGPONG_MAX_K
    assert sm90.schedule("op", 4096, cap) == (PP, True)
    assert sm90.schedule("op", 4096, cap + 64) == (256, False)
    assert sm90.schedule("op", 4096, cap, PP) == (PP, True)
    assert sm90.schedule("op", 4096, cap, 128) == (128, False)
    assert sm90.schedule("op", 4096, cap, 256) == (256, False)


def test_pingpong_staging_order_is_not_the_flat_order(tmp_path: Path) -> None:
    """The separating fact for gemm.fast_pingpong_acc_order_flat: a ping-pong warpgroup's retiled accumulator
    does not list the epilogue's subtiles in order (the cooperative one does), traced in a fresh process."""
    script = textwrap.dedent("""
        from nmoe.fast import runtime
        runtime.import_cutlass("sm_90a")
        import cutlass.cute as cute
        import cutlass.utils.hopper_helpers as sm90_utils
        from cutlass import BFloat16, Float32
        from cutlass.tensor_utils import LayoutEnum
        from nmoe.fast.kernels.sm90 import epilogue as ep
        from nmoe.fast.kernels.sm90 import tiles as g
        from nmoe.fast.limits import pingpong_bn

        @cute.jit
        def main():
            major = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
            for pingpong, bn in ((False, 256), (True, pingpong_bn("none"))):
                mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, major, major, Float32,
                                                        (g.tile_wgs(pingpong), 1, 1), tiler_mn=(64, bn))
                stm = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), BFloat16)
                r2s = cute.make_tiled_copy_S(stm, cute.make_tiled_copy_C_atom(stm, mma))
                shape = mma.get_slice(0).partition_shape_C((g.BM, bn))
                order = ep.acc_order(mma, r2s, shape, g.tile_wgs(pingpong) * g.WG_THREADS)
                print("FLAT" if order == tuple(range(len(order))) else "PERMUTED", len(order))

        cute.compile(main)
    """)
    (tmp_path / "order.py").write_text(script)
    out = subprocess.run([sys.executable, str(tmp_path / "order.py")], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=child_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["FLAT", "128", "PERMUTED", str(PP)], out.stdout


@gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fwd_and_dgrad_pingpong_equal_the_cooperative_tile(case: tuple[int, int, int, list[int]]) -> None:
    m, n, k, counts = case
    x, w = _inputs(m, n, k, len(counts), seed=m + n)
    offs = _ends(counts)
    (co,), (pp,) = _both(x, w, offs, n, True)
    _same_bits((pp,), (co,))
    dy = torch.randn(m, n, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16).cuda()
    (co,), (pp,) = _both(dy, w, offs, k, False)
    _same_bits((pp,), (co,))


@gpu
@pytest.mark.parametrize("act", ["swiglu", "relu2"])
@pytest.mark.parametrize("case", CASES[1:4], ids=IDS[1:4])
def test_fused_activation_pingpong_equals_the_cooperative_tile(act: str,
                                                               case: tuple[int, int, int, list[int]]) -> None:
    m, n, k, counts = case
    x, w = _inputs(m, n, k, len(counts), seed=3 * m)
    co, pp = _both(x, w, _ends(counts), n, True, act, n // 2 if act == "swiglu" else n)
    _same_bits(pp, co)


@gpu
@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_gathered_pingpong_equals_the_cooperative_tile_on_permutes_copy(
        act: str, monkeypatch: pytest.MonkeyPatch) -> None:
    t, top_k, hid, n, e = 1000, 4, 1024, 768, 16
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, hid, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(e, n, hid, generator=g) / hid**0.5).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).cuda()
    p = permute(x, ids, e, 128)
    co = _both(p.xp, w, p.offs, n, True, act, n // 2 if act == "swiglu" else n)[0]
    monkeypatch.setattr(sm90, "GEMM_GATHER_PINGPONG", True)
    got_a, got_h = sm90.grouped_gemm_act_gathered(x, p.slot, top_k, w, p.offs, act)
    _same_bits((got_h, got_a), co)
    dy = torch.randn(t, n, generator=g).to(torch.bfloat16).cuda()
    rows = torch.where(p.slot >= 0, p.slot // top_k, 0)
    dy_copy = torch.where((p.slot >= 0)[:, None], dy[rows], torch.zeros_like(dy[rows]))
    (want_dx,) = _both(dy_copy, w, p.offs, hid, False)[0]
    _same_bits((sm90.grouped_gemm_dgrad_gathered(dy, p.slot, top_k, w, p.offs),), (want_dx,))


@gpu
def test_sep_gemm_fast_pingpong_acc_order_flat() -> None:
    """Staged in the retiled accumulator's flat order, a ping-pong tile's values land at other coordinates
    (test_pingpong_staging_order_is_not_the_flat_order); on exact data with every value of a tile distinct,
    any such move changes the output."""
    tile = 128
    # x = I, so y = w[0] exactly: w's PP x 128 values are distinct bf16 numbers (mantissa x binade).
    x = torch.eye(tile, dtype=torch.bfloat16, device="cuda")
    vals = torch.tensor([(1 + (i % 128) / 128) * 2.0 ** (i // 128 - 64) for i in range(PP * tile)])
    w = vals.reshape(1, PP, tile).to(torch.bfloat16).cuda()
    assert torch.unique(w.float()).numel() == PP * tile, "every value of the tile is distinct"
    (co,), (pp,) = _both(x, w, _ends([tile]), PP, True)
    _same_bits((pp,), (co,))
    assert torch.equal(pp, w[0].t().contiguous()), "y = I @ w^T exactly"


_TURNS_RUN = """
import torch
from nmoe.fast.gemm import sm90
g = torch.Generator().manual_seed(11)
x = torch.randn(4096, 1024, generator=g).to(torch.bfloat16).cuda()
w = (torch.randn(8, 1024, 1024, generator=g) / 32).to(torch.bfloat16).cuda()
offs = torch.arange(512, 4097, 512, dtype=torch.int32, device="cuda")
ys = []
for pingpong in (False, True):
    ys.append(torch.full((4096, 1024), float("nan"), dtype=torch.bfloat16, device="cuda"))
    bn = sm90.pingpong_bn("none") if pingpong else 128
    sm90._launch("test", x, w, offs, ys[-1], True, bn, pingpong=pingpong)
torch.cuda.synchronize()
print("SAME" if torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16)) else "DIFFERENT")
"""


@gpu
def test_sep_gemm_fast_pingpong_turns_dropped() -> None:
    """Without turns, a warpgroup that stepped over the other's unit waits on a stage whose previous fill
    has not arrived, and a parity wait takes it as full (wrong tiles, faults or a hang: run in a child with
    a deadline). Separating: CTAs hold two units each, of more K boxes than the ring has stages."""
    from nmoe.fast import runtime

    kernels = runtime.kernel_module("nmoe.fast.kernels.sm90.grouped_gemm", "sm_90a")
    clusters = sm90.fwd_ctas(0, 4096, 1024, 8, PP, 2) // 2
    units = 8 * (512 // 256) * -(-1024 // PP)
    assert units > clusters, "some CTA's second warpgroup has a unit of its own"
    assert kernels.stages_for(PP, "none", True) < 1024 // 64, "a unit's K boxes outnumber the stages"
    try:
        out = subprocess.run([sys.executable, "-c", _TURNS_RUN], capture_output=True, text=True, timeout=120,
                             cwd=ROOT, env=child_env())
    except subprocess.TimeoutExpired:
        pytest.fail("the ping-pong launch hung")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["SAME"], out.stdout
