"""TOML -> frozen dataclasses, with validation, env/CLI overrides, fingerprint and diff.

Precedence: dataclass default < TOML file < env NMOE_<SECTION>__<KEY> < CLI --section.key=value.
Every problem raises ConfigError with one line: "config error: <dotted.path>: <problem>; <fix>".
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import tomllib
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from nmoe.constants import FP8_WEIGHT_BLOCK, NVFP4_BLOCK, O200K_HARMONY, O200K_HARMONY_VOCAB

ENV_PREFIX = "NMOE_"
TOKENIZERS = (O200K_HARMONY, "none")
TOKENIZER_VOCAB = {O200K_HARMONY: O200K_HARMONY_VOCAB}


class ConfigError(ValueError):
    """The single error type of config loading; str() is one line naming the key and the fix."""

    def __init__(self, path: str, problem: str, fix: str) -> None:
        self.path, self.problem, self.fix = path, problem, fix
        super().__init__(f"config error: {path}: {problem}; {fix}")


def _spec(
    default: Any,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    choices: tuple[Any, ...] | None = None,
) -> Any:
    meta = {"lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open, "choices": choices}
    return field(default=default, metadata=meta)


def _range_text(meta: Mapping[str, Any]) -> str:
    parts = []
    if meta["lo"] is not None:
        parts.append(f"{'>' if meta['lo_open'] else '>='} {meta['lo']}")
    if meta["hi"] is not None:
        parts.append(f"{'<' if meta['hi_open'] else '<='} {meta['hi']}")
    return " and ".join(parts)


def _type_name(tp: Any) -> str:
    return {int: "integer", float: "float", str: "string", bool: "boolean"}[tp]


class _Section:
    """Field-level validation shared by every section: exact type, finite, range, choices."""

    SECTION: ClassVar[str] = ""

    def _p(self, key: str) -> str:
        return f"{self.SECTION}.{key}"

    def _check_fields(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            tp, value, meta, path = hints[f.name], getattr(self, f.name), f.metadata, self._p(f.name)
            ok = isinstance(value, tp) and not (tp is not bool and isinstance(value, bool))
            if tp is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                object.__setattr__(self, f.name, value)
                ok = True
            if not ok:
                rng = _range_text(meta) if meta.get("lo") is not None or meta.get("hi") is not None else ""
                raise ConfigError(
                    path, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}",
                    f"write a TOML {_type_name(tp)}" + (f" ({rng})" if rng else ""),
                )
            if tp is float and not math.isfinite(value):
                raise ConfigError(path, f"{value!r} is not finite", "use a finite number")
            if meta.get("choices") is not None and value not in meta["choices"]:
                raise ConfigError(
                    path, f"{value!r} is not accepted", "use one of " + ", ".join(map(str, meta["choices"]))
                )
            lo, hi = meta.get("lo"), meta.get("hi")
            bad_lo = lo is not None and (value <= lo if meta["lo_open"] else value < lo)
            bad_hi = hi is not None and (value >= hi if meta["hi_open"] else value > hi)
            if bad_lo or bad_hi:
                raise ConfigError(path, f"{value!r} is out of range", f"accepted range: {_range_text(meta)}")


@dataclass(frozen=True)
class ModelConfig(_Section):
    """DeepSeek-shaped MoE: MLA attention, dense first layers, shared + routed experts."""

    SECTION: ClassVar[str] = "model"

    vocab_size: int = _spec(O200K_HARMONY_VOCAB, lo=2)
    dim: int = _spec(64, lo=1)
    n_layers: int = _spec(3, lo=1)
    n_dense_layers: int = _spec(1, lo=0)
    n_heads: int = _spec(2, lo=1)
    q_lora_rank: int = _spec(0, lo=0)
    kv_lora_rank: int = _spec(32, lo=1)
    qk_nope_head_dim: int = _spec(16, lo=1)
    qk_rope_head_dim: int = _spec(8, lo=2)
    v_head_dim: int = _spec(16, lo=1)
    inter_dim: int = _spec(128, lo=1)
    moe_inter_dim: int = _spec(32, lo=1)
    n_routed_experts: int = _spec(8, lo=1)
    n_shared_experts: int = _spec(1, lo=0)
    n_activated_experts: int = _spec(2, lo=1)
    n_expert_groups: int = _spec(1, lo=1)
    n_limited_groups: int = _spec(1, lo=1)
    route_scale: float = _spec(1.0, lo=0.0, lo_open=True)
    score_func: str = _spec("sigmoid", choices=("sigmoid", "softmax"))
    expert_dtype: str = _spec("bf16", choices=("bf16", "fp8", "nvfp4"))
    activation: str = _spec("swiglu", choices=("swiglu", "relu2"))
    max_seq_len: int = _spec(128, lo=1)
    rope_theta: float = _spec(10000.0, lo=1.0, lo_open=True)
    rope_factor: float = _spec(1.0, lo=1.0)
    original_seq_len: int = _spec(128, lo=1)
    beta_fast: float = _spec(32.0, lo=0.0, lo_open=True)
    beta_slow: float = _spec(1.0, lo=0.0, lo_open=True)
    mscale: float = _spec(1.0, lo=0.0)
    norm_eps: float = _spec(1e-6, lo=0.0, lo_open=True, hi=1e-2)
    bias_update_rate: float = _spec(1e-3, lo=0.0)
    bias_clamp: float = _spec(1.0, lo=0.0, lo_open=True)
    permute_align: int = _spec(8, lo=1, hi=1024)
    tokenizer: str = _spec(O200K_HARMONY, choices=TOKENIZERS)
    init_std: float = _spec(0.02, lo=0.0, lo_open=True)

    def __post_init__(self) -> None:
        self._check_fields()
        p = self._p
        if self.n_dense_layers > self.n_layers:
            raise ConfigError(p("n_dense_layers"), f"{self.n_dense_layers} > model.n_layers={self.n_layers}",
                              "set n_dense_layers <= n_layers")
        if self.n_activated_experts > self.n_routed_experts:
            raise ConfigError(p("n_activated_experts"),
                              f"{self.n_activated_experts} > model.n_routed_experts={self.n_routed_experts}",
                              "set n_activated_experts <= n_routed_experts")
        if self.n_routed_experts % self.n_expert_groups:
            raise ConfigError(p("n_expert_groups"),
                              f"{self.n_routed_experts} routed experts do not split into "
                              f"{self.n_expert_groups} groups", "use a divisor of n_routed_experts")
        if self.n_limited_groups > self.n_expert_groups:
            raise ConfigError(p("n_limited_groups"), f"{self.n_limited_groups} > model.n_expert_groups="
                              f"{self.n_expert_groups}", "set n_limited_groups <= n_expert_groups")
        reachable = self.n_limited_groups * (self.n_routed_experts // self.n_expert_groups)
        if self.n_activated_experts > reachable:
            raise ConfigError(p("n_activated_experts"), f"{self.n_activated_experts} > {reachable} experts "
                              "reachable in the limited groups", "raise n_limited_groups or lower top-k")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(p("qk_rope_head_dim"), f"{self.qk_rope_head_dim} is odd",
                              "use an even size (rope rotates interleaved pairs)")
        if self.beta_fast <= self.beta_slow:
            raise ConfigError(p("beta_fast"), f"{self.beta_fast} <= model.beta_slow={self.beta_slow}",
                              "YaRN needs beta_fast > beta_slow (e.g. 32 and 1)")
        want = TOKENIZER_VOCAB.get(self.tokenizer)
        if want is not None and self.vocab_size != want:
            raise ConfigError(p("vocab_size"), f"{self.vocab_size} does not match tokenizer "
                              f"{self.tokenizer!r}", f"set vocab_size = {want} (or tokenizer = \"none\" for "
                              "synthetic token ids)")
        block = {"fp8": FP8_WEIGHT_BLOCK, "nvfp4": NVFP4_BLOCK}.get(self.expert_dtype)
        for name in ("dim", "moe_inter_dim"):
            if block is not None and getattr(self, name) % block:
                raise ConfigError(p(name), f"{getattr(self, name)} is not a multiple of {block}, the "
                                  f"{self.expert_dtype} scale block", f"use a multiple of {block} or "
                                  "expert_dtype = \"bf16\"")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class OptimConfig(_Section):
    """Separate LR / weight decay for dense, router and expert parameters."""

    SECTION: ClassVar[str] = "optim"

    name: str = _spec("adamw", choices=("adamw", "muon"))
    lr_dense: float = _spec(3e-4, lo=0.0)
    lr_router: float = _spec(3e-4, lo=0.0)
    lr_expert: float = _spec(3e-4, lo=0.0)
    weight_decay_dense: float = _spec(0.1, lo=0.0)
    weight_decay_router: float = _spec(0.0, lo=0.0)
    weight_decay_expert: float = _spec(0.1, lo=0.0)
    beta1: float = _spec(0.9, lo=0.0, hi=1.0, hi_open=True)
    beta2: float = _spec(0.95, lo=0.0, hi=1.0, hi_open=True)
    eps: float = _spec(1e-8, lo=0.0, lo_open=True)
    muon_momentum: float = _spec(0.95, lo=0.0, hi=1.0, hi_open=True)
    muon_ns_steps: int = _spec(5, lo=1, hi=20)
    grad_clip: float = _spec(1.0, lo=0.0)

    def __post_init__(self) -> None:
        self._check_fields()


@dataclass(frozen=True)
class ScheduleConfig(_Section):
    """Warmup-stable-decay, measured in tokens so it survives batch-size changes."""

    SECTION: ClassVar[str] = "schedule"

    warmup_tokens: int = _spec(0, lo=0)
    total_tokens: int = _spec(1_000_000, lo=1)
    decay_fraction: float = _spec(0.2, lo=0.0, hi=1.0)
    min_lr_ratio: float = _spec(0.1, lo=0.0, hi=1.0)

    def __post_init__(self) -> None:
        self._check_fields()
        decay = self.decay_fraction * self.total_tokens
        if self.warmup_tokens + decay > self.total_tokens:
            raise ConfigError(self._p("warmup_tokens"), f"warmup {self.warmup_tokens} + decay {decay:.0f} > "
                              f"schedule.total_tokens={self.total_tokens}",
                              "shorten warmup, lower decay_fraction or raise total_tokens")


@dataclass(frozen=True)
class DataConfig(_Section):
    SECTION: ClassVar[str] = "data"

    dataset_dir: str = _spec("data/default")
    mixture: str = _spec("")
    seq_len: int = _spec(32, lo=1)
    batch_size: int = _spec(2, lo=1)
    seed: int = _spec(0, lo=0)
    prefetch: int = _spec(2, lo=0)

    def __post_init__(self) -> None:
        self._check_fields()


@dataclass(frozen=True)
class TrainConfig(_Section):
    """The [train] section: precision, how a step runs (CUDA graph, accumulation, loss chunking) and expert
    parallelism; model = "reference" picks the CPU spec by name only, as the fast path never falls back."""
    # dtype is bf16 only: fp8/nvfp4 come from expert_dtype. Masters are fp32; AdamW moments are fp32 or
    # bf16 (stored rounded, halving the bytes each step moves). cuda_graph: forward and backward replay as
    # one CUDA graph after the first step, which runs eagerly. grad_accum: microbatches of data.batch_size
    # sequences per optimizer step, their gradients summed, then averaged in the step. ce_chunk: tokens per
    # chunk of the loss head, so only ce_chunk x vocab fp32 logits exist at a time. expert_parallel: routed
    # experts are sharded over all ranks and rows move by RDEP; a rank receives at most ep_capacity x its
    # own tokens x top-k rows, and more raises.

    SECTION: ClassVar[str] = "train"

    seed: int = _spec(0, lo=0)
    device: str = _spec("cuda", choices=("cuda", "cpu"))
    model: str = _spec("fast", choices=("fast", "reference"))
    dtype: str = _spec("bf16", choices=("bf16",))
    param_dtype: str = _spec("fp32", choices=("fp32", "bf16"))
    optim_state_dtype: str = _spec("fp32", choices=("fp32", "bf16"))
    log_every: int = _spec(10, lo=1)
    grad_accum: int = _spec(1, lo=1)
    ce_chunk: int = _spec(4096, lo=1)
    cuda_graph: bool = _spec(False)
    expert_parallel: bool = _spec(False)
    ep_capacity: float = _spec(2.0, lo=0.0, lo_open=True)
    ep_timeout_s: float = _spec(60.0, lo=0.0, lo_open=True)
    run_name: str = _spec("run")
    experiment: str = _spec("default")

    def __post_init__(self) -> None:
        self._check_fields()
        if not self.run_name:
            raise ConfigError(self._p("run_name"), "empty", "give the run a name")
        if (self.device == "cpu") != (self.model == "reference"):
            raise ConfigError(self._p("model"), f'"{self.model}" on device "{self.device}"',
                              'the fast path runs on device = "cuda" (sm_90a/sm_100a); the spec model runs '
                              'on device = "cpu" with model = "reference"')
        if self.cuda_graph and self.device != "cuda":
            raise ConfigError(self._p("cuda_graph"), f'true on device "{self.device}"',
                              "CUDA graphs replay GPU work only; set train.cuda_graph = false for the CPU")
        if self.expert_parallel and self.model != "fast":
            raise ConfigError(self._p("expert_parallel"), f'true with model "{self.model}"',
                              'expert parallelism runs over RDEP on the fast path; set train.model = "fast"')


@dataclass(frozen=True)
class CheckpointConfig(_Section):
    """every_steps = 0 disables periodic checkpoints."""

    SECTION: ClassVar[str] = "checkpoint"

    dir: str = _spec("checkpoints/run")
    every_steps: int = _spec(1000, lo=0)
    keep_last: int = _spec(3, lo=1)
    allow_fingerprint_change: bool = _spec(False)

    def __post_init__(self) -> None:
        self._check_fields()


@dataclass(frozen=True)
class MetricsConfig(_Section):
    SECTION: ClassVar[str] = "metrics"

    db_path: str = _spec("runs/experiments.sqlite")
    dir: str = _spec("runs/run/metrics")

    def __post_init__(self) -> None:
        self._check_fields()


SECTIONS: dict[str, type[_Section]] = {
    "model": ModelConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
}


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(name, f"expected {cls.__name__}", f"pass a {cls.__name__} instance")
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError("data.seq_len", f"{self.data.seq_len} > model.max_seq_len="
                              f"{self.model.max_seq_len}", "shorten seq_len or raise model.max_seq_len")
        if self.train.optim_state_dtype == "bf16" and self.optim.name == "muon":
            raise ConfigError("train.optim_state_dtype", '"bf16" with optim.name = "muon"',
                              "bf16 state is AdamW's moments only (Muon's momentum buffer has no bf16 form); "
                              'set optim_state_dtype = "fp32" or optim.name = "adamw"')
        if self.train.expert_parallel and self.model.expert_dtype not in ("bf16", "fp8"):
            raise ConfigError("train.expert_parallel", f'true with expert_dtype "{self.model.expert_dtype}"',
                              "expert parallelism runs the fast MoE layer, whose sm_90a path has no nvfp4 "
                              'MMA; set model.expert_dtype = "bf16" or "fp8"')


def _suggest(key: str, valid: Iterable[str], prefix: str) -> str:
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return f"did you mean {prefix}{close[0]}?"
    return "valid keys: " + ", ".join(prefix + v for v in valid)


def _parse_value(text: str) -> Any:
    """Override values are TOML literals when they parse as one, else plain strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set(raw: dict[str, dict[str, Any]], section: str, key: str, text: str, origin: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"{section}.{key}", f"unknown section {section!r} (from {origin})",
                          _suggest(section, SECTIONS, ""))
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}  # type: ignore[arg-type]
    if key not in fields:
        raise ConfigError(f"{section}.{key}", f"unknown key (from {origin})",
                          _suggest(key, fields, f"{section}."))
    value = _parse_value(text)
    if typing.get_type_hints(SECTIONS[section])[key] is str and not isinstance(value, str):
        value = text
    raw.setdefault(section, {})[key] = value


