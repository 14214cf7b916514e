"""One global stream of sequences (smooth weighted round-robin over sources, keyed Feistel window order
per epoch); each rank reads its slice. A batch is a pure function of the loader state, so prefetching
ahead can never change what is read after a resume."""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import threading
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from torch import Tensor

from nmoe.data import prep
from nmoe.data.prep import PrepError, read_manifest
from nmoe.outpaths import user_cache_dir

STATE_VERSION: Final[int] = 1
_M64: Final[int] = (1 << 64) - 1


class DataError(RuntimeError):
    """Dataset, mixture or loader-state problem; the message names the file and the fix."""


@dataclass(frozen=True)
class SourceSpec:
    name: str
    path: str
    weight: float = 1.0


@dataclass(frozen=True)
class StageSpec:
    """A stage lasts `tokens` global tokens (0 = until the end); weights/temperature override the mixture."""

    name: str
    tokens: int = 0
    weights: Mapping[str, float] = field(default_factory=dict)
    temperature: float | None = None


@dataclass(frozen=True)
class Mixture:
    """Share of source i in a stage: p_i ∝ (w_i·n_i / Σ_j w_j·n_j)^(1/T), n_i = its token count."""

    sources: tuple[SourceSpec, ...]
    stages: tuple[StageSpec, ...]
    temperature: float = 1.0


