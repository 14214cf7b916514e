"""nmoe.fast.model: the spec Model's names and shapes (checked on the meta device), loud failure off a GPU,
and on the H200: parity with the spec model (loss and gradients), training through `train()`, resume."""

# Model-level contract (GPU): the fast model is a composition of ops each held to its own contract, in a
# different rounding order than the spec, so the defensible model-level check is an error ratio. The yard-
# stick is a "twin": the spec model itself with every weight moved by a relative 2^-9 (half a bf16 ULP or
# less), i.e. the error one extra rounding of each weight costs. Contract, per gradient tensor and for the
# loss: |fast - spec| <= RATIO * |twin - spec| + FLOOR * |spec| (L2 norms), RATIO = 4, FLOOR = 2^-12.

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from nmoe.config import Config, ModelConfig, load_config
from nmoe.fast import model as fast_model
from nmoe.fast.arch import ArchError
from nmoe.reference.attention import mla_softmax_scale
from nmoe.reference.model import Model as SpecModel

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
gpu = pytest.mark.gpu
RATIO, FLOOR, TWIN_REL = 4.0, 2.0**-12, 2.0**-9


def _tiny() -> ModelConfig:
    return load_config(CONFIGS / "tiny.toml", env={},
                       overrides=["--model.tokenizer=none", "--model.vocab_size=512"]).model


def _tiny_gpu(*extra: str) -> ModelConfig:
    """tiny-gpu.toml's kernel-friendly shape with a synthetic vocab, small enough for the CPU spec."""
    over = ["--model.tokenizer=none", "--model.vocab_size=4096", "--model.n_layers=3", *extra]
    return load_config(CONFIGS / "tiny-gpu.toml", env={}, overrides=over).model


def _signature(m: torch.nn.Module) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], list[str]]:
    params = [(n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()]
    return params, list(m.state_dict())


@pytest.mark.parametrize("extra", [(), ("--model.q_lora_rank=0",), ("--model.activation=relu2",),
                                   ("--model.n_shared_experts=0",)])
def test_meta_model_has_the_spec_names_shapes_and_dtypes(extra: tuple[str, ...]) -> None:
    cfg = load_config(CONFIGS / "tiny.toml", env={},
                      overrides=["--model.tokenizer=none", "--model.vocab_size=512", *extra]).model
    fast = fast_model.Model(cfg, device="meta")
    assert _signature(fast) == _signature(SpecModel(cfg))
    assert all(p.is_meta for p in fast.parameters())
    assert len(fast.moe_layers()) == cfg.n_layers - cfg.n_dense_layers


def test_param_dtype_is_the_configured_one() -> None:
    fast = fast_model.Model(_tiny(), device="meta", param_dtype="bf16")
    assert {p.dtype for p in fast.parameters()} == {torch.bfloat16}
    assert {b.dtype for n, b in fast.named_buffers() if n.endswith("router_bias")} == {torch.float32}
    with pytest.raises(ValueError, match=r"param_dtype 'fp16' unknown; use one of fp32, bf16"):
        fast_model.Model(_tiny(), device="meta", param_dtype="fp16")


def test_cpu_device_raises_naming_the_gpu_and_the_spec_model() -> None:
    with pytest.raises(ArchError, match=r"device cpu is not a GPU.*sm_90a.*nmoe\.reference\.model\.Model"):
        fast_model.Model(_tiny(), device="cpu")


def test_no_cuda_raises_before_touching_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ArchError, match=r"no CUDA device .*sm_90a or sm_100a"):
        fast_model.Model(_tiny())


def test_tokens_off_the_models_device_raise_naming_the_gpu() -> None:
    fast = fast_model.Model(_tiny(), device="meta")
    with pytest.raises(ArchError, match=r"tokens on cpu, parameters on meta; move the batch"):
        fast(torch.zeros(1, 4, dtype=torch.int64))


def test_traincli_builds_the_fast_model_and_fails_loud_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from nmoe import traincli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(CONFIGS / "tiny-gpu.toml", env={})
    with pytest.raises(ArchError, match=r"no CUDA device"):
        traincli.build_model(cfg)


@pytest.mark.parametrize("extra", [(), ("--model.max_seq_len=64",), ("--model.rope_factor=1.0",),
                                   ("--model.mscale=0.7",)])
