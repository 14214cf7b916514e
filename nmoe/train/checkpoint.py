"""Checkpoints: DIR/step_N/{DCP files, meta.json, rank_R.pt (RNG), manifest.json} and DIR/latest naming the
newest one. A step directory appears only by renaming a finished one, whose manifest (sha256 and size of
every file) is checked on load; `latest` is replaced atomically, so a crash leaves the previous one usable."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from nmoe.config import Config, diff, fingerprint, to_dict
from nmoe.data.prep import sha256_file
from nmoe.outpaths import LockHeld, exclusive
from nmoe.provenance import provenance
from nmoe.sharding import checkpoint_keys, shard_of
from nmoe.train.optim import TrainOptimizer

META: Final[str] = "meta.json"
LATEST: Final[str] = "latest"
MANIFEST: Final[str] = "manifest.json"
LOCK: Final[str] = "lock"
FORMAT: Final[str] = "nmoe-checkpoint/1"


class CheckpointError(RuntimeError):
    """Unreadable, incomplete or incompatible checkpoint; the message names the path and the fix."""


class CheckpointConfigMismatch(CheckpointError):
    def __init__(self, path: Path, keys: list[str]) -> None:
        self.path, self.keys = path, keys
        super().__init__(
            f"checkpoint {path} was written under a different config; differing keys: {', '.join(keys)}. "
            "Resume with the original config, point checkpoint.dir elsewhere to start fresh, or set "
            "checkpoint.allow_fingerprint_change = true to resume anyway"
        )


@dataclass(frozen=True)
class Resumed:
    path: Path
    step: int
    tokens: int
    run_id: str
    loader_state: dict[str, Any]
    meta: dict[str, Any]


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _dist():
        dist.barrier()


def capture_rng() -> dict[str, Any]:
    py = random.getstate()
    np_state: tuple[Any, ...] = tuple(np.random.get_state())
    out: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np.asarray(np_state[1]).astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(state: dict[str, Any]) -> None:
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _app_state(model: nn.Module, optimizer: TrainOptimizer) -> dict[str, Any]:
    """Expert-sharded parameters and their optimizer state go under per-rank keys (DCP would keep one
    rank's copy of a key every rank saves)."""
    keys = checkpoint_keys(model.named_parameters())
    return {"model": {keys.get(k, k): v for k, v in model.state_dict().items()},
            "optim": {keys.get(k, k): v for k, v in optimizer.named_state().items()}}


def _expert_parallel(model: nn.Module) -> bool:
    return any(shard_of(p) is not None for p in model.parameters())


def _fsync_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_manifest(path: Path) -> None:
    files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
             for f in sorted(path.iterdir()) if f.is_file()}
    _fsync_json(path / MANIFEST, {"format": FORMAT, "files": files})


def verify(path: Path) -> None:
    """Raise CheckpointError naming the first file that is missing, truncated or differs from the manifest."""
    fix = (f"resume from an older step: point {path.parent / LATEST} at another step_* directory, or delete "
           f"{path} to fall back")
    try:
        files: dict[str, dict[str, Any]] = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        raise CheckpointError(f"{path / MANIFEST}: missing; the checkpoint is incomplete or was written "
                              f"before checkpoints carried checksums; {fix}, or point checkpoint.dir "
                              "elsewhere to start fresh") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path / MANIFEST}: unreadable ({e}); {fix}") from None
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (listed in {MANIFEST}); {fix}")
        size = f.stat().st_size
        if size != want["bytes"]:
            what = "truncated" if size < want["bytes"] else "grown"
            raise CheckpointError(f"{f}: {what} ({size} bytes, {MANIFEST} says {want['bytes']}); {fix}")
        if sha256_file(f) != want["sha256"]:
            raise CheckpointError(f"{f}: corrupt (sha256 differs from {MANIFEST}); {fix}")


def check_writable(root: str | Path, need_bytes: int = 0) -> None:
    """Fail before training, not at the first save, when checkpoint.dir cannot take a checkpoint."""
    root = Path(root)
    probe = root / f".write-test-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with probe.open("wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
        free = shutil.disk_usage(root).free
    except OSError as e:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
        raise CheckpointError(f"checkpoint.dir {root} is not writable ({e}); fix its permissions or free "
                              "space, or point checkpoint.dir elsewhere") from None
    if free < need_bytes:
        raise CheckpointError(f"checkpoint.dir {root} is not writable for a checkpoint: "
                              f"{free / 2**30:.2f} GiB free, one checkpoint needs about "
                              f"{need_bytes / 2**30:.2f} GiB; free space or point checkpoint.dir elsewhere")


class DirLock:
    """An exclusive lock on DIR/lock for one trainer; the kernel drops it when the holder dies."""

    def __init__(self, root: str | Path, *, run: str) -> None:
        self.root, self.run = Path(root), run
        self._held = contextlib.ExitStack()

    def __enter__(self) -> DirLock:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / LOCK
        try:
            self._held.enter_context(exclusive(path, f"run {self.run}"))
        except LockHeld as e:
            raise CheckpointError(f"checkpoint.dir {self.root} is in use by {e.holder}; wait for that "
                                  "trainer to end or point checkpoint.dir elsewhere") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot lock ({e}); put checkpoint.dir on a filesystem with "
                                  "flock") from None
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._held.close()


