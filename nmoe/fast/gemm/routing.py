"""The checks every grouped GEMM shares, written once: offs, group counts, row coordinates, row strides."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.arch import ArchNotImplemented
from nmoe.fast.limits import GEMM_BM, GEMM_MAX_GROUPS

CHECK_OFFS_ENV = "NMOE_CHECK_OFFS"
_INT32_LIMIT = 2**31


def check_routing(op: str, offs: Tensor, n_groups: int | None, m: int,
                  max_groups: int | None = GEMM_MAX_GROUPS) -> None:
    """offs int32 [E] (E = n_groups where the weights fix it), at most `max_groups` groups where the kernel
    keeps a table of them, and int32 row coordinates for the rows plus one padded tile per group."""
    e = offs.numel() if n_groups is None else n_groups
    want = "E" if n_groups is None else str(e)
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() != e:
        raise ValueError(f"{op}: offs must be int32 [{want}] cumulative group ends, got {offs.dtype} "
                         f"{tuple(offs.shape)}; build it with torch.cumsum(counts, 0).to(torch.int32)")
    if max_groups is not None and e > max_groups:
        raise ValueError(f"{op}: {e} groups exceed the kernel's table of {max_groups}; split the "
                         "experts into several calls")
    if m + GEMM_BM * (e + 1) >= _INT32_LIMIT:
        raise ValueError(f"{op}: {m} rows exceed the kernel's int32 row coordinates; split M")


def check_aligned(op: str, what: str, *dims: tuple[str, int, int]) -> None:
    """Each (name, size, multiple): TMA rows need 16-byte strides and scaled formats whole scale blocks."""
    bad = [f"{name}={size} must be a multiple of {mult}" for name, size, mult in dims if size % mult]
    if bad:
        raise ValueError(f"{op}: {what} {' and '.join(bad)} (16-byte TMA rows, whole scale blocks); pad the "
                         "expert weights")


def check_bf16(op: str, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{op}: {name} is {t.dtype}; the fast kernel takes bfloat16 (cast with "
                             ".to(torch.bfloat16), or use nmoe.reference.gemm for other dtypes)")


def as_bytes(op: str, name: str, t: Tensor, allowed: tuple[torch.dtype, ...]) -> Tensor:
    """`t`'s bit patterns as contiguous uint8, for the quantized operands and their scales."""
    if t.dtype not in allowed:
        raise ValueError(f"{op}: {name} is {t.dtype}; pass its bit patterns as one of "
                         f"{[str(d) for d in allowed]} (quantize with nmoe.fast.formats)")
    return t.contiguous().view(torch.uint8)


def tile_upper_bound(m: int, n: int, n_groups: int, bn: int, cm: int = 1) -> int:
    """Most work units (cm M tiles side by side by one N tile) any routing of m rows into n_groups groups
    (plus the zero tail) can make: a group of t tiles takes ceil(t / cm) <= (t + cm - 1) / cm units."""
    return (-(-m // GEMM_BM) + cm * (n_groups + 1)) // cm * -(-n // bn)


def fwd_ctas(device: int, m: int, n: int, n_groups: int, bn: int, cm: int) -> int:
    """Persistent CTAs of a fwd/dgrad launch in clusters of cm M tiles: whole clusters, one CTA per SM at
    most, no more clusters than work units."""
    return cm * min(runtime.sm_count(device) // cm, tile_upper_bound(m, n, n_groups, bn, cm))


_OFFS_BUILT_ON_DEVICE = contextvars.ContextVar("nmoe_offs_built_on_device", default=False)


@contextlib.contextmanager
def offs_built_on_device() -> Iterator[None]:
    """GEMMs inside take offs built on the device by permute (valid by construction): no host check and no
    sync whatever NMOE_CHECK_OFFS says; the check stays available to every other caller."""
    token = _OFFS_BUILT_ON_DEVICE.set(True)
    try:
        yield
    finally:
        _OFFS_BUILT_ON_DEVICE.reset(token)


@functools.cache
def offs_check_enabled() -> bool:
    """NMOE_CHECK_OFFS=1 (or true), read once per process at the first GEMM launch, not on every call."""
    return os.environ.get(CHECK_OFFS_ENV, "") in ("1", "true")


def check_offs_on_host(op: str, offs: Tensor, m: int) -> None:
    """Opt-in (NMOE_CHECK_OFFS=1) validation; it syncs the host, so the hot path leaves it off."""
    if not offs_check_enabled() or _OFFS_BUILT_ON_DEVICE.get() or torch.cuda.is_current_stream_capturing():
        return
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if any(e < s for s, e in zip(starts, ends, strict=True)) or (ends and ends[-1] > m):
        raise ValueError(f"{op}: offs {ends} must be non-decreasing, >= 0 and <= {m} rows; fix the counts")


def require(op: str, arch: str, built_for: str) -> None:
    """A per-arch module called on another arch: name the front that picks the right kernel."""
    if arch != built_for:
        raise ArchNotImplemented(
            f"{op}: this is the {built_for} kernel, called on {arch}; call nmoe.fast.gemm.{op}, which picks "
            "the kernel for the GPU (or says what is missing there)"
        )

