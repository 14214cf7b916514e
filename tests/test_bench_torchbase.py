"""bench/torchbase.py on CPU: the plain-torch moonlet baseline has the fast model's parameter shapes (both
steps count the same FLOPs) and trains: a loss near ln V at init and a gradient on every weight."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from benchmod import load_bench
from torch.nn.attention import SDPBackend

from nmoe.config import load_config
from nmoe.fast import model as fast_model

ROOT = Path(__file__).resolve().parents[1]


def test_torch_moonlet_matches_the_fast_model_shapes_and_trains() -> None:
    cfg = load_config(ROOT / "configs" / "tiny.toml", env={}, overrides=["--model.q_lora_rank=0"]).model
    base = load_bench("torchbase").TorchMoonlet(cfg, torch.device("cpu"), ce_chunk=16, sdpa=SDPBackend.MATH)
    fast = fast_model.Model(cfg, device="meta")
    shapes = [sorted(tuple(p.shape) for p in m.parameters()) for m in (base, fast)]
    assert shapes[0] == shapes[1]
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    loss = base(tokens, tokens)
    loss.backward()
    assert abs(float(loss.detach()) - math.log(cfg.vocab_size)) < 0.5
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in base.parameters())
