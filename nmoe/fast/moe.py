"""Fast MoE layer: the spec's moe_layer (nmoe.reference.moe) from fast ops, sm_90a, no host sync.

One autograd node, _Routed, from the router to combine: router_logits and router_topk (the fast ops), the
shared MLP (one-group GEMMs) and permute's routing (slot, offs; bf16 experts copy no rows: the up projection
gathers x's rows as it loads) -> up (+act) -> down -> combine_gather (each slot's row read in place from the
permuted output: no [T,K,H] copy). Its backward calls the fast spread_rows, dgrad/wgrad and combine_gather
kernels, and expert_rows_bwd: one pass over [rows, I] for a = act(h), its router-weight scaling, dweights'
row dot and dh, written over h (exactly the separate kernels); x's three gradients meet with no add of their
own: the router's dx GEMM adds the shared MLP's dx (addmm), combine_gather adds that to the routed rows.
With an RDEP Exchange the experts are sharded over ranks: router_logits and _RouterTopk route, the routed
half is nmoe.fast.rdep.ep.ep_routed (rows travel to their expert's rank and back), _Shared the shared MLP.

Saved for the backward, per token (K slots, up width N = 2I swiglu or I relu2, E experts):
  x (the layer input, already alive)      0 extra: the up projection reads x's rows by index, the down
                                            projection's dgrad reads dout's rows by index (no permuted copy
                                            of x or dout kept, 2KH bytes per token each); the wgrads read
                                            transient permuted copies of column chunks of dout and of x
                                            (made once dx is reduced), each no larger than dh, spread on the
                                            forward's routing; at I <= 256 the down wgrad reads dout's rows
                                            by index instead (limits.GEMM_WGRAD_GATHER_DY_MAX_K); above
                                            it, with limits.GEMM_DGRAD_SPILL, the down dgrad writes dout's
                                            whole copy (2KH bytes, held until the down wgrad) from its rows;
                                            at N <= 512 the up wgrad reads x's rows by index
                                            (limits.GEMM_WGRAD_GATHER_X_MAX_N)
  h [slots, N] bf16                        2KN bytes: the up-projection output; a = act(h) is recomputed
                                            (elementwise), redoing the up GEMM would cost a third of the fwd;
                                            the backward writes dh over h (no second [slots, N] buffer)
  weights fp32 [T,K], ids int64 [T,K],      16K + 8*(rows/T) bytes: routing
  row_of int32 [T,K], slot int64 [rows]
  picked logits fp32 [T,K], sigmoid only   4K bytes: router_topk's backward, from the weights themselves
                                            (they move with the picked logits only), no [T,E] logits kept
With no backward to come (no grad mode, or no input requiring grad) nothing is kept for one: bf16 experts
never write h (the up projection stores a = act(h) only, 2KN bytes per token less memory and HBM writes),
fp8 drops h once act(h) exists.
bf16 experts keep no expert outputs y [T,K,H]: dweights_k = scale * <a_k, dout @ W2_e> (the down GEMM's
dgrad computes dout @ W2_e anyway), saving 2KH bytes per token for a row dot product.
fp8 experts: the forward quantizes (1x128 activations, 128x128 weights) and runs the sm90 fp8 GEMM; the
backward is the spec's straight-through gradient, bf16 dgrad/wgrad of the unquantized tensors, because the
spec defines the fp8 gradient that way (bf16 master weights) and fp8 dgrad/wgrad kernels are not written.
dweights_k = scale * <dout, y_k> is exact, not straight-through, and y_k is the fp8 GEMM's output, not a
function of bf16 operands: fp8 keeps y (2KH bytes per token) and takes dweights from combine_bwd.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from nmoe.accumulate import adding
from nmoe.config import ModelConfig
from nmoe.fast import limits, runtime
from nmoe.fast.activation import BY_NAME
from nmoe.fast.arch import ArchNotImplemented
from nmoe.fast.combine import combine, combine_bwd, combine_gather, expert_rows_bwd
from nmoe.fast.dispatch import permute_rows, spread_rows, unpermute
from nmoe.fast.experts import expert_gemm
from nmoe.fast.gemm import grouped_gemm_dgrad, grouped_gemm_wgrad, sm90
from nmoe.fast.gemm.routing import offs_built_on_device
from nmoe.fast.rdep.ep import Exchange, ep_routed
from nmoe.fast.router import expert_counts, logits_grads, picks_dense, router_logits, router_topk
from nmoe.layout import MoEParams, MoERouting, check_moe_params

__all__ = ["MoEParams", "MoERouting", "moe_layer"]

ARCH = "sm_90a"
EXPERT_DTYPES = ("bf16", "fp8")

F = TypeVar("F", bound=Callable[..., Any])


def _sync_free(fn: F) -> F:
    """Run fn with the GEMMs' opt-in host offs check off: the layer's offs come from permute on the device."""

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        with offs_built_on_device():
            return fn(*args)

    return run  # type: ignore[return-value]


def _up(x: Tensor, w: Tensor, offs: Tensor, activation: str, dtype: str) -> tuple[Tensor, Tensor]:
    """(a, h): bf16 from the fused up-projection kernel, fp8 as act(fp8 GEMM) like the spec."""
    if dtype == "bf16":
        return sm90.grouped_gemm_act_h(x, w, offs, activation)
    h = expert_gemm(x, w, offs, dtype)
    return BY_NAME[activation][0](h), h


def _slot_weights(weights: Tensor, slot: Tensor) -> Tensor:
    """fp32 [R]: the router weight of each permuted row's slot, 0 on pad rows (slot -1)."""
    flat = torch.cat([weights.reshape(-1), weights.new_zeros(1)])
    return flat[torch.where(slot >= 0, slot, flat.numel() - 1)]


