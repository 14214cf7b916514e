"""`nmoe prep`: text -> NFC -> o200k_harmony ids -> uint32 shards + document index + sha256 manifest.
Documents go to shards by a running count of their UTF-8 bytes, so the layout depends only on the input
stream (never on worker timing) and a re-run can skip every shard it already finished."""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import errno
import gzip
import hashlib
import io
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import numpy as np

from nmoe.constants import O200K_HARMONY, O200K_HARMONY_VOCAB
from nmoe.data import tokenizer as tok
from nmoe.outpaths import LockHeld, exclusive

FORMAT: Final[str] = "nmoe-shards/1"
CORPUS_DIR: Final[Path] = Path(__file__).resolve().parent / "corpus"
DEFAULT_CORPUS: Final[Path] = CORPUS_DIR / "shakespeare.jsonl.gz"
DEFAULT_OUT: Final[str] = "data/default"
DEFAULT_SHARD_BYTES: Final[int] = 256 << 20
CHUNK_BYTES: Final[int] = 1 << 20
TEXT_SUFFIXES: Final[tuple[str, ...]] = (".txt", ".md", ".txt.gz", ".md.gz")
JSONL_SUFFIXES: Final[tuple[str, ...]] = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES: Final[tuple[str, ...]] = (".parquet",)
LOCK_NAME: Final[str] = ".nmoe-prep.lock"
INTERRUPTED_RC: Final[int] = 130


class PrepError(RuntimeError):
    """A prep/verify failure whose message names the file and the remedy."""


@dataclass(frozen=True)
class HFSpec:
    name: str
    config: str | None = None
    split: str = "train"
    revision: str | None = None


@dataclass(frozen=True)
class PrepPlan:
    """Everything that decides the bytes of the output; a re-run must match it to reuse shards."""

    sources: tuple[dict[str, Any], ...]
    text_field: str
    shard_bytes: int
    tokenizer: str = O200K_HARMONY
    format: str = FORMAT

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "sources": list(self.sources)}


def _suffix(path: Path) -> str:
    name = path.name.lower()
    for s in TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES:
        if name.endswith(s):
            return s
    return ""


