"""The one table of GPU archs the fast path supports, and the errors that name an unsupported one.

Torch-free and cutlass-free, so runtime, parity, tests and the trainer all read the same table.
"""

from __future__ import annotations

from typing import Final

ARCH_BY_CAPABILITY: Final[dict[tuple[int, int], str]] = {(9, 0): "sm_90a", (10, 0): "sm_100a"}
SUPPORTED_ARCHS: Final[tuple[str, ...]] = tuple(ARCH_BY_CAPABILITY.values())


class ArchError(RuntimeError):
    """A fast op was handed a tensor it cannot run on (CPU, wrong GPU, or a mismatched DSL arch)."""


class ArchNotImplemented(ArchError, NotImplementedError):
    """A supported GPU but no kernel for its arch: reported "not run", never a silent fallback."""


def arch_of(capability: tuple[int, int]) -> str | None:
    """The arch name of a CUDA compute capability, None where the fast path has no kernels for it."""
    return ARCH_BY_CAPABILITY.get((int(capability[0]), int(capability[1])))


def check_arch(arch: str) -> None:
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(SUPPORTED_ARCHS)}")
