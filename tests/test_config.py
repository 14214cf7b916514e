"""Config loading: errors name the key and the fix, overrides, fingerprint, diff, shipped configs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from pathlib import Path

import pytest

from nmoe import constants
from nmoe.config import (
    SECTIONS,
    Config,
    ConfigError,
    ModelConfig,
    OptimConfig,
    ScheduleConfig,
    diff,
    fingerprint,
    from_dict,
    load_config,
    to_dict,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SHIPPED = ("tiny", "moonlet", "moonlight")



def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def _err(excinfo: pytest.ExceptionInfo[ConfigError]) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.startswith("config error: ")
    return msg


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_loads_and_is_explicit(name: str) -> None:
    path = CONFIGS / f"{name}.toml"
    cfg = load_config(path, env={})
    raw = tomllib.loads(path.read_text())
    for section, cls in SECTIONS.items():
        want = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        assert set(raw[section]) == want, f"{name}.toml [{section}] must set every field explicitly"
    assert cfg.model.tokenizer == "o200k_harmony" and cfg.model.vocab_size == 201088


def test_shipped_shapes() -> None:
    tiny = load_config(CONFIGS / "tiny.toml", env={})
    assert tiny.model.dim == 64 and 2 <= tiny.model.n_layers <= 4 and tiny.model.n_dense_layers == 1
    tm = tiny.model
    assert (tm.n_routed_experts, tm.n_activated_experts, tm.n_shared_experts) == (8, 2, 1)
    ml = load_config(CONFIGS / "moonlight.toml", env={}).model
    assert (ml.dim, ml.n_layers, ml.n_dense_layers) == (2048, 27, 1)
    assert (ml.n_routed_experts, ml.n_shared_experts) == (64, 2)
    assert (ml.n_activated_experts, ml.kv_lora_rank, ml.qk_rope_head_dim) == (6, 512, 64)
    mt = load_config(CONFIGS / "moonlet.toml", env={}).model
    assert (mt.dim, mt.n_layers, mt.n_routed_experts, mt.n_activated_experts) == (2048, 16, 64, 6)


def test_constants() -> None:
    assert constants.E4M3_MAX == 448.0 and constants.E2M1_MAX == 6.0 and constants.E2M1_VALUES[-1] == 6.0
    assert constants.O200K_HARMONY_VOCAB == 201088 and constants.NVFP4_BLOCK == 16


def test_unknown_key_suggests_closest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(_write(tmp_path, "[model]\ndimm = 4\n"), env={})
    msg = _err(ei)
    assert msg.startswith("config error: model.dimm: unknown key") and "did you mean model.dim?" in msg


def test_unknown_section_and_no_close_match(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config error: modle: unknown section; did you mean model\?"):
        load_config(_write(tmp_path, "[modle]\ndim = 4\n"), env={})
    with pytest.raises(ConfigError, match=r"optim.zzzzzz: unknown key; valid keys: optim.beta1"):
        from_dict({"optim": {"zzzzzz": 1}})
    with pytest.raises(ConfigError, match=r"config error: model: expected a table, got int; write \[model\]"):
        from_dict({"model": 3})


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (
            {"model": {"dim": "big"}},
            "model.dim: expected integer, got str 'big'; write a TOML integer (>= 1)",
        ),
        ({"model": {"dim": True}}, "model.dim: expected integer, got bool"),
        ({"model": {"route_scale": True}}, "model.route_scale: expected float, got bool"),
        (
            {"checkpoint": {"allow_fingerprint_change": 1}},
            "expected boolean, got int 1; write a TOML boolean",
        ),
        ({"train": {"run_name": 7}}, "train.run_name: expected string"),
        ({"model": {"route_scale": float("inf")}}, "model.route_scale: inf is not finite"),
    ],
)
def test_wrong_type(raw: dict[str, dict[str, object]], needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        from_dict(raw)
    assert needle in _err(ei)


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"model": {"dim": 0}}, "model.dim: 0 is out of range; accepted range: >= 1"),
        ({"model": {"route_scale": 0.0}}, "model.route_scale: 0.0 is out of range; accepted range: > 0.0"),
        ({"optim": {"beta2": 1.0}}, "optim.beta2: 1.0 is out of range; accepted range: >= 0.0 and < 1.0"),
        ({"model": {"permute_align": 4096}}, "accepted range: >= 1 and <= 1024"),
        (
            {"model": {"expert_dtype": "fp16"}},
            "model.expert_dtype: 'fp16' is not accepted; use one of bf16, fp8, nvfp4",
        ),
        ({"model": {"score_func": "relu"}}, "use one of sigmoid, softmax"),
        ({"train": {"run_name": ""}}, "train.run_name: empty"),
        ({"train": {"param_dtype": "fp16"}},
         "train.param_dtype: 'fp16' is not accepted; use one of fp32, bf16"),
        ({"train": {"optim_state_dtype": "fp16"}}, "train.optim_state_dtype: 'fp16' is not accepted"),
    ],
)
def test_out_of_range(raw: dict[str, dict[str, object]], needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        from_dict(raw)
    assert needle in _err(ei)


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        (
            {"n_layers": 2, "n_dense_layers": 3},
            "model.n_dense_layers: 3 > model.n_layers=2; set n_dense_layers <= n_layers",
        ),
        (
            {"n_routed_experts": 4, "n_activated_experts": 5},
            "model.n_activated_experts: 5 > model.n_routed_experts=4",
        ),
        (
            {"n_routed_experts": 8, "n_expert_groups": 3},
            "model.n_expert_groups: 8 routed experts do not split",
        ),
        (
            {"n_expert_groups": 2, "n_limited_groups": 3},
            "model.n_limited_groups: 3 > model.n_expert_groups=2",
        ),
        ({"n_routed_experts": 8, "n_expert_groups": 4, "n_limited_groups": 1, "n_activated_experts": 3},
         "model.n_activated_experts: 3 > 2 experts reachable"),
        ({"qk_rope_head_dim": 7}, "model.qk_rope_head_dim: 7 is odd"),
        ({"beta_fast": 1.0, "beta_slow": 2.0}, "model.beta_fast: 1.0 <= model.beta_slow=2.0"),
        (
            {"vocab_size": 1000},
            "model.vocab_size: 1000 does not match tokenizer 'o200k_harmony'; set vocab_size = 201088",
        ),
        ({"expert_dtype": "fp8", "dim": 64}, "model.dim: 64 is not a multiple of 128, the fp8 scale block"),
        (
            {"expert_dtype": "nvfp4", "dim": 64, "moe_inter_dim": 24},
            "model.moe_inter_dim: 24 is not a multiple of 16",
        ),
    ],
)
def test_cross_field(model: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        from_dict({"model": model})
    assert needle in _err(ei)


def test_cross_section_and_schedule() -> None:
    with pytest.raises(ConfigError, match=r"data.seq_len: 256 > model.max_seq_len=128"):
        from_dict({"data": {"seq_len": 256}})
    with pytest.raises(
        ConfigError,
        match=r"schedule.warmup_tokens: warmup 90 \+ decay 20 > schedule.total_tokens=100",
    ):
        ScheduleConfig(warmup_tokens=90, total_tokens=100, decay_fraction=0.2)
    with pytest.raises(ConfigError, match=r"model: expected ModelConfig"):
        Config(model=OptimConfig())  # type: ignore[arg-type]


def test_small_vocab_needs_tokenizer_none() -> None:
    m = ModelConfig(tokenizer="none", vocab_size=97)
    assert m.vocab_size == 97 and m.qk_head_dim == m.qk_nope_head_dim + m.qk_rope_head_dim
    assert ModelConfig(expert_dtype="fp8", dim=128, moe_inter_dim=256).expert_dtype == "fp8"


def test_int_widens_to_float() -> None:
    m = ModelConfig(route_scale=2)
    assert isinstance(m.route_scale, float) and m.route_scale == 2.0


def test_env_and_cli_overrides(tmp_path: Path) -> None:
    path = _write(tmp_path, "[model]\ndim = 32\n[train]\nrun_name = \"a\"\n")
    env = {
        "NMOE_MODEL__DIM": "48",
        "NMOE_OPTIM__LR_DENSE": "1e-3",
        "NMOE_TRAIN__RUN_NAME": "123",
        "NMOE_CHECKPOINT__ALLOW_FINGERPRINT_CHANGE": "true",
        "NMOE_TOKENIZER_DIR": "/elsewhere",
        "HOME": "/root",
    }
    cfg = load_config(path, env=env)
    assert cfg.model.dim == 48 and cfg.optim.lr_dense == 1e-3 and cfg.train.run_name == "123"
    assert cfg.checkpoint.allow_fingerprint_change is True
    over = ["--model.dim=96", "--train.device=cpu", "--train.model=reference", "--data.mixture=",
            '--model.score_func="softmax"']
    cfg = load_config(path, env=env, overrides=over)
    assert cfg.model.dim == 96 and cfg.train.device == "cpu" and cfg.data.mixture == ""
    assert cfg.model.score_func == "softmax"
    assert load_config(path, env={}).model.dim == 32


def test_env_defaults_to_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NMOE_MODEL__N_HEADS", "4")
    assert load_config(_write(tmp_path, ""), overrides=["--model.inter_dim=256"]).model.n_heads == 4


def test_override_errors(tmp_path: Path) -> None:
    path = _write(tmp_path, "")
    with pytest.raises(
        ConfigError,
        match=r"model.dimm: unknown key \(from env NMOE_MODEL__DIMM\); did you mean model.dim\?",
    ):
        load_config(path, env={"NMOE_MODEL__DIMM": "3"})
    with pytest.raises(
        ConfigError,
        match=r"modle.dim: unknown section 'modle' \(from --modle.dim\); did you mean model\?",
    ):
        load_config(path, env={}, overrides=["--modle.dim=3"])
    with pytest.raises(ConfigError, match=r"model.dim: expected integer, got str 'abc'"):
        load_config(path, env={}, overrides=["--model.dim=abc"])
    for bad in ("model.dim=3", "--model.dim", "--dim=3", "--a.b.c=1", "--.dim=3"):
        with pytest.raises(ConfigError, match=r"malformed override; write --section.key=value"):
            load_config(path, env={}, overrides=[bad])


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"file not found"):
        load_config(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match=r"invalid TOML .*; fix the syntax"):
        load_config(_write(tmp_path, "[model\n"), env={})
    assert issubclass(ConfigError, ValueError)


def test_fingerprint_stable_and_sensitive() -> None:
    a = load_config(CONFIGS / "tiny.toml", env={})
    b = load_config(CONFIGS / "tiny.toml", env={})
    canon = json.dumps(to_dict(a), sort_keys=True, separators=(",", ":"))
    assert fingerprint(a) == fingerprint(b) == hashlib.sha256(canon.encode()).hexdigest()
    assert fingerprint(to_dict(a)) == fingerprint(a)
    assert fingerprint(from_dict(to_dict(a))) == fingerprint(a)
    c = load_config(CONFIGS / "tiny.toml", env={}, overrides=["--optim.lr_dense=0.0011"])
    assert fingerprint(c) != fingerprint(a)
    assert fingerprint(a.model) == hashlib.sha256(
        json.dumps(dataclasses.asdict(a.model), sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    shuffled = dict(reversed(list(to_dict(a).items())))
    assert fingerprint(shuffled) == fingerprint(a)


def test_diff() -> None:
    a = load_config(CONFIGS / "tiny.toml", env={})
    b = load_config(CONFIGS / "tiny.toml", env={}, overrides=["--model.route_scale=1.0", "--train.seed=3"])
    assert diff(a, a) == []
    assert diff(a, b) == ["model.route_scale", "train.seed"]
    d = to_dict(a)
    d["model"] = {k: v for k, v in d["model"].items() if k != "dim"}
    d["extra"] = {"x": 1}
    assert diff(a, d) == ["extra.x", "model.dim"]
    d2 = to_dict(a)
    d2["train"]["seed"] = 0.0
    assert diff(a, d2) == ["train.seed"]


@pytest.mark.parametrize(("device", "model", "needle"), [
    ("cpu", "fast", 'train.model: "fast" on device "cpu"'),
    ("cuda", "reference", 'train.model: "reference" on device "cuda"'),
])
def test_device_and_model_must_agree(device: str, model: str, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        from_dict({"train": {"device": device, "model": model}}, env={})
    msg = _err(ei)
    assert needle in msg and "sm_90a" in msg


def test_cpu_runs_only_the_spec_model_named() -> None:
    assert from_dict({"train": {"device": "cpu", "model": "reference"}}, env={}).train.model == "reference"
    assert from_dict({}, env={}).train.model == "fast"


def test_cuda_graph_needs_the_gpu() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(CONFIGS / "tiny.toml", env={}, overrides=["--train.cuda_graph=true"])
    assert _err(ei).startswith('config error: train.cuda_graph: true on device "cpu"')
    gpu = load_config(CONFIGS / "tiny-gpu.toml", env={}, overrides=["--train.cuda_graph=true"])
    assert gpu.train.cuda_graph


def test_bf16_optimizer_state_is_adamw_only(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, '[train]\noptim_state_dtype = "bf16"\n'), env={})
    assert cfg.train.optim_state_dtype == "bf16"
    with pytest.raises(ConfigError) as ei:
        load_config(_write(tmp_path, '[train]\noptim_state_dtype = "bf16"\n[optim]\nname = "muon"\n'), env={})
    msg = _err(ei)
    assert "train.optim_state_dtype" in msg and 'optim.name = "adamw"' in msg
