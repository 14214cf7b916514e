"""The fast layer's autograd glue on CPU, the spec's ops standing in for its kernels: the forward equals the
spec bit for bit, the gradients (y-free dweights, recomputed xp and a) match the spec's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_fast_dispatch import _rows_of
from torch import Tensor

import nmoe.fast.experts as fx
import nmoe.fast.moe as fm
from nmoe.accumulate import adding_to_grads
from nmoe.config import ModelConfig
from nmoe.fast import limits
from nmoe.fast.gemm import sm90
from nmoe.layout import MoEParams
from nmoe.reference import combine as rc
from nmoe.reference import dispatch as rd
from nmoe.reference import formats as rf
from nmoe.reference import gemm as rg
from nmoe.reference import router as rr
from nmoe.reference.moe import ACTIVATIONS, moe_layer

T, E, K = 24, 8, 3
DIMS = {"bf16": (32, 16), "fp8": (128, 128)}


def _act_h(x: Tensor, w: Tensor, offs: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    return rg.grouped_gemm_act(x, w, offs, activation), rg.grouped_gemm(x, w, offs)


def _gathered_rows(x: Tensor, slot: Tensor, top_k: int) -> Tensor:
    return torch.where(slot[:, None] >= 0, x[slot.clamp(min=0) // top_k], torch.zeros_like(x[:1]))


def _wgrad_gathered(dy: Tensor, x: Tensor, slot: Tensor, top_k: int, offs: Tensor, side: str = "x",
                    transposed: bool = False) -> Tensor:
    """The gathered wgrad's result (transposed moves the token-major side in the kernel, not the result)."""
    if side == "dy":
        return rg.grouped_gemm_wgrad(_gathered_rows(dy, slot, top_k), x, offs)
    return rg.grouped_gemm_wgrad(dy, _gathered_rows(x, slot, top_k), offs)


def _wgrad_gathered_add(dy: Tensor, x: Tensor, slot: Tensor, top_k: int, offs: Tensor, side: str,
                        dw: Tensor, transposed: bool = False) -> None:
    dw.add_(_wgrad_gathered(dy, x, slot, top_k, offs, side))


def _wgrad_cols(dy: Tensor, x: Tensor, offs: Tensor, dw: Tensor, col0: int, row0: int = 0,
                accumulate: bool = False) -> None:
    block = dw[:, row0:row0 + dy.shape[1], col0:col0 + x.shape[1]]
    new = rg.grouped_gemm_wgrad(dy, x, offs)
    block.add_(new) if accumulate else block.copy_(new)


def _dgrad_gathered(dy: Tensor, slot: Tensor, top_k: int, w: Tensor, offs: Tensor) -> Tensor:
    return rg.grouped_gemm_dgrad(_gathered_rows(dy, slot, top_k), w, offs)


def _dgrad_gathered_spill(dy: Tensor, slot: Tensor, top_k: int, w: Tensor,
                          offs: Tensor) -> tuple[Tensor, Tensor]:
    """The spilling kernel's definition: the gathered dgrad and dy's permuted rows up to offs[-1], the rows
    past it (never written by the kernel) NaN here."""
    rows = _gathered_rows(dy, slot, top_k)
    rows[int(offs[-1]):] = float("nan")
    return _dgrad_gathered(dy, slot, top_k, w, offs), rows


def _act_gathered(x: Tensor, slot: Tensor, top_k: int, w: Tensor, offs: Tensor,
                  activation: str, keep_h: bool = True) -> tuple[Tensor, Tensor]:
    """The gathered kernel's definition: permute's rows (x[slot // top_k], zero where slot = -1), _act_h;
    keep_h False: h [0, N]."""
    a, h = _act_h(_gathered_rows(x, slot, top_k), w, offs, activation)
    return a, h if keep_h else h[:0]