def _reason(e: BaseException) -> str:
    """The last line of an error (DCP wraps the cause of each rank in a multi-line traceback)."""
    return ([ln for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__])[-1].strip()


def _pointer_name(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def save(
    root: str | Path,
    *,
    step: int,
    tokens: int,
    model: nn.Module,
    optimizer: TrainOptimizer,
    loader_state: dict[str, Any],
    cfg: Config,
    run_id: str,
    keep_last: int,
    rank: int = 0,
    world: int = 1,
) -> Path:
    """Write step `step` (collective when torch.distributed is initialised); returns its directory."""
    root = Path(root)
    final = step_dir(root, step)
    partial = root / f".{final.name}.partial"
    previous = _pointer_name(root)
    try:
        _write_partial(partial, step=step, tokens=tokens, model=model, optimizer=optimizer,
                       loader_state=loader_state, cfg=cfg, run_id=run_id, rank=rank, world=world)
    except (OSError, CheckpointException) as e:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        kept = f"{previous} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(f"cannot write checkpoint {final} ({_reason(e)}); free space or fix "
                              f"permissions on {root}, then resume: {kept}") from e
    except BaseException:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if rank == 0:
        if final.exists():
            old = root / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old)
        else:
            os.replace(partial, final)
        tmp = root / (LATEST + ".tmp")
        tmp.write_text(final.name + "\n")
        os.replace(tmp, root / LATEST)
        _prune(root, keep_last, keep=final)
    _barrier()
    return final


def _write_partial(
    partial: Path,
    *,
    step: int,
    tokens: int,
    model: nn.Module,
    optimizer: TrainOptimizer,
    loader_state: dict[str, Any],
    cfg: Config,
    run_id: str,
    rank: int,
    world: int,
) -> None:
    if rank == 0:
        partial.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    _barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_save(_app_state(model, optimizer), checkpoint_id=partial, no_dist=not _dist())
    torch.save({"rank": rank, "rng": capture_rng()}, partial / f"rank_{rank:05d}.pt")
    _barrier()
    if rank == 0:
        prov = provenance()
        _fsync_json(partial / META, {
            "format": FORMAT, "step": step, "tokens": tokens, "run_id": run_id, "world": world,
            "expert_parallel": _expert_parallel(model),
            "fingerprint": fingerprint(cfg), "config": to_dict(cfg), "loader": loader_state,
            "git_sha": prov["git_sha"], "git_dirty": prov["git_dirty"], "created_utc": prov["created_utc"],
            "torch": prov["torch"],
        })
        _write_manifest(partial)


def _prune(root: Path, keep_last: int, keep: Path) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for p in steps[:-keep_last]:
        if p != keep:
            shutil.rmtree(p)


def latest(root: str | Path) -> Path | None:
    """The checkpoint `latest` names, or None for a fresh directory."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not name or Path(name).name != name:
        what = "is empty" if not name else f"names {name!r}, not a directory in {root}"
        raise CheckpointError(f"{pointer} {what}; write the name of an existing step_* directory into it, "
                              "or remove it to start fresh")
    path = root / name
    if not (path / META).is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which is missing or incomplete; point it at an "
                              f"existing step_* directory in {root} or remove it to start fresh")
    return path


def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta: dict[str, Any] = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable {META} ({e}); resume from another step_* directory") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def check_config(path: Path, meta: dict[str, Any], cfg: Config) -> list[str]:
    """Differing config keys; raises CheckpointConfigMismatch unless the config allows the change."""
    if meta["fingerprint"] == fingerprint(cfg):
        return []
    keys = diff(meta["config"], to_dict(cfg))
    if not cfg.checkpoint.allow_fingerprint_change:
        raise CheckpointConfigMismatch(path, keys)
    return keys


def load(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: TrainOptimizer,
    cfg: Config,
    rank: int = 0,
    world: int = 1,
) -> Resumed:
    """Restore model, optimizer and this rank's RNG in place; the caller restores the loader."""
    path = Path(path)
    verify(path)
    meta = read_meta(path)
    check_config(path, meta, cfg)
    if meta["world"] != world:
        raise CheckpointError(f"{path} was written by {meta['world']} ranks, this run has {world}; resume "
                              "with the same world size")
    if bool(meta.get("expert_parallel", False)) != _expert_parallel(model):
        saved = "sharded over its ranks" if meta.get("expert_parallel") else "whole on every rank"
        raise CheckpointError(f"{path} holds the routed experts {saved}, this run does not; resume with the "
                              "same train.expert_parallel")
    state = _app_state(model, optimizer)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(state, checkpoint_id=path, no_dist=not _dist())
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{path}: cannot load model/optimizer state into this model ({_reason(e)}); "
                              "the model shape or parameter names changed since the checkpoint was "
                              "written") from e
    names = {v: k for k, v in checkpoint_keys(model.named_parameters()).items()}
    model.load_state_dict({names.get(k, k): v for k, v in state["model"].items()})
    rank_file = path / f"rank_{rank:05d}.pt"
    if not rank_file.is_file():
        raise CheckpointError(f"{rank_file} missing; the checkpoint is incomplete, resume from an older step")
    restore_rng(torch.load(rank_file, weights_only=True)["rng"])
    return Resumed(path, int(meta["step"]), int(meta["tokens"]), str(meta["run_id"]), dict(meta["loader"]),
                   meta)
