"""Provenance block shared by every report (parity, mutations, benchmarks, training)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def gpu_info() -> tuple[str | None, str | None]:
    """GPU name and driver version, or (None, None) without a CUDA device."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None, None
        name = torch.cuda.get_device_name(0)
    except Exception:
        return None, None
    driver = None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )
        driver = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return name, driver


def _env_commit() -> tuple[str | None, bool | None]:
    sha = os.environ.get("NMOE_GIT_SHA", "")
    if not sha:
        return None, None
    flag = os.environ.get("NMOE_GIT_DIRTY", "")
    if flag not in ("0", "1"):
        raise ValueError(f"NMOE_GIT_DIRTY={flag!r}: set it to 0 (tree as committed) or 1 (local edits) "
                         "beside NMOE_GIT_SHA")
    return sha, flag == "1"


def provenance(command: str | None = None) -> dict[str, Any]:
    """The `provenance` object of every report (docs/reports.md). NMOE_GIT_SHA (with NMOE_GIT_DIRTY 0 or 1)
    names the commit of a tree copied without .git or with a stale one, and wins over git when set."""
    gpu, driver = gpu_info()
    sha, dirty = _env_commit()
    if sha is None:
        status = _git("status", "--porcelain")
        sha, dirty = _git("rev-parse", "HEAD"), None if status is None else bool(status)
    return {
        "git_sha": sha,
        "git_dirty": dirty,
        "created_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "gpu": gpu,
        "cuda_driver": driver,
        "torch": _version("torch"),
        "cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "python": sys.version.split()[0],
        "command": command if command is not None else " ".join(sys.argv),
    }
