"""Param groups (dense / router / expert), WSD by tokens, and the optimizer that applies the AdamW and Muon
steps it is handed (`OptimSteps`): the math lives once, in the fast path or, for a CPU run of the spec model,
in the spec; `nmoe train` (nmoe/traincli.py) picks them from train.model, so this package never imports it."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import torch
from torch import Tensor, nn

from nmoe.config import OptimConfig, ScheduleConfig
from nmoe.sharding import AllReduceSum, grad_norm, shard_of

Kind = Literal["dense", "router", "expert"]
PARAM_DTYPES: Final[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)
STATE_DTYPES: Final[dict[str, torch.dtype]] = {"fp32": torch.float32, "bf16": torch.bfloat16}
STEP_BYTES: Final[dict[str, int]] = {"fp32": 28, "bf16": 20}
"""HBM bytes per parameter of the trainer's AdamW step by moment dtype: fp32 master read and written (8), bf16
grad read and bf16 copy written (4; fp32 params: their own master, fp32 grad read), both moments (16 or 8)."""
KINDS: Final[tuple[Kind, ...]] = ("dense", "router", "expert")

_ROUTER = re.compile(r"(^|\.)router[^.]*$|(^|\.)(router|gate)\.")
_EXPERT = re.compile(r"(^|\.)experts(\.|$)")
_ATTN = re.compile(r"(^|\.)(attn|attention|self_attn)\.")


def param_kind(name: str, p: Tensor) -> Kind:
    """Router weights by name; experts are the stacked [E, ...] tensors (or live under `experts.`)."""
    if _ROUTER.search(name):
        return "router"
    if p.dim() == 3 or _EXPERT.search(name):
        return "expert"
    return "dense"


def is_muon_param(name: str, p: Tensor) -> bool:
    """Muon covers the attention projection matrices; vectors, embeddings, head and experts stay AdamW."""
    return p.dim() == 2 and bool(_ATTN.search(name))


def build_param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """Groups keyed by (kind, algorithm, decay); 1-D params (norm scales, biases) never decay."""
    lr = {"dense": cfg.lr_dense, "router": cfg.lr_router, "expert": cfg.lr_expert}
    wd = {"dense": cfg.weight_decay_dense, "router": cfg.weight_decay_router,
          "expert": cfg.weight_decay_expert}
    groups: dict[tuple[str, str, bool], dict[str, Any]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        kind = param_kind(name, p)
        algo = "muon" if cfg.name == "muon" and is_muon_param(name, p) else "adamw"
        decay = p.dim() >= 2
        key = (kind, algo, decay)
        if key not in groups:
            groups[key] = {"params": [], "names": [], "kind": kind, "algo": algo, "base_lr": lr[kind],
                           "lr": lr[kind], "weight_decay": wd[kind] if decay else 0.0}
        groups[key]["params"].append(p)
        groups[key]["names"].append(name)
    order: dict[str, int] = {k: i for i, k in enumerate(KINDS)}
    return [groups[k] for k in sorted(groups, key=lambda k: (order[k[0]], k[1], not k[2]))]


class AdamWStep(Protocol):
    def __call__(self, p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: int, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float, grad_scale: Tensor | None = None,
                 p_low: Tensor | None = None) -> None: ...


class MuonStep(Protocol):
    def __call__(self, p: Tensor, g: Tensor, buf: Tensor, lr: float, momentum: float, weight_decay: float,
                 nesterov: bool = True, ns_steps: int = 5, grad_scale: Tensor | None = None,
                 p_low: Tensor | None = None) -> None: ...


@dataclass(frozen=True)
class OptimSteps:
    """The in-place step functions the optimizer applies, with the spec's signatures (adamw_step, muon_step)
    from nmoe.fast.optim, or from nmoe.reference.optim when the config trains the spec model on a CPU."""

    adamw: AdamWStep
    muon: MuonStep


class TrainOptimizer(torch.optim.Optimizer):
    """AdamW / Muon per group ("algo"); state is created eagerly so checkpoints load into it in place."""
    # An fp32 param is its own master; a bf16 param (train.param_dtype = "bf16": no cast in the forward, bf16
    # grads) gets an fp32 master in its state, which the step updates and then rounds into the param. AdamW's
    # moments are stored as `moments` (train.optim_state_dtype).

    def __init__(self, groups: list[dict[str, Any]], cfg: OptimConfig, steps: OptimSteps,
                 moments: torch.dtype = torch.float32) -> None:
        defaults = {"lr": 0.0, "base_lr": 0.0, "weight_decay": 0.0, "algo": "adamw", "kind": "dense",
                    "names": []}
        super().__init__(groups, defaults)
        self.cfg = cfg
        self.steps = steps
        self.grad_scale: Tensor | None = None
        if moments not in STATE_DTYPES.values():
            raise ValueError(f"optimizer: AdamW moments {moments}; use torch.float32 or torch.bfloat16")
        for group in self.param_groups:
            if group["algo"] not in ("adamw", "muon"):
                raise ValueError(f"param group algo {group['algo']!r}; use adamw or muon")
            for p in group["params"]:
                if p.dtype not in PARAM_DTYPES:
                    raise ValueError(f"optimizer: param dtype {p.dtype}; params are fp32 masters, or bf16 "
                                     "with fp32 masters held here (train.param_dtype)")
                master = {} if p.dtype == torch.float32 else {"master": p.detach().float()}
                like = master.get("master", p)
                if group["algo"] == "muon":
                    self.state[p] = {"momentum_buffer": torch.zeros_like(like), **master}
                else:
                    self.state[p] = {"step": torch.zeros((), dtype=torch.int64),
                                     "exp_avg": torch.zeros_like(like, dtype=moments),
                                     "exp_avg_sq": torch.zeros_like(like, dtype=moments),
                                     **master}

    def set_lr_factor(self, factor: float) -> None:
        for group in self.param_groups:
            group["lr"] = group["base_lr"] * factor

    def set_grad_scale(self, scale: Tensor | None) -> None:
        """The clip factor (clip_scale's) the next step folds into every gradient it reads."""
        self.grad_scale = scale

    def named_state(self) -> dict[str, dict[str, Tensor]]:
        """{param name: {state key: tensor}}: the optimizer part of a checkpoint, keyed by FQN."""
        out: dict[str, dict[str, Tensor]] = {}
        for group in self.param_groups:
            for name, p in zip(group["names"], group["params"], strict=True):
                out[name] = dict(self.state[p])
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        c = self.cfg
        for group in self.param_groups:
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                w, low = (st["master"], p) if "master" in st else (p, None)
                if group["algo"] == "muon":
                    self.steps.muon(w, p.grad, st["momentum_buffer"], lr, c.muon_momentum, wd, True,
                                    c.muon_ns_steps, self.grad_scale, low)
                else:
                    st["step"] += 1
                    self.steps.adamw(w, p.grad, st["exp_avg"], st["exp_avg_sq"], int(st["step"]), lr, c.beta1,
                                     c.beta2, c.eps, wd, self.grad_scale, low)
        return loss


def grads(params: Iterable[Tensor]) -> Iterator[Tensor]:
    return (p.grad for p in params if p.grad is not None)


def clip_scale(params: list[Tensor], max_norm: float, all_reduce_sum: AllReduceSum | None = None,
               accum: int = 1) -> tuple[Tensor, Tensor | None]:
    """(fp32 L2 norm of the step's gradient: the grads' (a sum of `accum` microbatch means) / accum; the scale
    set_grad_scale folds into each gradient: clip / accum, clip = max_norm / (norm + 1e-6) where the norm
    exceeds max_norm > 0, else 1; None when exactly 1). No host sync; grads untouched."""
    if accum < 1:
        raise ValueError(f"clip_scale: accum = {accum} microbatches; it must be >= 1")
    held = [p for p in params if p.grad is not None]
    gs = list(grads(held))
    if not gs:
        return torch.zeros((), dtype=torch.float32), None
    norms = list(torch._foreach_norm(gs, 2, dtype=torch.float32))
    total = grad_norm(norms, [shard_of(p) is not None for p in held], all_reduce_sum) / accum
    if max_norm <= 0:
        return total, None if accum == 1 else torch.full((), 1.0 / accum, device=total.device)
    t64 = total.double()
    clip = torch.where(t64 > max_norm, max_norm / (t64 + 1e-6), torch.ones_like(t64))
    return total, (clip / accum).float()


def wsd_factor(tokens: int, s: ScheduleConfig) -> float:
    """LR multiplier for the step whose batch brings the total to `tokens`: linear warmup 0→1, flat, then
    linear to min_lr_ratio over the last decay_fraction of total_tokens, held past the end."""
    decay_tokens = s.decay_fraction * s.total_tokens
    decay_start = s.total_tokens - decay_tokens
    if tokens < s.warmup_tokens:
        return tokens / s.warmup_tokens
    if tokens <= decay_start or decay_tokens == 0:
        return 1.0
    frac = min((tokens - decay_start) / decay_tokens, 1.0)
    return 1.0 - (1.0 - s.min_lr_ratio) * frac


def build_optimizer(model: nn.Module, cfg: OptimConfig, steps: OptimSteps,
                    moments: torch.dtype = torch.float32) -> TrainOptimizer:
    return TrainOptimizer(build_param_groups(model, cfg), cfg, steps, moments)
