"""Layouts the spec and the fast path share: permute's row capacity and result bundle, embedding_bwd's operand
check, the MLA and MoE layers' parameter bundles and their shape checks, the model's op bundle (one
definition, so neither path imports the other)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from nmoe.config import ModelConfig

FP8_ACT_BLOCK = 128


@dataclass(frozen=True)
class Permuted:
    """xp [R,H] expert-sorted rows, counts (real rows), offs (cumulative padded ends), slot per row."""

    xp: Tensor
    counts: Tensor
    offs: Tensor
    slot: Tensor


def padded_rows(n_slots: int, n_experts: int, align: int) -> int:
    """Worst case of sum_e ceil(c_e/align)*align over all routings of n_slots slots."""
    if n_slots < 0 or n_experts < 1 or align < 1:
        raise ValueError(
            f"padded_rows: need n_slots >= 0, n_experts >= 1, align >= 1; got {n_slots}, {n_experts}, {align}"
        )
    worst = n_slots + n_experts * (align - 1)
    return -(-worst // align) * align


def check_embedding_grad(dy: Tensor, ids: Tensor) -> None:
    """embedding_bwd's operands: rows dy [T, H] and one integer id per row."""
    if dy.dim() != 2 or ids.shape != (dy.shape[0],) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"embedding_bwd: need dy [T,H] and integer ids [T]; got {tuple(dy.shape)}, "
                         f"{ids.dtype} {tuple(ids.shape)}")


@dataclass(frozen=True)
class MLAParams:
    """One MLA layer's weights in nn.Linear layout [out, in], so a module can pass its Parameters directly.

    q_lora_rank=0: set wq only; otherwise set wq_a, q_norm, wq_b and leave wq None.
    """

    wkv_a: Tensor  # [kv_lora_rank + qk_rope_head_dim, dim]
    kv_norm: Tensor  # [kv_lora_rank]
    wkv_b: Tensor  # [n_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
    wo: Tensor  # [dim, n_heads * v_head_dim]
    wq: Tensor | None = None  # [n_heads * (qk_nope_head_dim + qk_rope_head_dim), dim]
    wq_a: Tensor | None = None  # [q_lora_rank, dim]
    q_norm: Tensor | None = None  # [q_lora_rank]
    wq_b: Tensor | None = None  # [n_heads * (qk_nope_head_dim + qk_rope_head_dim), q_lora_rank]

    @property
    def q_lora_rank(self) -> int:
        return 0 if self.wq_a is None else int(self.wq_a.shape[0])

    @property
    def kv_lora_rank(self) -> int:
        return int(self.kv_norm.shape[0])


def _expect(name: str, t: Tensor | None, shape: tuple[int, ...]) -> Tensor:
    if t is None or tuple(t.shape) != shape:
        got = None if t is None else tuple(t.shape)
        raise ValueError(f"mla_attention: {name} has shape {got}, expected {shape} from the given head dims")
    return t


def check_mla_params(p: MLAParams, dim: int, n_heads: int, d_nope: int, d_rope: int, d_v: int) -> None:
    """The weights' shapes against the head dims, named in the error (spec and fast path alike)."""
    d_qk = d_nope + d_rope
    if (p.wq is None) == (p.wq_a is None):
        raise ValueError(
            "mla_attention: set exactly one of wq (q_lora_rank=0) or wq_a/q_norm/wq_b (q LoRA) in MLAParams"
        )
    if p.wq is not None:
        _expect("wq", p.wq, (n_heads * d_qk, dim))
        if p.q_norm is not None or p.wq_b is not None:
            raise ValueError("mla_attention: wq is set, so q_norm and wq_b must be None (q_lora_rank=0)")
    else:
        r_q = p.q_lora_rank
        _expect("wq_a", p.wq_a, (r_q, dim))
        _expect("q_norm", p.q_norm, (r_q,))
        _expect("wq_b", p.wq_b, (n_heads * d_qk, r_q))
    r_kv = p.kv_lora_rank
    _expect("wkv_a", p.wkv_a, (r_kv + d_rope, dim))
    _expect("wkv_b", p.wkv_b, (n_heads * (d_nope + d_v), r_kv))
    _expect("wo", p.wo, (dim, n_heads * d_v))