def _rows_bwd(dz: Tensor, h: Tensor, w: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """expert_rows_bwd's definition from the spec's ops: h becomes dh in place."""
    act, act_bwd = ACTIVATIONS[activation]
    a = act(h)
    dzw, dot = rc.combine_bwd(dz, a[:, None], w[:, None], 1.0)[:2]
    aw = rc.combine(a[:, None], w[:, None], 1.0)
    h.copy_(act_bwd(dzw[:, 0], h))
    return aw, dot.view(-1)


EXPERT_SUBS: dict[str, Any] = {
    "grouped_gemm": rg.grouped_gemm, "grouped_gemm_dgrad": rg.grouped_gemm_dgrad,
    "grouped_gemm_wgrad": rg.grouped_gemm_wgrad, "grouped_gemm_fp8": rg.grouped_gemm_fp8,
    "quantize_mxfp8": rf.quantize_mxfp8, "quantize_mxfp8_weight": rf.quantize_mxfp8_weight,
}
"""nmoe.fast.experts' kernels, the spec's ops in their place."""


def _permute_rows(x: Tensor, ids: Tensor, n_experts: int, align: int) -> tuple[Any, Tensor]:
    """The spec's permute and slot's inverse row_of [T,K] (int32), as the fast op's one launch gives both."""
    p = rd.permute(x, ids, n_experts, align)
    return p, _rows_of(p.slot, *ids.shape)


@pytest.fixture
def spec_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    subs: dict[str, Any] = {
        "permute_rows": _permute_rows, "unpermute": rd.unpermute,
        "spread_rows": lambda x, slot, row_of: _gathered_rows(x, slot, row_of.shape[1]),
        "combine": rc.combine, "combine_bwd": rc.combine_bwd, "combine_gather": rc.combine_gather,
        "expert_rows_bwd": _rows_bwd,
        "grouped_gemm_dgrad": rg.grouped_gemm_dgrad, "grouped_gemm_wgrad": rg.grouped_gemm_wgrad,
        "router_logits": rr.router_logits, "router_topk": rr.router_topk, "expert_counts": rr.expert_counts,
        "_check_fast": lambda x, cfg: None, "BY_NAME": ACTIVATIONS,
    }
    for name, fn in subs.items():
        monkeypatch.setattr(fm, name, fn)
    for name, fn in EXPERT_SUBS.items():
        monkeypatch.setattr(fx, name, fn)
    monkeypatch.setattr(sm90, "grouped_gemm_act_h", _act_h)
    monkeypatch.setattr(sm90, "grouped_gemm_act_gathered", _act_gathered)
    monkeypatch.setattr(sm90, "grouped_gemm_wgrad_gathered", _wgrad_gathered)
    monkeypatch.setattr(sm90, "grouped_gemm_dgrad_gathered", _dgrad_gathered)
    monkeypatch.setattr(sm90, "grouped_gemm_dgrad_gathered_spill", _dgrad_gathered_spill)
    monkeypatch.setattr(sm90, "grouped_gemm_wgrad_gathered_add", _wgrad_gathered_add)
    monkeypatch.setattr(sm90, "grouped_gemm_wgrad_cols", _wgrad_cols)
    monkeypatch.setattr(sm90, "wgrad_cols", lambda k, n: 8)  # x's and dout's copies in several chunks
    monkeypatch.setattr(limits, "GEMM_WGRAD_GATHER_DY_MAX_K", 0)  # dout copied, as at I > 256
    monkeypatch.setattr(limits, "GEMM_DGRAD_SPILL", False)  # in column chunks, by spread_rows
    monkeypatch.setattr(limits, "GEMM_WGRAD_GATHER_X_MAX_N", 0)  # x copied, as at N > 512


@pytest.fixture
def gathered_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """The down wgrad reads dout's rows by index, as at I <= 256 (INTER, the bound itself, here)."""
    monkeypatch.setattr(limits, "GEMM_WGRAD_GATHER_DY_MAX_K", DIMS["bf16"][1])


def _case(activation: str, shared: int, dtype: str, score: str, seed: int,
          groups: tuple[int, int] = (1, 1)) -> tuple[Tensor, MoEParams, ModelConfig]:
    g = torch.Generator().manual_seed(seed)
    D, INTER = DIMS[dtype]
    up = 2 * INTER if activation == "swiglu" else INTER

    def rn(*shape: int, s: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=g) * s).to(torch.bfloat16).requires_grad_()

    cfg = ModelConfig(tokenizer="none", vocab_size=64, dim=D, moe_inter_dim=INTER, n_routed_experts=E,
                      n_activated_experts=K, n_shared_experts=shared, route_scale=2.5, permute_align=4,
                      activation=activation, score_func=score, expert_dtype=dtype,
                      n_expert_groups=groups[0], n_limited_groups=groups[1])
    w_up, sh_up = rn(E, up, D, s=D**-0.5), rn(up * shared, D, s=D**-0.5) if shared else None
    swiglu = activation == "swiglu"
    p = MoEParams(router_w=rn(E, D, s=D**-0.5), router_bias=0.05 * torch.randn(E, generator=g),
                  w2=rn(E, D, INTER, s=INTER**-0.5), w13=w_up if swiglu else None,
                  w1=None if swiglu else w_up,
                  shared_w13=sh_up if swiglu else None, shared_w1=None if swiglu else sh_up,
                  shared_w2=rn(D, INTER * shared, s=(INTER * shared) ** -0.5) if shared else None)
    return rn(T, D), p, cfg


def _grads(fn: Any, x: Tensor, p: MoEParams, cfg: ModelConfig, dout: Tensor) -> tuple[Tensor, list[Tensor]]:
    out, routing = fn(x, p, cfg)
    leaves = [t for t in (x, p.router_w, p.w13, p.w1, p.w2, p.shared_w13, p.shared_w1, p.shared_w2)
              if t is not None]
    grads = torch.autograd.grad(out, leaves, dout)
    return torch.cat([out.detach().view(-1).float(), routing.weights.detach().view(-1)]), list(grads)


