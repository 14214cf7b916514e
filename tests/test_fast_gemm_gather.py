"""The gathered up projection (nmoe.fast.gemm.sm90.grouped_gemm_act_gathered): A rows read by 16-byte cp.async
straight from the token rows permute names, never copied. Its contract is the fused kernel's on permute's
copy: every output bit equal (same MMA order per row), pad and tail rows zero. Argument checks need no GPU."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from test_fast_gather_queue import pipeline_finishes
from test_fast_gemm import into_nan
from torch import Tensor

from nmoe.fast import limits
from nmoe.fast.dispatch import permute
from nmoe.fast.gemm import sm90
from nmoe.fast.kernels.sm90 import gatherplan

gpu = pytest.mark.gpu

# (tokens, top_k, K = hidden, N = up width, experts, align, activation, routing): K = 288 leaves a 32-column
# tail in the last box (TMA's zero fill in the fwd, the zero chunk in the wgrad); "skew" empties some experts.
CASES = [
    (300, 4, 288, 256, 8, 128, "swiglu", "uniform"),
    (1000, 2, 512, 384, 16, 16, "relu2", "skew"),
    (64, 6, 2048, 1024, 64, 128, "swiglu", "skew"),
    (5, 1, 64, 128, 4, 128, "relu2", "uniform"),
]


def _ids(t: int, k: int, e: int, routing: str, g: torch.Generator) -> Tensor:
    if routing == "uniform":
        return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.tensor([2.0 ** -(i // 2) if i % 3 else 0.0 for i in range(e)])
    weights[0] = 1.0
    return torch.stack([torch.multinomial(weights, k, replacement=False, generator=g) for _ in range(t)])


@gpu
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}K{c[1]}H{c[2]}N{c[3]}E{c[4]}-{c[6]}" for c in CASES])
def test_gathered_up_projection_equals_the_fused_kernel_on_permutes_copy(
        case: tuple[int, int, int, int, int, int, str, str]) -> None:
    t, k, hid, n, e, align, act, routing = case
    g = torch.Generator().manual_seed(t * 7 + e)
    x = torch.randn(t, hid, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(e, n, hid, generator=g) / hid**0.5).to(torch.bfloat16).cuda()
    ids = _ids(t, k, e, routing, g).cuda()
    p = permute(x, ids, e, align)
    want_a, want_h = sm90.grouped_gemm_act_h(p.xp, w, p.offs, act)
    got_a, got_h = sm90.grouped_gemm_act_gathered(x, p.slot, k, w, p.offs, act)
    torch.cuda.synchronize()
    pads = int((p.slot < 0).sum())
    assert pads > 0 or align == 16, "the case has pad rows"
    assert torch.equal(got_h.view(torch.int16), want_h.view(torch.int16)), "h differs from the TMA path"
    assert torch.equal(got_a.view(torch.int16), want_a.view(torch.int16)), "act(h) differs from the TMA path"
    assert torch.all(got_h[p.slot < 0] == 0), "pad rows must be zero"


@gpu
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}K{c[1]}H{c[2]}N{c[3]}E{c[4]}-{c[6]}" for c in CASES])
def test_act_only_epilogue_stores_the_same_act_and_no_h(case: tuple[int, int, int, int, int, int, str, str]
                                                        ) -> None:
    """keep_h False (no backward to come): act(h) bit for bit the full epilogue's, h [0, N] never written."""
    t, k, hid, n, e, align, act, routing = case
    g = torch.Generator().manual_seed(t * 5 + e)
    x = torch.randn(t, hid, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(e, n, hid, generator=g) / hid**0.5).to(torch.bfloat16).cuda()
    p = permute(x.new_empty(t, 0), _ids(t, k, e, routing, g).cuda(), e, align)
    want, _ = sm90.grouped_gemm_act_gathered(x, p.slot, k, w, p.offs, act)
    got, h = sm90.grouped_gemm_act_gathered(x, p.slot, k, w, p.offs, act, keep_h=False)
    torch.cuda.synchronize()
    assert h.shape == (0, n)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "act(h) differs from the full epilogue"


