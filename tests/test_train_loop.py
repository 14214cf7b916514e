"""Training loop on CPU: loss goes down, exact resume, SIGTERM, config refusal, clear data errors.
Default runs drive a test-local MoE hashing o200k ids into 4096 buckets (fast on a shared CPU); the heavy
test repeats them with the reference model built from configs/tiny.toml."""

from __future__ import annotations

import json
import os
import signal
import socket
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmoe.config import Config, load_config
from nmoe.data import prep
from nmoe.runreport import main as metrics_main
from nmoe.train import checkpoint as ckpt
from nmoe.train.data import build_loader
from nmoe.train.loop import TrainResult, train
from nmoe.train.metrics import ExperimentsDB, runs_main
from nmoe.train.metricstore import rank_dir, read_parts, visible_parts
from nmoe.train.optim import OptimSteps
from nmoe.traincli import optim_steps

REPO = Path(__file__).resolve().parent.parent
BUCKETS = 4096


class ToyMoE(nn.Module):
    """Bigram-ish MoE over id % 4096: embed -> top-1 expert (router with aux-free bias) -> rmsnorm -> head."""

    def __init__(self, vocab: int = BUCKETS, dim: int = 16, n_experts: int = 4, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(vocab, dim, generator=g) * 0.02)
        self.router_w = nn.Parameter(torch.randn(n_experts, dim, generator=g) * 0.5)
        self.experts = nn.Parameter(torch.randn(n_experts, dim, dim, generator=g) * 0.1)
        self.norm = nn.Parameter(torch.ones(dim))
        self.head = nn.Parameter(torch.randn(vocab, dim, generator=g) * 0.02)
        self.router_bias: Tensor
        self.register_buffer("router_bias", torch.zeros(n_experts))
        self.n_experts = n_experts
        self.counts: Tensor | None = None

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        v = self.embed.shape[0]
        x = self.embed[tokens % v].reshape(-1, self.embed.shape[1])
        scores = torch.sigmoid(x @ self.router_w.T)
        ids = (scores.detach() + self.router_bias).argmax(-1)
        w = scores.gather(1, ids[:, None])
        x = x + w * torch.einsum("td,tod->to", x, self.experts[ids])
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        self.counts = torch.bincount(ids, minlength=self.n_experts)
        return F.cross_entropy(x @ self.head.T, targets.reshape(-1) % v)

    def router_counts(self) -> list[Tensor]:
        assert self.counts is not None
        return [self.counts]

    @torch.no_grad()
    def update_router_bias(self, counts: list[Tensor]) -> None:
        c = counts[0]
        self.router_bias.add_(1e-3 * torch.sign(c.sum() - self.n_experts * c).float()).clamp_(-1.0, 1.0)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "default"
    assert prep.main(["--out", str(out), "--workers", "1", "--no-progress"]) == 0
    return out


def make_cfg(tmp: Path, dataset: Path, *extra: str, name: str = "run") -> Config:
    return load_config(REPO / "configs" / "tiny.toml", env={}, overrides=[
        f"--data.dataset_dir={dataset}", f"--checkpoint.dir={tmp / name / 'ckpt'}",
        f"--metrics.db_path={tmp / 'experiments.sqlite'}", f"--metrics.dir={tmp / name / 'metrics'}",
        "--checkpoint.every_steps=0", "--train.log_every=5", "--optim.lr_dense=0.02",
        "--optim.lr_expert=0.02", "--optim.lr_router=0.02", "--schedule.warmup_tokens=128", *extra,
    ])


def run(cfg: Config, steps: int, model: nn.Module | None = None, **kw: object) -> TrainResult:
    return train(cfg, model if model is not None else ToyMoE(), steps=optim_steps(cfg), max_steps=steps,
                 progress=False, **kw)  # type: ignore[arg-type]


