"""The spec model: nmoe.modeldef's model on the CPU with the spec ops, fp32 masters and bf16 forward casts
(the mixed-precision recipe the fast path trains with). The router bias is a buffer moved by bias_update.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nmoe import modeldef
from nmoe.config import ModelConfig, TrainConfig
from nmoe.layout import ModelOps
from nmoe.modeldef import MLA, Block, DenseFFN, MoE
from nmoe.reference.attention import mla_attention
from nmoe.reference.loss import cross_entropy, cross_entropy_bwd
from nmoe.reference.moe import ffn, moe_layer
from nmoe.reference.norm import add_rmsnorm, rmsnorm
from nmoe.reference.router import bias_update

__all__ = ["MLA", "OPS", "Block", "DenseFFN", "MoE", "Model"]


class _CrossEntropy(torch.autograd.Function):
    """Chunked CE whose backward is cross_entropy_bwd, so [T,V] logits are never kept for autograd."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor, targets: Tensor, ignore_index: int, chunk: int) -> Tensor:
        ctx.save_for_backward(h, w, targets)
        ctx.ignore_index, ctx.chunk = ignore_index, chunk
        return cross_entropy(h, w, targets, ignore_index, chunk)

    @staticmethod
    def backward(ctx: Any, dloss: Tensor) -> tuple[Tensor, Tensor, None, None, None]:
        h, w, targets = ctx.saved_tensors
        dh, dw = cross_entropy_bwd(dloss, h, w, targets, ctx.ignore_index, ctx.chunk)
        return dh, dw, None, None, None


def _cross_entropy(h: Tensor, w: Tensor, targets: Tensor, ignore_index: int, chunk: int) -> Tensor:
    loss: Tensor = _CrossEntropy.apply(h, w, targets, ignore_index, chunk)  # type: ignore[no-untyped-call]
    return loss


def _dense_ffn(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    return ffn(x, w13, w2, "swiglu", "bf16")


def _embedding(tokens: Tensor, embed: Tensor) -> Tensor:
    return embed[tokens]


def _check_tokens(tokens: Tensor, embed: Tensor, vocab_size: int) -> None:
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"Model: token ids must lie in [0, {vocab_size}); check the tokenizer "
                         "and model.vocab_size")


OPS = ModelOps(
    mla_attention=mla_attention, rmsnorm=rmsnorm, add_rmsnorm=add_rmsnorm, dense_ffn=_dense_ffn,
    moe_layer=moe_layer, cross_entropy=_cross_entropy, bias_update=bias_update,
    embedding=_embedding, check_tokens=_check_tokens,
)


class Model(modeldef.Model):
    """forward(tokens [B,S]) -> fp32 logits [B,S,V]; with targets [B,S] -> fp32 mean CE over kept tokens."""

    def __init__(
        self, cfg: ModelConfig, seed: int = 0, ce_chunk: int = TrainConfig.ce_chunk, ignore_index: int = -100
    ) -> None:
        super().__init__(cfg, OPS, seed, ce_chunk, ignore_index, torch.device("cpu"), torch.float32)