def _positive(value: Any, where: str, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or \
            value < 0 or (value == 0 and not allow_zero):
        raise DataError(f"{where}: {value!r} must be a {'non-negative' if allow_zero else 'positive'} number")
    return float(value)


def load_mixture(path: str | Path) -> Mixture:
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise DataError(f"{p}: mixture file not found; see configs/mixtures/") from None
    except tomllib.TOMLDecodeError as e:
        raise DataError(f"{p}: invalid TOML ({e})") from None
    unknown = set(raw) - {"temperature", "sources", "stages", "description"}
    if unknown:
        raise DataError(f"{p}: unknown keys {sorted(unknown)}; allowed: description, temperature, sources, "
                        "stages")
    sources = []
    for i, s in enumerate(raw.get("sources", [])):
        where = f"{p}: sources[{i}]"
        if set(s) - {"name", "path", "weight"} or not isinstance(s.get("name"), str) or \
                not isinstance(s.get("path"), str):
            raise DataError(f"{where}: needs string name and path (optional weight), got {sorted(s)}")
        sources.append(SourceSpec(s["name"], s["path"], _positive(s.get("weight", 1.0), f"{where}.weight")))
    if not sources:
        raise DataError(f"{p}: no [[sources]]; add at least one with name and path")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise DataError(f"{p}: duplicate source names {names}")
    stages = []
    for i, st in enumerate(raw.get("stages", [{"name": "main"}])):
        where = f"{p}: stages[{i}]"
        extra = set(st) - {"name", "tokens", "weights", "temperature"}
        if extra:
            raise DataError(f"{where}: unknown keys {sorted(extra)}; allowed: name, tokens, weights, "
                            "temperature")
        weights = {k: _positive(v, f"{where}.weights.{k}", allow_zero=True)
                   for k, v in st.get("weights", {}).items()}
        if set(weights) - set(names):
            raise DataError(f"{where}: weights name unknown sources {sorted(set(weights) - set(names))}")
        tokens = st.get("tokens", 0)
        if not isinstance(tokens, int) or tokens < 0:
            raise DataError(f"{where}.tokens: {tokens!r} must be an integer >= 0 (0 = until the end)")
        temp = st.get("temperature")
        stages.append(StageSpec(str(st.get("name", f"stage{i}")), tokens, weights,
                                None if temp is None else _positive(temp, f"{where}.temperature")))
    for st in stages[:-1]:
        if st.tokens == 0:
            raise DataError(f"{p}: stage {st.name!r} has no token budget but is not the last stage")
    return Mixture(tuple(sources), tuple(stages), _positive(raw.get("temperature", 1.0), f"{p}: temperature"))


def single_source(path: str) -> Mixture:
    return Mixture((SourceSpec(Path(path).name or "data", path),), (StageSpec("main"),))


def _cache_file() -> Path:
    return user_cache_dir() / "verified-shards.json"


def _stamp(directory: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What a past verification vouches for: the manifest's bytes and every file's size and mtime."""
    files = {}
    for meta in manifest["shards"]:
        for name in (meta["file"], meta["index"]):
            st = (directory / name).stat()
            files[name] = [st.st_size, st.st_mtime_ns]
    return {"manifest_sha256": hashlib.sha256((directory / "manifest.json").read_bytes()).hexdigest(),
            "files": files}


def verify_hashes(directory: Path, manifest: Mapping[str, Any]) -> None:
    """Re-hash the shards against their manifest once; later runs skip it while sizes and mtimes hold."""
    key, cache_path = str(directory.resolve()), _cache_file()
    try:
        cache: dict[str, Any] = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    stamp = _stamp(directory, manifest)
    if cache.get(key) == stamp:
        return
    problems = prep.verify(directory)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DataError(f"{problems[0]}{more}; found when the run started, `nmoe prep --verify {directory}` "
                        "lists every problem")
    cache = {k: v for k, v in cache.items() if Path(k).is_dir()}
    cache[key] = stamp
    tmp = cache_path.with_name(f"{cache_path.name}.{os.getpid()}.tmp")
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, cache_path)
    except OSError:
        tmp.unlink(missing_ok=True)


class TokenSource:
    """The concatenated uint32 shards of one prepped directory, memory-mapped and checked against the
    manifest's hashes; `read` refuses ids outside the manifest's vocab, naming the shard."""

    def __init__(self, name: str, directory: Path) -> None:
        try:
            manifest = read_manifest(directory)
        except PrepError as e:
            raise DataError(str(e)) from None
        self.name, self.directory, self.manifest = name, directory, manifest
        self.arrays: list[np.ndarray] = []
        for meta in manifest["shards"]:
            path = directory / meta["file"]
            if not path.is_file() or path.stat().st_size != 4 * meta["tokens"]:
                raise DataError(f"{path}: missing or truncated (manifest says {meta['tokens']} tokens); run "
                                f"`nmoe prep --verify {directory}` and rebuild the shard it names")
            self.arrays.append(np.memmap(path, dtype="<u4", mode="r") if meta["tokens"] else
                               np.zeros(0, np.uint32))
        verify_hashes(directory, manifest)
        sizes = np.array([a.size for a in self.arrays], dtype=np.int64)
        self.ends = np.cumsum(sizes)
        self.total = int(self.ends[-1]) if sizes.size else 0
        digest = hashlib.sha256(json.dumps([m["sha256"] for m in manifest["shards"]]).encode())
        self.fingerprint = digest.hexdigest()
        self.vocab_size = int(manifest["vocab_size"])

    def read(self, start: int, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.int64)
        pos, done = start, 0
        shard = int(np.searchsorted(self.ends, pos, side="right"))
        while done < length:
            base = int(self.ends[shard - 1]) if shard else 0
            take = min(length - done, int(self.ends[shard]) - pos)
            chunk = self.arrays[shard][pos - base:pos - base + take]
            if take and int(chunk.max()) >= self.vocab_size:
                self._out_of_vocab(shard, pos - base, chunk)
            out[done:done + take] = chunk
            done, pos, shard = done + take, pos + take, shard + 1
        return out

    def _out_of_vocab(self, shard: int, offset: int, chunk: np.ndarray) -> None:
        at = int(np.argmax(chunk >= self.vocab_size))
        path = self.directory / self.manifest["shards"][shard]["file"]
        raise DataError(f"{path}: token id {int(chunk[at])} at token {offset + at} is outside the "
                        f"dataset's {self.vocab_size}-token vocab; the shard is corrupt or from another "
                        f"tokenizer: run `nmoe prep --verify {self.directory}` and rebuild it")


def _mix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def feistel_index(i: int, n: int, key: int, rounds: int = 4) -> int:
    """A keyed bijection of [0, n): balanced Feistel network on the next even bit width, cycle-walking."""
    if not 0 <= i < n:
        raise ValueError(f"index {i} outside [0, {n})")
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = [_mix64(key ^ (r * 0xA24BAED4963EE407)) for r in range(rounds)]
    x = i
    while True:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        x = (left << half) | right
        if x < n:
            return x


@dataclass
class LoaderState:
    global_seq: int
    stage: int
    swrr: list[float]
    source_seq: list[int]

    def copy(self) -> LoaderState:
        return LoaderState(self.global_seq, self.stage, list(self.swrr), list(self.source_seq))


@dataclass(frozen=True)
class Batch:
    inputs: Tensor
    targets: Tensor
    first_seq: int
    sources: tuple[int, ...]


class Loader:
    """Rank `rank` of `world` reads sequences [step·B·W + rank·B, +B) of the global stream."""

    def __init__(
        self,
        mixture: Mixture,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        prefetch: int = 2,
        vocab_size: int | None = None,
    ) -> None:
        if seq_len < 1 or batch_size < 1 or world < 1 or not 0 <= rank < world or prefetch < 0:
            raise DataError(f"loader: bad layout seq_len={seq_len} batch_size={batch_size} rank={rank} "
                            f"world={world} prefetch={prefetch}")
        self.mixture, self.seq_len, self.batch_size = mixture, seq_len, batch_size
        self.seed, self.rank, self.world, self.prefetch = seed, rank, world, prefetch
        self.sources = [TokenSource(s.name, Path(s.path)) for s in mixture.sources]
        for src in self.sources:
            if vocab_size is not None and src.vocab_size > vocab_size:
                raise DataError(f"{src.directory}: tokenized for a {src.vocab_size}-token vocab but "
                                f"model.vocab_size={vocab_size}; use model.tokenizer = \"o200k_harmony\"")
        self.windows = [max((s.total - 1) // seq_len, 0) for s in self.sources]
        self.shares = [self._stage_shares(st) for st in mixture.stages]
        for src, n in zip(self.sources, self.windows, strict=True):
            used = any(shares[self.sources.index(src)] > 0 for shares in self.shares)
            if used and n == 0:
                raise DataError(f"{src.directory}: {src.total} tokens cannot fill one sequence of "
                                f"seq_len+1={seq_len + 1}; prep more text or shorten data.seq_len")
        ends, acc = [], 0
        for st in mixture.stages:
            acc = acc + st.tokens if st.tokens else 0
            ends.append(-(-acc // seq_len) if st.tokens else -1)
        self.stage_end_seq = ends
        self._state = LoaderState(0, 0, [0.0] * len(self.sources), [0] * len(self.sources))
        self._queue: queue.Queue[tuple[Batch, LoaderState] | BaseException] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _stage_shares(self, st: StageSpec) -> list[float]:
        total = sum(s.total for s in self.sources) or 1
        temp = st.temperature if st.temperature is not None else self.mixture.temperature
        q = [st.weights.get(spec.name, spec.weight) * src.total / total
             for spec, src in zip(self.mixture.sources, self.sources, strict=True)]
        if sum(q) <= 0:
            raise DataError(f"mixture stage {st.name!r}: every source has zero weight or zero tokens")
        p = [x ** (1.0 / temp) if x > 0 else 0.0 for x in q]
        s = sum(p)
        return [x / s for x in p]

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size * self.world

    def _advance(self, st: LoaderState) -> int:
        """Pick the source of global sequence st.global_seq (smooth weighted round-robin) and step st."""
        while self.stage_end_seq[st.stage] != -1 and st.global_seq >= self.stage_end_seq[st.stage]:
            st.stage += 1
            st.swrr = [0.0] * len(self.sources)
        shares = self.shares[st.stage]
        best = -1
        for i, w in enumerate(shares):
            if w <= 0:
                continue
            st.swrr[i] += w
            if best < 0 or st.swrr[i] > st.swrr[best]:
                best = i
        st.swrr[best] -= 1.0
        st.global_seq += 1
        return best

    def _window(self, src: int, k: int) -> np.ndarray:
        n = self.windows[src]
        epoch, j = divmod(k, n)
        key = _mix64(_mix64(_mix64(self.seed) ^ src) ^ epoch)
        w = feistel_index(j, n, key)
        return self.sources[src].read(w * self.seq_len, self.seq_len + 1)

    def _make(self, state: LoaderState) -> tuple[Batch, LoaderState]:
        st = state.copy()
        rows, picked = [], []
        first = st.global_seq + self.rank * self.batch_size
        for slot in range(self.batch_size * self.world):
            src = self._advance(st)
            k = st.source_seq[src]
            st.source_seq[src] += 1
            if self.rank * self.batch_size <= slot < (self.rank + 1) * self.batch_size:
                rows.append(self._window(src, k))
                picked.append(src)
        tokens = torch.from_numpy(np.stack(rows))
        batch = Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), first, tuple(picked))
        return batch, st

    def _producer(self, start: LoaderState) -> None:
        assert self._queue is not None
        st = start
        try:
            while not self._stop.is_set():
                item = self._make(st)
                st = item[1]
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:
            self._queue.put(e)

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> Batch:
        if self.prefetch == 0:
            batch, self._state = self._make(self._state)
            return batch
        if self._thread is None:
            self._stop.clear()
            self._queue = queue.Queue(maxsize=self.prefetch)
            self._thread = threading.Thread(target=self._producer, args=(self._state.copy(),), daemon=True,
                                            name="nmoe-loader")
            self._thread.start()
        assert self._queue is not None
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        batch, self._state = item
        return batch

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread, self._queue = None, None

    def _layout(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "global_batch": self.batch_size * self.world, "seed": self.seed,
                "sources": [[s.name, s.fingerprint] for s in self.sources],
                "stages": [[st.name, st.tokens] for st in self.mixture.stages], "shares": self.shares}

    def state_dict(self) -> dict[str, Any]:
        """The state after the last batch handed out (prefetched batches are not counted)."""
        st = self._state
        return {"version": STATE_VERSION, "global_seq": st.global_seq, "stage": st.stage,
                "swrr": list(st.swrr), "source_seq": list(st.source_seq), "layout": self._layout()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise DataError(f"loader state version {state.get('version')!r}, expected {STATE_VERSION}")
        have, want = state["layout"], json.loads(json.dumps(self._layout()))
        if have != want:
            keys = sorted(k for k in want if have.get(k) != want[k])
            raise DataError(f"loader state was written for a different data layout (differs in: "
                            f"{', '.join(keys)}); resume with the original dataset, mixture, seq_len, global "
                            "batch and seed")
        self.close()
        self._state = LoaderState(int(state["global_seq"]), int(state["stage"]),
                                  [float(x) for x in state["swrr"]], [int(x) for x in state["source_seq"]])


def build_loader(
    dataset_dir: str,
    mixture_path: str,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    prefetch: int,
    rank: int = 0,
    world: int = 1,
    vocab_size: int | None = None,
) -> Loader:
    mixture = load_mixture(mixture_path) if mixture_path else single_source(dataset_dir)
    return Loader(mixture, seq_len=seq_len, batch_size=batch_size, seed=seed, rank=rank, world=world,
                  prefetch=prefetch, vocab_size=vocab_size)
