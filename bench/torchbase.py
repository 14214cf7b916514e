"""Plain-torch baselines the benches time in the same run as ours: the MoE routing ops and layer, and the
moonlet model (bf16 compute over fp32 masters, cuDNN SDPA, torch._grouped_mm experts, chunked CE).

Nothing here is a contract: the spec (nmoe/reference) fixes the semantics; these only set the speed to beat.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from nmoe.config import ModelConfig
from nmoe.layout import MoEParams, padded_rows

BF16 = torch.bfloat16


def router_topk_torch(logits: Tensor, bias: Tensor, k: int) -> tuple[Tensor, Tensor]:
    scores = torch.sigmoid(logits)
    ids = torch.topk(scores + bias, k, dim=-1).indices
    picked = scores.gather(1, ids)
    return picked / picked.sum(-1, keepdim=True), ids


def permute_torch(x: Tensor, ids: Tensor, n_experts: int, align: int) -> tuple[Tensor, ...]:
    t, k = ids.shape
    m = t * k
    eid = ids.reshape(-1)
    order = torch.argsort(eid, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, eid, torch.ones_like(eid))
    padded = (counts + (align - 1)) // align * align
    offs = padded.cumsum(0)
    shift = offs - padded - (counts.cumsum(0) - counts)
    dest = torch.arange(m, device=x.device) + shift[eid[order]]
    rows = padded_rows(m, n_experts, align)
    xp = x.new_zeros(rows, x.shape[1]).index_copy_(0, dest, x.index_select(0, order // k))
    slot = torch.full((rows,), -1, dtype=torch.int64, device=x.device).index_copy_(0, dest, order)
    return xp, counts.to(torch.int32), offs.to(torch.int32), slot


def unpermute_torch(yp: Tensor, slot: Tensor, t: int, k: int) -> Tensor:
    m = t * k
    sink = torch.where(slot >= 0, slot, m)
    return yp.new_empty(m + 1, yp.shape[1]).index_copy_(0, sink, yp)[:m].view(t, k, yp.shape[1])


def torch_layer(x: Tensor, router_w: Tensor, router_bias: Tensor, w13: Tensor, w2: Tensor, k: int,
                align: int, route_scale: float = 1.0) -> Tensor:
    """The routed experts from torch ops: fp32 router logits, sigmoid top-k, argsort permute, _grouped_mm."""
    t = x.shape[0]
    w, ids = router_topk_torch(x.float() @ router_w.float().T, router_bias, k)
    xp, _, offs, slot = permute_torch(x, ids, w13.shape[0], align)
    hp = torch._grouped_mm(xp, w13.transpose(-2, -1), offs=offs)
    a = F.silu(hp[:, 0::2].float()) * hp[:, 1::2].float()
    yp = torch._grouped_mm(a.to(BF16), w2.transpose(-2, -1), offs=offs)
    y = unpermute_torch(yp, slot, t, k)
    return ((w * route_scale)[:, :, None] * y.float()).sum(1).to(BF16)


LAYER_CONFIGS = ((32768, 4096, 1024, 128, 8), (24576, 1536, 256, 128, 8), (32768, 4096, 512, 256, 8),
                 (32768, 2048, 512, 64, 6))
"""(T, H, I, E, K) of the MoE layer rows: SonicMoE's three, then moonlet's layer at its 32k-token step."""
LAYER_ALIGN = 8
"""permute_align of the layer rows, the config default: against 128 its fwd+bwd measured 0.99-1.01x the time
with 0.04-0.26 GiB less peak on the H200, once the wgrad's tail mask stored 16 bytes at a time."""


def layer_flops(cfg: tuple[int, ...], pass_: str) -> float:
    """The layer's FLOPs as SonicMoE counts them: forward 6*T*I*H*K, forward+backward three times that."""
    t, h, i, _, k = cfg
    return (6.0 if pass_ == "fwd" else 18.0) * t * i * h * k


ZIPF_BIAS = 0.25
"""Zipf-skewed routing: router bias -ZIPF_BIAS * ln(1 + rank) over a random expert ranking."""


CE_SHAPE = (8192, 2048, 201088)
"""(T, H, V) of the production head the cross-entropy rows time; chunks of CE_CHUNK tokens."""
CE_CHUNK = 4096
CE_IGNORE = -100