def _held_grad(w: Tensor) -> Tensor | None:
    """w's .grad to add the wgrad into, when nmoe.accumulate's adding_to_grads is on and w (a leaf) holds a
    bf16 one the kernel can address; else None, and autograd gets the wgrad as usual."""
    g = w.grad
    if (not adding() or not w.is_leaf or g is None or g.dtype != torch.bfloat16 or g.shape != w.shape
            or not g.is_contiguous() or g.data_ptr() % 16):
        return None
    return g


def _wgrad_gathers(tokens: str, width: int) -> bool:
    """Whether a wgrad reads its token side's rows by index, not a permuted copy: its other side (the down
    wgrad's a, I wide; the up wgrad's dh, N wide) is narrow enough that the copy would cost more."""
    if tokens == "x":
        return width <= limits.GEMM_WGRAD_GATHER_X_MAX_N
    return width <= limits.GEMM_WGRAD_GATHER_DY_MAX_K


def _expert_wgrad(dy: Tensor, x: Tensor, slot: Tensor, row_of: Tensor, offs: Tensor, tokens: str,
                  width: int, w: Tensor, copied: Tensor | None = None) -> Tensor | None:
    """dy^T @ x per expert when the `tokens` side is token-major: read through slot by the gathering wgrad
    (_wgrad_gathers: dout on M, x on M or N) or, permuted, by the TMA-fed wgrad: `copied` (the spilling
    dgrad's) or copies of `width` columns at a time."""
    # The `tokens` side is "x" (the up projection's x) or "dy" (the down projection's dout); chunks are whole
    # 128-wide tiles, permuted by the forward's routing with their columns read in place. Which one is faster
    # is measured (GEMM_WGRAD_GATHER_DY_MAX_K, GEMM_WGRAD_GATHER_X_MAX_N): gathering pays where the other
    # side is narrow, so the copy weighs more against the MMAs. None when the wgrad was added into w's held
    # .grad in place (_held_grad), autograd's share then being nothing.
    into = _held_grad(w)
    if copied is None and _wgrad_gathers(tokens, (dy if tokens == "x" else x).shape[1]):
        transposed, k = tokens == "x" and limits.GEMM_WGRAD_GATHER_X_ON_M, row_of.shape[1]
        if into is None:
            return sm90.grouped_gemm_wgrad_gathered(dy, x, slot, k, offs, side=tokens, transposed=transposed)
        sm90.grouped_gemm_wgrad_gathered_add(dy, x, slot, k, offs, tokens, into, transposed)
        return None
    src, other = (x, dy) if tokens == "x" else (dy, x)
    dw = other.new_empty(offs.shape[0], dy.shape[1], x.shape[1]) if into is None else into
    add = into is not None
    cols = src.shape[1] if copied is not None else sm90.wgrad_cols(src.shape[1], width)
    for c0 in range(0, src.shape[1], cols):
        part = copied if copied is not None else spread_rows(src[:, c0:c0 + cols], slot, row_of)
        if tokens == "x":
            sm90.grouped_gemm_wgrad_cols(dy, part, offs, dw, c0, accumulate=add)
        else:
            sm90.grouped_gemm_wgrad_cols(part, x, offs, dw, 0, c0, accumulate=add)
        del part
    return None if add else dw