@gpu
def test_sep_gemm_fast_act_only_act_store_dropped() -> None:
    """Full tiles' act(h) leaves by TMA: an act-only epilogue dropping that store too leaves a as torch.empty
    found it, here a block filled with NaN just before (the caching allocator hands the same block back)."""
    t, k, hid, n, e = 512, 2, 256, 256, 4
    x = torch.randn(t, hid, device="cuda").to(torch.bfloat16)
    w = (torch.randn(e, n, hid, device="cuda") / hid**0.5).to(torch.bfloat16)
    p = permute(x.new_empty(t, 0), torch.arange(t * k, device="cuda").view(t, k) % e, e, 128)
    want, _ = sm90.grouped_gemm_act_gathered(x, p.slot, k, w, p.offs, "swiglu")
    assert not want.isnan().any(), "the unwritten (NaN) result and the kernel's must differ"
    got, _ = into_nan([tuple(want.shape)],
                      lambda: sm90.grouped_gemm_act_gathered(x, p.slot, k, w, p.offs, "swiglu", keep_h=False))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@gpu
def test_gathered_up_projection_reads_x_in_place_without_a_sync() -> None:
    """No permuted copy of x: the call allocates only h and act(h), and never waits on the GPU."""
    t, k, hid, n, e = 512, 4, 1024, 512, 16
    x = torch.randn(t, hid, device="cuda").to(torch.bfloat16)
    w = torch.randn(e, n, hid, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, e, (t, k), device="cuda")
    p = permute(x.new_empty(t, 0), ids, e, 128)
    sm90.grouped_gemm_act_gathered(x, p.slot, k, w, p.offs, "swiglu")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        a, h = sm90.grouped_gemm_act_gathered(x, p.slot, k, w, p.offs, "swiglu")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    grown = torch.cuda.memory_allocated() - before
    assert grown <= (a.numel() + h.numel()) * 2 + 4096, f"{grown} bytes allocated beyond h and act(h)"


def test_gathered_up_projection_refuses_bad_arguments() -> None:
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    offs = torch.tensor([128, 256], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"need int64 slot \[R\]"):
        sm90.grouped_gemm_act_gathered(x, torch.zeros(256, dtype=torch.int32), 2, w, offs, "swiglu")
    with pytest.raises(ValueError, match="top_k >= 1"):
        sm90.grouped_gemm_act_gathered(x, torch.zeros(256, dtype=torch.int64), 0, w, offs, "swiglu")
    with pytest.raises(ValueError, match=r"need x \[T, K\] and w \[E, N, K\]"):
        sm90.grouped_gemm_act_gathered(x[:, :32], torch.zeros(256, dtype=torch.int64), 2, w, offs, "swiglu")
    with pytest.raises(ValueError, match="activation 'none' unknown"):
        sm90.grouped_gemm_act_gathered(x, torch.zeros(256, dtype=torch.int64), 2, w, offs, "none")