def test_twenty_steps_lower_the_loss_and_log(tmp_path: Path, dataset: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = make_cfg(tmp_path, dataset)
    model = ToyMoE()
    res = run(cfg, 20, model)
    assert res.status == "stopped" and res.step == 20 and res.tokens == 20 * 64
    assert len(res.losses) == 20
    first, last = sum(res.losses[:3]) / 3, sum(res.losses[-3:]) / 3
    assert last < first - 0.3, res.losses
    assert res.checkpoint == ckpt.step_dir(Path(cfg.checkpoint.dir), 20)
    assert float(model.router_bias.abs().sum()) > 0  # aux-loss-free update ran
    db = ExperimentsDB(cfg.metrics.db_path)
    (row,) = db.runs()
    db.close()
    assert row["id"] == res.run_id and row["status"] == "stopped" and row["last_step"] == 20
    assert visible_parts(rank_dir(cfg.metrics.dir, res.run_id, 0))
    capsys.readouterr()
    assert metrics_main([res.run_id, "--db", cfg.metrics.db_path]) == 0
    out = capsys.readouterr().out
    for tag in ("loss", "lr", "tokens_per_s", "ms_per_step", "grad_norm", "mem/max_rss_gb",
                "router/model/load_cv", "router/model/bias_range", "router/model/load/0",
                "router/model/load/3"):
        assert f"\n{tag} " in out, out
    report = json.loads((Path(cfg.metrics.dir) / f"{res.run_id}.report.json").read_text())
    assert (Path(cfg.metrics.dir) / f"{res.run_id}.training.png").stat().st_size > 1000
    assert report["run"]["id"] == res.run_id and report["exported_on"]["torch"] == torch.__version__
    losses = [r["loss"] for r in report["steps"] if r["loss"] is not None]
    assert losses and min(res.losses) <= losses[-1] <= max(res.losses)
    assert report["steps"][-1]["tokens_per_s"] > 0
    assert runs_main(["--db", cfg.metrics.db_path]) == 0
    assert res.run_id in capsys.readouterr().out


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_resume_at_10_is_bitwise_identical(tmp_path: Path, dataset: Path, moments: str) -> None:
    """Also with bf16 AdamW moments: the checkpoint holds them as the step stored them."""
    state = f"--train.optim_state_dtype={moments}"
    full_model = ToyMoE()
    full = run(make_cfg(tmp_path, dataset, state, name="full"), 20, full_model)
    cfg = make_cfg(tmp_path, dataset, state, name="split")
    first = run(cfg, 10)
    assert first.step == 10 and first.checkpoint is not None
    resumed_model = ToyMoE(seed=123)  # different init: everything must come from the checkpoint
    second = run(cfg, 20, resumed_model)
    assert second.resumed_from == first.checkpoint and second.run_id == first.run_id
    assert first.losses == full.losses[:10]
    assert second.losses == full.losses[10:]  # exact float equality, steps 11-20
    resumed_state = resumed_model.state_dict()
    for n, a in full_model.state_dict().items():
        assert torch.equal(a, resumed_state[n]), n


@pytest.mark.parametrize(("moments", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_loop_steps_adamw_moments_of_the_configured_dtype(tmp_path: Path, dataset: Path, moments: str,
                                                               dtype: torch.dtype) -> None:
    cfg = make_cfg(tmp_path, dataset, f"--train.optim_state_dtype={moments}")
    base = optim_steps(cfg)
    seen: set[tuple[torch.dtype, torch.dtype]] = set()

    def adamw(p: Tensor, g: Tensor, m: Tensor, v: Tensor, *args: Any, **kw: Any) -> None:
        seen.add((m.dtype, v.dtype))
        base.adamw(p, g, m, v, *args, **kw)

    train(cfg, ToyMoE(), steps=OptimSteps(adamw=adamw, muon=base.muon), max_steps=2, progress=False)
    assert seen == {(dtype, dtype)}


def test_sigterm_leaves_resumable_checkpoint(tmp_path: Path, dataset: Path) -> None:
    cfg = make_cfg(tmp_path, dataset)

    def kill_at_5(step: int, loss: float) -> None:
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    res = run(cfg, 20, on_step=kill_at_5)
    assert res.status == "interrupted" and res.step == 5
    assert signal.getsignal(signal.SIGTERM) is before
    assert ckpt.latest(cfg.checkpoint.dir) == ckpt.step_dir(Path(cfg.checkpoint.dir), 5)
    again = run(cfg, 8)
    assert again.resumed_from is not None and again.step == 8 and len(again.losses) == 3
    db = ExperimentsDB(cfg.metrics.db_path)
    (row,) = db.runs()
    db.close()
    assert row["resumes"] == 1 and row["status"] == "stopped"


def test_changed_config_refuses_resume_with_keys(tmp_path: Path, dataset: Path) -> None:
    run(make_cfg(tmp_path, dataset), 2)
    changed = make_cfg(tmp_path, dataset, "--optim.lr_dense=0.5", "--data.seed=3")
    with pytest.raises(ckpt.CheckpointConfigMismatch, match=r"data\.seed, optim\.lr_dense") as e:
        run(changed, 4)
    assert e.value.keys == ["data.seed", "optim.lr_dense"]
    allowed = make_cfg(tmp_path, dataset, "--optim.lr_dense=0.5",
                       "--checkpoint.allow_fingerprint_change=true")
    assert run(allowed, 4).step == 4


def test_periodic_checkpoints_and_keep_last(tmp_path: Path, dataset: Path) -> None:
    cfg = make_cfg(tmp_path, dataset, "--checkpoint.every_steps=2", "--checkpoint.keep_last=2")
    run(cfg, 7)
    steps = sorted(p.name for p in Path(cfg.checkpoint.dir).glob("step_*"))
    assert steps == ["step_00000006", "step_00000007"]


def test_truncated_shard_is_a_clear_error(tmp_path: Path, dataset: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in dataset.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    shard = bad / "shard_00000.bin"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(RuntimeError, match=r"shard_00000\.bin: missing or truncated .*nmoe prep --verify"):
        run(make_cfg(tmp_path, bad), 1)


@pytest.mark.heavy
def test_reference_tiny_model_twenty_steps_and_exact_resume(tmp_path: Path, dataset: Path) -> None:
    from nmoe.reference.model import Model

    full_cfg = make_cfg(tmp_path, dataset, "--optim.lr_dense=0.003", "--optim.lr_expert=0.003",
                        "--optim.lr_router=0.003", name="ref_full")
    full = run(full_cfg, 20, Model(full_cfg.model))
    print("reference tiny 20-step losses:", [round(x, 4) for x in full.losses])
    assert sum(full.losses[-3:]) / 3 < sum(full.losses[:3]) / 3
    cfg = make_cfg(tmp_path, dataset, "--optim.lr_dense=0.003", "--optim.lr_expert=0.003",
                   "--optim.lr_router=0.003", name="ref_split")
    run(cfg, 10, Model(cfg.model))
    second = run(cfg, 20, Model(cfg.model, seed=7))
    assert second.losses == full.losses[10:]


def test_a_non_finite_loss_stops_before_the_optimizer_step(tmp_path: Path, dataset: Path) -> None:
    """The loss is read once per step, after the backward (no sync between forward and backward); a NaN there
    raises naming the step, and the weights stay those of the last good step."""
    from nmoe.train.loop import default_loss

    cfg = make_cfg(tmp_path, dataset)
    model = ToyMoE()
    seen: list[int] = []

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(len(seen))
        loss = default_loss(m, x, y)
        return loss * float("nan") if len(seen) == 3 else loss

    before: dict[str, torch.Tensor] = {}

    def keep(step: int, loss: float) -> None:
        before.update({k: v.detach().clone() for k, v in model.state_dict().items()})

    with pytest.raises(FloatingPointError, match="loss is nan at step 3"):
        run(cfg, 5, model=model, loss_fn=loss_fn, on_step=keep)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items() if v.is_floating_point())


def test_graphed_step_refuses_a_cpu_batch() -> None:
    from nmoe.train.graphstep import GraphedStep, GraphError
    from nmoe.train.loop import default_loss

    x = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(GraphError, match="replay GPU work only"):
        GraphedStep(ToyMoE(), default_loss, x, x)


@pytest.mark.gpu
def test_only_the_first_capture_warms_up_and_the_second_adds() -> None:
    """An eager warm-up beside the first graph's pool holds a second set of activations (moonlet at batch 16
    ran out of memory there); the accumulating graph, captured without one, still adds its gradients."""
    from nmoe.train.graphstep import WARMUP, GraphedStep

    class Bigram(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)))

        def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
            return F.cross_entropy(self.w[tokens.reshape(-1)], targets.reshape(-1))

    capturing: list[bool] = []

    def loss_fn(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        capturing.append(torch.cuda.is_current_stream_capturing())
        out: Tensor = m(x, y)
        return out

    model = Bigram().cuda()
    x = torch.arange(16, device="cuda").view(2, 8)
    y = x.flip(1).contiguous()
    step = GraphedStep(model, loss_fn, x, y, accumulate=True)
    assert capturing == [False] * WARMUP + [True, True]
    step(x, y)
    one = model.w.grad.clone()  # type: ignore[union-attr]
    step(x, y, add=True)
    assert torch.equal(model.w.grad, 2 * one) and one.abs().sum() > 0


def _dp_rank(rank: int, port: int, cfg: Config, out: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        d = cfg.data
        loader = build_loader(d.dataset_dir, d.mixture, seq_len=d.seq_len, batch_size=d.batch_size,
                              seed=d.seed, prefetch=0, rank=rank, world=2)
        batch = next(loader)
        own = float(ToyMoE()(batch.inputs, batch.targets))
        model = ToyMoE()
        res = train(cfg, model, steps=optim_steps(cfg), max_steps=3, rank=rank, world=2, progress=False)
        out.put((rank, own, res.losses, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_train_like_one_rank_on_the_same_global_batch(tmp_path: Path, dataset: Path) -> None:
    """Data parallel over 2 CPU ranks, each half of the global batch: the logged loss is the global mean
    and the weights after 3 steps are one rank's on the whole batch (gradients summed, then averaged)."""
    one_cfg = make_cfg(tmp_path, dataset, "--data.batch_size=4", name="one")
    model = ToyMoE()
    one = run(one_cfg, 3, model)
    two_cfg = make_cfg(tmp_path, dataset, "--data.batch_size=2", name="two")
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_dp_rank, args=(r, port, two_cfg, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted((out.get(timeout=180) for _ in procs), key=lambda g: g[0])
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert abs(got[0][1] - got[1][1]) > 1e-3, "the two ranks' own first losses differ"
    assert (got[0][1] + got[1][1]) / 2 == pytest.approx(one.losses[0], rel=1e-5)
    # Summed halves round differently from the whole batch, and Adam turns that noise on near-zero
    # gradients into visible entry-wise moves (1 to 101 entries of 65536 beyond rtol 1e-4 / atol 1e-6, by
    # CPU and load), so each weight is held in relative L2: noise measured 6e-7, unsynchronized ranks 0.03+.
    lr, steps = one_cfg.optim.lr_dense, len(one.losses)
    for _, _, losses, params in got:
        assert losses == pytest.approx(one.losses, rel=1e-5), (losses, one.losses)
        for name, p in model.named_parameters():
            a, b = torch.from_numpy(params[name]), p.detach()
            assert float((a - b).norm() / b.norm()) <= 1e-4, name
            assert float((a - b).abs().max()) <= 2 * lr * steps, name


def _logged(cfg: Config, run_id: str, tag: str) -> list[float]:
    q = f"SELECT value FROM metrics WHERE run='{run_id}' AND tag='{tag}' ORDER BY step"
    rows = read_parts(rank_dir(cfg.metrics.dir, run_id, 0), lambda con: con.execute(q).fetchall(), [])
    return [float(r[0]) for r in rows]


def test_sep_loop_accum_norm_of_the_sum(tmp_path: Path, dataset: Path) -> None:
    """Two microbatches of 2 sequences per step train like one batch of 4: the same losses (the mean of the
    microbatch means), router counts, gradient norms (the summed gradients' over 2; the mutant logs twice
    that) and weights after 3 steps."""
    one_cfg = make_cfg(tmp_path, dataset, "--data.batch_size=4", name="one")
    one_model = ToyMoE()
    one = run(one_cfg, 3, one_model)
    acc_cfg = make_cfg(tmp_path, dataset, "--data.batch_size=2", "--train.grad_accum=2", name="acc")
    acc_model = ToyMoE()
    acc = run(acc_cfg, 3, acc_model)
    assert acc.step == one.step == 3 and acc.tokens == one.tokens == 3 * 4 * one_cfg.data.seq_len
    assert acc.losses == pytest.approx(one.losses, rel=1e-5)
    norms, acc_norms = _logged(one_cfg, one.run_id, "grad_norm"), _logged(acc_cfg, acc.run_id, "grad_norm")
    assert len(norms) == 3 and min(norms) > 0.01  # separating: twice each norm is far from it
    assert acc_norms == pytest.approx(norms, rel=1e-4)
    assert acc_norms != pytest.approx([2 * n for n in norms], rel=0.1)
    assert torch.equal(acc_model.router_bias, one_model.router_bias)
    for (name, a), b in zip(acc_model.named_parameters(), one_model.parameters(), strict=True):
        assert float((a - b).norm() / b.norm()) <= 1e-4, name


def test_sep_loop_previous_graph_kept(tmp_path: Path, dataset: Path) -> None:
    """A step's autograd graph is freed before the next forward. A kept one keeps its parameters'
    AccumulateGrad nodes, which remember the stream of the eager step, so a CUDA graph captured next makes
    that stream wait on the capture and fails (train.cuda_graph)."""
    from nmoe.train.loop import default_loss

    cfg = make_cfg(tmp_path, dataset)
    model = ToyMoE()
    x = torch.zeros(2, 8, dtype=torch.int64)
    probe = default_loss(model, x, x)
    ref = weakref.ref(probe)
    assert ref() is not None, "a loss still referenced is seen alive (what a kept graph looks like)"
    del probe
    assert ref() is None, "and a dropped one is freed at once: nothing else holds the graph"

    alive: list[bool] = []
    last: list[weakref.ref[Tensor]] = []

    def loss_fn(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        alive.append(bool(last) and last[-1]() is not None)
        loss = default_loss(m, x, y)
        last.append(weakref.ref(loss))
        return loss

    run(cfg, 3, model=model, loss_fn=loss_fn)
    assert alive == [False, False, False], "a step's loss (and its graph) is alive at the next forward"
