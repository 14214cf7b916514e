"""The fast model: nmoe.modeldef's model with the fast ops, dense projections on cuBLAS. Params in
`param_dtype`: fp32 masters cast to bf16 once per forward, or bf16 read as they are (the optimizer holds fp32
masters); built on an sm_90a/sm_100a GPU, or on meta for shapes; any other device raises."""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Final

import torch
import torch.distributed as dist
from torch import Tensor

from nmoe import modeldef
from nmoe.config import ModelConfig, TrainConfig
from nmoe.fast import runtime
from nmoe.fast.activation import swiglu
from nmoe.fast.arch import ArchError
from nmoe.fast.attention import mla_attention
from nmoe.fast.dispatch import embedding
from nmoe.fast.loss import cross_entropy
from nmoe.fast.moe import moe_layer
from nmoe.fast.norm import add_rmsnorm, rmsnorm
from nmoe.fast.rdep.ep import Exchange
from nmoe.fast.rdep.group import RdepShape
from nmoe.fast.router import bias_update
from nmoe.layout import ModelOps
from nmoe.modeldef import COMPUTE, MLA, Block, DenseFFN, MoE
from nmoe.sharding import ExpertShard

__all__ = ["MLA", "OPS", "Block", "DenseFFN", "MoE", "Model", "ep_shape", "model_device"]

PARAM_DTYPES: Final[dict[str, torch.dtype]] = {"fp32": torch.float32, "bf16": torch.bfloat16}
CPU_HINT: Final[str] = ("the CPU spec model is nmoe.reference.model.Model (train.device = \"cpu\", "
                        "train.model = \"reference\")")


def model_device(device: str | torch.device | None) -> torch.device:
    """The device to build on: meta, or a CUDA device of a supported arch; anything else raises ArchError."""
    dev = torch.device("cuda" if device is None else device)
    if dev.type == "meta":
        return dev
    if dev.type != "cuda":
        raise ArchError(f"nmoe.fast.model.Model: device {dev} is not a GPU; the fast model runs on an sm_90a "
                        f"(H100/H200) or sm_100a (B200) GPU with no CPU fallback; {CPU_HINT}")
    if not torch.cuda.is_available():
        raise ArchError(f"nmoe.fast.model.Model: no CUDA device (torch {torch.__version__}); the fast model "
                        f"needs an sm_90a or sm_100a GPU and a CUDA build of torch; {CPU_HINT}")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    dev = torch.device("cuda", index)
    runtime.require_arch(torch.empty(0, device=dev))
    return dev


def _dense_ffn(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Dense projections on cuBLAS (bf16 in and out, fp32 accumulate) around the fast swiglu."""
    a: Tensor = swiglu(x @ w13.T)
    return a @ w2.T


def _check_tokens(tokens: Tensor, embed: Tensor, vocab_size: int) -> None:
    """The batch must sit on the model's device; ids are not range-checked (a host sync, the loader's job)."""
    if tokens.device != embed.device:
        raise ArchError(f"Model: tokens on {tokens.device}, parameters on {embed.device}; move the "
                        f"batch to the model's GPU ({CPU_HINT})")


OPS: Final[ModelOps] = ModelOps(
    mla_attention=mla_attention, rmsnorm=rmsnorm, add_rmsnorm=add_rmsnorm, dense_ffn=_dense_ffn,
    moe_layer=moe_layer, cross_entropy=cross_entropy, bias_update=bias_update,
    embedding=embedding, check_tokens=_check_tokens,
)


class Model(modeldef.Model):
    """forward(tokens [B,S]) -> fp32 logits [B,S,V]; with targets [B,S] -> fp32 mean CE over kept tokens.

    Token ids are not range-checked here (that is a host sync): the loader refuses ids outside the vocab.
    """

    def __init__(
        self, cfg: ModelConfig, seed: int = 0, ce_chunk: int = TrainConfig.ce_chunk,
        ignore_index: int = -100, *,
        param_dtype: str = "fp32", device: str | torch.device | None = None, shard: ExpertShard | None = None,
    ) -> None:
        if param_dtype not in PARAM_DTYPES:
            raise ValueError(f"nmoe.fast.model.Model: param_dtype {param_dtype!r} unknown; use one of "
                             f"{', '.join(PARAM_DTYPES)} (train.param_dtype)")
        if ce_chunk < 1:
            raise ValueError(f"nmoe.fast.model.Model: ce_chunk={ce_chunk} must be >= 1")
        dev = model_device(device)
        super().__init__(cfg, OPS, seed, ce_chunk, ignore_index, dev, PARAM_DTYPES[param_dtype], shard)
        self.exchange: Exchange | None = None

    def attach_exchange(self, ex: Exchange) -> None:
        """Route every MoE layer's rows over `ex` (expert parallelism); one exchange serves all layers."""
        c, s = self.cfg, ex.fwd.shape
        if self.shard is None or (ex.fwd.rank, s.world) != (self.shard.rank, self.shard.world):
            raise ValueError(f"Model.attach_exchange: exchange of rank {ex.fwd.rank} of {s.world}, model "
                             f"shard {self.shard}; build the model with shard=ExpertShard(rank, world)")
        if (s.n_experts, s.top_k, s.hidden, s.dtype) != (c.n_routed_experts, c.n_activated_experts, c.dim,
                                                         COMPUTE):
            raise ValueError(f"Model.attach_exchange: exchange shape {s} does not fit the model (experts "
                             f"{c.n_routed_experts}, top-k {c.n_activated_experts}, dim {c.dim}, bf16)")
        for moe in self.moe_layers():
            moe.ops = replace(moe.ops, moe_layer=functools.partial(moe_layer, ex=ex))
        self.exchange = ex

    def close_exchange(self) -> None:
        """Free the RDEP windows once every rank is done with them (collective: a barrier first)."""
        if self.exchange is None:
            return
        torch.cuda.synchronize(self.exchange.fwd.device)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        self.exchange.close()
        self.exchange = None
        for moe in self.moe_layers():
            moe.ops = OPS

    def check_exchange(self) -> None:
        """Raise an RDEP error (capacity overflow, silent peer) a kernel recorded; call after a host sync."""
        if self.exchange is not None:
            self.exchange.check()


def ep_shape(cfg: ModelConfig, tokens: int, world: int, capacity: float, timeout_s: float) -> RdepShape:
    """The exchange of `tokens` tokens per rank and forward: a rank receives at most `capacity` times its own
    T*K rows (every rank's W*T*K is the most that can arrive, so more is never allocated)."""
    if capacity <= 0:
        raise ValueError(f"ep_shape: capacity {capacity} must be > 0 (train.ep_capacity)")
    k = cfg.n_activated_experts
    rows = tokens * k
    cap = min(math.ceil(capacity * rows), world * rows)
    return RdepShape(world=world, n_experts=cfg.n_routed_experts, tokens=tokens, top_k=k, hidden=cfg.dim,
                     dtype=COMPUTE, capacity=cap, timeout_s=timeout_s)
