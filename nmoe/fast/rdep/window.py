"""Peer windows over CUDA IPC, and the mapped-host status word the RDEP kernels report errors into.

CUDA IPC maps a peer's allocation on another GPU of this host or on this GPU in another process.
"""

# Why not torch symmetric memory: it refuses ranks on overlapping devices (unless
# TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES) and rendezvouses over NCCL, which refuses two ranks on one GPU;
# IPC serves W ranks on W GPUs and W ranks sharing one GPU with one path. Handles travel once, at group
# creation, through any all-gather (gloo in the rank pool).

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

IPC_HANDLE_BYTES = 64
STATUS_WORDS = 8

Exchange = Callable[[bytes], Sequence[bytes]]
"""All-gather of one bytes object per rank, in rank order (e.g. torch.distributed.all_gather_object)."""


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _ok(result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"rdep: {what} failed with CUDA driver error {err}; check that every rank is its "
                           "own process on this host (a process cannot open its own IPC handle) and that "
                           "CUDA IPC is allowed (same container, no --ipc=private, no MIG)")
    return rest[0] if len(rest) == 1 else tuple(rest)


def _bind(device: torch.device) -> None:
    """Make torch's context on `device` (the runtime's primary context) current on this thread, so driver
    calls act in it whichever thread makes them (a new thread has no current context)."""
    drv = _driver()
    index = torch.device(device).index or 0
    torch.cuda.set_device(index)
    torch.empty(1, device=torch.device("cuda", index))  # the runtime creates and holds the primary context
    dev = _ok(drv.cuDeviceGet(index), "cuDeviceGet")
    ctx = _ok(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _ok(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _ok(drv.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")  # the runtime still holds it


class _Cai:
    """A device address as a __cuda_array_interface__ bytes buffer, so torch can view it without a copy."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "stream": None}


def bytes_at(address: int, nbytes: int, device: torch.device) -> Tensor:
    """uint8 [nbytes] torch view of device memory at `address` (no copy, no ownership)."""
    return torch.as_tensor(_Cai(address, nbytes), device=device)


@dataclass
class Window:
    """This rank's window (allocated, zeroed) and every rank's window base in this process."""

    device: torch.device
    nbytes: int
    own: int
    bases: tuple[int, ...]
    rank: int
    closed: bool = False

    def view(self) -> Tensor:
        return bytes_at(self.own, self.nbytes, self.device)

    def close(self) -> None:
        """Unmap the peers and free the own window; call after a barrier so no peer still writes here."""
        if self.closed:
            return
        drv = _driver()
        _bind(self.device)
        for r, base in enumerate(self.bases):
            if r != self.rank:
                _ok(drv.cuIpcCloseMemHandle(base), "cuIpcCloseMemHandle")
        _ok(drv.cuMemFree(self.own), "cuMemFree")
        self.closed = True


def open_window(nbytes: int, device: torch.device, rank: int, exchange: Exchange) -> Window:
    """Allocate and zero this rank's window, then map every peer's through their IPC handles."""
    drv = _driver()
    _bind(device)
    own = int(_ok(drv.cuMemAlloc(max(nbytes, 1)), "cuMemAlloc"))
    _ok(drv.cuMemsetD8(own, 0, max(nbytes, 1)), "cuMemsetD8")
    _ok(drv.cuCtxSynchronize(), "cuCtxSynchronize")
    handle = _ok(drv.cuIpcGetMemHandle(own), "cuIpcGetMemHandle")
    mine = ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)
    handles = list(exchange(mine))
    bases: list[int] = []
    for r, data in enumerate(handles):
        if r == rank:
            bases.append(own)
            continue
        h = drv.CUipcMemHandle()
        ctypes.memmove(h.getPtr(), bytes(data), IPC_HANDLE_BYTES)
        flag = int(drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        bases.append(int(_ok(drv.cuIpcOpenMemHandle(h, flag), f"cuIpcOpenMemHandle of rank {r}")))
    return Window(device, nbytes, own, tuple(bases), rank)


class Status:
    """STATUS_WORDS int64 in mapped pinned host memory: the device writes errors there and the host reads
    them with a plain load, no stream sync; it stays readable after a kernel traps."""

    def __init__(self, gpu: torch.device) -> None:
        drv = _driver()
        self.gpu = gpu
        _bind(gpu)
        flags = drv.CU_MEMHOSTALLOC_DEVICEMAP | drv.CU_MEMHOSTALLOC_PORTABLE
        self.host = int(_ok(drv.cuMemHostAlloc(STATUS_WORDS * 8, flags), "cuMemHostAlloc"))
        ctypes.memset(self.host, 0, STATUS_WORDS * 8)
        self.device = int(_ok(drv.cuMemHostGetDevicePointer(self.host, 0), "cuMemHostGetDevicePointer"))
        self.words = (ctypes.c_int64 * STATUS_WORDS).from_address(self.host)

    def read(self) -> tuple[int, ...]:
        return tuple(int(w) for w in self.words)

    def close(self) -> None:
        _bind(self.gpu)
        _ok(_driver().cuMemFreeHost(self.host), "cuMemFreeHost")
