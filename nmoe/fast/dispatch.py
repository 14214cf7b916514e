"""Fast permute / unpermute: CuTeDSL kernels (nmoe/fast/kernels/dispatch.py) behind torch custom ops.

No host sync: counts, offsets and ranks stay on device and every output shape follows from input shapes
(row capacity padded_rows), so both ops capture in CUDA graphs. Bad ids or slot maps abort the kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any, cast

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.runtime import KernelSpec
from nmoe.layout import Permuted, padded_rows

_KERNEL_MODULES = ("nmoe.fast.kernels.dispatch", "nmoe.fast.kernels.router")
MAX_EXPERTS = 1024
_INT32_LIMIT = 2**31


def _source_sha256() -> str:
    """The dispatch kernels import the trap helper from the router kernels, so both files key the cache."""
    return runtime.sources_sha256(*_KERNEL_MODULES)


def _kernels(arch: str) -> ModuleType:
    return runtime.kernel_module(_KERNEL_MODULES[0], arch)


def _copy_shape(row_bytes: int, *ptrs: int) -> tuple[str, int, int]:
    """(unit, units per vector, bytes per vector): the widest vector dividing the row and every pointer."""
    for width in (16, 8, 4, 2, 1):
        if row_bytes % width == 0 and all(p % width == 0 for p in ptrs):
            unit, vec = {16: ("i32", 4), 8: ("i32", 2), 4: ("i32", 1), 2: ("i16", 1), 1: ("i8", 1)}[width]
            return unit, vec, width
    raise AssertionError("width 1 divides everything")


@functools.cache
def _permute_executor(arch: str, n_experts: int, ids_bits: int, unit: str, vec: int, has_slots: bool,
                      has_rows: bool) -> Any:
    """Compiled once per (arch, shape class); memoised so a call costs no key hashing."""
    kern = _kernels(arch)
    spec = {"E": n_experts, "ids_bits": ids_bits, "unit": unit, "vec": vec, "has_slots": has_slots,
            "has_rows": has_rows}
    key = runtime.cache_key("permute", _source_sha256(), arch, spec)

    def build() -> Any:
        import cutlass.cute as cute

        host, args = kern.permute_args(n_experts, ids_bits, unit, vec, has_slots, has_rows)
        return cute.compile(host, *args)

    return runtime.kernel_cache().executor(key, build)


@functools.cache
def _unpermute_executor(arch: str, unit: str, vec: int, has_rows: bool, has_slots: bool) -> Any:
    kern = _kernels(arch)
    spec = {"unit": unit, "vec": vec, "has_rows": has_rows, "has_slots": has_slots}
    key = runtime.cache_key("unpermute", _source_sha256(), arch, spec)

    def build() -> Any:
        import cutlass.cute as cute

        host, args = kern.unpermute_args(unit, vec, has_rows, has_slots)
        return cute.compile(host, *args)

    return runtime.kernel_cache().executor(key, build)


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


_Four = tuple[Tensor, Tensor, Tensor, Tensor]


def _permute_impl(x: Tensor, ids: Tensor, n_experts: int, align: int) -> _Four:
    arch = runtime.require_arch(x, ids)
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
    kern = _kernels(arch)
    n_tiles = -(-n_slots // kern.TILE)
    tile = torch.empty(max(n_experts * n_tiles, 1), dtype=torch.int32, device=dev)
    start = torch.empty(n_experts, dtype=torch.int32, device=dev)
    row_of = torch.empty(max(n_slots, 1), dtype=torch.int32, device=dev)
    row_bytes = h * x.element_size()
    unit, vec, width = _copy_shape(row_bytes, xc.data_ptr(), xp.data_ptr())
    ids_bits = 64 if idc.dtype == torch.int64 else 32
    ex = _permute_executor(arch, n_experts, ids_bits, unit, vec, n_slots > 0, n_rows > 0)
    ut = kern.UNIT_TYPES[unit]
    i32 = kern.Int32
    with torch.cuda.device(dev):
        ex(kern.pointer(kern.ids_type(ids_bits), idc.data_ptr(), ids_bits // 8),
           kern.pointer(ut, xc.data_ptr(), width), kern.pointer(i32, tile.data_ptr(), 4),
           kern.pointer(i32, counts.data_ptr(), 4), kern.pointer(i32, offs.data_ptr(), 4),
           kern.pointer(i32, start.data_ptr(), 4), kern.pointer(kern.Int64, slot.data_ptr(), 8),
           kern.pointer(i32, row_of.data_ptr(), 4), kern.pointer(ut, xp.data_ptr(), width),
           n_slots, n_tiles, t, n_rows, k, align, row_bytes // width, runtime.current_stream(dev))
    return xp, counts, offs, slot


def _permute_fake(x: Tensor, ids: Tensor, n_experts: int, align: int) -> _Four:
    n_rows = padded_rows(ids.shape[0] * ids.shape[1], n_experts, align)
    dev = x.device
    return (torch.empty(n_rows, x.shape[1], dtype=x.dtype, device=dev),
            torch.empty(n_experts, dtype=torch.int32, device=dev),
            torch.empty(n_experts, dtype=torch.int32, device=dev),
            torch.empty(n_rows, dtype=torch.int64, device=dev))


def _unpermute_impl(yp: Tensor, slot: Tensor, t: int, k: int) -> Tensor:
    arch = runtime.require_arch(yp, slot)
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
    kern = _kernels(arch)
    row_bytes = h * yp.element_size()
    unit, vec, width = _copy_shape(row_bytes, ypc.data_ptr(), y.data_ptr())
    ex = _unpermute_executor(arch, unit, vec, n_rows > 0, n_slots > 0)
    ut = kern.UNIT_TYPES[unit]
    with torch.cuda.device(dev):
        ex(kern.pointer(ut, ypc.data_ptr(), width), kern.pointer(kern.Int64, sc.data_ptr(), 8),
           kern.pointer(ut, y.data_ptr(), width), kern.pointer(kern.Int32, seen.data_ptr(), 4),
           n_rows, n_slots, row_bytes // width, runtime.current_stream(dev))
    return y.view(t, k, h)


def _unpermute_fake(yp: Tensor, slot: Tensor, t: int, k: int) -> Tensor:
    return torch.empty(t, k, yp.shape[1], dtype=yp.dtype, device=yp.device)


_permute_op = runtime.register_custom_op(
    "nmoe::permute", cast(Callable[..., Tensor], _permute_impl), cast(Callable[..., Tensor], _permute_fake)
)
_unpermute_op = runtime.register_custom_op("nmoe::unpermute", _unpermute_impl, _unpermute_fake)


def permute(x: Tensor, ids: Tensor, n_experts: int, align: int) -> Permuted:
    """Rows sorted by (expert, t, k); each expert segment padded to `align`; pad and tail rows are zero."""
    xp, counts, offs, slot = cast(_Four, _permute_op(x, ids, n_experts, align))
    return Permuted(xp=xp, counts=counts, offs=offs, slot=slot)


def unpermute(yp: Tensor, slot: Tensor, t: int, k: int) -> Tensor:
    """y[T,K,H] in slot order from permuted rows; pad rows (slot -1) are dropped."""
    out: Tensor = _unpermute_op(yp, slot, t, k)
    return out


def _permute_ptx(unit: str, vec: int, arch: str) -> str:
    kern = _kernels(arch)
    host, args = kern.permute_args(256, 64, unit, vec, True, True)
    return runtime.compile_ptx(host, args)


def _unpermute_ptx(unit: str, vec: int, arch: str) -> str:
    kern = _kernels(arch)
    host, args = kern.unpermute_args(unit, vec, True, True)
    return runtime.compile_ptx(host, args)


# Stable ranks come from match.any + popc in slot order, never from atomics on positions (shared-memory
# atomics only build the tile histogram); rows move as 128-bit vectors; no spills.
_LD128 = r"\bld\.global(\.nc)?\.v4\.(b|u|s)32\b"
_ST128 = r"\bst\.global\.v4\.(b|u|s)32\b"


def _spec(op: str, name: str, compile: Callable[[str], str], expect: tuple[str, ...]) -> KernelSpec:
    return runtime.portable_spec(op, name, compile, (r"\btrap;", *expect),
                                 (r"\bld\.local\b", r"\batom\.global\.add\.u64\b"))


KERNELS: tuple[KernelSpec, ...] = (
    _spec("permute", "permute_e256_v128", functools.partial(_permute_ptx, "i32", 4),
          (r"\bmatch\.any\.sync\.b32\b", r"\bpopc\.b32\b", r"\batom\.shared\.add\.u32\b",
           r"\bshfl\.sync\.up\.b32\b", r"\bbar\.sync\b", _LD128, _ST128)),
    _spec("permute", "permute_e256_b16", functools.partial(_permute_ptx, "i16", 1),
          (r"\bmatch\.any\.sync\.b32\b", r"\bld\.global(\.nc)?\.(b|u|s)16\b", r"\bst\.global\.(b|u|s)16\b")),
    _spec("unpermute", "unpermute_v128", functools.partial(_unpermute_ptx, "i32", 4),
          (r"\batom\.global\.add\.u32\b", _LD128, _ST128)),
)