def test_attention_softmax_scale_is_the_spec_models(extra: tuple[str, ...]) -> None:
    cfg = load_config(CONFIGS / "tiny.toml", env={}, overrides=["--data.seq_len=32", *extra]).model
    fast, spec = fast_model.Model(cfg, device="meta"), SpecModel(cfg)
    want = [blk.attn.softmax_scale for blk in spec.layers]
    assert [blk.attn.softmax_scale for blk in fast.layers] == want
    assert want[0] == mla_softmax_scale(cfg.qk_head_dim, cfg.rope_factor, cfg.mscale, cfg.max_seq_len,
                                        cfg.original_seq_len)


def test_fast_model_glue_is_the_spec_model_with_the_specs_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every fast kernel op swapped for the spec's (same signatures), the fast model's own glue (device
    and dtype policy, token check, the dense FFN on matmuls) gives the spec model's loss, grads,
    router counts and biases on CPU."""
    from nmoe.layout import ModelOps
    from nmoe.reference import activation as ref_act
    from nmoe.reference import model as ref_model

    class SpecSwiglu(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, h: Tensor) -> Tensor:
            ctx.save_for_backward(h)
            return ref_act.swiglu(h)

        @staticmethod
        def backward(ctx: Any, dy: Tensor) -> Tensor:
            return ref_act.swiglu_bwd(dy, ctx.saved_tensors[0])

    kernels = ("mla_attention", "moe_layer", "cross_entropy", "rmsnorm", "add_rmsnorm", "bias_update",
               "embedding")
    glue = {"dense_ffn", "check_tokens"}
    assert {f.name for f in dataclasses.fields(ModelOps)} == glue | set(kernels)
    spec_ops = dataclasses.replace(fast_model.OPS, **{n: getattr(ref_model.OPS, n) for n in kernels})
    monkeypatch.setattr(fast_model, "OPS", spec_ops)
    monkeypatch.setattr(fast_model, "swiglu", SpecSwiglu.apply)
    monkeypatch.setattr(fast_model, "model_device", lambda device: torch.device("cpu"))
    cfg = _tiny()
    spec = SpecModel(cfg, seed=3)
    fast = fast_model.Model(cfg, seed=4)
    fast.load_state_dict(spec.state_dict())
    assert torch.equal(fast.cos, spec.cos) and torch.equal(fast.sin, spec.sin)
    tok = _tokens(cfg.vocab_size, 2, 24)
    losses, grads, counts = [], [], []
    for m in (spec, fast):
        loss = m(tok[:, :-1], tok[:, 1:])
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
        counts.append(m.router_counts())
        for _ in range(2):
            m.update_router_bias()
    names = {n for n, _ in spec.named_parameters()}
    assert set(grads[0]) == set(grads[1]) == names, (names - set(grads[0]), names - set(grads[1]))
    assert abs(losses[0] - losses[1]) <= 2.0**-12 * losses[0]
    for name, want in grads[0].items():
        err = float((grads[1][name] - want).norm() / want.norm())
        assert err <= 2.0**-8, (name, err)
    for a, b in zip(*counts, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(spec.moe_layers(), fast.moe_layers(), strict=True):
        assert b.router_bias.abs().max() > cfg.bias_update_rate and torch.equal(a.router_bias, b.router_bias)


# ---------------------------------------------------------------- GPU


def _tokens(vocab: int, b: int, s: int, seed: int = 1) -> Tensor:
    return torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(seed))


def _spec_grads(model: SpecModel, tok: Tensor) -> tuple[float, dict[str, Tensor]]:
    loss = model(tok[:, :-1], tok[:, 1:])
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}


def _within(name: str, fast: Tensor, spec: Tensor, twin: Tensor) -> tuple[bool, str]:
    e_fast = float(torch.linalg.vector_norm(fast.double() - spec.double()))
    e_twin = float(torch.linalg.vector_norm(twin.double() - spec.double()))
    scale = float(torch.linalg.vector_norm(spec.double()))
    ok = e_fast <= RATIO * e_twin + FLOOR * scale
    return ok, f"{name}: |fast-spec| {e_fast:.3e}, |twin-spec| {e_twin:.3e}, |spec| {scale:.3e}"


@gpu
def test_fast_model_matches_the_spec_loss_and_gradients() -> None:
    cfg = _tiny_gpu()
    spec = SpecModel(cfg, seed=3)
    twin = SpecModel(cfg, seed=3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.0 + TWIN_REL * (2.0 * torch.rand(p.shape, generator=g) - 1.0))
    fast = fast_model.Model(cfg, seed=11)
    fast.load_state_dict(spec.state_dict())
    tok = _tokens(cfg.vocab_size, 2, 256)
    loss_spec, g_spec = _spec_grads(spec, tok)
    loss_twin, g_twin = _spec_grads(twin, tok)
    dev_tok = tok.cuda()
    loss_fast = fast(dev_tok[:, :-1], dev_tok[:, 1:])
    loss_fast.backward()
    g_fast = {n: p.grad.detach().cpu() for n, p in fast.named_parameters() if p.grad is not None}
    assert set(g_fast) == set(g_spec) == {n for n, _ in spec.named_parameters()}
    ok, line = _within("loss", torch.tensor(float(loss_fast.detach())), torch.tensor(loss_spec),
                       torch.tensor(loss_twin))
    results = [(ok, line)] + [_within(n, g_fast[n].float(), g_spec[n], g_twin[n]) for n in g_spec]
    print("\n".join(("ok   " if ok else "FAIL ") + line for ok, line in results))
    assert all(ok for ok, _ in results), [line for ok, line in results if not ok]
    counts = fast.router_counts()
    assert all(c.is_cuda and int(c.sum()) == 2 * 256 * cfg.n_activated_experts for c in counts)


@gpu
def test_router_bias_update_moves_on_the_gpu() -> None:
    """The spec's rule (hand-written here from the loads), applied on the GPU without a host sync."""
    cfg = _tiny_gpu()
    fast = fast_model.Model(cfg)
    tok = _tokens(cfg.vocab_size, 2, 128).cuda()
    fast(tok[:, :-1], tok[:, 1:])
    counts = [c.clone() for c in fast.router_counts()]
    before = [m.router_bias.clone() for m in fast.moe_layers()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast.update_router_bias(counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for moe, c, b in zip(fast.moe_layers(), counts, before, strict=True):
        mean = c.double().mean()
        sign = torch.where(c < mean, 1.0, torch.where(c > mean, -1.0, 0.0)).to(b.device)
        assert torch.equal(moe.router_bias, torch.clamp(b + sign * cfg.bias_update_rate, -cfg.bias_clamp,
                                                        cfg.bias_clamp).float())


@gpu
def test_forward_backward_make_no_host_sync() -> None:
    """After a warm-up step (kernel compiles may sync), a training step's fwd+bwd never waits on the GPU."""
    cfg = _tiny_gpu()
    fast = fast_model.Model(cfg)
    tok = _tokens(cfg.vocab_size, 2, 128).cuda()
    fast(tok[:, :-1], tok[:, 1:]).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast(tok[:, :-1], tok[:, 1:]).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nmoe.data import prep

    out = tmp_path_factory.mktemp("data") / "default"
    assert prep.main(["--out", str(out), "--workers", "1", "--no-progress"]) == 0
    return out


def _train_cfg(tmp: Path, dataset: Path, name: str, steps: int, *extra: str) -> Config:
    tokens = 4 * 256
    return load_config(CONFIGS / "tiny-gpu.toml", env={}, overrides=[
        f"--data.dataset_dir={dataset}", f"--checkpoint.dir={tmp / name / 'ckpt'}",
        f"--metrics.db_path={tmp / 'experiments.sqlite'}", f"--metrics.dir={tmp / name / 'metrics'}",
        "--checkpoint.every_steps=0", "--train.log_every=5", "--data.seq_len=256", "--data.batch_size=4",
        f"--schedule.warmup_tokens={4 * tokens}", f"--schedule.total_tokens={steps * tokens}", *extra,
    ])


@gpu
@pytest.mark.parametrize("accum", [1, 2])
def test_graphed_steps_train_bitwise_like_eager_ones(tmp_path: Path, dataset: Path, accum: int) -> None:
    """train.cuda_graph replays the same kernels in the same order: losses, weights and router biases equal
    the eager run's bit for bit (step 1 eager, then capture and replays; with grad_accum 2 a second graph
    adds the second microbatch's gradients as eager autograd does)."""
    from nmoe.train.loop import train
    from nmoe.traincli import optim_steps

    runs = []
    for name, graph in (("eager", "false"), ("graph", "true")):
        cfg = _train_cfg(tmp_path, dataset, name, 8 * accum, f"--train.cuda_graph={graph}",
                         f"--train.grad_accum={accum}")
        model = fast_model.Model(cfg.model, seed=cfg.train.seed)
        runs.append((train(cfg, model, steps=optim_steps(cfg), max_steps=8, progress=False), model))
    (eager, m_eager), (graph, m_graph) = runs
    assert graph.losses == eager.losses
    for (name, a), b in zip(m_eager.state_dict().items(), m_graph.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs between the eager and the graphed run"


@gpu
def test_fast_model_trains_and_reports_mfu_and_memory(tmp_path: Path, dataset: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from nmoe.train.loop import train
    from nmoe.traincli import optim_steps

    cfg = _train_cfg(tmp_path, dataset, "run", 30)
    model = fast_model.Model(cfg.model, seed=cfg.train.seed)
    result = train(cfg, model, steps=optim_steps(cfg), max_steps=30)
    print("fast tiny-gpu 30-step losses:", [round(x, 4) for x in result.losses])
    assert result.status == "completed" and all(math.isfinite(x) for x in result.losses)
    assert sum(result.losses[-3:]) / 3 < sum(result.losses[:3]) / 3 - 1.0
    err = capsys.readouterr().err
    assert "MFU " in err and "peak mem " in err, err[-2000:]


@gpu
def test_fast_checkpoint_restores_the_state_and_resume_is_bitwise(tmp_path: Path, dataset: Path) -> None:
    """Resume reproduces the unbroken run bit for bit; a difference names a non-deterministic kernel."""
    from nmoe.train import checkpoint as ckpt
    from nmoe.train.loop import train
    from nmoe.train.optim import build_optimizer
    from nmoe.traincli import optim_steps

    full_cfg = _train_cfg(tmp_path, dataset, "full", 20)
    steps = optim_steps(full_cfg)
    full = train(full_cfg, fast_model.Model(full_cfg.model), steps=steps, max_steps=20, progress=False)
    cfg = _train_cfg(tmp_path, dataset, "split", 20)
    first_model = fast_model.Model(cfg.model)
    first = train(cfg, first_model, steps=steps, max_steps=10, progress=False)
    assert first.checkpoint is not None
    loaded = fast_model.Model(cfg.model, seed=7)
    ckpt.load(first.checkpoint, model=loaded, optimizer=build_optimizer(loaded, cfg.optim, steps), cfg=cfg)
    restored = loaded.state_dict()
    for name, want in first_model.state_dict().items():
        assert torch.equal(want, restored[name]), f"{name} differs after checkpoint load"
    second = train(cfg, fast_model.Model(cfg.model, seed=7), steps=steps, max_steps=20, progress=False)
    assert first.losses == full.losses[:10], "two fresh runs differ: a fwd/bwd kernel is not deterministic"
    assert second.losses == full.losses[10:], "resumed run differs from the unbroken one"


@gpu
def test_bf16_params_train_like_fp32_masters_and_resume_bitwise(tmp_path: Path, dataset: Path) -> None:
    """train.param_dtype = "bf16": the params stay bf16, the loss falls like the fp32-master run's (the two
    differ by bf16 weight rounding only), and a resume through the checkpointed fp32 masters reproduces the
    unbroken run bit for bit."""
    from nmoe.train.loop import train
    from nmoe.traincli import optim_steps

    bf16 = ("--train.param_dtype=bf16",)
    runs = {}
    for name, extra in (("fp32", ()), ("bf16", bf16)):
        cfg = _train_cfg(tmp_path, dataset, name, 20, *extra)
        model = fast_model.Model(cfg.model, seed=cfg.train.seed, param_dtype=cfg.train.param_dtype)
        runs[name] = train(cfg, model, steps=optim_steps(cfg), max_steps=20, progress=False), model
    (ref, _), (low, model) = runs["fp32"], runs["bf16"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert sum(low.losses[-3:]) / 3 < sum(low.losses[:3]) / 3 - 0.5, low.losses
    assert abs(sum(low.losses[-3:]) - sum(ref.losses[-3:])) / 3 < 0.1, (low.losses, ref.losses)
    cfg = _train_cfg(tmp_path, dataset, "split", 20, *bf16)
    first = train(cfg, fast_model.Model(cfg.model, param_dtype="bf16"), steps=optim_steps(cfg), max_steps=10,
                  progress=False)
    assert first.checkpoint is not None and first.losses == low.losses[:10]
    second = train(cfg, fast_model.Model(cfg.model, seed=7, param_dtype="bf16"), steps=optim_steps(cfg),
                   max_steps=20, progress=False)
    assert second.losses == low.losses[10:], "a bf16-param resume differs from the unbroken run"