def _topk_grad(weights: Tensor, g: Tensor, picked: Tensor | None) -> Tensor:
    """dL/dlogits at the picks [T,K], zero elsewhere: weights = s[ids] / sum s[ids] moves with the picked
    logits only (softmax's normaliser cancels), and sigmoid's s'(l) / sum s = weights * s(-l)."""
    d = (g - (g * weights).sum(-1, keepdim=True)) * weights
    return d if picked is None else d * torch.sigmoid(-picked)


def _picked_logits(logits: Tensor, ids: Tensor, score_func: str) -> Tensor | None:
    """What _topk_grad needs of the logits: the picked ones under sigmoid, none under softmax."""
    return logits.gather(1, ids) if score_func == "sigmoid" else None


class _RouterTopk(torch.autograd.Function):
    """Fast top-k forward; backward is _topk_grad scattered over [T,E] (the expert-parallel path's router)."""

    @staticmethod
    def forward(ctx: FunctionCtx, logits: Tensor, bias: Tensor, k: int, score_func: str, n_groups: int,
                topk_groups: int) -> tuple[Tensor, Tensor]:
        w, ids = router_topk(logits, bias, k, score_func, n_groups, topk_groups)
        ctx.save_for_backward(w, ids, _picked_logits(logits, ids, score_func))  # type: ignore[arg-type]
        ctx.n_experts = logits.shape[1]  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(ids)
        return w, ids

    @staticmethod
    def backward(ctx: Any, dw: Tensor, _: Any) -> tuple[Tensor, None, None, None, None, None]:
        w, ids, picked = ctx.saved_tensors
        return picks_dense(_topk_grad(w, dw, picked), ids, ctx.n_experts), None, None, None, None, None