def _pair(t: int, k: int, hid: int, n: int, e: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(slot, gathered h, TMA-path h) for x on the GPU, uniform routing, swiglu."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(e, n, hid, generator=g) / hid**0.5).to(torch.bfloat16).cuda()
    p = permute(x, _ids(t, k, e, "uniform", g).cuda(), e, 128)
    _, want = sm90.grouped_gemm_act_h(p.xp, w, p.offs, "swiglu")
    _, got = sm90.grouped_gemm_act_gathered(x, p.slot, k, w, p.offs, "swiglu")
    torch.cuda.synchronize()
    return p.slot, got, want


def _assert_off_by_one_separates(slot: Tensor, x: Tensor, k: int) -> None:
    """Some real row's slot + 1 is still a real slot of the next token, whose row differs: reading slot + 1's
    token changes that row."""
    real = slot[slot >= 0]
    shifted = real[((real % k) == k - 1) & (real + 1 < x.shape[0] * k)]
    assert shifted.numel() > 0, "some row's slot + 1 names the next token"
    assert not torch.equal(x[shifted // k], x[(shifted + 1) // k]), "and that token's row differs"


@gpu
def test_sep_gemm_fast_gather_unswizzled() -> None:
    t, k = 64, 2
    x = torch.randn(t, 256).to(torch.bfloat16).cuda()
    chunks = x.view(t, -1, 8)
    assert not torch.equal(chunks[:, 0], chunks[:, 1]), (
        "16-byte chunks of a row differ, so the gathered wgrad's chunk c placed at c instead of "
        "c ^ (row % 8) changes what the tensor cores read for 7 rows of every 8")
    _, got, want = _wgrad_pair(t, k, 256, 256, 4, x)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@gpu
def test_sep_gemm_fast_gather_k_tail_unmasked() -> None:
    """K = 288: the last box's columns 288..319 of token t's row are, in memory, token t + 1's first 32
    columns. With those infinite, a kernel reading them (times B's zero-filled columns) makes NaN in token
    t's rows; the producer's zero fill past K (source size 0) keeps them finite and equal to the TMA path."""
    t, k, hid = 64, 2, 288
    x = torch.randn(t, hid).to(torch.bfloat16)
    x[1::2, :32] = float("inf")
    x = x.cuda()
    assert torch.isinf(x.view(-1)[hid:hid + 32]).all(), "token 0's row is followed by infinite columns"
    slot, got, want = _pair(t, k, hid, 256, 4, x)
    even = (slot >= 0) & ((slot // k) % 2 == 0)
    assert torch.isfinite(want[even].float()).all(), "the TMA path keeps the even tokens' rows finite"
    assert torch.equal(got[even].view(torch.int16), want[even].view(torch.int16))


def _assert_pad_rows_zero(pair: Callable[..., tuple[Tensor, Tensor, Tensor]]) -> None:
    """Pad rows (slot -1) exist and token 0 is nonzero, so a pad row read as token 0's row changes the
    gathered result against the kernel on permute's copy."""
    t, k = 40, 3
    x = torch.randn(t, 256).to(torch.bfloat16).cuda()
    slot, got, want = pair(t, k, 256, 256, 4, x)
    assert int((slot < 0).sum()) > 0 and bool(x[0].abs().sum() > 0), "pad rows exist and token 0 is nonzero"
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@gpu
def test_sep_gemm_fast_gather_pad_rows_read() -> None:
    """Read as token 0's row, a pad row of the gathered h holds x_0 @ w_e^T instead of zeros."""
    _assert_pad_rows_zero(_pair)


@gpu
def test_sep_gemm_fast_gather_token_lane() -> None:
    """Tile row p // 8 + 16 i copied from the token looked up for row p // 8 + 16 (i + 1): every token routed
    to both of two experts, the first tile's 128 rows are real and rows 16 apart name different tokens."""
    t, k = 256, 2
    x = torch.randn(t, 256).to(torch.bfloat16).cuda()
    slot, got, want = _pair(t, k, 256, 256, 2, x)
    real = slot[:128]
    assert bool((real >= 0).all()) and bool((real[:-16] // k != real[16:] // k).any()), (
        "rows 16 apart in the first tile name different tokens")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_producer_rows_cover_every_tile_row_once() -> None:
    """The producer's map (gatherplan, traced by the kernel): its threads' rows at their chunk columns tile a
    stage's 128 x 8 chunks once each, and every thread's i-th row is the one the lane it reads the token from
    looked up."""
    per_row, threads = gatherplan.ROW_CHUNKS, gatherplan.PRODUCER_THREADS
    rows = range(gatherplan.ROWS_PER_THREAD)
    seen = [(gatherplan.copied_row(p, i), p % per_row) for p in range(threads) for i in rows]
    assert sorted(seen) == [(r, c) for r in range(128) for c in range(per_row)]
    for p in range(threads):
        lane = p % 32
        for i in rows:
            src = p - lane + gatherplan.copied_lane(lane, i)
            assert gatherplan.copied_lookup(src) == gatherplan.copied_row(p, i), (p, i)


def _wgrad_pair(t: int, k: int, hid: int, n: int, e: int, x: Tensor, routing: str = "uniform",
                align: int = 128) -> tuple[Tensor, Tensor, Tensor]:
    """(slot, gathered dw, dw on permute's copy) for x with a random dy (pad rows too) on the GPU."""
    g = torch.Generator().manual_seed(1)
    p = permute(x, _ids(t, k, e, routing, g).cuda(), e, align)
    dy = torch.randn(p.xp.shape[0], n, generator=g).to(torch.bfloat16).cuda()
    want = sm90.grouped_gemm_wgrad(dy, p.xp, p.offs)
    got = sm90.grouped_gemm_wgrad_gathered(dy, x, p.slot, k, p.offs)
    torch.cuda.synchronize()
    return p.slot, got, want


@gpu
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}K{c[1]}H{c[2]}N{c[3]}E{c[4]}" for c in CASES])
def test_gathered_wgrad_equals_the_wgrad_on_permutes_copy(
        case: tuple[int, int, int, int, int, int, str, str]) -> None:
    t, k, hid, n, e, align, _, routing = case
    x = torch.randn(t, hid, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).cuda()
    _, got, want = _wgrad_pair(t, k, hid, n, e, x, routing, align)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "dw differs from the TMA path"


@gpu
def test_sep_gemm_fast_wgrad_gather_row_off_by_one() -> None:
    t, k = 64, 2
    x = torch.randn(t, 256).to(torch.bfloat16).cuda()
    slot, got, want = _wgrad_pair(t, k, 256, 256, 4, x)
    _assert_off_by_one_separates(slot, x, k)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@gpu
def test_sep_gemm_fast_wgrad_gather_pad_rows_read() -> None:
    """Pad rows carry dy values here: read as token 0's row instead of zeros they add dy_pad^T x_0."""
    _assert_pad_rows_zero(_wgrad_pair)


@gpu
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}K{c[1]}H{c[2]}N{c[3]}E{c[4]}" for c in CASES])
def test_gathered_dgrad_and_dy_side_wgrad_equal_the_kernels_on_permutes_copy(
        case: tuple[int, int, int, int, int, int, str, str]) -> None:
    """The down projection's backward from the token-major dout: dz = dout[slot // K] @ w2[e] and
    dw2[e] = dout[slot // K]^T @ a, bit for bit those of permute's copy of dout."""
    t, k, hid, inter, e, align, _, routing = case
    g = torch.Generator().manual_seed(t + 5)
    dout = torch.randn(t, hid, generator=g).to(torch.bfloat16).cuda()
    w2 = (torch.randn(e, hid, inter, generator=g) / inter**0.5).to(torch.bfloat16).cuda()
    p = permute(dout, _ids(t, k, e, routing, g).cuda(), e, align)
    a = torch.randn(p.xp.shape[0], inter, generator=g).to(torch.bfloat16).cuda()
    want_dz = sm90.grouped_gemm_dgrad(p.xp, w2, p.offs)
    want_dw = sm90.grouped_gemm_wgrad(p.xp, a, p.offs)
    got_dz = sm90.grouped_gemm_dgrad_gathered(dout, p.slot, k, w2, p.offs)
    got_dw = sm90.grouped_gemm_wgrad_gathered(dout, a, p.slot, k, p.offs, side="dy")
    torch.cuda.synchronize()
    assert torch.equal(got_dz.view(torch.int16), want_dz.view(torch.int16)), "dz differs from the TMA path"
    assert torch.equal(got_dw.view(torch.int16), want_dw.view(torch.int16)), "dw2 differs from the TMA path"


def _spilled(t: int, k: int, hid: int, inter: int, e: int, align: int,
             routing: str) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """(gathered dgrad's dz, the spilling one's dz and dyp, permute's copy of dout, offs[-1]) on the GPU;
    dyp in a block the allocator held NaN in, so rows past offs[-1] (unwritten) are NaN."""
    g = torch.Generator().manual_seed(t + hid)
    dout = torch.randn(t, hid, generator=g).to(torch.bfloat16).cuda()
    w2 = (torch.randn(e, hid, inter, generator=g) / inter**0.5).to(torch.bfloat16).cuda()
    p = permute(dout, _ids(t, k, e, routing, g).cuda(), e, align)
    want = sm90.grouped_gemm_dgrad_gathered(dout, p.slot, k, w2, p.offs)
    got, dyp = into_nan([(p.xp.shape[0], hid), tuple(want.shape)],
                        lambda: sm90.grouped_gemm_dgrad_gathered_spill(dout, p.slot, k, w2, p.offs))
    return want, got, dyp, p.xp, int(p.offs[-1])


@gpu
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}K{c[1]}H{c[2]}N{c[3]}E{c[4]}" for c in CASES])
def test_spilling_dgrad_writes_permutes_copy_of_dout(case: tuple[int, int, int, int, int, int, str, str]
                                                     ) -> None:
    """The spilling dgrad: dz bit for bit the gathered dgrad's, dyp up to offs[-1] permute's copy of dout
    (pad rows zero), and the TMA wgrad on dyp bit for bit the one on permute's copy (rows past offs[-1],
    NaN, unread)."""
    t, k, hid, inter, e, align, _, routing = case
    want, got, dyp, xp, end = _spilled(t, k, hid, inter, e, align, routing)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "dz differs from the gathered dgrad's"
    assert torch.equal(dyp[:end].view(torch.int16), xp[:end].view(torch.int16)), "dyp is not permute's copy"
    a = torch.randn(xp.shape[0], inter, device="cuda").to(torch.bfloat16)
    offs = torch.tensor([end], dtype=torch.int32, device="cuda")
    if end < xp.shape[0]:
        assert dyp[end:].isnan().all(), "rows past offs[-1] stay unwritten (NaN here)"
    want_dw = sm90.grouped_gemm_wgrad(xp, a, offs)
    got_dw = sm90.grouped_gemm_wgrad(dyp, a, offs)
    assert torch.equal(got_dw.view(torch.int16), want_dw.view(torch.int16)), "dw on dyp differs"


@gpu
def test_sep_gemm_fast_dgrad_spill_unswizzled() -> None:
    """Chunk c of a row read from the stage at c instead of c ^ (row % 8): rows' 16-byte chunks differ, so 7
    rows of every 8 leave with their chunks shuffled."""
    _, _, dyp, xp, end = _spilled(200, 2, 256, 256, 4, 128, "uniform")
    chunks = xp[:end].view(end, -1, 8)
    assert not torch.equal(chunks[:, 0], chunks[:, 1]), "a row's chunks differ"
    assert torch.equal(dyp[:end].view(torch.int16), xp[:end].view(torch.int16))


@gpu
def test_sep_gemm_fast_dgrad_spill_box_owner_fixed() -> None:
    """I = 512 spans several N tiles and H = 256 several K boxes, so boxes with kt % n_tiles != 0 exist; left
    unwritten, their columns of dyp stay NaN instead of permute's copy."""
    bn, _ = sm90.schedule("grouped_gemm_dgrad_gathered_spill", 512, 256, pingpong=False, gathered=True)
    assert 512 // bn > 1 and 256 // limits.GEMM_BK > 1, "several N tiles and several K boxes"
    _, _, dyp, xp, end = _spilled(200, 2, 256, 512, 4, 128, "uniform")
    assert torch.equal(dyp[:end].view(torch.int16), xp[:end].view(torch.int16))


@gpu
def test_sep_gemm_fast_dgrad_spill_k_tail_unmasked() -> None:
    """H = 288: the last K box's chunks past column 288 hold zeros (the producer's fill); stored unmasked they
    land on the next row's first 32 columns, which are not all zero here."""
    _, _, dyp, xp, end = _spilled(300, 4, 288, 256, 8, 128, "uniform")
    assert bool((xp[1:end, :32] != 0).any()), "a row after a live one starts with nonzero columns"
    assert torch.equal(dyp[:end].view(torch.int16), xp[:end].view(torch.int16))


def test_gathered_wgrad_refuses_bad_arguments() -> None:
    dy = torch.zeros(256, 128, dtype=torch.bfloat16)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    offs = torch.tensor([128, 256], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"int64 slot \[R\]"):
        sm90.grouped_gemm_wgrad_gathered(dy, x, torch.zeros(256, dtype=torch.int32), 2, offs)
    with pytest.raises(ValueError, match=r"int64 slot \[R\]"):
        sm90.grouped_gemm_wgrad_gathered(dy, x, torch.zeros(255, dtype=torch.int64), 2, offs)
    with pytest.raises(ValueError, match="top_k=0"):
        sm90.grouped_gemm_wgrad_gathered(dy, x, torch.zeros(256, dtype=torch.int64), 0, offs)
    with pytest.raises(ValueError, match="side 'both'"):
        sm90.grouped_gemm_wgrad_gathered(dy, x, torch.zeros(256, dtype=torch.int64), 2, offs, side="both")
    many = torch.zeros(1, 64, dtype=torch.bfloat16).expand(2**28, 64)
    with pytest.raises(ValueError, match=r"T \* top_k must be at most 2\^31; got 268435456 \* 9"):
        sm90.grouped_gemm_wgrad_gathered(dy, many, torch.zeros(256, dtype=torch.int64), 9, offs)
    for dw in (torch.zeros(2, 128, 32, dtype=torch.bfloat16), torch.zeros(2, 128, 64),
               torch.zeros(2, 64, 128, dtype=torch.bfloat16).transpose(1, 2)):
        with pytest.raises(ValueError, match=r"dw to add to must be a contiguous .* bf16 \[2, 128, 64\]"):
            sm90.grouped_gemm_wgrad_gathered_add(dy, x, torch.zeros(256, dtype=torch.int64), 2, offs, "x", dw)
    w = torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"need dy \[T, N\] and w \[E, N, K\]"):
        sm90.grouped_gemm_dgrad_gathered(x, torch.zeros(256, dtype=torch.int64), 2, w, offs)
    with pytest.raises(ValueError, match=r"int64 slot \[R\]"):
        sm90.grouped_gemm_dgrad_gathered(dy, torch.zeros(256, dtype=torch.int32), 2, w, offs)


def test_zero_chunk_is_made_eagerly_never_inside_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Made inside a capture, the zero chunk would hold zeros only after a replay: a first call there raises
    naming the fix (nothing allocated); a chunk made eagerly is reused by capturing calls."""
    monkeypatch.setattr(sm90, "_ZERO_CHUNKS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="run one eager"):
        sm90._zero_chunk("grouped_gemm_act_gathered", torch.device("cuda", 0))
    assert sm90._ZERO_CHUNKS == {}
    made = torch.zeros(8, dtype=torch.bfloat16)
    sm90._ZERO_CHUNKS[torch.device("cuda", 0)] = made
    assert sm90._zero_chunk("grouped_gemm_act_gathered", torch.device("cuda", 0)) is made


def test_sep_gemm_fast_gather_lag_too_deep() -> None:
    """Producers land a stage gather_lag stages after issuing it. Separating: at stages - 1 the slot they
    need is freed only by the consumers' reading a stage not yet landed, so the pipeline stands still; at 1 to
    stages - 2 it finishes for any tiling. gather_lag accepts exactly those (default GEMM_GATHER_LAG)."""
    from nmoe.fast.kernels.sm90.gatherplan import gather_lag
    from nmoe.fast.limits import GEMM_GATHER_LAG

    rng = random.Random(5)
    for stages in range(3, 9):
        tilings = [[1] * 20, [40], [rng.randint(1, 6) for _ in range(30)]]
        assert not pipeline_finishes(stages, stages - 1, [40], depth=None), "one stage deeper stands still"
        for lag in range(1, stages - 1):
            assert gather_lag(stages, lag) == lag
            assert all(pipeline_finishes(stages, lag, t, depth=None) for t in tilings), (stages, lag)
        for bad in (0, stages - 1):
            with pytest.raises(ValueError, match=f"GEMM_GATHER_LAG = {bad}: .* 1 to {stages - 2} stages"):
                gather_lag(stages, bad)
    assert gather_lag(4) == GEMM_GATHER_LAG
    with pytest.raises(ValueError, match="3 or more pipeline stages"):
        gather_lag(2)


def test_act_only_needs_an_activation() -> None:
    """keep_h=False with act 'none' would store nothing: refused before any compile."""
    from nmoe.fast.kernels.sm90 import grouped_gemm_gather as km
    with pytest.raises(ValueError, match="keep_h=False"):
        km.compile_args_gather(256, 256, 256, "none", True, keep_h=False)
