"""The one DeepSeek-shaped model: embed -> [MLA + dense FFN | MoE] blocks -> rmsnorm -> head, built from a
ModelOps bundle, so the spec and fast models share names, shapes, init draws, casts and router wiring."""

from __future__ import annotations

from dataclasses import replace
from typing import Final

import torch
from torch import Tensor, nn

from nmoe import sharding
from nmoe.config import ModelConfig
from nmoe.layout import MLAParams, ModelOps, MoEParams, MoERouting
from nmoe.sharding import ExpertShard
from nmoe.yarn import mla_softmax_scale, yarn_cos_sin

COMPUTE: Final[torch.dtype] = torch.bfloat16


def _bf(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.to(COMPUTE)


class _Init:
    """Draws parameters in construction order from one seeded generator on the device (none on meta)."""

    def __init__(self, seed: int, std: float, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype, self.std = device, dtype, std
        self.gen = None if device.type == "meta" else torch.Generator(device).manual_seed(seed)

    def normal(self, *shape: int) -> nn.Parameter:
        """Drawn in fp32 whatever the param dtype, so a bf16 model holds the rounded fp32 model's draws."""
        t = torch.empty(*shape, device=self.device, dtype=torch.float32)
        if self.gen is not None:
            t.normal_(0.0, self.std, generator=self.gen)
        return nn.Parameter(t.to(self.dtype))

    def ones(self, n: int) -> nn.Parameter:
        return nn.Parameter(torch.ones(n, device=self.device, dtype=self.dtype))


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, init: _Init, ops: ModelOps) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        h, dqk = cfg.n_heads, cfg.qk_head_dim
        self.wq: nn.Parameter | None = None
        self.wq_a: nn.Parameter | None = None
        self.q_norm: nn.Parameter | None = None
        self.wq_b: nn.Parameter | None = None
        if cfg.q_lora_rank == 0:
            self.wq = init.normal(h * dqk, cfg.dim)
        else:
            self.wq_a = init.normal(cfg.q_lora_rank, cfg.dim)
            self.q_norm = init.ones(cfg.q_lora_rank)
            self.wq_b = init.normal(h * dqk, cfg.q_lora_rank)
        self.wkv_a = init.normal(cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.dim)
        self.kv_norm = init.ones(cfg.kv_lora_rank)
        self.wkv_b = init.normal(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        self.wo = init.normal(cfg.dim, h * cfg.v_head_dim)
        self.softmax_scale = mla_softmax_scale(dqk, cfg.rope_factor, cfg.mscale, cfg.max_seq_len,
                                               cfg.original_seq_len)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        c = self.cfg
        p = MLAParams(wkv_a=self.wkv_a.to(COMPUTE), kv_norm=self.kv_norm.to(COMPUTE),
                      wkv_b=self.wkv_b.to(COMPUTE), wo=self.wo.to(COMPUTE), wq=_bf(self.wq),
                      wq_a=_bf(self.wq_a), q_norm=_bf(self.q_norm), wq_b=_bf(self.wq_b))
        return self.ops.mla_attention(x, p, cos, sin, c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                                      c.v_head_dim, self.softmax_scale, c.norm_eps)


class DenseFFN(nn.Module):
    """SwiGLU MLP of the first n_dense_layers; w13 rows interleave gate/up like the experts."""

    def __init__(self, cfg: ModelConfig, init: _Init, ops: ModelOps) -> None:
        super().__init__()
        self.ops = ops
        self.w13 = init.normal(2 * cfg.inter_dim, cfg.dim)
        self.w2 = init.normal(cfg.dim, cfg.inter_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.ops.dense_ffn(x, self.w13.to(COMPUTE), self.w2.to(COMPUTE))


class MoE(nn.Module):
    """With an ExpertShard the routed experts are this rank's rows of the full stacks, drawn whole so every
    world size starts from the same weights; `ops` may be replaced by one that routes over ranks."""

    def __init__(self, cfg: ModelConfig, init: _Init, ops: ModelOps, shard: ExpertShard | None) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        e, i, d, s = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim, cfg.n_shared_experts
        up = 2 * i if cfg.activation == "swiglu" else i
        self.router_w = init.normal(e, d)
        self.router_bias: Tensor
        self.register_buffer("router_bias", torch.zeros(e, dtype=torch.float32, device=init.device))
        self.w_up = _local(init.normal(e, up, d), shard)
        self.w2 = _local(init.normal(e, d, i), shard)
        self.shared_up: nn.Parameter | None = init.normal(up * s, d) if s else None
        self.shared_w2: nn.Parameter | None = init.normal(d, i * s) if s else None
        self.last_routing: MoERouting | None = None

    def params(self) -> MoEParams:
        swiglu = self.cfg.activation == "swiglu"
        up, shared_up = self.w_up.to(COMPUTE), _bf(self.shared_up)
        return MoEParams(
            router_w=self.router_w.to(COMPUTE), router_bias=self.router_bias, w2=self.w2.to(COMPUTE),
            w13=up if swiglu else None, w1=None if swiglu else up,
            shared_w13=shared_up if swiglu else None, shared_w1=None if swiglu else shared_up,
            shared_w2=_bf(self.shared_w2),
        )

    def forward(self, x: Tensor) -> Tensor:
        out, routing = self.ops.moe_layer(x, self.params(), self.cfg)
        self.last_routing = replace(routing, weights=routing.weights.detach())
        return out


def _local(full: nn.Parameter, shard: ExpertShard | None) -> nn.Parameter:
    if shard is None:
        return full
    p = nn.Parameter(full.data[shard.rows(full.shape[0])].clone())
    sharding.mark(p, shard)
    return p


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, init: _Init, ops: ModelOps,
                 shard: ExpertShard | None = None) -> None:
        super().__init__()
        self.eps, self.ops = cfg.norm_eps, ops
        self.attn_norm = init.ones(cfg.dim)
        self.attn = MLA(cfg, init, ops)
        self.ffn_norm = init.ones(cfg.dim)
        self.ffn: DenseFFN | MoE = (DenseFFN(cfg, init, ops) if layer_id < cfg.n_dense_layers
                                    else MoE(cfg, init, ops, shard))

    def forward(self, h: Tensor, f: Tensor | None, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """(stream, this block's ffn output): the previous block's ffn output f joins the stream in the op
        that norms it, and this block's waits for the next, so each residual add shares a pass with a norm."""
        h, x = add_norm(self.ops, h, f, self.attn_norm.to(COMPUTE), self.eps)
        a: Tensor = self.attn(x, cos, sin)
        h, x = self.ops.add_rmsnorm(h, a, self.ffn_norm.to(COMPUTE), self.eps)
        b, s, d = h.shape
        out: Tensor = self.ffn(x.reshape(b * s, d))
        return h, out.reshape(b, s, d)


def add_norm(ops: ModelOps, h: Tensor, f: Tensor | None, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h + f, its rmsnorm) by the path's fused op; (h, rmsnorm(h)) before the first block's attention."""
    if f is None:
        return h, ops.rmsnorm(h, w, eps)
    return ops.add_rmsnorm(h, f, w, eps)


class Model(nn.Module):
    """forward(tokens [B,S]) -> fp32 logits [B,S,V]; with targets [B,S] -> fp32 mean CE over kept tokens."""
    # Masters live in `dtype` on `device`, cast to bf16 once per forward; on meta only shapes are built.
    # `shard`: the routed experts this rank holds under expert parallelism (None: all of them).

    def __init__(self, cfg: ModelConfig, ops: ModelOps, seed: int, ce_chunk: int, ignore_index: int,
                 device: torch.device, dtype: torch.dtype, shard: ExpertShard | None = None) -> None:
        super().__init__()
        self.cfg, self.ops, self.ce_chunk, self.ignore_index = cfg, ops, ce_chunk, ignore_index
        self.shard = shard
        if shard is not None:
            shard.rows(cfg.n_routed_experts)
        init = _Init(seed, cfg.init_std, device, dtype)
        self.embed = init.normal(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i, init, ops, shard) for i in range(cfg.n_layers))
        self.norm = init.ones(cfg.dim)
        self.head = init.normal(cfg.vocab_size, cfg.dim)
        if device.type == "meta":
            half = cfg.qk_rope_head_dim // 2
            cos = torch.empty(cfg.max_seq_len, half, device=device)
            sin = torch.empty(cfg.max_seq_len, half, device=device)
        else:
            cos, sin = yarn_cos_sin(cfg.max_seq_len, cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor,
                                    cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow)
        self.cos: Tensor
        self.sin: Tensor
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def moe_layers(self) -> list[MoE]:
        return [blk.ffn for blk in self.layers if isinstance(blk.ffn, MoE)]

    def hidden(self, tokens: Tensor) -> Tensor:
        """Final-normed bf16 hidden states [B,S,D]."""
        if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"Model: tokens must be integer [B, S], got {tokens.dtype} "
                             f"{tuple(tokens.shape)}")
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"Model: sequence length {tokens.shape[1]} > model.max_seq_len="
                             f"{self.cfg.max_seq_len}; shorten data.seq_len or raise max_seq_len")
        self.ops.check_tokens(tokens, self.embed, self.cfg.vocab_size)
        h = self.ops.embedding(tokens, self.embed).to(COMPUTE)
        f: Tensor | None = None
        for blk in self.layers:
            h, f = blk(h, f, self.cos, self.sin)
        return add_norm(self.ops, h, f, self.norm.to(COMPUTE), self.cfg.norm_eps)[1]

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        if targets is not None and targets.shape != tokens.shape:
            raise ValueError(f"Model: targets {tuple(targets.shape)} must match tokens {tuple(tokens.shape)}")
        h = self.hidden(tokens)
        w = self.head.to(COMPUTE)
        if targets is None:
            return h.float() @ w.float().T
        b, s, d = h.shape
        return self.ops.cross_entropy(h.reshape(b * s, d), w, targets.reshape(b * s), self.ignore_index,
                                      self.ce_chunk)

    def router_counts(self) -> list[Tensor]:
        """Per-MoE-layer expert counts [E] of the last forward, on the model's device (all-reduce for DP)."""
        out = []
        for moe in self.moe_layers():
            if moe.last_routing is None:
                raise RuntimeError("Model.router_counts: no forward has run yet; call the model first")
            out.append(moe.last_routing.counts)
        return out

    @torch.no_grad()
    def update_router_bias(self, counts: list[Tensor] | None = None) -> None:
        """Aux-loss-free balancing step outside autograd: bias <- bias_update(bias, counts, rate, clamp)."""
        moes = self.moe_layers()
        counts = self.router_counts() if counts is None else counts
        if len(counts) != len(moes):
            raise ValueError(f"update_router_bias: got {len(counts)} count tensors for {len(moes)} MoE "
                             "layers; pass one [E] tensor per MoE layer")
        rate, clamp = self.cfg.bias_update_rate, self.cfg.bias_clamp
        for moe, c in zip(moes, counts, strict=True):
            moe.router_bias.copy_(self.ops.bias_update(moe.router_bias, c, rate, clamp))
