"""nmoe.fast.dispatch (permute, unpermute, padded_rows) against the spec: bitwise, no host sync."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fastcompile import assert_rows_ok, compile_rows
from torch import Tensor

from nmoe.fast import dispatch as fast
from nmoe.fast.arch import ArchError
from nmoe.reference import dispatch as ref

ROOT = Path(__file__).resolve().parents[1]
gpu = pytest.mark.gpu


def _routing(t: int, k: int, e: int, kind: str, seed: int) -> Tensor:
    """Distinct experts per token, as a router produces: uniform, Zipf-skewed, or half the experts empty."""
    g = torch.Generator().manual_seed(seed)
    if kind == "one":
        return torch.full((t, k), e - 1) if k == 1 else torch.stack([torch.arange(k)] * t) % e
    if kind == "zipf":
        w = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 1.2
    elif kind == "empty":
        w = (torch.arange(e) % 2 == 0).double()
    else:
        w = torch.ones(e, dtype=torch.float64)
    if t == 0:
        return torch.zeros(0, k, dtype=torch.int64)
    return torch.multinomial(w.expand(t, e), k, replacement=False, generator=g)


def _bytes(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.uint8)


def _assert_permuted(got: fast.Permuted, want: ref.Permuted) -> None:
    assert got.counts.dtype == got.offs.dtype == torch.int32 and got.slot.dtype == torch.int64
    assert torch.equal(got.counts.cpu(), want.counts), "counts"
    assert torch.equal(got.offs.cpu(), want.offs), "offs"
    assert torch.equal(got.slot.cpu(), want.slot), "slot"
    assert got.xp.dtype == want.xp.dtype and got.xp.shape == want.xp.shape
    assert torch.equal(_bytes(got.xp.cpu()), _bytes(want.xp)), "xp"


def _dirty_cache(nbytes: int) -> None:
    """Leave NaN-filled blocks in torch's caching allocator so torch.empty in the op returns garbage."""
    for _ in range(4):
        torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")


# ------------------------------------------------------------------ CPU


def test_padded_rows_equals_the_spec() -> None:
    for n in (0, 1, 7, 64, 1000):
        for e in (1, 3, 64, 256):
            for a in (1, 2, 8, 128):
                assert fast.padded_rows(n, e, a) == ref.padded_rows(n, e, a)
    with pytest.raises(ValueError, match="align >= 1"):
        fast.padded_rows(4, 2, 0)


def test_copy_shape_picks_the_widest_dividing_vector() -> None:
    assert fast._copy_shape(4096, 0, 512) == ("i32", 4, 16)
    assert fast._copy_shape(4096, 8, 512) == ("i32", 2, 8)
    assert fast._copy_shape(6, 0, 0) == ("i16", 1, 2)
    assert fast._copy_shape(3, 0, 0) == ("i8", 1, 1)
    assert fast._copy_shape(0, 0, 0) == ("i32", 4, 16)


def test_cpu_tensors_are_rejected_naming_the_reference() -> None:
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        fast.permute(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int64), 4, 1)
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        fast.unpermute(torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64), 1, 2)
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        fast.spread_rows(torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64), torch.zeros(2, 1,
                                                                                           dtype=torch.int32))
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        fast.embedding_bwd(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64), 4)