def env_overrides(env: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(section, key, text) for every NMOE_<SECTION>__<KEY>; other NMOE_* vars belong to other tools."""
    out = []
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and "__" in name[len(ENV_PREFIX):]:
            section, key = name[len(ENV_PREFIX):].split("__", 1)
            out.append((section.lower(), key.lower(), env[name]))
    return out


def cli_overrides(args: Iterable[str]) -> list[tuple[str, str, str]]:
    out = []
    for arg in args:
        head, eq, text = arg.partition("=")
        dotted = head[2:]
        section, dot, key = dotted.partition(".")
        if not head.startswith("--") or not eq or not dot or not section or not key or "." in key:
            raise ConfigError(arg, "malformed override", "write --section.key=value (e.g. --model.dim=128)")
        out.append((section, key, text))
    return out


def from_dict(
    raw: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    overrides: Iterable[str] = (),
) -> Config:
    """Build and validate a Config from a nested {section: {key: value}} mapping plus overrides."""
    data: dict[str, dict[str, Any]] = {}
    for section, table in raw.items():
        if section not in SECTIONS:
            raise ConfigError(section, "unknown section", _suggest(section, SECTIONS, ""))
        if not isinstance(table, Mapping):
            raise ConfigError(section, f"expected a table, got {type(table).__name__}",
                              f"write [{section}] followed by key = value lines")
        names = {f.name for f in dataclasses.fields(SECTIONS[section])}  # type: ignore[arg-type]
        for key in table:
            if key not in names:
                raise ConfigError(f"{section}.{key}", "unknown key", _suggest(key, names, f"{section}."))
        data[section] = dict(table)
    for section, key, text in env_overrides(env or {}):
        _set(data, section, key, text, f"env {ENV_PREFIX}{section.upper()}__{key.upper()}")
    for section, key, text in cli_overrides(overrides):
        _set(data, section, key, text, f"--{section}.{key}")
    sections = {name: cls(**data.get(name, {})) for name, cls in SECTIONS.items()}
    return Config(**sections)  # type: ignore[arg-type]


def load_config(
    path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    overrides: Iterable[str] = (),
) -> Config:
    """Load a TOML config; env defaults to os.environ."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(str(p), "file not found", "pass an existing TOML file (see configs/)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(p), f"invalid TOML ({e})", "fix the syntax") from None
    return from_dict(raw, os.environ if env is None else env, overrides)


def to_dict(cfg: Config | _Section) -> dict[str, Any]:
    return dataclasses.asdict(cfg)  # type: ignore[arg-type]


def fingerprint(cfg: Config | _Section | Mapping[str, Any]) -> str:
    """sha256 of canonical JSON (sorted keys, no whitespace) of the resolved values."""
    d = cfg if isinstance(cfg, Mapping) else to_dict(cfg)
    text = json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def diff(a: Config | Mapping[str, Any], b: Config | Mapping[str, Any]) -> list[str]:
    """Sorted dotted keys whose values differ (or exist on one side only)."""
    fa = _flatten(a if isinstance(a, Mapping) else to_dict(a))
    fb = _flatten(b if isinstance(b, Mapping) else to_dict(b))
    return sorted(k for k in fa.keys() | fb.keys() if k not in fa or k not in fb or fa[k] != fb[k]
                  or type(fa[k]) is not type(fb[k]))
