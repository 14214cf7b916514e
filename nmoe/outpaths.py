"""Where commands write: every output path is checked before any work, so a bad path costs no run, and
per-user state lives in the user's data dir, never inside the installed package."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class UnwritableError(RuntimeError):
    """An output path that cannot be written; the message is one line naming the path and the fix."""


def user_data_dir() -> Path:
    """$XDG_DATA_HOME/nmoe, else ~/.local/share/nmoe (the XDG base directory default)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "nmoe"


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/nmoe, else ~/.cache/nmoe: compiled kernels, npm bundles, shard verdicts."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nmoe"


def require_writable(flag: str, path: str | Path) -> None:
    """Create `path`'s directory and prove a file can be written there, leaving `path` itself untouched."""
    p = Path(path)
    try:
        if p.is_dir():
            raise IsADirectoryError(f"{p} is a directory")
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists():
            with p.open("ab"):
                pass
        else:
            fd, probe = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".probe")
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        why = e.strerror or str(e)
        raise UnwritableError(f"cannot write {flag} {p} ({why}); give {flag} a file in a writable directory"
                              ) from e