class _Routed(torch.autograd.Function):
    """(out, weights, ids): route x (router_logits, router_topk), then combine(unpermute(down(act(up(
    permute(x))))), weights, scale, shared(x)) (module docstring), one node so x's router, shared and routed
    gradients meet inside its backward's GEMM and combine passes, with no add of their own."""

    @staticmethod
    @_sync_free
    def forward(ctx: FunctionCtx, x: Tensor, wr: Tensor, bias: Tensor, w_up: Tensor, w2: Tensor,
                s_up: Tensor | None, s_w2: Tensor | None, cfg: ModelConfig,
                grad: bool) -> tuple[Tensor, Tensor, Tensor]:
        # With no backward to come (no grad mode, or no input asks for one) nothing is kept for it: the logits
        # go once routed, and the up projection never writes h (bf16) or drops it once act(h) exists (fp8).
        logits = router_logits(x, wr)
        weights, ids = router_topk(logits, bias, cfg.n_activated_experts, cfg.score_func, cfg.n_expert_groups,
                                   cfg.n_limited_groups)
        picked = _picked_logits(logits, ids, cfg.score_func) if grad else None
        del logits
        shared = h_s = offs_s = None
        if s_up is not None:
            assert s_w2 is not None
            shared, h_s, offs_s = _shared_fwd(x, s_up, s_w2, cfg.activation, cfg.expert_dtype)
        t, k = ids.shape
        e, align = cfg.n_routed_experts, cfg.permute_align
        if cfg.expert_dtype == "bf16":
            p, row_of = permute_rows(x.new_empty(t, 0), ids, e, align)
            a, h = sm90.grouped_gemm_act_gathered(x, p.slot, k, w_up, p.offs, cfg.activation, keep_h=grad)
        else:
            p, row_of = permute_rows(x, ids, e, align)
            a, h = _up(p.xp, w_up, p.offs, cfg.activation, cfg.expert_dtype)
        kept_h = h if grad else None
        offs, slot = p.offs, p.slot
        del p, h
        yp = expert_gemm(a, w2, offs, cfg.expert_dtype)
        del a
        fp8_y = []
        if cfg.expert_dtype == "fp8":
            fp8_y = [unpermute(yp, slot, t, k)]
            out = combine(fp8_y[0], weights, cfg.route_scale, shared)
        else:
            out = combine_gather(yp, row_of, weights, cfg.route_scale, shared)
        saved: list[Tensor | None] = [x, wr, picked, w_up, w2, weights, ids, slot, row_of, offs, s_up,
                                      s_w2, h_s, offs_s, *fp8_y]
        ctx.save_for_backward(*saved)  # type: ignore[arg-type]
        # h, the largest saved tensor, is held outside saved_tensors so the backward can drop it as soon as
        # dh exists, before the up-projection's wgrad and dgrad allocate theirs.
        ctx.h, ctx.cfg = kept_h, cfg  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(ids)
        return out, weights, ids

    @staticmethod
    @_sync_free
    def backward(ctx: Any, dout: Tensor, dweights_out: Tensor, _: Any) -> tuple[Tensor | None, ...]:
        x, wr, picked, w_up, w2, weights, ids, slot, row_of, offs, s_up, s_w2, h_s, offs_s, *fp8_y = \
            ctx.saved_tensors
        h, ctx.h = ctx.h, None
        if h is None:
            raise RuntimeError("moe_layer: its backward ran twice (retain_graph=True); the layer frees h "
                               "during its backward, so run the forward again for a second backward")
        cfg: ModelConfig = ctx.cfg
        need_x, need_wr, _, need_up, need_w2 = ctx.needs_input_grad[:5]
        need_w = need_x or need_wr
        need_h = need_x or need_up
        dot_w = need_w and not fp8_y
        t, k = ids.shape
        dout = dout.contiguous()
        scale = float(torch.tensor(cfg.route_scale, dtype=torch.float32))
        wrow = _slot_weights(weights, slot) * scale
        aw = dot = dyp = None
        if need_h or dot_w:
            # Per permuted row r, one pass: a = act(h), aw_r = bf16(a_r * w_r), dot_r = <a_r, dz_r> and h
            # overwritten by act_bwd(bf16(dz_r * w_r), h) = dh, with w_r = w[slot r] * scale.
            if need_w2 and limits.GEMM_DGRAD_SPILL and not _wgrad_gathers("dy", w2.shape[2]):
                dz, dyp = sm90.grouped_gemm_dgrad_gathered_spill(dout, slot, k, w2, offs)
            else:
                dz = sm90.grouped_gemm_dgrad_gathered(dout, slot, k, w2, offs)
            aw, dot = expert_rows_bwd(dz, h, wrow, cfg.activation)
            del dz
        elif need_w2:
            aw = combine(BY_NAME[cfg.activation][0](h)[:, None], wrow[:, None], 1.0)
        dweights = dw2 = dw_up = dx = None
        if need_w and fp8_y:
            dweights = combine_bwd(dout, fp8_y[0], weights, cfg.route_scale)[1]
        elif need_w:
            assert dot is not None
            dweights = (dot * scale).index_select(0, row_of.view(-1)).view(t, k)
        if need_w2:
            assert aw is not None
            dw2 = _expert_wgrad(dout, aw, slot, row_of, offs, "dy", h.shape[1], w2, dyp)
        del aw, dyp
        dx_s = dw_up_s = dw2_s = None
        if s_up is not None:
            dx_s, dw_up_s, dw2_s = _shared_bwd(dout, x, s_up, s_w2, h_s, offs_s, cfg.activation,
                                               (need_x, *ctx.needs_input_grad[5:7]))
        dx_r = dwr = None
        if need_w:
            assert dweights is not None
            dlogits = _topk_grad(weights, dweights + dweights_out, picked)
            dx_r, dwr = logits_grads(dlogits, x, wr, need_x, need_wr, dx_s, ids)
        if need_h:
            dh = h  # expert_rows_bwd wrote it over h
            if need_x:
                dxp = grouped_gemm_dgrad(dh, w_up, offs)
                ones = torch.ones(t, k, dtype=torch.float32, device=dout.device)
                dx = combine_gather(dxp, row_of, ones, 1.0, dx_r)
                del dxp
            if need_up:
                dw_up = _expert_wgrad(dh, x, slot, row_of, offs, "x", dh.shape[1], w_up)
        return dx, dwr, None, dw_up, dw2, dw_up_s, dw2_s, None, None


def _apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    return fn.apply(*args)  # type: ignore[no-untyped-call]


def _shared_fwd(x: Tensor, w_up: Tensor, w2: Tensor, activation: str,
                dtype: str) -> tuple[Tensor, Tensor, Tensor]:
    """(out, h, offs) of the shared MLP as one-group grouped GEMMs (so it rounds like an expert)."""
    offs = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
    a, h = _up(x, w_up[None], offs, activation, dtype)
    return expert_gemm(a, w2[None], offs, dtype), h, offs


