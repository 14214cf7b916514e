"""Where commands write: every output path is checked before any work, so a bad path costs no run, and
per-user state lives in the user's data dir, never inside the installed package."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


class UnwritableError(RuntimeError):
    """An output path that cannot be written; the message is one line naming the path and the fix."""


class LockHeld(RuntimeError):
    """Another live process holds the lock; `holder` is what it wrote there (who, pid, host, since when)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by {holder}")
        self.path, self.holder = path, holder


@contextlib.contextmanager
def exclusive(path: Path, who: str) -> Iterator[None]:
    """An exclusive flock on `path` with `who` (plus pid, host, start time) written in it while held; the
    kernel drops it when the holder dies. A held lock raises LockHeld naming the holder."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            held_by = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            raise LockHeld(path, held_by or "a process that has not yet recorded itself") from None
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{who} (pid {os.getpid()} on {socket.gethostname()}, since {since})\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


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
