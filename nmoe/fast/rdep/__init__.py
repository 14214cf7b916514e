"""RDEP: expert-parallel dispatch and return by direct writes into peer GPU memory (CUDA IPC windows)."""

from nmoe.fast.rdep.group import (
    KERNELS,
    RdepGroup,
    RdepShape,
    Received,
    Sent,
    rdep_dispatch,
    rdep_return,
)

__all__ = ["KERNELS", "RdepGroup", "RdepShape", "Received", "Sent", "rdep_dispatch", "rdep_return"]
