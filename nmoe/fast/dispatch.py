"""Fast permute / unpermute / embedding_bwd: CuTeDSL kernels (nmoe/fast/kernels/dispatch.py) behind torch
custom ops.

No host sync: counts, offsets and ranks stay on device and every output shape follows from input shapes
(row capacity padded_rows), so both ops capture in CUDA graphs. Bad ids or slot maps abort the kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.limits import MAX_EXPERTS
from nmoe.fast.op import Kernel, fast_op
from nmoe.fast.runtime import KernelSpec
from nmoe.layout import Permuted, check_embedding_grad, padded_rows

_INT32_LIMIT = 2**31
PERMUTE = Kernel("nmoe.fast.kernels.dispatch", "permute",
                 lambda km, E, ids_bits, unit, vec, has_slots, has_rows, copies=True: km.permute_args(
                     E, ids_bits, unit, vec, has_slots, has_rows, copies))
SPREAD = Kernel("nmoe.fast.kernels.dispatch", "spread", lambda km, unit, vec: km.spread_args(unit, vec))
UNPERMUTE = Kernel("nmoe.fast.kernels.dispatch", "unpermute",
                   lambda km, unit, vec, has_rows, has_slots: km.unpermute_args(
                       unit, vec, has_rows, has_slots))
EMBED_BWD = Kernel("nmoe.fast.kernels.dispatch", "embed_bwd",
                   lambda km, h, threads, dtype: km.embed_bwd_args(h, threads, dtype))
EMBED_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
EMBED_THREADS = 256


def _copy_shape(row_bytes: int, *ptrs: int) -> tuple[str, int, int]:
    """(unit, units per vector, bytes per vector): the widest vector dividing the row and every pointer."""
    for width in (16, 8, 4, 2, 1):
        if row_bytes % width == 0 and all(p % width == 0 for p in ptrs):
            unit, vec = {16: ("i32", 4), 8: ("i32", 2), 4: ("i32", 1), 2: ("i16", 1), 1: ("i8", 1)}[width]
            return unit, vec, width
    raise AssertionError("width 1 divides everything")


def _check_permute(x: Tensor, ids: Tensor, n_experts: int, align: int) -> None:
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"permute: ids must be integer [T,K], got {ids.dtype} {tuple(ids.shape)}")
    if x.dim() != 2 or x.shape[0] != ids.shape[0]:
        raise ValueError(f"permute: x must be [T,H] with T={ids.shape[0]} from ids, got {tuple(x.shape)}")
    if not 1 <= n_experts <= MAX_EXPERTS:
        raise ValueError(f"permute: n_experts={n_experts} must lie in [1, {MAX_EXPERTS}] (one scan CTA "
                         "holds one expert per thread)")
    if align < 1:
        raise ValueError(f"permute: align={align} must be >= 1")


_Five = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


def _permute_impl(x: Tensor, ids: Tensor, n_experts: int, align: int) -> _Five:
    device, arch = runtime.device_arch(x, ids)
    _check_permute(x, ids, n_experts, align)
    t, k = ids.shape
    n_slots = t * k
    n_rows = padded_rows(n_slots, n_experts, align)
    if n_rows >= _INT32_LIMIT:
        raise ValueError(f"permute: {n_rows} rows exceed the kernels' int32 row index; split the batch")
    dev = x.device
    h = x.shape[1]
    xc = x.contiguous()
    idc = ids.contiguous()
    xp = torch.empty(n_rows, h, dtype=x.dtype, device=dev)
    counts = torch.empty(n_experts, dtype=torch.int32, device=dev)
    offs = torch.empty(n_experts, dtype=torch.int32, device=dev)
    slot = torch.empty(n_rows, dtype=torch.int64, device=dev)
    n_tiles = -(-n_slots // PERMUTE.kernels(arch).TILE)
    tile = torch.empty(max(n_experts * n_tiles, 1), dtype=torch.int32, device=dev)
    start = torch.empty(n_experts, dtype=torch.int32, device=dev)
    row_of = torch.empty(max(n_slots, 1), dtype=torch.int32, device=dev)
    row_bytes = h * x.element_size()
    unit, vec, width = _copy_shape(row_bytes, xc.data_ptr(), xp.data_ptr())
    ids_bits = 64 if idc.dtype == torch.int64 else 32
    launch = PERMUTE.launcher(arch, E=n_experts, ids_bits=ids_bits, unit=unit, vec=vec, has_slots=n_slots > 0,
                              has_rows=n_rows > 0, copies=h > 0)
    launch(device, idc.data_ptr(), xc.data_ptr(), tile.data_ptr(), counts.data_ptr(), offs.data_ptr(),
           start.data_ptr(), slot.data_ptr(), row_of.data_ptr(), xp.data_ptr(), n_slots, n_tiles, t, n_rows,
           k, align, row_bytes // width)
    return xp, counts, offs, slot, row_of[:n_slots].view(t, k)


def _permute_fake(x: Tensor, ids: Tensor, n_experts: int, align: int) -> _Five:
    t, k = ids.shape
    n_rows = padded_rows(t * k, n_experts, align)
    dev = x.device
    return (torch.empty(n_rows, x.shape[1], dtype=x.dtype, device=dev),
            torch.empty(n_experts, dtype=torch.int32, device=dev),
            torch.empty(n_experts, dtype=torch.int32, device=dev),
            torch.empty(n_rows, dtype=torch.int64, device=dev),
            torch.empty(t, k, dtype=torch.int32, device=dev))


def _spread_impl(x: Tensor, slot: Tensor, row_of: Tensor) -> Tensor:
    device, arch = runtime.device_arch(x, slot, row_of)
    if x.dim() != 2 or row_of.dim() != 2 or row_of.shape[0] != x.shape[0] or row_of.dtype != torch.int32 or \
            slot.dim() != 1 or slot.dtype != torch.int64:
        raise ValueError(f"spread_rows: need x [T,H], int64 slot [R] and int32 row_of [T,K] (permute's "
                         f"routing), got x {tuple(x.shape)}, slot {slot.dtype} {tuple(slot.shape)}, row_of "
                         f"{row_of.dtype} {tuple(row_of.shape)}")
    t, h = x.shape
    n_rows = slot.shape[0]
    if max(n_rows, row_of.numel()) >= _INT32_LIMIT:
        raise ValueError(f"spread_rows: {n_rows} rows exceed the kernels' int32 row index; split the batch")
    xc = x if x.stride(1) == 1 and (t <= 1 or x.stride(0) >= h) else x.contiguous()
    pitch = xc.stride(0) if t > 1 else h
    xp = torch.empty(n_rows, h, dtype=x.dtype, device=x.device)
    if n_rows == 0 or h == 0:
        return xp
    es = x.element_size()
    unit, vec, width = _copy_shape(h * es, xc.data_ptr(), xp.data_ptr(), pitch * es)
    rows, slots = row_of.contiguous(), slot.contiguous()
    SPREAD.launcher(arch, unit=unit, vec=vec)(
        device, xc.data_ptr(), slots.data_ptr(), rows.data_ptr(), xp.data_ptr(), t, n_rows, row_of.shape[1],
        h * es // width, pitch * es // width)
    return xp


def _spread_fake(x: Tensor, slot: Tensor, row_of: Tensor) -> Tensor:
    return torch.empty(slot.shape[0], x.shape[1], dtype=x.dtype, device=x.device)


def _unpermute_impl(yp: Tensor, slot: Tensor, t: int, k: int) -> Tensor:
    device, arch = runtime.device_arch(yp, slot)
    if yp.dim() != 2 or slot.shape != (yp.shape[0],) or slot.dtype != torch.int64:
        raise ValueError(f"unpermute: need yp [R,H] and int64 slot [R]; got {tuple(yp.shape)}, "
                         f"{slot.dtype} {tuple(slot.shape)}; pass permute's slot")
    if t < 0 or k < 0:
        raise ValueError(f"unpermute: T={t} and K={k} must be >= 0")
    n_rows, h = yp.shape
    n_slots = t * k
    if max(n_rows, n_slots) >= _INT32_LIMIT:
        raise ValueError(f"unpermute: {n_rows} rows / {n_slots} slots exceed int32; split the batch")
    dev = yp.device
    ypc = yp.contiguous()
    sc = slot.contiguous()
    y = torch.empty(n_slots, h, dtype=yp.dtype, device=dev)
    seen = torch.zeros(max(n_slots, 1), dtype=torch.int32, device=dev)
    if n_rows == 0 and n_slots == 0:
        return y.view(t, k, h)
    row_bytes = h * yp.element_size()
    unit, vec, width = _copy_shape(row_bytes, ypc.data_ptr(), y.data_ptr())
    launch = UNPERMUTE.launcher(arch, unit=unit, vec=vec, has_rows=n_rows > 0, has_slots=n_slots > 0)
    launch(device, ypc.data_ptr(), sc.data_ptr(), y.data_ptr(), seen.data_ptr(), n_rows, n_slots,
           row_bytes // width)
    return y.view(t, k, h)


def _unpermute_fake(yp: Tensor, slot: Tensor, t: int, k: int) -> Tensor:
    return torch.empty(t, k, yp.shape[1], dtype=yp.dtype, device=yp.device)


def _check_embed(dy: Tensor, ids: Tensor, vocab: int) -> None:
    check_embedding_grad(dy, ids)
    if dy.dtype not in EMBED_DTYPES or dy.shape[1] % (16 // dy.element_size()) or \
            not 1 <= vocab < _INT32_LIMIT or dy.shape[0] >= _INT32_LIMIT:
        raise ValueError(f"embedding_bwd: the fast path takes bf16 or fp32 dy whose rows are whole 16-byte "
                         f"vectors (got {dy.dtype}, H {dy.shape[1]}), 1 <= vocab < 2^31 (got {vocab}) and "
                         "T < 2^31; use nmoe.reference.dispatch.embedding_bwd otherwise")


def _embedding_bwd_impl(dy: Tensor, ids: Tensor, vocab: int) -> Tensor:
    _check_embed(dy, ids, vocab)
    device, arch = runtime.device_arch(dy, ids)
    h = dy.shape[1]
    out = torch.empty(vocab, h, dtype=dy.dtype, device=dy.device)
    if h == 0:
        return out
    sorted_ids, order = torch.sort(ids, stable=True)
    bounds = torch.arange(vocab + 1, device=dy.device, dtype=sorted_ids.dtype)
    starts = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    rows = runtime.vector_aligned(dy, 16)
    vec = 16 // dy.element_size()
    launch = EMBED_BWD.launcher(arch, h=h, threads=min(EMBED_THREADS, h // vec), dtype=EMBED_DTYPES[dy.dtype])
    launch(device, rows.data_ptr(), order.data_ptr(), starts.data_ptr(), out.data_ptr(), dy.shape[0], vocab)
    return out


def _embedding_bwd_fake(dy: Tensor, ids: Tensor, vocab: int) -> Tensor:
    _check_embed(dy, ids, vocab)
    return torch.empty(vocab, dy.shape[1], dtype=dy.dtype, device=dy.device)


_permute_op = fast_op("permute", _permute_impl, _permute_fake)
_unpermute_op = fast_op("unpermute", _unpermute_impl, _unpermute_fake)
_spread_op = fast_op("spread_rows", _spread_impl, _spread_fake)
_embedding_bwd_op = fast_op("embedding_bwd", _embedding_bwd_impl, _embedding_bwd_fake)


def permute(x: Tensor, ids: Tensor, n_experts: int, align: int) -> Permuted:
    """Rows sorted by (expert, t, k); each expert segment padded to `align`; pad and tail rows are zero."""
    return permute_rows(x, ids, n_experts, align)[0]


def permute_rows(x: Tensor, ids: Tensor, n_experts: int, align: int) -> tuple[Permuted, Tensor]:
    """permute, and int32 row_of [T,K]: the row holding each slot (slot's inverse), which the same launch
    writes; spread_rows and combine_gather take it."""
    xp, counts, offs, slot, row_of = _permute_op(x, ids, n_experts, align)
    return Permuted(xp=xp, counts=counts, offs=offs, slot=slot), row_of


def spread_rows(x: Tensor, slot: Tensor, row_of: Tensor) -> Tensor:
    """permute(x, ids).xp for rows permute already routed (its slot and row_of = slot's inverse, [T,K]): only
    the row copy runs; x may be a column slice of a wider tensor (rows at one pitch), read in place."""
    return _spread_op(x, slot, row_of)


def unpermute(yp: Tensor, slot: Tensor, t: int, k: int) -> Tensor:
    """y[T,K,H] in slot order from permuted rows; pad rows (slot -1) are dropped."""
    return _unpermute_op(yp, slot, t, k)


def embedding_bwd(dy: Tensor, ids: Tensor, vocab: int) -> Tensor:
    """The table's gradient [vocab, H]: row v the fp32 sum of dy's rows with id v in token order (a stable
    sort and one CTA per row), rounded once; no atomics, no host sync; an id outside the vocab traps."""
    return _embedding_bwd_op(dy, ids, vocab)


class _Embedding(torch.autograd.Function):
    """F.embedding's gather forward; backward embedding_bwd (torch's sort-and-scatter took 2.5 ms of a
    batch-16 moonlet step)."""

    @staticmethod
    def forward(ctx: Any, tokens: Tensor, table: Tensor) -> Tensor:
        ctx.save_for_backward(tokens)
        ctx.vocab = table.shape[0]
        return F.embedding(tokens, table)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[None, Tensor]:
        (tokens,) = ctx.saved_tensors
        rows = dy.reshape(-1, dy.shape[-1])
        return None, embedding_bwd(rows, tokens.reshape(-1), ctx.vocab)


def embedding(tokens: Tensor, table: Tensor) -> Tensor:
    """table[tokens] [..., H], differentiable in the table through embedding_bwd."""
    out: Tensor = _Embedding.apply(tokens, table)  # type: ignore[no-untyped-call]
    return out


# Stable ranks come from match.any + popc in slot order, never from atomics on positions (shared-memory
# atomics only build the tile histogram); rows move as 128-bit vectors; no spills.
_LD128 = r"\bld\.global(\.nc)?\.v4\.(b|u|s)32\b"
_ST128 = r"\bst\.global\.v4\.(b|u|s)32\b"


def _permute_e256(unit: str, vec: int) -> Callable[[str], str]:
    return PERMUTE.compiler(E=256, ids_bits=64, unit=unit, vec=vec, has_slots=True, has_rows=True)


def _spec(op: str, name: str, compile: Callable[[str], str], expect: tuple[str, ...]) -> KernelSpec:
    return runtime.portable_spec(op, name, compile, (r"\btrap;", *expect),
                                 (r"\bld\.local\b", r"\batom\.global\.add\.u64\b"))


KERNELS: tuple[KernelSpec, ...] = (
    _spec("permute", "permute_e256_v128", _permute_e256("i32", 4),
          (r"\bmatch\.any\.sync\.b32\b", r"\bpopc\.b32\b", r"\batom\.shared\.add\.u32\b",
           r"\bshfl\.sync\.up\.b32\b", r"\bbar\.sync\b", _LD128, _ST128)),
    _spec("permute", "permute_e256_b16", _permute_e256("i16", 1),
          (r"\bmatch\.any\.sync\.b32\b", r"\bld\.global(\.nc)?\.(b|u|s)16\b", r"\bst\.global\.(b|u|s)16\b")),
    # The routing alone (x with no columns, as the MoE layer's gathering up projection asks): no row copies.
    runtime.portable_spec("permute", "permute_e256_routing", PERMUTE.compiler(
        E=256, ids_bits=64, unit="i32", vec=4, has_slots=True, has_rows=True, copies=False),
        (r"\btrap;", r"\bmatch\.any\.sync\.b32\b", r"\bpopc\.b32\b"),
        (r"\bld\.local\b", r"\batom\.global\.add\.u64\b", _LD128, _ST128)),
    _spec("unpermute", "unpermute_v128", UNPERMUTE.compiler(unit="i32", vec=4, has_rows=True, has_slots=True),
          (r"\batom\.global\.add\.u32\b", _LD128, _ST128)),
    runtime.portable_spec("permute", "spread_rows_v128", SPREAD.compiler(unit="i32", vec=4), (_LD128, _ST128),
                          (r"\bld\.local\b",)),
    # fp32 adds in token order, one rounding, 16-byte rows: no atomics, no fma, no spills.
    runtime.portable_spec("embedding_bwd", "embed_bwd_h2048", EMBED_BWD.compiler(h=2048, threads=256,
                                                                                  dtype="bfloat16"),
                          (r"\btrap;", _LD128, _ST128, r"\badd\.(rn\.)?f32(x2)?\b",
                           r"\bcvt\.rn\.bf16x2\.f32\b"),
                          (r"\bld\.local\b", r"\batom\.", r"\bred\.", r"\bfma\.")),
)