@pytest.mark.parametrize(("activation", "shared", "dtype", "score"),
                         [("swiglu", 1, "bf16", "sigmoid"), ("relu2", 0, "bf16", "softmax"),
                          pytest.param("swiglu", 0, "fp8", "softmax", marks=pytest.mark.heavy),
                          pytest.param("relu2", 1, "fp8", "sigmoid", marks=pytest.mark.heavy)])
def test_glue_matches_spec(spec_kernels: None, activation: str, shared: int, dtype: str, score: str) -> None:
    x, p, cfg = _case(activation, shared, dtype, score, 3)
    dout = torch.randn(T, DIMS[dtype][0], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got_out, got = _grads(fm.moe_layer, x, p, cfg, dout)
    want_out, want = _grads(moe_layer, x, p, cfg, dout)
    assert torch.equal(got_out, want_out)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        err = float((a.double() - b.double()).norm() / b.double().norm())
        assert err < 1e-2, f"grad {i}: relative error {err:.3g}"


@pytest.mark.parametrize("case", [("swiglu", 1, "bf16", "sigmoid"), ("relu2", 0, "bf16", "softmax")])
def test_gathered_down_wgrad_matches_spec(spec_kernels: None, gathered_down: None,
                                          monkeypatch: pytest.MonkeyPatch,
                                          case: tuple[str, int, str, str]) -> None:
    """At I <= GEMM_WGRAD_GATHER_DY_MAX_K the down wgrad reads dout's rows through slot (no copy of dout),
    and every gradient still matches the spec's."""
    sides: list[str] = []

    def gathered(*args: Any, side: str = "x", transposed: bool = False) -> Tensor:
        sides.append(side)
        return _wgrad_gathered(*args, side=side)

    monkeypatch.setattr(sm90, "grouped_gemm_wgrad_gathered", gathered)
    x, p, cfg = _case(*case, 3)
    dout = torch.randn(T, DIMS["bf16"][0], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got_out, got = _grads(fm.moe_layer, x, p, cfg, dout)
    want_out, want = _grads(moe_layer, x, p, cfg, dout)
    assert sides == ["dy"]
    assert torch.equal(got_out, want_out)
    for a, b in zip(got, want, strict=True):
        _close(a, b)


def test_spilled_dout_copy_feeds_the_down_wgrad(spec_kernels: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With GEMM_DGRAD_SPILL the down dgrad's permuted copy of dout (rows past offs[-1] never written) feeds
    the down wgrad whole: spread_rows copies x's chunks only, and every gradient matches the spec's."""
    monkeypatch.setattr(limits, "GEMM_DGRAD_SPILL", True)
    spills: list[int] = []
    spread: list[int] = []

    def spill(*args: Any) -> tuple[Tensor, Tensor]:
        spills.append(1)
        return _dgrad_gathered_spill(*args)

    def spread_rows(src: Tensor, slot: Tensor, row_of: Tensor) -> Tensor:
        spread.append(src.shape[1])
        return _gathered_rows(src, slot, row_of.shape[1])

    monkeypatch.setattr(sm90, "grouped_gemm_dgrad_gathered_spill", spill)
    monkeypatch.setattr(fm, "spread_rows", spread_rows)
    x, p, cfg = _case("swiglu", 1, "bf16", "sigmoid", 3)
    dout = torch.randn(T, DIMS["bf16"][0], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got_out, got = _grads(fm.moe_layer, x, p, cfg, dout)
    want_out, want = _grads(moe_layer, x, p, cfg, dout)
    assert spills == [1] and sum(spread) == x.shape[1]
    assert torch.equal(got_out, want_out)
    for a, b in zip(got, want, strict=True):
        _close(a, b)


@pytest.mark.parametrize("on_m", [False, True], ids=["x_on_n", "x_on_m"])
def test_gathered_up_wgrad_matches_spec(spec_kernels: None, gathered_down: None,
                                        monkeypatch: pytest.MonkeyPatch, on_m: bool) -> None:
    """At N <= GEMM_WGRAD_GATHER_X_MAX_N the up wgrad reads x's rows through slot too (no copy of x), after
    the down wgrad, x on the kernel's M side when GEMM_WGRAD_GATHER_X_ON_M (the down's dout stays on M,
    untransposed), and every gradient still matches the spec's."""
    sides: list[tuple[str, bool]] = []

    def gathered(*args: Any, side: str = "x", transposed: bool = False) -> Tensor:
        sides.append((side, transposed))
        return _wgrad_gathered(*args, side=side)

    monkeypatch.setattr(sm90, "grouped_gemm_wgrad_gathered", gathered)
    monkeypatch.setattr(limits, "GEMM_WGRAD_GATHER_X_MAX_N", 2 * DIMS["bf16"][1])
    monkeypatch.setattr(limits, "GEMM_WGRAD_GATHER_X_ON_M", on_m)
    x, p, cfg = _case("swiglu", 1, "bf16", "sigmoid", 5)
    dout = torch.randn(T, DIMS["bf16"][0], generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    got_out, got = _grads(fm.moe_layer, x, p, cfg, dout)
    want_out, want = _grads(moe_layer, x, p, cfg, dout)
    assert sides == [("dy", False), ("x", on_m)]
    assert torch.equal(got_out, want_out)
    for a, b in zip(got, want, strict=True):
        _close(a, b)


@pytest.mark.parametrize(("tokens", "width", "want"), [("dy", 256, "gathered"), ("dy", 264, "cols"),
                                                      ("x", 512, "gathered"), ("x", 520, "cols")])
def test_only_narrow_wgrads_gather(monkeypatch: pytest.MonkeyPatch, tokens: str, width: int,
                                   want: str) -> None:
    """The shipped bounds: dout's rows gathered up to I = 256, copied above it; x's rows gathered up to an
    up width of N = 512, copied above it."""
    calls: list[str] = []
    monkeypatch.setattr(sm90, "grouped_gemm_wgrad_gathered", lambda *a, **kw: calls.append("gathered"))
    monkeypatch.setattr(sm90, "grouped_gemm_wgrad_cols", lambda *a, **kw: calls.append("cols"))
    monkeypatch.setattr(fm, "spread_rows", lambda src, slot, row_of: src)
    assert limits.GEMM_WGRAD_GATHER_DY_MAX_K == 256 and limits.GEMM_WGRAD_GATHER_X_MAX_N == 512
    rows, other = torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(4, width, dtype=torch.bfloat16)
    dy, x = (other, rows) if tokens == "x" else (rows, other)
    slot, row_of = torch.arange(4), torch.arange(4).view(4, 1)
    fm._expert_wgrad(dy, x, slot, row_of, torch.tensor([4]), tokens, 16, torch.zeros(1, 16, width))
    assert calls and set(calls) == {want}


def test_sep_moe_fast_gathered_down_rows_shifted(spec_kernels: None, gathered_down: None) -> None:
    """The gathered down wgrad reading dout's previous token row: every token's dout row differs from its
    neighbour's here, so dw2 moves."""
    dout = torch.randn(T, DIMS["bf16"][0], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert bool((dout != dout.roll(1, 0)).any(-1).all())
    got, _ = _run(fm.moe_layer, SWIGLU_SHARED)
    want, _ = _run(moe_layer, SWIGLU_SHARED)
    _close(got["w2"], want["w2"])


def test_sep_moe_fast_gathered_up_wgrad_side_swapped(spec_kernels: None, gathered_down: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The gathered up wgrad with its sides swapped reads dh's permuted rows by token and x as permuted
    rows: x has T rows, the permuted rows T * K or more, so w13's gradient moves (or shapes cannot meet)."""
    monkeypatch.setattr(limits, "GEMM_WGRAD_GATHER_X_MAX_N", 2 * DIMS["bf16"][1])
    assert T * K > T
    got, _ = _run(fm.moe_layer, SWIGLU_SHARED)
    want, _ = _run(moe_layer, SWIGLU_SHARED)
    _close(got["w13"], want["w13"])


@pytest.mark.parametrize("frozen", [False, True], ids=["no_grad", "frozen_inputs"])
def test_h_is_kept_only_for_a_backward(spec_kernels: None, monkeypatch: pytest.MonkeyPatch,
                                       frozen: bool) -> None:
    """Under no_grad, or with no input requiring grad, the up projection is asked for act(h) alone
    (keep_h=False) and the output is unchanged; with grad it keeps h."""
    asked: list[bool] = []

    def act_gathered(*args: Any, keep_h: bool = True) -> tuple[Tensor, Tensor]:
        asked.append(keep_h)
        return _act_gathered(*args, keep_h=keep_h)

    monkeypatch.setattr(sm90, "grouped_gemm_act_gathered", act_gathered)
    x, p, cfg = _case("swiglu", 1, "bf16", "sigmoid", 3)
    want, _ = fm.moe_layer(x, p, cfg)
    if frozen:
        leaves = [t for t in (x, p.router_w, p.w13, p.w2, p.shared_w13, p.shared_w2) if t is not None]
        for t in leaves:
            t.requires_grad_(False)
        got, _ = fm.moe_layer(x, p, cfg)
    else:
        with torch.no_grad():
            got, _ = fm.moe_layer(x, p, cfg)
    assert asked == [True, False]
    assert torch.equal(got, want.detach())


def _run(fn: Any, cfg_args: tuple[str, int, str, str]) -> tuple[dict[str, Tensor], Tensor]:
    """(grads by name, routing weights) of one layer call on the glue case."""
    x, p, cfg = _case(*cfg_args, 3)
    dout = torch.randn(T, cfg.dim, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out, routing = fn(x, p, cfg)
    out.backward(dout)
    names = ("x", "router_w", "w13", "w1", "w2", "shared_w13", "shared_w1", "shared_w2")
    leaves = (x, p.router_w, p.w13, p.w1, p.w2, p.shared_w13, p.shared_w1, p.shared_w2)
    grads = {n: t.grad for n, t in zip(names, leaves, strict=True) if t is not None and t.grad is not None}
    return grads, routing.weights.detach()


def _close(got: Tensor, want: Tensor) -> None:
    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err < 1e-2, f"relative error {err:.3g} against the spec"


SWIGLU_SHARED = ("swiglu", 1, "bf16", "sigmoid")


def test_sep_moe_fast_dweights_scale_dropped(spec_kernels: None) -> None:
    """route_scale 2.5: dweights without it are 2.5x too small, and so is the router weight's gradient,
    linear in dweights."""
    got, _ = _run(fm.moe_layer, SWIGLU_SHARED)
    want, _ = _run(moe_layer, SWIGLU_SHARED)
    dwr = want["router_w"]
    assert float((dwr - dwr / 2.5).norm()) > 0.5 * float(dwr.norm())
    _close(got["router_w"], dwr)


def test_sep_moe_fast_shared_grad_dropped(spec_kernels: None) -> None:
    """The shared MLP's weights get gradient only through dout; dropped, they would stay without one."""
    got, _ = _run(fm.moe_layer, SWIGLU_SHARED)
    want, _ = _run(moe_layer, SWIGLU_SHARED)
    assert float(want["shared_w2"].norm()) > 0 and float(want["shared_w13"].norm()) > 0
    assert "shared_w2" in got and "shared_w13" in got
    _close(got["shared_w2"], want["shared_w2"])
    _close(got["shared_w13"], want["shared_w13"])


def test_sep_moe_fast_shared_dx_dropped(spec_kernels: None) -> None:
    """dx carries the shared MLP's share (added in the routed dx's combine pass): the spec's dx with the
    shared weights zeroed, which leaves routing and the routed dx as they are, is far from the full one."""
    got, _ = _run(fm.moe_layer, SWIGLU_SHARED)
    want, _ = _run(moe_layer, SWIGLU_SHARED)
    x, p, cfg = _case(*SWIGLU_SHARED, 3)
    assert p.shared_w13 is not None and p.shared_w2 is not None
    with torch.no_grad():
        p.shared_w2.zero_()
        p.shared_w13.zero_()
    dout = torch.randn(T, cfg.dim, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out, _ = moe_layer(x, p, cfg)
    (routed_only,) = torch.autograd.grad(out, (x,), dout)
    sep = float((routed_only.double() - want["x"].double()).norm() / want["x"].double().norm())
    assert sep > 0.1, f"the shared MLP's dx is too small to tell apart ({sep:.3g})"
    _close(got["x"], want["x"])


def test_sep_moe_fast_router_dx_dropped(spec_kernels: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """dx carries the router's share (its GEMM's addend into combine_gather's pass): the spec's dx with the
    router logits cut from x, which leaves routing and every other path as they are, is far from the full
    one."""
    import nmoe.reference.moe as spec_moe

    got, _ = _run(fm.moe_layer, SWIGLU_SHARED)
    want, _ = _run(moe_layer, SWIGLU_SHARED)
    monkeypatch.setattr(spec_moe, "router_logits", lambda x, wr: rr.router_logits(x.detach(), wr))
    cut, _ = _run(moe_layer, SWIGLU_SHARED)
    sep = float((cut["x"].double() - want["x"].double()).norm() / want["x"].double().norm())
    assert sep > 0.1, f"the router's dx is too small to tell apart ({sep:.3g})"
    _close(got["x"], want["x"])


def test_sep_moe_fast_weight_wrong_slot(spec_kernels: None) -> None:
    """Each row's router weight scales its dy; a neighbouring slot's weight differs on most rows."""
    got, w = _run(fm.moe_layer, SWIGLU_SHARED)
    want, _ = _run(moe_layer, SWIGLU_SHARED)
    flat = w.reshape(-1)
    assert float((flat[1:] - flat[:-1]).abs().min()) > 0
    _close(got["w2"], want["w2"])
    _close(got["w13"], want["w13"])


def test_sep_moe_fast_gather_off_by_one(spec_kernels: None) -> None:
    """The wgrads copy x's (and dout's) rows in permuted order; a neighbouring token's row differs
    everywhere."""
    x, _, _ = _case(*SWIGLU_SHARED, 3)
    assert bool((x.detach() != x.detach().roll(1, 0)).any(-1).all())
    got, _ = _run(fm.moe_layer, SWIGLU_SHARED)
    want, _ = _run(moe_layer, SWIGLU_SHARED)
    _close(got["w13"], want["w13"])
    _close(got["w2"], want["w2"])


def _check_chunks(weight: str, chunk: Any) -> None:
    """The wgrad of `weight` runs in 8-wide chunks; chunk(dw, c0) is the block chunk c0 fills, and the first
    two blocks of the spec's gradient differ, so a chunk stored at the wrong place shows."""
    assert fm.sm90.wgrad_cols(DIMS["bf16"][0], 0) < DIMS["bf16"][0], "more than one chunk"
    got, _ = _run(fm.moe_layer, SWIGLU_SHARED)
    want, _ = _run(moe_layer, SWIGLU_SHARED)
    assert bool((chunk(want[weight], 0) != chunk(want[weight], 8)).any())
    _close(got[weight], want[weight])


def test_sep_moe_fast_up_wgrad_chunk_at_col0(spec_kernels: None) -> None:
    """The up wgrad runs in column chunks of x: each lands on its own columns of dw13."""
    _check_chunks("w13", lambda dw, c0: dw[:, :, c0:c0 + 8])


def test_sep_moe_fast_down_wgrad_chunk_at_row0(spec_kernels: None) -> None:
    """The down wgrad runs in column chunks of dout: each lands on its own rows of dw2."""
    _check_chunks("w2", lambda dw, c0: dw[:, c0:c0 + 8])


def _topk_case(score: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logits, ids, weights, dL/dweights) in float64: distinct picks by biased logits, as routing picks."""
    g = torch.Generator().manual_seed(7)
    logits = 2 * torch.randn(T, E, generator=g, dtype=torch.float64)
    ids = (logits + torch.randn(T, E, generator=g, dtype=torch.float64)).topk(K, dim=-1).indices
    s = torch.sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, dim=-1)
    picked = s.gather(1, ids)
    dw = torch.randn(T, K, generator=g, dtype=torch.float64)
    return logits, ids, picked / picked.sum(-1, keepdim=True), dw


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_sep_moe_fast_topk_grad_unnormalised(score: str) -> None:
    """Oracle: float64 autograd of weights = s[ids] / sum s[ids] over all E logits. It is zero off the picks
    (softmax's normaliser cancels); the renormalisation's term moves the picks' gradient far."""
    logits, ids, w, dw = _topk_case(score)
    lg = logits.clone().requires_grad_()
    s = torch.sigmoid(lg) if score == "sigmoid" else torch.softmax(lg, dim=-1)
    picked = s.gather(1, ids)
    (want,) = torch.autograd.grad(picked / picked.sum(-1, keepdim=True), lg, dw)
    off = torch.ones_like(want, dtype=torch.bool).scatter_(1, ids, False)
    assert float(want[off].abs().max()) < 1e-12 * float(want.norm())
    l_ids = logits.gather(1, ids) if score == "sigmoid" else None
    raw = dw * w * (torch.sigmoid(-l_ids) if l_ids is not None else 1)
    assert float((raw - want.gather(1, ids)).norm()) > 0.3 * float(want.norm())
    got = fm._topk_grad(w.float(), dw.float(), None if l_ids is None else l_ids.float())
    err = float((torch.zeros_like(want).scatter_(1, ids, got.double()) - want).norm() / want.norm())
    assert err < 1e-6, f"relative error {err:.3g} against float64 autograd"


@pytest.mark.parametrize(("score", "groups"), [("sigmoid", (4, 2)), ("softmax", (1, 1))])
def test_router_topk_node_grad_is_the_spec_s(spec_kernels: None, score: str, groups: tuple[int, int]) -> None:
    """The expert-parallel path's top-k node: its [T,E] gradient is the spec's autograd gradient of the
    logits through the same picks (grouped picks too)."""
    logits, _, _, _ = _topk_case(score)
    bias, dw = 0.3 * torch.randn(E, dtype=torch.float32), torch.randn(T, K, dtype=torch.float32)
    lg = logits.float().requires_grad_()
    w, ids = fm._apply(fm._RouterTopk, lg, bias, K, score, *groups)
    (got,) = torch.autograd.grad(w, lg, dw)
    lg_spec = logits.float().requires_grad_()
    w_spec, ids_spec = rr.router_topk(lg_spec, bias, K, score, *groups)
    (want,) = torch.autograd.grad(w_spec, lg_spec, dw)
    assert torch.equal(ids, ids_spec) and float(want.norm()) > 0
    assert float((got - want).norm() / want.norm()) < 1e-6


def test_sparse_logit_grads_equal_the_dense_ones() -> None:
    """logits_grads of [T,K] values at ids (bf16 split scattered, or scattered then fp32) is bit for bit the
    dense [T,E] gradient's."""
    from nmoe.fast.router import logits_grads
    gen = torch.Generator().manual_seed(11)
    _, ids, _, _ = _topk_case("sigmoid")
    vals = torch.randn(T, K, generator=gen)
    dense = torch.zeros(T, E).scatter_(1, ids, vals)
    for dtype in (torch.bfloat16, torch.float32):
        x, wr = torch.randn(T, 16, generator=gen).to(dtype), torch.randn(E, 16, generator=gen).to(dtype)
        for got, want in zip(logits_grads(vals, x, wr, True, True, None, ids),
                             logits_grads(dense, x, wr, True, True), strict=True):
            assert got is not None and want is not None and torch.equal(got, want)


def test_offs_check_off_inside_the_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """NMOE_CHECK_OFFS=1 still rejects bad offs elsewhere; in the layer's scope the host check never runs."""
    from nmoe.fast.gemm import routing
    from nmoe.fast.gemm.routing import check_offs_on_host, offs_built_on_device
    monkeypatch.setattr(routing, "offs_check_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    bad = torch.tensor([5, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing"):
        check_offs_on_host("grouped_gemm", bad, 8)
    with offs_built_on_device():
        check_offs_on_host("grouped_gemm", bad, 8)


def _layer_grads(fn: Any, x: Tensor, p: MoEParams, cfg: ModelConfig,
                 dout: Tensor) -> dict[str, Tensor | None]:
    out, _ = fn(x, p, cfg)
    out.backward(dout)
    names = ("x", "router_w", "w13", "w1", "w2", "shared_w13", "shared_w1", "shared_w2")
    leaves = (x, p.router_w, p.w13, p.w1, p.w2, p.shared_w13, p.shared_w1, p.shared_w2)
    return {n: t.grad for n, t in zip(names, leaves, strict=True) if t is not None}


@pytest.mark.parametrize("frozen", [("x", "w13", "w2", "shared_w13", "shared_w2"), ("router_w", "w13", "w2"),
                                    ("x", "router_w"), ("x", "router_w", "w13", "w2")])
def test_frozen_inputs_get_no_grad_and_skip_their_gemms(spec_kernels: None, monkeypatch: pytest.MonkeyPatch,
                                                        frozen: tuple[str, ...]) -> None:
    """needs_input_grad: a frozen input gets None and its GEMMs never run; the others match the spec."""
    calls: list[str] = []

    def counted(name: str, fn: Any) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            calls.append(name)
            return fn(*args, **kw)
        return run

    monkeypatch.setattr(fm, "grouped_gemm_wgrad", counted("wgrad", rg.grouped_gemm_wgrad))
    monkeypatch.setattr(sm90, "grouped_gemm_wgrad_gathered", counted("wgrad", _wgrad_gathered))
    monkeypatch.setattr(sm90, "grouped_gemm_dgrad_gathered", counted("dgrad", _dgrad_gathered))
    monkeypatch.setattr(fm, "grouped_gemm_dgrad", counted("dgrad", rg.grouped_gemm_dgrad))

    def cols(dy: Tensor, x: Tensor, offs: Tensor, dw: Tensor, col0: int, row0: int = 0,
             accumulate: bool = False) -> None:
        calls.extend(["wgrad"] if col0 == row0 == 0 else [])  # one weight's wgrad, in chunks
        _wgrad_cols(dy, x, offs, dw, col0, row0, accumulate)

    monkeypatch.setattr(sm90, "grouped_gemm_wgrad_cols", cols)
    dout = torch.randn(T, DIMS["bf16"][0], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    runs = []
    for fn in (fm.moe_layer, moe_layer):
        x, p, cfg = _case(*SWIGLU_SHARED, 3)
        for name in frozen:
            (x if name == "x" else getattr(p, name)).requires_grad_(False)
        calls.clear()
        runs.append((_layer_grads(fn, x, p, cfg, dout), list(calls)))
    (got, fast_calls), (want, _) = runs
    for name, g in got.items():
        if name in frozen:
            assert g is None, name
        else:
            ref = want[name]
            assert g is not None and ref is not None, name
            _close(g, ref)
    live = {"x", "router_w", "w13", "shared_w13"} - set(frozen)
    want_wgrad = sum(n not in frozen for n in ("w13", "w2", "shared_w13", "shared_w2"))
    routed_dz, shared_dz = bool(live & {"x", "router_w", "w13"}), bool(live & {"x", "shared_w13"})
    want_dgrad = routed_dz + shared_dz + 2 * ("x" in live)
    assert fast_calls.count("wgrad") == want_wgrad
    assert fast_calls.count("dgrad") == want_dgrad


def test_noncontiguous_dout_same_grads(spec_kernels: None) -> None:
    """dout as a transposed view (and as an expanded scalar grad) gives the grads of its contiguous copy."""
    base = torch.randn(DIMS["bf16"][0], T, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for view in (base.t(), torch.ones((), dtype=torch.bfloat16).expand(T, DIMS["bf16"][0])):
        assert not view.is_contiguous()
        got = _layer_grads(fm.moe_layer, *_case(*SWIGLU_SHARED, 3), view)
        want = _layer_grads(fm.moe_layer, *_case(*SWIGLU_SHARED, 3), view.contiguous())
        for name, g in got.items():
            ref = want[name]
            assert g is not None and ref is not None and torch.equal(g, ref), name


def test_group_limited_routing_reaches_the_router(spec_kernels: None) -> None:
    """4 groups of 2, 2 kept: the routing differs from ungrouped top-3 here, and fast equals the spec."""
    x, p, cfg = _case(*SWIGLU_SHARED, 3, groups=(4, 2))
    dout = torch.randn(T, cfg.dim, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    _, flat = moe_layer(*_case(*SWIGLU_SHARED, 3))
    got_out, got = _grads(fm.moe_layer, x, p, cfg, dout)
    _, r = fm.moe_layer(x, p, cfg)
    assert not torch.equal(r.ids, flat.ids)
    want_out, want = _grads(moe_layer, x, p, cfg, dout)
    assert torch.equal(got_out, want_out)
    for a, b in zip(got, want, strict=True):
        _close(a, b)


def test_h_is_freed_by_the_backward_and_a_second_backward_says_so(spec_kernels: None) -> None:
    """h leaves the layer's memory inside its backward (before the up-projection's wgrad and dgrad)."""
    x, p, cfg = _case(*SWIGLU_SHARED, 3)
    out, _ = fm.moe_layer(x, p, cfg)
    dout = torch.ones_like(out)
    node = out.grad_fn
    while node is not None and not hasattr(node, "h"):
        node = next((f for f, _ in node.next_functions if f is not None and "Routed" in type(f).__name__),
                    None)
    assert node is not None and node.h is not None
    torch.autograd.backward(out, dout, retain_graph=True)
    assert node.h is None
    with pytest.raises(RuntimeError, match="backward ran twice"):
        torch.autograd.backward(out, dout)


def _two_microbatches(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """A first backward() writes .grad (autograd takes the wgrad); a second inside adding_to_grads adds the
    routed experts' wgrads in place through the kernel's accumulate: bit for bit autograd's bf16 add of the
    two, in the same tensors, every other .grad as autograd adds it; torch.autograd.grad is untouched."""
    adds: list[bool] = []
    kinds: set[str] = set()

    def cols(dy: Tensor, x: Tensor, offs: Tensor, dw: Tensor, col0: int, row0: int = 0,
             accumulate: bool = False) -> None:
        adds.append(accumulate)
        kinds.add("cols")
        _wgrad_cols(dy, x, offs, dw, col0, row0, accumulate)

    def gathered(*args: Any, **kw: Any) -> Tensor:
        adds.append(False)
        return _wgrad_gathered(*args, **kw)

    def gathered_add(*args: Any) -> None:
        adds.append(True)
        kinds.add("gathered")
        _wgrad_gathered_add(*args)

    monkeypatch.setattr(sm90, "grouped_gemm_wgrad_cols", cols)
    monkeypatch.setattr(sm90, "grouped_gemm_wgrad_gathered", gathered)
    monkeypatch.setattr(sm90, "grouped_gemm_wgrad_gathered_add", gathered_add)
    x, p, cfg = _case(*SWIGLU_SHARED, 3)
    g = torch.Generator().manual_seed(11)
    douts = [torch.randn(T, DIMS["bf16"][0], generator=g).to(torch.bfloat16) for _ in range(2)]
    leaves = [x, p.router_w, p.w13, p.w2, p.shared_w13, p.shared_w2]
    each = [torch.autograd.grad(fm.moe_layer(x, p, cfg)[0], leaves, d) for d in douts]
    want = [a + b for a, b in zip(*each, strict=True)]
    assert all(t.grad is None for t in leaves) and not any(adds)
    fm.moe_layer(x, p, cfg)[0].backward(douts[0])
    held = [p.w13.grad, p.w2.grad]
    adds.clear()
    with adding_to_grads():
        fm.moe_layer(x, p, cfg)[0].backward(douts[1])
    assert adds and all(adds), "the second microbatch's routed wgrads were not added by the kernel"
    assert p.w13.grad is held[0] and p.w2.grad is held[1]
    for t, w in zip(leaves, want, strict=True):
        assert t.grad is not None and torch.equal(t.grad, w)
    adds.clear()
    again = torch.autograd.grad(fm.moe_layer(x, p, cfg)[0], leaves, douts[0])
    assert not any(adds) and all(torch.equal(a, b) for a, b in zip(again, each[0], strict=True))
    assert all(t.grad is not None and torch.equal(t.grad, w) for t, w in zip(leaves, want, strict=True))
    return kinds


def test_later_microbatches_add_routed_wgrads_into_grad(spec_kernels: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _two_microbatches(monkeypatch) == {"cols"}


def test_sep_moe_fast_gathered_held_grad_returned_too(spec_kernels: None, gathered_down: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The down wgrad gathered from dout's rows and added into dw2's .grad: also handed to autograd, it
    doubles that microbatch's share."""
    assert _two_microbatches(monkeypatch) == {"cols", "gathered"}


def test_sep_moe_fast_held_grad_returned_too(spec_kernels: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The added wgrad also handed to autograd doubles that microbatch's share of .grad."""
    _two_microbatches(monkeypatch)


def test_sep_moe_fast_adding_flag_ignored(spec_kernels: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding into .grad outside adding_to_grads: torch.autograd.grad gets None for the experts and .grad
    moves under it."""
    _two_microbatches(monkeypatch)