def _shared_bwd(dout: Tensor, x: Tensor, w_up: Tensor, w2: Tensor, h: Tensor, offs: Tensor, activation: str,
                need: tuple[bool, bool, bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(dx, dw_up, dw2) of _shared_fwd, each where `need` (x, w_up, w2) asks for it."""
    act, act_bwd = BY_NAME[activation]
    need_x, need_up, need_w2 = need
    dw2 = grouped_gemm_wgrad(dout, act(h), offs)[0] if need_w2 else None
    if not (need_x or need_up):
        return None, None, dw2
    dh = act_bwd(grouped_gemm_dgrad(dout, w2[None], offs), h)
    dw_up = grouped_gemm_wgrad(dh, x, offs)[0] if need_up else None
    dx = grouped_gemm_dgrad(dh, w_up[None], offs) if need_x else None
    return dx, dw_up, dw2


class _Shared(torch.autograd.Function):
    """The shared MLP on its own, beside the RDEP routed half (without RDEP, _Routed runs it)."""

    @staticmethod
    @_sync_free
    def forward(ctx: FunctionCtx, x: Tensor, w_up: Tensor, w2: Tensor, activation: str, dtype: str) -> Tensor:
        out, h, offs = _shared_fwd(x, w_up, w2, activation, dtype)
        ctx.save_for_backward(x, w_up, w2, h, offs)
        ctx.activation = activation  # type: ignore[attr-defined]
        return out

    @staticmethod
    @_sync_free
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None]:
        x, w_up, w2, h, offs = ctx.saved_tensors
        dx, dw_up, dw2 = _shared_bwd(dout.contiguous(), x, w_up, w2, h, offs, ctx.activation,
                                     ctx.needs_input_grad[:3])
        return dx, dw_up, dw2, None, None


def _check_fast(x: Tensor, cfg: ModelConfig) -> None:
    arch = runtime.require_arch(x)
    if arch != ARCH:
        raise ArchNotImplemented(f"moe_layer: no {arch} path: the fused up-projection and the dgrad/wgrad "
                                 f"GEMMs are {ARCH} kernels; train on H100/H200, or use nmoe.reference.moe")
    if cfg.expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"moe_layer: expert_dtype {cfg.expert_dtype!r} has no fast {arch} path; use one of "
                         f"{EXPERT_DTYPES} (nvfp4 needs sm_100a's scaled MMA)")


def _check_ep(x: Tensor, cfg: ModelConfig, ex: Exchange) -> None:
    s = ex.fwd.shape
    want = (cfg.n_routed_experts, x.shape[0], cfg.n_activated_experts, cfg.dim, torch.bfloat16)
    if (s.n_experts, s.tokens, s.top_k, s.hidden, s.dtype) != want:
        got = (s.n_experts, s.tokens, s.top_k, s.hidden, s.dtype)
        raise ValueError(f"moe_layer: the exchange is shaped for (experts, tokens, top_k, hidden, dtype) = "
                         f"{got}, this call needs {want}; build the model's Exchange from the config "
                         "and the batch (nmoe.fast.model.ep_shape)")


def moe_layer(x: Tensor, p: MoEParams, cfg: ModelConfig,
              ex: Exchange | None = None) -> tuple[Tensor, MoERouting]:
    """x bf16 [T,D] -> (out bf16 [T,D], routing), the spec's results; differentiable in x and every weight.
    With `ex`, p holds this rank's expert shard and the routed rows travel over RDEP (expert parallelism)."""
    up, shared_up = check_moe_params(x, p, cfg, None if ex is None else ex.fwd.shape.n_local)
    _check_fast(x, cfg)
    if ex is not None:
        _check_ep(x, cfg, ex)
    k, e = cfg.n_activated_experts, cfg.n_routed_experts
    out: Tensor
    if ex is None:
        grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, p.router_w, up, p.w2, shared_up, p.shared_w2))
        out, weights, ids = _apply(_Routed, x, p.router_w, p.router_bias, up, p.w2, shared_up, p.shared_w2,
                                   cfg, grad)
    else:
        logits = router_logits(x, p.router_w)
        weights, ids = _apply(_RouterTopk, logits, p.router_bias, k, cfg.score_func, cfg.n_expert_groups,
                              cfg.n_limited_groups)
        shared = None
        if shared_up is not None:
            assert p.shared_w2 is not None
            shared = _apply(_Shared, x, shared_up, p.shared_w2, cfg.activation, cfg.expert_dtype)
        with offs_built_on_device():
            out = ep_routed(x, weights, ids, up, p.w2, cfg.activation, cfg.route_scale, shared, ex,
                            cfg.expert_dtype)
    return out, MoERouting(weights=weights, ids=ids, counts=expert_counts(ids, e))