def expand_inputs(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files in argument order; directories contribute their supported files in sorted path order."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and _suffix(f))
            if not found:
                raise PrepError(f"{p}: no .txt/.md/.jsonl/.parquet files (optionally .gz) inside; "
                                "point prep at files it can read")
            out += found
        elif p.is_file():
            if not _suffix(p):
                raise PrepError(f"{p}: unsupported file type; use .txt, .md, .jsonl (optionally .gz) or "
                                ".parquet")
            out.append(p)
        else:
            raise PrepError(f"{p}: no such file or directory")
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def describe_files(files: Sequence[Path]) -> tuple[dict[str, Any], ...]:
    return tuple({"file": f.name, "bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in files)


def _open_text(path: Path) -> tuple[IO[str], IO[bytes]]:
    raw = path.open("rb")
    stream: IO[bytes] = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw  # type: ignore[assignment]
    return io.TextIOWrapper(stream, encoding="utf-8", newline=""), raw


def iter_file_documents(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    """(document text, raw bytes of `path` consumed so far)."""
    kind = _suffix(path)
    if kind in PARQUET_SUFFIXES:
        yield from _iter_parquet(path, text_field)
        return
    text, raw = _open_text(path)
    with text, raw:
        try:
            if kind in TEXT_SUFFIXES:
                yield text.read(), raw.tell()
                return
            for lineno, line in enumerate(text, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PrepError(f"{path}:{lineno}: invalid JSON ({e}); fix or drop the line") from e
                value = obj.get(text_field) if isinstance(obj, dict) else None
                if not isinstance(value, str):
                    raise PrepError(f"{path}:{lineno}: no string field {text_field!r}; pass --text-field "
                                    "with the name of the text column")
                yield value, raw.tell()
        except UnicodeDecodeError as e:
            raise PrepError(f"{path}: not UTF-8 ({e}); re-encode the file as UTF-8") from e
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise PrepError(f"{path}: truncated or corrupt gzip ({e}); re-download or re-compress the "
                            "file") from e


def _iter_parquet(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise PrepError(f"{path}: reading parquet needs pyarrow; pip install pyarrow") from e
    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise PrepError(f"{path}: no column {text_field!r} (columns: {pf.schema_arrow.names}); pass "
                        "--text-field")
    n_groups = pf.num_row_groups
    size = path.stat().st_size
    for g in range(n_groups):
        for value in pf.read_row_group(g, columns=[text_field]).column(0).to_pylist():
            if not isinstance(value, str):
                raise PrepError(f"{path}: row group {g} holds a non-string {text_field!r} value")
            yield value, size * (g + 1) // n_groups


def iter_hf_documents(spec: HFSpec, text_field: str) -> Iterator[tuple[str, int]]:
    """Stream a Hugging Face dataset (network or local HF cache); `datasets` is imported only here."""
    try:
        import datasets
    except ImportError as e:
        raise PrepError("--hf needs the `datasets` package; pip install datasets") from e
    ds = datasets.load_dataset(spec.name, spec.config, split=spec.split, revision=spec.revision,
                               streaming=True)
    for i, row in enumerate(ds):
        value = row.get(text_field)
        if not isinstance(value, str):
            raise PrepError(f"{spec.name}: row {i} has no string field {text_field!r}; pass --text-field")
        yield value, 0


@dataclass(frozen=True)
class _Chunk:
    shard: int
    texts: tuple[str, ...]
    raw_done: int


@dataclass(frozen=True)
class _Close:
    shard: int
    docs: int
    text_bytes: int
    first_doc: int


_Item = _Chunk | _Close
_Result = tuple[_Item, np.ndarray | None, np.ndarray | None]


def plan_chunks(docs: Iterable[tuple[str, int]], shard_bytes: int, skip: frozenset[int]) -> Iterator[_Item]:
    """Cut the document stream into per-shard chunks; shards in `skip` are counted but not tokenized."""
    shard, shard_docs, shard_text, first_doc = 0, 0, 0, 0
    buf: list[str] = []
    buf_bytes = 0
    raw_done = 0
    for n_doc, (text, raw_done) in enumerate(docs, 1):
        norm = tok.normalize(text)
        nbytes = len(norm.encode("utf-8"))
        if shard not in skip:
            buf.append(norm)
            buf_bytes += nbytes
        shard_docs += 1
        shard_text += nbytes
        if buf_bytes >= CHUNK_BYTES:
            yield _Chunk(shard, tuple(buf), raw_done)
            buf, buf_bytes = [], 0
        if shard_text >= shard_bytes:
            if buf:
                yield _Chunk(shard, tuple(buf), raw_done)
                buf, buf_bytes = [], 0
            yield _Close(shard, shard_docs, shard_text, first_doc)
            shard, shard_docs, shard_text, first_doc = shard + 1, 0, 0, n_doc
    if buf:
        yield _Chunk(shard, tuple(buf), raw_done)
    if shard_docs:
        yield _Close(shard, shard_docs, shard_text, first_doc)


def _worker_init() -> None:
    tok.get_encoding()


def _start_pool(workers: int) -> Any:
    """Workers start with SIGINT ignored (inherited through exec), so Ctrl-C, which reaches the whole
    process group, stops only the parent, which then terminates them: one message, no worker tracebacks."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        return mp.get_context("spawn").Pool(workers, initializer=_worker_init)
    finally:
        if main:
            signal.signal(signal.SIGINT, old)


def _tokenize(item: _Item) -> _Result:
    if isinstance(item, _Close):
        return item, None, None
    enc = tok.get_encoding()
    ids = [tok.encode_document(t, enc) for t in item.texts]
    lengths = np.fromiter((len(x) for x in ids), dtype=np.uint64, count=len(ids))
    flat = np.fromiter((i for x in ids for i in x), dtype=np.uint32, count=int(lengths.sum()))
    return dataclasses.replace(item, texts=()), flat, lengths


def _ordered(pool: Any, items: Iterator[_Item], window: int) -> Iterator[_Result]:
    """Results in submission order, at most `window` chunks in flight (Pool.imap reads ahead unbounded)."""
    pending: collections.deque[Any] = collections.deque()
    for item in items:
        pending.append(pool.apply_async(_tokenize, (item,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def shard_name(i: int) -> str:
    return f"shard_{i:05d}"


class _Progress:
    """One live status line on stderr; a percentage where the input size is known, 100% only once finished
    (raw bytes read can reach the end of a file before its last document is written)."""

    def __init__(self, total_raw: int, enabled: bool) -> None:
        self.total_raw, self.enabled = total_raw, enabled
        self.t0 = self.last = time.monotonic()
        self.tokens = self.docs = self.raw = 0
        self.shards = 0
        self.finished = False
        self.tty = sys.stderr.isatty()

    def update(self, tokens: int, docs: int, raw: int, force: bool = False) -> None:
        self.tokens += tokens
        self.docs += docs
        self.raw = max(self.raw, raw)
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < (0.25 if self.tty else 10.0)):
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        head = ""
        if self.total_raw:
            frac = min(self.raw / self.total_raw, 1.0 if self.finished else 0.999)
            filled = int(frac * 30)
            head = f"[{'#' * filled}{'.' * (30 - filled)}] {100 * frac:5.1f}% "
        start, end = ("\r", "") if self.tty else ("", "\n")
        sys.stderr.write(f"{start}prep {head}{self.docs:,} docs {self.tokens:,} tokens {self.shards} shards "
                         f"{self.tokens / dt / 1e6:.2f}M tok/s{end}")
        sys.stderr.flush()

    def close(self, finished: bool) -> None:
        """The last line shows 100% only for a finished prep; a stopped one keeps the fraction it reached."""
        self.finished = finished
        if self.enabled:
            self.update(0, 0, self.total_raw if finished else 0, force=True)
            if self.tty:
                sys.stderr.write("\n")


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_json(path: Path, obj: Any) -> None:
    _fsync_write(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def _shard_ok(out: Path, meta: dict[str, Any]) -> bool:
    bin_path, idx_path = out / meta["file"], out / meta["index"]
    if not bin_path.is_file() or not idx_path.is_file():
        return False
    if bin_path.stat().st_size != 4 * meta["tokens"]:
        return False
    return bool(sha256_file(bin_path) == meta["sha256"] and sha256_file(idx_path) == meta["index_sha256"])


def _read_sidecar(side: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("shard"), int) else None


def _finished_shards(out: Path) -> dict[int, dict[str, Any]]:
    """Shards whose files match their sidecar; an unreadable sidecar marks its shard for rebuilding."""
    done: dict[int, dict[str, Any]] = {}
    for side in sorted(out.glob("shard_*.json")):
        meta = _read_sidecar(side)
        if meta is not None and _shard_ok(out, meta):
            done[int(meta["shard"])] = meta
    return done


class _ShardWriter:
    def __init__(self, out: Path, shard: int) -> None:
        self.out, self.shard = out, shard
        self.bin_path = out / f"{shard_name(shard)}.bin"
        self.tmp = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self.f = self.tmp.open("wb")
        self.h = hashlib.sha256()
        self.lengths: list[np.ndarray] = []
        self.tokens = 0

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        data = flat.astype("<u4", copy=False).tobytes()
        self.f.write(data)
        self.h.update(data)
        self.lengths.append(lengths)
        self.tokens += int(flat.size)

    def close(self, c: _Close) -> dict[str, Any]:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.uint64)
        if lengths.size != c.docs:
            raise PrepError(f"internal: shard {c.shard} tokenized {lengths.size} docs, planned {c.docs}")
        offsets = np.zeros(lengths.size + 1, dtype="<u8")
        np.cumsum(lengths, out=offsets[1:])
        idx_bytes = offsets.tobytes()
        os.replace(self.tmp, self.bin_path)
        idx_path = self.out / f"{shard_name(self.shard)}.idx"
        _fsync_write(idx_path, idx_bytes)
        meta = {
            "shard": self.shard, "file": self.bin_path.name, "index": idx_path.name,
            "tokens": self.tokens, "docs": c.docs, "first_doc": c.first_doc, "text_bytes": c.text_bytes,
            "sha256": self.h.hexdigest(), "index_sha256": hashlib.sha256(idx_bytes).hexdigest(),
        }
        _write_json(self.out / f"{shard_name(self.shard)}.json", meta)
        return meta


def _make_out(out: Path) -> None:
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            raise PrepError(f"--out {out}: {p} is a file; choose a directory path for --out")
    out.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def out_lock(out: Path) -> Iterator[None]:
    """Exclusive hold on `out` for one prep (released by the kernel even if the holder dies)."""
    try:
        with exclusive(out / LOCK_NAME, "nmoe prep"):
            yield
    except LockHeld as e:
        raise PrepError(f"{out} is being written by another `nmoe prep` ({e.holder}); wait for it to "
                        "finish or choose another --out") from None


def _prepare_out(out: Path, plan: PrepPlan, overwrite: bool) -> None:
    plan_path = out / "plan.json"
    want = plan.to_json()
    if plan_path.is_file():
        have = json.loads(plan_path.read_text())
        if have != want and not overwrite:
            keys = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
            raise PrepError(f"{out} holds a prep of different inputs/settings (differs in: "
                            f"{', '.join(keys)}); choose another --out or pass --overwrite to replace it")
        if have != want:
            for p in out.iterdir():
                if p.name.startswith("shard_") or p.name in ("manifest.json", "plan.json"):
                    p.unlink() if p.is_file() else shutil.rmtree(p)
    elif any(p.name != LOCK_NAME for p in out.iterdir()) and not overwrite:
        raise PrepError(f"{out} is not empty and holds no prep plan; choose an empty --out or pass "
                        "--overwrite")
    _write_json(plan_path, want)
    (out / "manifest.json").unlink(missing_ok=True)


def prepare(
    out: Path,
    docs: Iterable[tuple[str, int]],
    plan: PrepPlan,
    *,
    workers: int = 1,
    overwrite: bool = False,
    total_raw: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Write shards + manifest.json into `out` under its lock; manifest.json appears only when complete."""
    _make_out(out)
    with out_lock(out):
        return _prepare_locked(out, docs, plan, workers, overwrite, total_raw, progress)


def _prepare_locked(out: Path, docs: Iterable[tuple[str, int]], plan: PrepPlan, workers: int,
                    overwrite: bool, total_raw: int, progress: bool) -> dict[str, Any]:
    _prepare_out(out, plan, overwrite)
    done = _finished_shards(out)
    metas: dict[int, dict[str, Any]] = {}
    bar = _Progress(total_raw, progress)
    items = plan_chunks(docs, plan.shard_bytes, frozenset(done))
    pool = _start_pool(workers) if workers > 1 else None
    results = _ordered(pool, items, 2 * workers) if pool is not None else map(_tokenize, items)
    writer: _ShardWriter | None = None
    finished = False
    try:
        for item, flat, lengths in results:
            if isinstance(item, _Chunk):
                assert flat is not None and lengths is not None
                if writer is None:
                    writer = _ShardWriter(out, item.shard)
                writer.add(flat, lengths)
                bar.update(int(flat.size), int(lengths.size), item.raw_done)
                continue
            if item.shard in done:
                meta = done[item.shard]
                if (meta["docs"], meta["text_bytes"], meta["first_doc"]) != (item.docs, item.text_bytes,
                                                                                item.first_doc):
                    raise PrepError(f"{out}/{meta['file']} was cut from different input; delete {out} or "
                                    "pass --overwrite")
                bar.update(int(meta["tokens"]), item.docs, 0)
            else:
                if writer is None:
                    writer = _ShardWriter(out, item.shard)
                meta = writer.close(item)
                writer = None
            metas[item.shard] = meta
            bar.shards += 1
        finished = True
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if writer is not None:
            writer.f.close()
            writer.tmp.unlink(missing_ok=True)
        bar.close(finished)
    shards = [metas[i] for i in sorted(metas)]
    for stale in out.glob("shard_*.json"):
        side = _read_sidecar(stale)
        if side is None or side["shard"] >= len(shards):
            raise PrepError(f"{stale} belongs to no shard of this prep; delete {out} or pass --overwrite")
    manifest = {
        "format": FORMAT,
        "tokenizer": plan.tokenizer,
        "vocab_size": O200K_HARMONY_VOCAB,
        "eos_id": tok.EOS_ID,
        "dtype": "uint32",
        "plan": plan.to_json(),
        "total_tokens": sum(s["tokens"] for s in shards),
        "total_docs": sum(s["docs"] for s in shards),
        "shards": shards,
    }
    _write_json(out / "manifest.json", manifest)
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / "manifest.json"
    if not path.is_file() and (directory / "plan.json").is_file():
        raise PrepError(f"{directory}: its `nmoe prep` did not finish (plan.json but no manifest.json); "
                        "re-run the same `nmoe prep` command to finish it")
    if not path.is_file():
        raise PrepError(f"{directory}: no manifest.json; build the dataset with `nmoe prep --out "
                        f"{directory}` (no inputs = the embedded default corpus)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PrepError(f"{path} is not valid JSON ({e}); re-run the same `nmoe prep` command to rewrite "
                        "it") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise PrepError(f"{path}: format {got!r}, expected {FORMAT!r}; re-run `nmoe prep`")
    return manifest


def verify(directory: Path) -> list[str]:
    """Problems found (empty = every shard matches the manifest's sha256 and sizes, and every token id is
    below its vocab_size)."""
    manifest = read_manifest(directory)
    vocab = int(manifest["vocab_size"])
    problems: list[str] = []
    for meta in manifest["shards"]:
        bin_path, idx_path = directory / meta["file"], directory / meta["index"]
        fix = (f"delete {bin_path.name}, {idx_path.name} and {shard_name(meta['shard'])}.json and re-run the "
               "same `nmoe prep` command to rebuild exactly that shard")
        if not bin_path.is_file() or not idx_path.is_file():
            problems.append(f"{bin_path}: missing shard or index; {fix}")
            continue
        size = bin_path.stat().st_size
        if size != 4 * meta["tokens"]:
            problems.append(f"{bin_path}: {size} bytes, manifest says {4 * meta['tokens']}; corrupt shard; "
                            f"{fix}")
            continue
        got = sha256_file(bin_path)
        if got != meta["sha256"]:
            problems.append(f"{bin_path}: sha256 {got} != manifest {meta['sha256']}; corrupt shard; {fix}")
            continue
        if sha256_file(idx_path) != meta["index_sha256"]:
            problems.append(f"{idx_path}: sha256 differs from the manifest; corrupt index; {fix}")
            continue
        offsets = np.fromfile(idx_path, dtype="<u8")
        ids = np.memmap(bin_path, dtype="<u4", mode="r") if size else np.zeros(0, "<u4")
        ends = offsets[1:].astype(np.int64) - 1
        if offsets.size != meta["docs"] + 1 or (ends.size and not bool((ids[ends] == tok.EOS_ID).all())):
            problems.append(f"{idx_path}: document index does not match the shard's EOS tokens; {fix}")
        elif ids.size and (top := int(ids.max())) >= vocab:
            problems.append(f"{bin_path}: token id {top} at position {int(ids.argmax())} >= vocab_size "
                            f"{vocab} of the manifest; {fix}")
    return problems


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nmoe prep", description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="*", help="text/jsonl/parquet files or directories (default: the embedded "
                   "Shakespeare corpus)")
    p.add_argument("--out", default=None, help=f"output directory (default {DEFAULT_OUT}, or the config's "
                   "data.dataset_dir with --config)")
    p.add_argument("--config", default=None, help="take --out from this config's data.dataset_dir")
    p.add_argument("--hf", default=None, metavar="NAME", help="Hugging Face dataset name (needs `datasets`)")
    p.add_argument("--hf-config", default=None)
    p.add_argument("--hf-split", default="train")
    p.add_argument("--hf-revision", default=None)
    p.add_argument("--text-field", default="text", help="jsonl key / parquet or HF column holding the text")
    p.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES,
                   help="UTF-8 text bytes per shard (decides document->shard assignment)")
    p.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 16))
    p.add_argument("--overwrite", action="store_true", help="replace an output dir prepped differently")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--verify", metavar="DIR", default=None, help="re-check every shard's sha256 and exit")
    return p


def _out_dir(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return Path(args.out)
    if args.config is not None:
        from nmoe.config import ConfigError, load_config

        cfg = Path(args.config)
        if cfg.is_dir():
            raise PrepError(f"--config {cfg} is a directory; pass a TOML file such as configs/tiny.toml")
        try:
            return Path(load_config(cfg).data.dataset_dir)
        except ConfigError as e:
            raise PrepError(f"--config {cfg}: {e}") from None
        except UnicodeDecodeError as e:
            raise PrepError(f"--config {cfg} is not UTF-8 ({e}); save the TOML file as UTF-8") from None
        except OSError as e:
            raise PrepError(f"--config {cfg}: cannot read it ({e.strerror}); pass a readable TOML "
                            "file") from None
    return Path(DEFAULT_OUT)


def _os_error(e: OSError, out: Path) -> str:
    """One line for a file-system failure: a write under --out names the --out fix, a read its input."""
    where = Path(e.filename) if e.filename else out
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"{where}: no space left on device; free space or choose another --out, then re-run the same "
                "command (finished shards are kept)")
    inside = where == out or out in where.parents
    if inside and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {where} ({e.strerror}); choose a writable --out"
    if inside:
        return f"{where}: {e.strerror}; check --out"
    return f"cannot read {where} ({e.strerror}); check the input's path and permissions"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out or DEFAULT_OUT)
    try:
        if args.verify is not None:
            problems = verify(Path(args.verify))
            for line in problems:
                print(f"nmoe prep --verify: {line}", file=sys.stderr)
            if not problems:
                n = len(read_manifest(Path(args.verify))["shards"])
                print(f"{args.verify}: {n} shards verified")
            return 1 if problems else 0
        if args.shard_bytes < 1 or args.workers < 1:
            raise PrepError("--shard-bytes and --workers must be >= 1")
        out = _out_dir(args)
        docs: Iterable[tuple[str, int]]
        if args.hf is not None:
            if args.inputs:
                raise PrepError("give either local inputs or --hf, not both")
            spec = HFSpec(args.hf, args.hf_config, args.hf_split, args.hf_revision)
            sources: tuple[dict[str, Any], ...] = ({"hf": dataclasses.asdict(spec)},)
            docs, total = iter_hf_documents(spec, args.text_field), 0
        else:
            files = expand_inputs(args.inputs or [DEFAULT_CORPUS])
            sources = describe_files(files)
            docs, total = _chain_files(files, args.text_field), sum(s["bytes"] for s in sources)
        plan = PrepPlan(sources=sources, text_field=args.text_field, shard_bytes=args.shard_bytes)
        t0 = time.monotonic()
        manifest = prepare(out, docs, plan, workers=args.workers, overwrite=args.overwrite, total_raw=total,
                           progress=not args.no_progress)
    except PrepError as e:
        print(f"nmoe prep: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"nmoe prep: {_os_error(e, out)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.verify is not None:
            print("nmoe prep: --verify interrupted; nothing was changed", file=sys.stderr)
            return INTERRUPTED_RC
        print(f"nmoe prep: interrupted; {out} is unfinished (no manifest.json) and keeps its finished "
              "shards; re-run the same command to resume", file=sys.stderr)
        return INTERRUPTED_RC
    print(f"{out}: {manifest['total_docs']:,} docs, {manifest['total_tokens']:,} tokens in "
          f"{len(manifest['shards'])} shards ({time.monotonic() - t0:.1f} s)")
    return 0


def _chain_files(files: Sequence[Path], text_field: str) -> Iterator[tuple[str, int]]:
    base = 0
    for f in files:
        for text, raw in iter_file_documents(f, text_field):
            yield text, base + raw
        base += f.stat().st_size