@dataclass(frozen=True)
class MoEParams:
    """One MoE layer's tensors. Expert/shared weights bf16; router_w any float dtype; router_bias fp32."""
    # Up projection: w13 [E,2I,D] (rows interleaved gate/up) for swiglu, w1 [E,I,D] for relu2; set exactly
    # one. Shared experts form one MLP of width n_shared*I: shared_w13 [2SI,D] or shared_w1 [SI,D],
    # shared_w2 [D,SI].

    router_w: Tensor
    router_bias: Tensor
    w2: Tensor
    w13: Tensor | None = None
    w1: Tensor | None = None
    shared_w13: Tensor | None = None
    shared_w1: Tensor | None = None
    shared_w2: Tensor | None = None


@dataclass(frozen=True)
class MoERouting:
    """weights fp32 [T,K] sum to 1 per token (route_scale is applied in combine, never here)."""

    weights: Tensor
    ids: Tensor
    counts: Tensor


def _up_weight(w13: Tensor | None, w1: Tensor | None, activation: str, who: str) -> Tensor | None:
    want, other = (w13, w1) if activation == "swiglu" else (w1, w13)
    if other is not None:
        name = "w1" if activation == "swiglu" else "w13"
        raise ValueError(
            f"moe_layer: {who}{name} is set but activation is {activation!r}; set "
            f"{who}{'w13' if activation == 'swiglu' else 'w1'} instead"
        )
    return want


def check_moe_params(x: Tensor, p: MoEParams, cfg: ModelConfig,
                     n_local: int | None = None) -> tuple[Tensor, Tensor | None]:
    """(up weight, shared up weight or None) after checking x and every weight against the config; with
    n_local the expert weights are this rank's shard of n_local experts (the router still sees all)."""
    d = x.shape[1] if x.dim() == 2 else -1
    e, i, s = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.n_shared_experts
    ne = e if n_local is None else n_local
    up_rows = 2 * i if cfg.activation == "swiglu" else i
    if x.dim() != 2 or d != cfg.dim or x.dtype != torch.bfloat16:
        raise ValueError(f"moe_layer: x must be bf16 [T, {cfg.dim}], got {x.dtype} {tuple(x.shape)}")
    up = _up_weight(p.w13, p.w1, cfg.activation, "")
    shared_up = _up_weight(p.shared_w13, p.shared_w1, cfg.activation, "shared_")
    want: dict[str, tuple[Tensor | None, tuple[int, ...] | None]] = {
        "router_w": (p.router_w, (e, d)),
        "router_bias": (p.router_bias, (e,)),
        "w13" if cfg.activation == "swiglu" else "w1": (up, (ne, up_rows, d)),
        "w2": (p.w2, (ne, d, i)),
        "shared up": (shared_up, (up_rows * s, d) if s else None),
        "shared_w2": (p.shared_w2, (d, i * s) if s else None),
    }
    for name, (tensor, shape) in want.items():
        got = None if tensor is None else tuple(tensor.shape)
        if got != shape:
            raise ValueError(
                f"moe_layer: {name} has shape {got}, expected {shape} from the config "
                f"(n_routed_experts={e}, moe_inter_dim={i}, n_shared_experts={s}"
                + (f", {n_local} experts on this rank)" if n_local is not None else ")")
            )
    if p.router_bias.dtype != torch.float32:
        raise ValueError(f"moe_layer: router_bias must be fp32, got {p.router_bias.dtype}")
    for name, tensor in (("up", up), ("w2", p.w2), ("shared up", shared_up), ("shared_w2", p.shared_w2)):
        if tensor is not None and tensor.dtype != torch.bfloat16:
            raise ValueError(
                f"moe_layer: {name} weight must be bf16 (cast the fp32 master), got {tensor.dtype}"
            )
    assert up is not None
    return up, shared_up


@dataclass(frozen=True)
class ModelOps:
    """The functions one path calls, each with the spec op's signature; the rest of the model is shared."""
    # dense_ffn(x, w13, w2) is the dense SwiGLU MLP; check_tokens(tokens, embed, vocab_size) is the path's own
    # input check after the shared ones (the spec checks id range on the host, the fast path the device).

    mla_attention: Callable[[Tensor, MLAParams, Tensor, Tensor, int, int, int, int, float, float], Tensor]
    rmsnorm: Callable[[Tensor, Tensor, float], Tensor]
    add_rmsnorm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    dense_ffn: Callable[[Tensor, Tensor, Tensor], Tensor]
    moe_layer: Callable[[Tensor, MoEParams, ModelConfig], tuple[Tensor, MoERouting]]
    cross_entropy: Callable[[Tensor, Tensor, Tensor, int, int], Tensor]
    bias_update: Callable[[Tensor, Tensor, float, float], Tensor]
    embedding: Callable[[Tensor, Tensor], Tensor]
    check_tokens: Callable[[Tensor, Tensor, int], None]