def ce_inputs() -> tuple[Tensor, Tensor, Tensor]:
    """(h, w_out, targets) at CE_SHAPE, seeded, both leaves requiring grad; every 17th target ignored."""
    t, hd, v = CE_SHAPE
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(t, hd, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, hd, device="cuda", generator=g) / hd**0.5).bfloat16().requires_grad_()
    tg = torch.randint(0, v, (t,), device="cuda", generator=g)
    tg[::17] = CE_IGNORE
    return h, w, tg


def layer_inputs(cfg: tuple[int, ...], routing: str,
                 align: int) -> tuple[ModelConfig, MoEParams, Tensor, list[Tensor]]:
    """The MoE layer rows' config, weights and x at (T, H, I, E, K), seeded: every process builds the same."""
    t, h, i, e, k = cfg
    g = torch.Generator(device="cuda").manual_seed(3)

    def rn(*shape: int, scale: float) -> Tensor:
        w = torch.randn(*shape, device="cuda", generator=g) * scale
        return w.to(torch.bfloat16).requires_grad_()

    mc = ModelConfig(tokenizer="none", vocab_size=64, dim=h, moe_inter_dim=i, n_routed_experts=e,
                     n_activated_experts=k, n_shared_experts=0, route_scale=1.0, permute_align=align,
                     activation="swiglu", score_func="sigmoid", expert_dtype="bf16")
    bias = torch.zeros(e, device="cuda")
    if routing == "zipf":
        rank = torch.randperm(e, device="cuda", generator=g).float()
        bias = -ZIPF_BIAS * torch.log1p(rank)
    p = MoEParams(router_w=rn(e, h, scale=h**-0.5), router_bias=bias,
                  w2=rn(e, h, i, scale=i**-0.5), w13=rn(e, 2 * i, h, scale=h**-0.5))
    x = rn(t, h, scale=1.0)
    assert p.w13 is not None
    return mc, p, x, [x, p.router_w, p.w13, p.w2]


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Pairs (x[2i], x[2i+1]) rotated in fp32 over x [B, S, H, D]; cos/sin [S, D/2]."""
    xf = x.float().unflatten(-1, (-1, 2))
    c, s = cos[:, None, :], sin[:, None, :]
    y0 = xf[..., 0] * c - xf[..., 1] * s
    y1 = xf[..., 0] * s + xf[..., 1] * c
    return torch.stack((y0, y1), -1).flatten(-2).to(x.dtype)


def _cos_sin(cfg: ModelConfig, device: torch.device) -> tuple[Tensor, Tensor]:
    d = cfg.qk_rope_head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(cfg.max_seq_len, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float().to(device), torch.sin(ang).float().to(device)


class _Params(nn.Module):
    def __init__(self, gen: torch.Generator, std: float, device: torch.device) -> None:
        super().__init__()
        self._gen, self._std, self._device = gen, std, device

    def normal(self, *shape: int) -> nn.Parameter:
        t = torch.empty(shape, dtype=torch.float32, device=self._device)
        return nn.Parameter(t.normal_(0.0, self._std, generator=self._gen))

    def ones(self, n: int) -> nn.Parameter:
        return nn.Parameter(torch.ones(n, dtype=torch.float32, device=self._device))


class TorchMoonlet(nn.Module):
    """The config's shapes (MLA with q_lora_rank 0, dense then MoE layers, shared experts, swiglu). The router
    bias update is left out (a few [E] ops a step); rope is plain (the timed configs keep rope_factor 1)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, seed: int = 0, ce_chunk: int = 4096,
                 sdpa: SDPBackend = SDPBackend.CUDNN_ATTENTION) -> None:
        super().__init__()
        if cfg.q_lora_rank or cfg.activation != "swiglu" or cfg.score_func != "sigmoid":
            raise ValueError("TorchMoonlet: the baseline covers q_lora_rank 0, swiglu and sigmoid routing "
                             f"(got {cfg.q_lora_rank}, {cfg.activation}, {cfg.score_func})")
        self.cfg, self.ce_chunk, self.sdpa = cfg, ce_chunk, sdpa
        gen = torch.Generator(device).manual_seed(seed)
        p = _Params(gen, cfg.init_std, device)
        h, dqk = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        e, i, s = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.n_shared_experts
        self.embed, self.norm, self.head = p.normal(cfg.vocab_size, cfg.dim), p.ones(cfg.dim), \
            p.normal(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList()
        for layer in range(cfg.n_layers):
            blk = nn.Module()
            blk.attn_norm, blk.ffn_norm = p.ones(cfg.dim), p.ones(cfg.dim)
            blk.attn = nn.Module()
            blk.attn.wq = p.normal(h * dqk, cfg.dim)
            blk.attn.wkv_a = p.normal(cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.dim)
            blk.attn.kv_norm = p.ones(cfg.kv_lora_rank)
            blk.attn.wkv_b = p.normal(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
            blk.attn.wo = p.normal(cfg.dim, h * cfg.v_head_dim)
            blk.ffn = nn.Module()
            if layer < cfg.n_dense_layers:
                blk.ffn.w13 = p.normal(2 * cfg.inter_dim, cfg.dim)
                blk.ffn.w2 = p.normal(cfg.dim, cfg.inter_dim)
            else:
                blk.ffn.router_w = p.normal(e, cfg.dim)
                blk.ffn.register_buffer("router_bias", torch.zeros(e, device=device))
                blk.ffn.w13, blk.ffn.w2 = p.normal(e, 2 * i, cfg.dim), p.normal(e, cfg.dim, i)
                blk.ffn.shared_w13 = p.normal(2 * i * s, cfg.dim)
                blk.ffn.shared_w2 = p.normal(cfg.dim, i * s)
            self.layers.append(blk)
        cos, sin = _cos_sin(cfg, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.scale = dqk ** -0.5

    def _attn(self, a: nn.Module, x: Tensor) -> Tensor:
        cfg, (b, s, _) = self.cfg, x.shape
        h, dn, dr, dv = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        cos, sin = self.cos[:s], self.sin[:s]
        q = (x @ a.wq.to(BF16).T).view(b, s, h, dn + dr)
        q = torch.cat((q[..., :dn], _rope(q[..., dn:], cos, sin)), -1)
        kv = x @ a.wkv_a.to(BF16).T
        lat = F.rms_norm(kv[..., :cfg.kv_lora_rank], (cfg.kv_lora_rank,), a.kv_norm.to(BF16), cfg.norm_eps)
        k_rope = _rope(kv[..., cfg.kv_lora_rank:].unsqueeze(2), cos, sin).expand(b, s, h, dr)
        kvb = (lat @ a.wkv_b.to(BF16).T).view(b, s, h, dn + dv)
        k = torch.cat((kvb[..., :dn], k_rope), -1)
        with sdpa_kernel(self.sdpa):
            qh, kh, vh = (t.transpose(1, 2) for t in (q, k, kvb[..., dn:]))
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        return o.transpose(1, 2).reshape(b, s, h * dv) @ a.wo.to(BF16).T

    def _ffn(self, f: nn.Module, x: Tensor) -> Tensor:
        def mlp(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
            g = x @ w13.to(BF16).T
            return (F.silu(g[..., 0::2]) * g[..., 1::2]) @ w2.to(BF16).T

        if not hasattr(f, "router_w"):
            return mlp(x, f.w13, f.w2)
        routed = torch_layer(x, f.router_w, f.router_bias, f.w13.to(BF16), f.w2.to(BF16),
                             self.cfg.n_activated_experts, self.cfg.permute_align, self.cfg.route_scale)
        return routed + mlp(x, f.shared_w13, f.shared_w2)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        cfg, (b, s) = self.cfg, tokens.shape
        h = F.embedding(tokens, self.embed).to(BF16)
        for blk in self.layers:
            h = h + self._attn(blk.attn, F.rms_norm(h, (cfg.dim,), blk.attn_norm.to(BF16), cfg.norm_eps))
            f = F.rms_norm(h, (cfg.dim,), blk.ffn_norm.to(BF16), cfg.norm_eps).reshape(b * s, cfg.dim)
            h = h + self._ffn(blk.ffn, f).reshape(b, s, cfg.dim)
        hn = F.rms_norm(h, (cfg.dim,), self.norm.to(BF16), cfg.norm_eps).reshape(b * s, cfg.dim)
        w, t = self.head.to(BF16), targets.reshape(-1)

        def chunk_ce(hc: Tensor, tc: Tensor) -> Tensor:
            return F.cross_entropy((hc @ w.T).float(), tc, reduction="sum")

        total = sum(checkpoint(chunk_ce, hn[i:i + self.ce_chunk], t[i:i + self.ce_chunk], use_reentrant=False)
                    for i in range(0, b * s, self.ce_chunk))
        assert isinstance(total, Tensor)
        return total / (b * s)