@pytest.mark.parametrize(("dy", "ids", "vocab", "match"), [
    (torch.zeros(2, 12, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64), 4, "16-byte"),
    (torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2, dtype=torch.int64), 4, "bf16 or fp32"),
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int64), 4, "integer ids"),
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64), 0, "vocab"),
])
def test_embedding_bwd_refuses_what_the_kernel_cannot_take(dy: Tensor, ids: Tensor, vocab: int,
                                                           match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fast.embedding_bwd(dy, ids, vocab)


def test_embedding_has_a_fake_and_its_table_gradient_shape() -> None:
    table = torch.empty(50, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.zeros(2, 3, device="meta", dtype=torch.int64)
    out = fast.embedding(tokens, table)
    assert (out.shape, out.dtype) == ((2, 3, 16), torch.bfloat16)
    out.sum().backward()
    assert table.grad is not None and table.grad.shape == (50, 16)


def test_kernel_specs_cover_both_archs() -> None:
    assert {s.op for s in fast.KERNELS} == {"permute", "unpermute", "embedding_bwd"}
    for s in fast.KERNELS:
        assert set(s.expect) == set(s.forbid) == {"sm_90a", "sm_100a"}


@pytest.mark.heavy
def test_kernels_compile_without_gpu() -> None:
    for arch, rows in compile_rows("nmoe.fast.dispatch").items():
        assert_rows_ok(rows, arch, len(fast.KERNELS))


# ------------------------------------------------------------------ GPU

CASES = [  # (T, K, E, align, H, dtype, ids dtype, routing)
    (1, 1, 1, 1, 64, torch.bfloat16, torch.int64, "uniform"),
    (1, 8, 256, 128, 128, torch.bfloat16, torch.int64, "uniform"),
    (1000, 8, 256, 128, 256, torch.bfloat16, torch.int64, "zipf"),
    (777, 6, 64, 8, 96, torch.float32, torch.int32, "uniform"),
    (2049, 2, 16, 16, 3, torch.bfloat16, torch.int64, "empty"),
    (300, 4, 8, 1, 5, torch.float32, torch.int32, "one"),
    (5000, 8, 1024, 32, 40, torch.float16, torch.int64, "zipf"),
    (0, 4, 8, 8, 64, torch.bfloat16, torch.int64, "uniform"),
    (33, 3, 5, 4, 7, torch.uint8, torch.int64, "uniform"),
    (4096, 1, 32, 64, 2048, torch.bfloat16, torch.int32, "zipf"),
]


def _x(t: int, h: int, dtype: torch.dtype, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(1, 256, (t, h), generator=g, dtype=torch.uint8)
    return (torch.randn(t, h, generator=g) + 0.5).to(dtype)


@gpu
@pytest.mark.parametrize(("t", "k", "e", "align", "h", "dtype", "idt", "kind"), CASES)
def test_permute_bitwise_vs_reference(t: int, k: int, e: int, align: int, h: int, dtype: torch.dtype,
                                      idt: torch.dtype, kind: str) -> None:
    ids = _routing(t, k, e, kind, seed=t + e).to(idt)
    x = _x(t, h, dtype, seed=h)
    want = ref.permute(x, ids, e, align)
    _dirty_cache(want.xp.numel() * x.element_size())
    _assert_permuted(fast.permute(x.cuda(), ids.cuda(), e, align), want)


@gpu
@pytest.mark.parametrize(("t", "k", "e", "align", "h", "dtype", "idt", "kind"), CASES)
def test_unpermute_bitwise_vs_reference(t: int, k: int, e: int, align: int, h: int, dtype: torch.dtype,
                                        idt: torch.dtype, kind: str) -> None:
    ids = _routing(t, k, e, kind, seed=t + e + 1).to(idt)
    slot = ref.permute(torch.zeros(t, 1), ids, e, align).slot
    yp = _x(slot.numel(), h, dtype, seed=h + 1)
    want = ref.unpermute(yp, slot, t, k)
    got = fast.unpermute(yp.cuda(), slot.cuda(), t, k)
    assert got.shape == want.shape and torch.equal(_bytes(got.cpu()), _bytes(want))


@gpu
def test_round_trip_on_unaligned_views() -> None:
    """Offset views defeat 128-bit vectors; the op must still copy every byte."""
    base = torch.randn(257 * 64 + 1, dtype=torch.bfloat16)
    x = base[1:].view(257, 64)
    ids = _routing(257, 4, 32, "zipf", seed=1)
    want = ref.permute(x, ids, 32, 16)
    got = fast.permute(x.cuda(), ids.cuda(), 32, 16)
    _assert_permuted(got, want)
    y = fast.unpermute(got.xp, got.slot, 257, 4).cpu()
    assert torch.equal(y, x[:, None, :].expand(257, 4, 64))


def _rows_of(slot: Tensor, t: int, k: int) -> Tensor:
    """int32 [T,K]: the permuted row of each slot, slot's inverse built by scatter here."""
    row_of = torch.full((t * k,), -1, dtype=torch.int32)
    real = slot >= 0
    row_of[slot[real]] = torch.arange(slot.numel(), dtype=torch.int32)[real]
    return row_of.view(t, k)


@gpu
@pytest.mark.parametrize(("t", "k", "e", "align", "h", "dtype", "idt", "kind"), CASES)
def test_permute_rows_is_slots_inverse_and_routes_without_columns(t: int, k: int, e: int, align: int, h: int,
                                                                  dtype: torch.dtype, idt: torch.dtype,
                                                                  kind: str) -> None:
    """row_of from the same launch is slot's inverse; x with no columns (the MoE layer's gathering path: no
    row-copy launch) routes bit for bit as with them."""
    ids = _routing(t, k, e, kind, seed=t + e).to(idt)
    x = _x(t, h, dtype, seed=h)
    want = ref.permute(x, ids, e, align)
    got, row_of = fast.permute_rows(x.cuda(), ids.cuda(), e, align)
    _assert_permuted(got, want)
    assert row_of.dtype == torch.int32 and torch.equal(row_of.cpu(), _rows_of(want.slot, t, k))
    bare, bare_rows = fast.permute_rows(x.cuda()[:, :0], ids.cuda(), e, align)
    assert bare.xp.shape == (want.slot.numel(), 0)
    for name in ("counts", "offs", "slot"):
        assert torch.equal(getattr(bare, name).cpu(), getattr(want, name)), name
    assert torch.equal(bare_rows.cpu(), row_of.cpu())


@gpu
@pytest.mark.parametrize(("h", "c0", "cols"), [(256, 64, 128), (96, 0, 96), (40, 8, 24), (2048, 1024, 1024)])
def test_spread_rows_of_a_column_slice_equals_permute(h: int, c0: int, cols: int) -> None:
    """The row copy alone, on the routing permute built and on x's columns read in place (rows h apart),
    is permute's xp of the same columns bit for bit."""
    t, k, e, align = 1000, 6, 64, 128
    ids = _routing(t, k, e, "zipf", seed=5)
    x = _x(t, h, torch.bfloat16, seed=6)
    want = ref.permute(x[:, c0:c0 + cols].contiguous(), ids, e, align)
    xg = x.cuda()
    got = fast.spread_rows(xg[:, c0:c0 + cols], want.slot.cuda(), _rows_of(want.slot, t, k).cuda())
    assert torch.equal(_bytes(got.cpu()), _bytes(want.xp))


@gpu
def test_sep_dispatch_fast_row_of_next_row() -> None:
    """The routing-only permute (no columns, no row-copy launch) hands back row_of = slot's inverse: its next
    row differs for every slot."""
    t, k, e, align = 300, 4, 16, 16
    ids = _routing(t, k, e, "zipf", seed=9)
    want = _rows_of(ref.permute(torch.zeros(t, 1), ids, e, align).slot, t, k)
    assert bool((want + 1 != want).all())
    _, row_of = fast.permute_rows(torch.zeros(t, 0).cuda(), ids.cuda(), e, align)
    assert torch.equal(row_of.cpu(), want)


@gpu
def test_sep_dispatch_fast_spread_pitch_ignored() -> None:
    t, k, e, align, h = 300, 4, 16, 16, 256
    ids = _routing(t, k, e, "uniform", seed=7)
    x = _x(t, h, torch.bfloat16, seed=8)
    want = ref.permute(x[:, 128:].contiguous(), ids, e, align)
    packed = x.reshape(-1)[128:128 + t * 128].view(t, 128)  # rows read 128 apart from the slice's start
    assert not torch.equal(ref.permute(packed, ids, e, align).xp, want.xp)
    got = fast.spread_rows(x.cuda()[:, 128:], want.slot.cuda(), _rows_of(want.slot, t, k).cuda())
    assert torch.equal(_bytes(got.cpu()), _bytes(want.xp))


@gpu
def test_sep_dispatch_fast_unstable_order() -> None:
    """All slots of one expert: any order but (t, k) differs from the stable one."""
    ids = torch.zeros(300, 2, dtype=torch.int64)
    ids[:, 1] = 1
    x = torch.arange(300, dtype=torch.float32)[:, None].repeat(1, 4)
    want = ref.permute(x, ids, 2, 1)
    stable = want.slot[:300]
    assert torch.equal(stable, torch.arange(300) * 2)
    warp_reversed = torch.cat([c.flip(0) for c in torch.split(stable, 32)])
    assert not torch.equal(stable, stable.flip(0)) and not torch.equal(stable, warp_reversed)
    _assert_permuted(fast.permute(x.cuda(), ids.cuda(), 2, 1), want)


@gpu
def test_sep_dispatch_fast_pad_rows_garbage() -> None:
    ids = _routing(100, 4, 16, "zipf", seed=4)
    x = torch.randn(100, 64) + 2
    want = ref.permute(x, ids, 16, 32)
    pad = want.slot < 0
    assert int(pad.sum()) > 0 and bool((want.xp[pad] == 0).all())
    garbage = torch.full_like(want.xp, float("nan"))
    assert not torch.equal(_bytes(want.xp), _bytes(torch.where(pad[:, None], garbage, want.xp)))
    _dirty_cache(want.xp.numel() * 4)
    _assert_permuted(fast.permute(x.cuda(), ids.cuda(), 16, 32), want)


@gpu
def test_sep_dispatch_fast_offs_unpadded() -> None:
    ids = _routing(50, 2, 8, "uniform", seed=2)
    want = ref.permute(torch.zeros(50, 8), ids, 8, 8)
    assert not torch.equal(want.offs, torch.cumsum(want.counts, 0).to(torch.int32))
    _assert_permuted(fast.permute(torch.zeros(50, 8).cuda(), ids.cuda(), 8, 8), want)


@gpu
def test_dispatch_makes_no_host_sync() -> None:
    x = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 64, (512, 8), device="cuda")
    p = fast.permute(x, ids, 64, 16)
    fast.unpermute(p.xp, p.slot, 512, 8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        p = fast.permute(x, ids, 64, 16)
        fast.unpermute(p.xp, p.slot, 512, 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
def test_custom_ops_pass_opcheck() -> None:
    x = torch.randn(40, 16, device="cuda")
    ids = torch.randint(0, 8, (40, 2), device="cuda")
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.nmoe.permute.default, (x, ids, 8, 4), test_utils=tests)
    p = fast.permute(x, ids, 8, 4)
    torch.library.opcheck(torch.ops.nmoe.unpermute.default, (p.xp, p.slot, 40, 2), test_utils=tests)
    row_of = _rows_of(p.slot.cpu(), 40, 2).cuda()
    torch.library.opcheck(torch.ops.nmoe.spread_rows.default, (x[:, 4:12], p.slot, row_of), test_utils=tests)


def _run_expecting_abort(code: str, message: str) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode != 0, out.stdout + out.stderr
    assert message in out.stdout + out.stderr, out.stdout + out.stderr


@gpu
def test_out_of_range_ids_abort_like_the_spec_raises() -> None:
    with pytest.raises(ValueError, match="lie in"):
        ref.permute(torch.zeros(1, 4), torch.tensor([[0, 9]]), 8, 1)
    _run_expecting_abort("""
        import torch
        from nmoe.fast.dispatch import permute
        ids = torch.tensor([[0, 1], [2, -1], [3, 4]], device="cuda")
        permute(torch.zeros(3, 4, device="cuda"), ids, 8, 1)
        torch.cuda.synchronize()
    """, "expert id -1 of slot 3")


@gpu
def test_bad_slot_map_aborts_like_the_spec_raises() -> None:
    slot = torch.tensor([0, 1, 1, -1])
    with pytest.raises(ValueError, match="once"):
        ref.unpermute(torch.zeros(4, 2), slot, 3, 1)
    _run_expecting_abort("""
        import torch
        from nmoe.fast.dispatch import unpermute
        unpermute(torch.zeros(4, 2, device="cuda"), torch.tensor([0, 1, 1, -1], device="cuda"), 3, 1)
        torch.cuda.synchronize()
    """, "arrived")


@gpu
def test_sep_dispatch_fast_missing_slot_unchecked() -> None:
    """A slot that never arrives (no duplicate elsewhere) must abort, as the spec raises."""
    slot = torch.tensor([0, -1, 2, -1])
    with pytest.raises(ValueError, match="once"):
        ref.unpermute(torch.zeros(4, 2), slot, 3, 1)
    _run_expecting_abort("""
        import torch
        from nmoe.fast.dispatch import unpermute
        unpermute(torch.zeros(4, 2, device="cuda"), torch.tensor([0, -1, 2, -1], device="cuda"), 3, 1)
        torch.cuda.synchronize()
    """, "slot 1 arrived 0 times")


def _embed_case(t: int, h: int, v: int, seed: int, heavy: bool = False) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    dy = (torch.randn(t, h, generator=g) * torch.logspace(-3, 3, max(t, 1))[:t, None]).to(torch.bfloat16)
    ids = torch.randint(0, v, (t,), generator=g)
    if heavy and t:
        ids[torch.rand(t, generator=g) < 0.6] = v // 3
    return dy, ids


@gpu
@pytest.mark.parametrize(("t", "h", "v", "heavy", "dtype"), [
    (0, 8, 5, False, torch.bfloat16), (1, 8, 1, False, torch.bfloat16), (37, 24, 11, True, torch.bfloat16),
    (300, 2048, 977, True, torch.bfloat16), (64, 7168, 40, False, torch.bfloat16),
    (90, 12, 7, True, torch.float32),
])
def test_embedding_bwd_bitwise_vs_reference(t: int, h: int, v: int, heavy: bool, dtype: torch.dtype) -> None:
    dy, ids = _embed_case(t, h, v, t + h, heavy)
    dy = dy.to(dtype)
    got = fast.embedding_bwd(dy.cuda(), ids.cuda(), v).cpu()
    assert torch.equal(got.view(torch.int16), ref.embedding_bwd(dy, ids, v).view(torch.int16))


@gpu
def test_embedding_grad_through_the_table_and_no_host_sync() -> None:
    dy, ids = _embed_case(4 * 33, 64, 19, 3, heavy=True)
    table = torch.zeros(19, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tokens = ids.view(4, 33).cuda()
    fast.embedding(tokens, table).backward(dy.view(4, 33, 64).cuda())
    assert table.grad is not None
    assert torch.equal(table.grad.cpu().view(torch.int16), ref.embedding_bwd(dy, ids, 19).view(torch.int16))
    dy_dev, ids_dev = dy.cuda(), ids.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast.embedding_bwd(dy_dev, ids_dev, 19)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
def test_sep_dispatch_fast_embed_last_token_dropped() -> None:
    """A vocab row's last token (in token order) must count: dropping it moves every row named twice."""
    dy, ids = _embed_case(200, 64, 7, 8)
    want = ref.embedding_bwd(dy, ids, 7)
    dropped = torch.zeros(7, 64)
    last = {v: t for t, v in enumerate(ids.tolist())}
    for t, v in enumerate(ids.tolist()):
        if last[v] != t:
            dropped[v] += dy[t].float()
    assert not torch.equal(dropped.to(torch.bfloat16), want)
    assert torch.equal(fast.embedding_bwd(dy.cuda(), ids.cuda(), 7).cpu(), want)


@gpu
def test_embedding_ids_outside_the_vocab_abort_like_the_spec_raises() -> None:
    with pytest.raises(ValueError, match="vocab size"):
        ref.embedding_bwd(torch.zeros(2, 8, dtype=torch.bfloat16), torch.tensor([0, 4]), 4)
    _run_expecting_abort("""
        import torch
        from nmoe.fast.dispatch import embedding_bwd
        dy = torch.zeros(2, 8, device="cuda", dtype=torch.bfloat16)
        embedding_bwd(dy, torch.tensor([0, 4], device="cuda"), 4)
        torch.cuda.synchronize()
    """, "error")
