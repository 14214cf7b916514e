"""sm_90a grouped GEMM fwd/dgrad/wgrad (bf16 in, fp32 accumulate), the fwd optionally with swiglu/relu2 fused:
wgmma/TMA CuTeDSL kernels as torch custom ops that read `offs` on the device, so routing changes neither sync
the host nor recompile. Reached through nmoe.fast.gemm, which picks the kernel by arch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.activation import ACTIVATIONS, relu2_bwd, swiglu_bwd
from nmoe.fast.gemm.routing import (
    check_aligned,
    check_bf16,
    check_offs_on_host,
    check_routing,
    fwd_ctas,
    require,
)
from nmoe.fast.gemm.sm90_kernels import ARCH, DGRAD, FWD, GATHER, WGRAD, WGRAD_GATHER, pick_bn
from nmoe.fast.gemm.sm90_kernels import KERNELS as KERNELS
from nmoe.fast.limits import (
    GEMM_ALIGN,
    GEMM_BK,
    GEMM_BM,
    GEMM_BN_CHOICES,
    GEMM_CLUSTER_M,
    GEMM_FWD_DEFERRED,
    GEMM_FWD_DYNAMIC,
    GEMM_GATHER_DEFERRED,
    GEMM_GATHER_DYNAMIC,
    GEMM_GATHER_PINGPONG,
    GEMM_PINGPONG_MAX_K,
    GEMM_WGRAD_CLUSTER_M,
    GEMM_WGRAD_DEFERRED,
    GEMM_WGRAD_DYNAMIC,
    GEMM_WGRAD_GATHER_DYNAMIC,
    pingpong_bn,
)
from nmoe.fast.op import Launcher, fast_op, remember, save_inputs
from nmoe.fast.runtime import tma_aligned


def whole_clusters(widest: int, tiles: int) -> int:
    """The widest power of two up to `widest` whose clusters `tiles` fill (1: none); a schedule's choice,
    like its tile width, with the same bits."""
    c = widest
    while c > 1 and tiles % c:
        c //= 2
    return c


def wgrad_cluster(n: int) -> int:
    """The TMA-fed wgrad's M cluster over dw's n / GEMM_BM M tiles."""
    return whole_clusters(GEMM_WGRAD_CLUSTER_M, -(-n // GEMM_BM))


def _check(op: str, a: Tensor, w: Tensor, offs: Tensor, a_name: str, red_dim: int) -> None:
    check_bf16(op, **{a_name: a, "w": w})
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[red_dim]:
        raise ValueError(f"{op}: need {a_name} [M, R] and w [E, N, K] with R = w.shape[{red_dim}], got "
                         f"{tuple(a.shape)} and {tuple(w.shape)}")
    check_routing(op, offs, w.shape[0], a.shape[0])
    check_aligned(op, "w's", ("N", w.shape[1], GEMM_ALIGN), ("K", w.shape[2], GEMM_ALIGN))


def _pick_bn(op: str, width: int, bn: int | None) -> int:
    bn = pick_bn(width) if bn is None else bn
    if bn not in GEMM_BN_CHOICES:
        raise ValueError(f"{op}: tile width {bn} unsupported; choose one of {GEMM_BN_CHOICES}")
    return bn


def schedule(op: str, n: int, k: int, bn: int | None = None, pingpong: bool | None = None,
             gathered: bool = False, act: str = "none") -> tuple[int, bool]:
    """(N tile, ping-pong) of a fwd/dgrad launch of reduction k, unless asked: ping-pong for K up to
    GEMM_PINGPONG_MAX_K (GEMM_GATHER_PINGPONG when gathered) in pingpong_bn(act)-wide tiles, unless another
    width is asked for."""
    wide = pingpong_bn(act)
    if pingpong is None:
        rule = GEMM_GATHER_PINGPONG if gathered else k <= GEMM_PINGPONG_MAX_K
        pingpong = rule and bn in (None, wide)
    if not pingpong:
        return _pick_bn(op, n, bn), False
    if bn not in (None, wide):
        raise ValueError(f"{op}: ping-pong tiles are {wide} wide, not {bn}; pass bn=None or {wide}, or the "
                         f"cooperative schedule for {bn}")
    return wide, True


def unit_counter(dynamic: bool, device: torch.device) -> tuple[Tensor | None, int]:
    """(buffer to keep alive over the launch, its address) of a dynamic fwd/dgrad's unit counter, zeroed per
    launch so a replayed graph starts at unit 0; a static launch gets none (address 0)."""
    if not dynamic:
        return None, 0
    count = torch.zeros(1, dtype=torch.int32, device=device)
    return count, count.data_ptr()


@dataclass(frozen=True)
class WgradSplit:
    """The wgrad's row split, planned from shapes alone so that no routing value has to reach the host."""
    # A group of more than `thresh` rows (a CTA's average share of the work) is cut into `rows`-row chunks.
    # Their fp32 partials fill at most `ws_tiles` workspace tiles of `tile_floats` each (none: nothing splits)
    # and are summed in chunk order, a fixed order whatever the timing. One counter per group tile counts its
    # finished chunks; then, with `dynamic`, one more counts the tiles taken.

    thresh: int
    rows: int
    ws_tiles: int
    counters: int
    tile_floats: int
    dynamic: bool = False

    def args(self, device: torch.device) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
        """(buffers to keep alive over the launch, the kernel's split arguments): a fresh workspace and zeroed
        counters per launch, so a replayed graph starts clean; null pointers where nothing needs them."""
        if self.ws_tiles == 0 and not self.dynamic:
            return (), (0, 0, self.thresh, self.rows, self.ws_tiles)
        counters = torch.zeros(self.counters + 1, dtype=torch.int32, device=device)
        if self.ws_tiles == 0:
            return (counters,), (0, counters.data_ptr(), self.thresh, self.rows, self.ws_tiles)
        ws = torch.empty(self.ws_tiles * self.tile_floats, dtype=torch.float32, device=device)
        return (ws, counters), (ws.data_ptr(), counters.data_ptr(), self.thresh, self.rows, self.ws_tiles)


def wgrad_split(m: int, n: int, k: int, bn: int, n_groups: int, sms: int,
                dynamic: bool = False) -> WgradSplit:
    """Chunks of half a CTA's share, in K boxes. A split group has S = ceil(R / rows) < 2R / rows chunks
    (R > rows), so together they take fewer than 2m / rows workspace slices of tiles_per_group tiles."""
    tpg = -(-n // GEMM_BM) * -(-k // bn)
    share = -(-m * tpg // sms)
    if share >= m:
        return WgradSplit(m, m, 0, n_groups * tpg, GEMM_BM * bn, dynamic)
    rows = -(-max(4 * GEMM_BK, -(-share // 2)) // GEMM_BK) * GEMM_BK
    return WgradSplit(share, rows, (2 * m // rows) * tpg, n_groups * tpg, GEMM_BM * bn, dynamic)


def wgrad_cols(k: int, n: int) -> int:
    """Columns of a wgrad's token-major side taken per launch where it is a transient copy: at most n, in
    whole 128-wide tiles, at least one."""
    return min(k, max(128, n // 128 * 128))


@dataclass(frozen=True)
class _Plan:
    """A validated call of one layout (shapes, strides, dtypes, devices, aligned bases): what it allocates,
    and whether it launches, zeroes its outputs or does nothing; only the offs values are read per call.
    `act_ptr`: the kernel takes a second output pointer (fwd/dgrad do, wgrad does not)."""

    op: str
    index: int
    device: torch.device
    out_shape: tuple[int, ...]
    act_width: int
    a_ready: bool
    w_ready: bool
    launch: Launcher | None
    zero: bool
    scalars: tuple[int, ...]
    act_ptr: bool
    split: WgradSplit | None = None
    dynamic: bool = False

    def run(self, a: Tensor, w: Tensor, offs: Tensor, outs: tuple[Tensor, ...]) -> None:
        launch = self.launch
        if launch is None:
            if self.zero:
                for t in outs:
                    t.zero_()
            return
        check_offs_on_host(self.op, offs, self.scalars[0])
        if self.act_ptr:
            _counter, count = unit_counter(self.dynamic, a.device)
            launch(self.index, a.data_ptr(), w.data_ptr(), outs[0].data_ptr(), outs[-1].data_ptr(),
                   offs.data_ptr(), count, *self.scalars)
        else:
            assert self.split is not None, "a wgrad plan carries its row split"
            _keep, (ws, counters, *split) = self.split.args(a.device)
            launch(self.index, a.data_ptr(), w.data_ptr(), outs[0].data_ptr(), offs.data_ptr(), ws, counters,
                   *self.scalars, *split)


def _prepare(op: str, a: Tensor, w: Tensor, offs: Tensor, n: int, w_k_major: bool, bn: int | None,
             activation: str, *outs: Tensor, pingpong: bool | None = None
             ) -> tuple[int, Launcher | None, bool, tuple[int, int, int]]:
    """(device, launcher or None, zero the outputs, (m, groups, CTAs)): every check a launch makes that reads
    no tensor values, in the order it always made them."""
    device, arch = runtime.device_arch(a, w, offs, *outs)
    require(op, arch, ARCH)
    m, k = a.shape
    if m == 0 or n == 0:
        return device, None, False, (m, 0, 0)
    if k == 0 or w.shape[0] == 0:
        return device, None, True, (m, 0, 0)
    bn, pp = schedule(op, n, k, bn, pingpong, act=activation)
    n_ctas = fwd_ctas(device, m, n, w.shape[0], bn, GEMM_CLUSTER_M)
    deferred = GEMM_FWD_DEFERRED and not pp
    if w_k_major:
        launch = FWD.launcher(arch, n=n, k=k, bn=bn, act=activation, pingpong=pp, deferred=deferred,
                              dynamic=GEMM_FWD_DYNAMIC)
    else:
        launch = DGRAD.launcher(arch, n=n, k=k, bn=bn, pingpong=pp, deferred=deferred,
                                dynamic=GEMM_FWD_DYNAMIC)
    return device, launch, False, (m, w.shape[0], n_ctas)


def _launch(op: str, a: Tensor, w: Tensor, offs: Tensor, out: Tensor, w_k_major: bool, bn: int | None = None,
            act_out: Tensor | None = None, activation: str = "none", pingpong: bool | None = None) -> None:
    """out[M, n] = per-group a[M, k] @ B_e^T with B_e = w[e] (K-major) or w[e]^T (dgrad); with an
    activation the same kernel also writes act_out = act(out) (both zero where out is)."""
    outs = (out,) if act_out is None else (out, act_out)
    device, launch, zero, scalars = _prepare(op, a, w, offs, out.shape[1], w_k_major, bn, activation, *outs,
                                             pingpong=pingpong)
    _Plan(op, device, a.device, (), 0, True, True, launch, zero, scalars, True,
          dynamic=GEMM_FWD_DYNAMIC).run(a, w, offs, outs)


def _launch_wgrad(dy: Tensor, x: Tensor, offs: Tensor, dw: Tensor, bn: int | None = None) -> None:
    """dw[e] = dy[rows of e]^T @ x[rows of e]; groups without rows get zeros."""
    device, launch, zero, scalars, split = _prepare_wgrad(dy, x, offs, dw.shape, bn, dw)
    _Plan("grouped_gemm_wgrad", device, dy.device, (), 0, True, True, launch, zero, scalars, False,
          split).run(dy, x, offs, (dw,))


def _prepare_wgrad(dy: Tensor, x: Tensor, offs: Tensor, dw_shape: tuple[int, ...], bn: int | None,
                   *outs: Tensor, ld: int = 0, gs: int = 0, accumulate: bool = False
                   ) -> tuple[int, Launcher | None, bool, tuple[int, int, int], WgradSplit | None]:
    """accumulate: the kernel adds to dw, and no rows at all leave dw as it is (zeros to add)."""
    device, arch = runtime.device_arch(dy, x, offs, *outs)
    require("grouped_gemm_wgrad", arch, ARCH)
    m = dy.shape[0]
    n_groups, n, k = dw_shape
    if n_groups * n * k == 0:
        return device, None, False, (m, 0, 0), None
    if m == 0:
        return device, None, not accumulate, (m, 0, 0), None
    bn = _pick_bn("grouped_gemm_wgrad", k, bn)
    cm = wgrad_cluster(n)
    n_ctas, split = _wgrad_grid(device, m, n, k, bn, n_groups, GEMM_WGRAD_DYNAMIC, cm)
    launch = WGRAD.launcher(arch, n=n, k=k, bn=bn, ld=ld or k, gs=gs or n, dynamic=split.dynamic,
                            accumulate=accumulate, deferred=GEMM_WGRAD_DEFERRED, cm=cm)
    return device, launch, False, (m, n_groups, n_ctas), split


def _wgrad_grid(device: int, m: int, n: int, k: int, bn: int, n_groups: int,
                dynamic: bool = False, cm: int = 1) -> tuple[int, WgradSplit]:
    """(CTAs, row split) of a wgrad over m rows: a CTA per SM, fewer only when there are fewer tiles; whole
    clusters of cm (its M tiles fill them, so there are at least cm tiles)."""
    sms = runtime.sm_count(device)
    split = wgrad_split(m, n, k, bn, n_groups, sms, dynamic)
    return min(sms, n_groups * -(-n // GEMM_BM) * -(-k // bn) + split.ws_tiles) // cm * cm, split


def _check_wgrad(dy: Tensor, x: Tensor, offs: Tensor) -> None:
    op = "grouped_gemm_wgrad"
    check_bf16(op, dy=dy, x=x)
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: need dy [M, N] and x [M, K], got {tuple(dy.shape)} and {tuple(x.shape)}")
    check_routing(op, offs, None, dy.shape[0])
    check_aligned(op, "dy and x widths", ("N", dy.shape[1], GEMM_ALIGN), ("K", x.shape[1], GEMM_ALIGN))


def _layout(a: Tensor, w: Tensor, offs: Tensor) -> tuple[Any, ...]:
    """Everything the checks of a (a, w, offs) call read: a plan memo key."""
    return (a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16 == 0, w.shape, w.stride(), w.dtype,
            w.device, w.data_ptr() % 16 == 0, offs.shape, offs.dtype, offs.device)


_PLANS: dict[tuple[Any, ...], _Plan] = {}


def _plan(op: str, a: Tensor, w: Tensor, offs: Tensor, a_name: str, w_name: str,
          activation: str = "") -> _Plan:
    """The memoised plan of this layout, or the full checks (raising as they always did) and a new plan."""
    key = (op, activation, GEMM_WGRAD_DYNAMIC, GEMM_WGRAD_DEFERRED, GEMM_WGRAD_CLUSTER_M, GEMM_FWD_DEFERRED,
           GEMM_FWD_DYNAMIC,
           *_layout(a, w, offs))
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    width = act_width(w, activation) if activation else 0
    if op == "grouped_gemm_wgrad":
        _check_wgrad(a, w, offs)
        shape: tuple[int, ...] = (offs.numel(), a.shape[1], w.shape[1])
    else:
        dgrad = op == "grouped_gemm_dgrad"
        _check(op, a, w, offs, a_name, 1 if dgrad else 2)
        shape = (a.shape[0], w.shape[2] if dgrad else w.shape[1])
    ca, cw = tma_aligned(op, a_name, a), tma_aligned(op, w_name, w)
    split: WgradSplit | None = None
    if op == "grouped_gemm_wgrad":
        index, launch, zero, scalars, split = _prepare_wgrad(ca, cw, offs, shape, None)
    else:
        index, launch, zero, scalars = _prepare(op, ca, cw, offs, shape[1], not dgrad, None,
                                                 activation or "none")
    plan = _Plan(op, index, a.device, shape, width, ca is a, cw is w, launch, zero, scalars,
                 op != "grouped_gemm_wgrad", split, GEMM_FWD_DYNAMIC)
    return remember(_PLANS, key, plan)


def _call(op: str, a: Tensor, w: Tensor, offs: Tensor, a_name: str, w_name: str) -> Tensor:
    """One call: the plan, copies only where it says an input is strided, the output, the launch."""
    plan = _plan(op, a, w, offs, a_name, w_name)
    a = a if plan.a_ready else tma_aligned(op, a_name, a)
    w = w if plan.w_ready else tma_aligned(op, w_name, w)
    out = torch.empty(plan.out_shape, dtype=torch.bfloat16, device=plan.device)
    plan.run(a, w, offs.contiguous(), (out,))
    return out


def _fwd_impl(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return _call("grouped_gemm", x, w, offs, "x", "w")


def _fwd_fake(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


def _dgrad_impl(dy: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return _call("grouped_gemm_dgrad", dy, w, offs, "dy", "w")


def _dgrad_fake(dy: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return dy.new_empty(dy.shape[0], w.shape[2])


def _wgrad_impl(dy: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    return _call("grouped_gemm_wgrad", dy, x, offs, "dy", "x")


def _wgrad_fake(dy: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    return dy.new_empty(offs.shape[0], dy.shape[1], x.shape[1])


_fwd_op = fast_op("grouped_gemm", _fwd_impl, _fwd_fake)
_dgrad_op = fast_op("grouped_gemm_dgrad", _dgrad_impl, _dgrad_fake)
_wgrad_op = fast_op("grouped_gemm_wgrad", _wgrad_impl, _wgrad_fake)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    x, w, offs = ctx.saved_tensors
    dx = _dgrad_op(grad, w, offs) if ctx.needs_input_grad[0] else None
    dw = _wgrad_op(grad, x, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_fwd_op.autograd(_backward, save_inputs(0, 1, 2))


def act_width(w: Tensor, activation: str) -> int:
    """Columns of act(h) for h [M, N]: swiglu pairs interleaved rows (2i gate, 2i+1 up), relu2 keeps N."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"grouped_gemm_act: activation {activation!r} unknown; use 'swiglu' or 'relu2'")
    n = w.shape[1] if w.dim() == 3 else 0
    if activation == "swiglu":
        if w.dim() != 3 or n % 2:
            raise ValueError(f"grouped_gemm_act: swiglu needs w [E, 2I, K] with even N (rows 2i = gate_i, "
                             f"2i+1 = up_i interleaved), got {tuple(w.shape)}; interleave w1 and w3 into w13")
        return n // 2
    return n


def _act_impl(x: Tensor, w: Tensor, offs: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    op = "grouped_gemm_act"
    plan = _plan(op, x, w, offs, "x", "w", activation)
    x = x if plan.a_ready else tma_aligned(op, "x", x)
    w = w if plan.w_ready else tma_aligned(op, "w", w)
    h = torch.empty(plan.out_shape, dtype=torch.bfloat16, device=plan.device)
    a = torch.empty(plan.out_shape[0], plan.act_width, dtype=torch.bfloat16, device=plan.device)
    plan.run(x, w, offs.contiguous(), (h, a))
    return a, h


def _act_fake(x: Tensor, w: Tensor, offs: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    width = act_width(w, activation)
    return x.new_empty(x.shape[0], width), x.new_empty(x.shape[0], w.shape[1])


_act_op = fast_op("grouped_gemm_act", _act_impl, _act_fake)


def _act_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, w, offs, activation = inputs
    h = output[1]
    ctx.save_for_backward(x, w, offs, h)
    ctx.activation = activation
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)


def _act_backward(ctx: Any, da: Tensor, _: Tensor | None) -> tuple[Tensor | None, Tensor | None, None, None]:
    x, w, offs, h = ctx.saved_tensors
    dh = swiglu_bwd(da, h) if ctx.activation == "swiglu" else relu2_bwd(da, h)
    dx = _dgrad_op(dh, w, offs) if ctx.needs_input_grad[0] else None
    dw = _wgrad_op(dh, x, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None, None


_act_op.autograd(_act_backward, _act_setup_context)


def grouped_gemm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """y[rows of e] = x[rows of e] @ w[e]^T in fp32, rounded once to bf16; rows past offs[-1] are zero."""
    return _fwd_op(x, w, offs)


def grouped_gemm_act(x: Tensor, w: Tensor, offs: Tensor, activation: str) -> Tensor:
    """act(grouped_gemm(x, w, offs)) from one kernel (swiglu [M, N/2], relu2 [M, N]) that also writes h,
    so the activation never re-reads h from memory and the backward keeps h instead of recomputing it."""
    return _act_op(x, w, offs, activation)[0]


def grouped_gemm_act_h(x: Tensor, w: Tensor, offs: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """(act(h), h) from the fused kernel, for a caller that owns the backward and keeps h itself."""
    return _act_op(x, w, offs, activation)


_ZERO_CHUNKS: dict[torch.device, Tensor] = {}


def _zero_chunk(op: str, device: torch.device) -> Tensor:
    """16 zero bytes whose address the gathered wgrad gives pad rows (they land zero-filled, reading none),
    made once per device by an eager call: made inside a capture, they would be zeros only once it replays."""
    z = _ZERO_CHUNKS.get(device)
    if z is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{op}: first call on {device} is inside a CUDA graph capture; its zero chunk "
                               "is made by an eager call, so run one eager (warm-up) call before capturing")
        z = _ZERO_CHUNKS[device] = torch.zeros(8, dtype=torch.bfloat16, device=device)
    return z


def _gathered_gemm(op: str, src: Tensor, src_name: str, slot: Tensor, w: Tensor, offs: Tensor, top_k: int,
                   activation: str, w_k_major: bool, keep_h: bool = True,
                   spill: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(h, act(h) or h): the gathering kernel over src's token rows; w [E, N, K] read K-major (the up
    projection, h [R, N]) or N-major (a dgrad, h [R, K]); keep_h False: h is [0, N], never stored; spill
    [R, K] (a dgrad): gets src's rows in permuted order up to offs[-1]."""
    check_bf16(op, **{src_name: src, "w": w})
    red = 2 if w_k_major else 1
    if src.dim() != 2 or w.dim() != 3 or src.shape[1] != w.shape[red]:
        want = "[T, K] and w [E, N, K]" if w_k_major else "[T, N] and w [E, N, K]"
        raise ValueError(f"{op}: need {src_name} {want}, got {tuple(src.shape)} and {tuple(w.shape)}")
    if slot.dtype != torch.int64 or slot.dim() != 1 or top_k < 1:
        raise ValueError(f"{op}: need int64 slot [R] (permute's, -1 on pad rows) and top_k >= 1, got "
                         f"{slot.dtype} {tuple(slot.shape)} and top_k={top_k}")
    check_routing(op, offs, w.shape[0], slot.shape[0])
    check_aligned(op, "w's", ("N", w.shape[1], GEMM_ALIGN), ("K", w.shape[2], GEMM_ALIGN))
    width = act_width(w, activation) if activation != "none" else 0
    device, arch = runtime.device_arch(src, slot, w, offs)
    require(op, arch, ARCH)
    src, w = tma_aligned(op, src_name, src), tma_aligned(op, "w", w)
    m, n, k = slot.shape[0], w.shape[1 if w_k_major else 2], w.shape[red]
    h = torch.empty(m if keep_h else 0, n, dtype=torch.bfloat16, device=src.device)
    a = torch.empty(m, width, dtype=torch.bfloat16, device=src.device) if width else h
    if m == 0 or n == 0:
        return h, a
    if k == 0 or w.shape[0] == 0:
        return h.zero_(), a.zero_()
    check_offs_on_host(op, offs, m)
    bn, pp = schedule(op, n, k, pingpong=False if spill is not None else None, gathered=True, act=activation)
    n_ctas = fwd_ctas(device, m, n, w.shape[0], bn, 1)
    dynamic = GEMM_GATHER_DYNAMIC
    launch = GATHER.launcher(arch, n=n, k=k, bn=bn, act=activation, w_k_major=w_k_major, pingpong=pp,
                             keep_h=keep_h, deferred=GEMM_GATHER_DEFERRED and not pp, dynamic=dynamic,
                             spill=spill is not None)
    h_ptr = h.data_ptr() if keep_h else a.data_ptr()
    _keep, count = unit_counter(dynamic, src.device)
    launch(device, src.data_ptr(), slot.contiguous().data_ptr(), w.data_ptr(), h_ptr, a.data_ptr(),
           offs.contiguous().data_ptr(), count, 0 if spill is None else spill.data_ptr(), top_k, m,
           w.shape[0], n_ctas)
    return h, a


def _gathered_impl(x: Tensor, slot: Tensor, w: Tensor, offs: Tensor, top_k: int, activation: str,
                   keep_h: bool) -> tuple[Tensor, Tensor]:
    act_width(w, activation)
    h, a = _gathered_gemm("grouped_gemm_act_gathered", x, "x", slot, w, offs, top_k, activation, True, keep_h)
    return a, h


def _gathered_fake(x: Tensor, slot: Tensor, w: Tensor, offs: Tensor, top_k: int, activation: str,
                   keep_h: bool) -> tuple[Tensor, Tensor]:
    width = act_width(w, activation)
    return x.new_empty(slot.shape[0], width), x.new_empty(slot.shape[0] if keep_h else 0, w.shape[1])


_gathered_op = fast_op("grouped_gemm_act_gathered", _gathered_impl, _gathered_fake)


def grouped_gemm_act_gathered(x: Tensor, slot: Tensor, top_k: int, w: Tensor, offs: Tensor,
                              activation: str, keep_h: bool = True) -> tuple[Tensor, Tensor]:
    """(act(h), h) with h[p] = x[slot[p] // top_k] @ w[e]^T for permuted row p of group e (zero rows where
    slot[p] = -1), without permute's [R, K] copy of x; keep_h False (no backward to come): h [0, N], never
    written. No autograd: its caller owns the backward (the fast MoE layer)."""
    out: tuple[Tensor, Tensor] = _gathered_op(x, slot, w, offs, top_k, activation, keep_h)
    return out


def _dgrad_gathered_impl(dy: Tensor, slot: Tensor, w: Tensor, offs: Tensor, top_k: int) -> Tensor:
    return _gathered_gemm("grouped_gemm_dgrad_gathered", dy, "dy", slot, w, offs, top_k, "none", False)[0]


def _dgrad_gathered_fake(dy: Tensor, slot: Tensor, w: Tensor, offs: Tensor, top_k: int) -> Tensor:
    return dy.new_empty(slot.shape[0], w.shape[2])


_dgrad_gathered_op = fast_op("grouped_gemm_dgrad_gathered", _dgrad_gathered_impl, _dgrad_gathered_fake)


def grouped_gemm_dgrad_gathered(dy: Tensor, slot: Tensor, top_k: int, w: Tensor, offs: Tensor) -> Tensor:
    """dx[p] = dy[slot[p] // top_k] @ w[e] for permuted row p of group e (zero rows where slot = -1): the
    down projection's dgrad straight from the layer's token-major output gradient, without permuting it."""
    return _dgrad_gathered_op(dy, slot, w, offs, top_k)


def _dgrad_spill_impl(dy: Tensor, slot: Tensor, w: Tensor, offs: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    dyp = dy.new_empty(slot.shape[0], dy.shape[1])
    dx = _gathered_gemm("grouped_gemm_dgrad_gathered_spill", dy, "dy", slot, w, offs, top_k, "none", False,
                        spill=dyp)[0]
    return dx, dyp


def _dgrad_spill_fake(dy: Tensor, slot: Tensor, w: Tensor, offs: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    return dy.new_empty(slot.shape[0], w.shape[2]), dy.new_empty(slot.shape[0], dy.shape[1])


_dgrad_spill_op = fast_op("grouped_gemm_dgrad_gathered_spill", _dgrad_spill_impl, _dgrad_spill_fake)


def grouped_gemm_dgrad_gathered_spill(dy: Tensor, slot: Tensor, top_k: int, w: Tensor,
                                      offs: Tensor) -> tuple[Tensor, Tensor]:
    """(grouped_gemm_dgrad_gathered, dyp): dyp [R, H] holds dy's rows in permuted order up to offs[-1] (zero
    where slot = -1; rows past offs[-1] unwritten), copied out of the rows the dgrad gathered, so the down
    wgrad reads them by TMA without a copy pass (N tile kt % n_tiles stores K box kt beside its MMAs)."""
    out: tuple[Tensor, Tensor] = _dgrad_spill_op(dy, slot, w, offs, top_k)
    return out


def _wgrad_gathered_run(dy: Tensor, x: Tensor, slot: Tensor, offs: Tensor, top_k: int, side: str,
                        dw: Tensor | None, transposed: bool = False) -> Tensor:
    """The gathered wgrad into a new dw, or added to `dw` in place (bit for bit a bf16 add of the wgrad);
    transposed: the kernel computes x^T @ dy (the token-major side on its other side), stored transposed."""
    op = "grouped_gemm_wgrad_gathered"
    check_bf16(op, dy=dy, x=x)
    permuted = x if side == "dy" else dy
    shapes_ok = dy.dim() == 2 and x.dim() == 2 and slot.shape == (permuted.shape[0],)
    if side not in ("x", "dy") or not shapes_ok or slot.dtype != torch.int64 or top_k < 1:
        raise ValueError(f"{op}: need dy [R, N] and x [T, K] (side 'x': x is token-major) or dy [T, N] and "
                         "x [R, K] (side 'dy'), int64 slot [R] (permute's, -1 on pad rows) and top_k >= 1; "
                         f"got side {side!r}, {tuple(dy.shape)}, {tuple(x.shape)}, {slot.dtype} "
                         f"{tuple(slot.shape)}, top_k={top_k}")
    check_routing(op, offs, None, slot.shape[0])
    check_aligned(op, "dy and x widths", ("N", dy.shape[1], GEMM_ALIGN), ("K", x.shape[1], GEMM_ALIGN))
    tokens = (dy if side == "dy" else x).shape[0]
    if tokens * top_k > 2**31:
        raise ValueError(f"{op}: the kernel reads slot's low 32 bits, so T * top_k must be at most 2^31; got "
                         f"{tokens} * {top_k}: split the tokens into microbatches")
    m, n, k, e = slot.shape[0], dy.shape[1], x.shape[1], offs.shape[0]
    if dw is not None and (dw.dtype != torch.bfloat16 or dw.shape != (e, n, k) or not dw.is_contiguous()
                           or dw.data_ptr() % 16):
        raise ValueError(f"{op}: the dw to add to must be a contiguous 16-byte aligned bf16 [{e}, {n}, {k}]; "
                         f"got {dw.dtype} {tuple(dw.shape)}")
    device, arch = runtime.device_arch(dy, x, slot, offs, *(() if dw is None else (dw,)))
    require(op, arch, ARCH)
    dy, x = tma_aligned(op, "dy", dy), tma_aligned(op, "x", x)
    accumulate = dw is not None
    out = torch.empty(e, n, k, dtype=torch.bfloat16, device=dy.device) if dw is None else dw
    if e * n * k == 0:
        return out
    if m == 0:
        return out if accumulate else out.zero_()
    check_offs_on_host(op, offs, m)
    kn, kk = (k, n) if transposed else (n, k)
    bn = pick_bn(kk)
    n_ctas, split = _wgrad_grid(device, m, kn, kk, bn, e, GEMM_WGRAD_GATHER_DYNAMIC)
    kernel_side = "a" if (side == "dy") != transposed else "b"
    launch = WGRAD_GATHER.launcher(arch, n=kn, k=kk, bn=bn, side=kernel_side, top_k=top_k,
                                   accumulate=accumulate, transposed=transposed, dynamic=split.dynamic)
    tma_side, token_major = (x, dy) if side == "dy" else (dy, x)
    zero = _zero_chunk(op, dy.device).data_ptr()
    _keep, (ws, counters, *split_args) = split.args(dy.device)
    launch(device, tma_side.data_ptr(), token_major.data_ptr(), zero, slot.contiguous().data_ptr(),
           out.data_ptr(), offs.contiguous().data_ptr(), ws, counters, m, e, n_ctas, *split_args)
    return out


def _wgrad_gathered_impl(dy: Tensor, x: Tensor, slot: Tensor, offs: Tensor, top_k: int, side: str,
                         transposed: bool) -> Tensor:
    return _wgrad_gathered_run(dy, x, slot, offs, top_k, side, None, transposed)


def _wgrad_gathered_fake(dy: Tensor, x: Tensor, slot: Tensor, offs: Tensor, top_k: int, side: str,
                         transposed: bool) -> Tensor:
    return dy.new_empty(offs.shape[0], dy.shape[1], x.shape[1])


_wgrad_gathered_op = fast_op("grouped_gemm_wgrad_gathered", _wgrad_gathered_impl, _wgrad_gathered_fake)


def _wgrad_gathered_add_impl(dy: Tensor, x: Tensor, slot: Tensor, offs: Tensor, top_k: int, side: str,
                             dw: Tensor, transposed: bool) -> None:
    _wgrad_gathered_run(dy, x, slot, offs, top_k, side, dw, transposed)


def _wgrad_gathered_add_fake(dy: Tensor, x: Tensor, slot: Tensor, offs: Tensor, top_k: int, side: str,
                             dw: Tensor, transposed: bool) -> None:
    return None


_wgrad_gathered_add_op = fast_op("grouped_gemm_wgrad_gathered_add", _wgrad_gathered_add_impl,
                                 _wgrad_gathered_add_fake, mutates=("dw",))


def grouped_gemm_wgrad_gathered(dy: Tensor, x: Tensor, slot: Tensor, top_k: int, offs: Tensor,
                                side: str = "x", transposed: bool = False) -> Tensor:
    """dw[e] = dy[rows of e]^T @ x[rows of e] where the `side` operand ("x" or "dy") is token-major and read
    through slot (row p is token slot[p] // top_k, zero where slot = -1), without permute's [R, width] copies;
    transposed: x^T @ dy stored transposed (x on M: half the gathered reads of x on N)."""
    return _wgrad_gathered_op(dy, x, slot, offs, top_k, side, transposed)


def grouped_gemm_wgrad_gathered_add(dy: Tensor, x: Tensor, slot: Tensor, top_k: int, offs: Tensor, side: str,
                                    dw: Tensor, transposed: bool = False) -> None:
    """grouped_gemm_wgrad_gathered added into dw in place, bit for bit a bf16 add of it: a later microbatch's
    expert gradient with no second gradient in memory."""
    _wgrad_gathered_add_op(dy, x, slot, offs, top_k, side, dw, transposed)


def _wgrad_cols_impl(dy: Tensor, x: Tensor, offs: Tensor, dw: Tensor, col0: int, row0: int = 0,
                     accumulate: bool = False) -> None:
    op = "grouped_gemm_wgrad_cols"
    _check_wgrad(dy, x, offs)
    n, k = dy.shape[1], x.shape[1]
    e, height, width = offs.shape[0], dw.shape[-2] if dw.dim() == 3 else 0, dw.shape[-1]
    if (dw.dtype != torch.bfloat16 or dw.shape != (e, height, width) or not dw.is_contiguous()
            or not 0 <= col0 <= width - k or not 0 <= row0 <= height - n or (col0 | width) % GEMM_ALIGN
            or dw.data_ptr() % 16):
        raise ValueError(f"{op}: need a contiguous 16-byte aligned bf16 dw [E, R, W] = [{e}, R, W] with W "
                         f"and col0 multiples of {GEMM_ALIGN}, col0 + {k} <= W and row0 + {n} <= R; got "
                         f"{dw.dtype} {tuple(dw.shape)}, row0={row0}, col0={col0}")
    dy, x = tma_aligned(op, "dy", dy), tma_aligned(op, "x", x)
    device, launch, zero, scalars, split = _prepare_wgrad(dy, x, offs, (e, n, k), None, dw, ld=width,
                                                          gs=height, accumulate=accumulate)
    _Plan(op, device, dy.device, (), 0, True, True, launch, zero, scalars, False, split).run(
        dy, x, offs.contiguous(), (dw[:, row0:row0 + n, col0:col0 + k],))


def _wgrad_cols_fake(dy: Tensor, x: Tensor, offs: Tensor, dw: Tensor, col0: int, row0: int = 0,
                     accumulate: bool = False) -> None:
    return None


_wgrad_cols_op = fast_op("grouped_gemm_wgrad_cols", _wgrad_cols_impl, _wgrad_cols_fake, mutates=("dw",))


def grouped_gemm_wgrad_cols(dy: Tensor, x: Tensor, offs: Tensor, dw: Tensor, col0: int,
                            row0: int = 0, accumulate: bool = False) -> None:
    """grouped_gemm_wgrad(dy, x, offs) stored bit for bit into one block of a larger dw, so that a wide wgrad
    can be taken a few x columns (or dy columns) at a time, in place."""
    # The block is dw[e, row0 : row0 + N, col0 : col0 + K] = dy[rows of e]^T @ x[rows of e]. accumulate: the
    # wgrad is added to the block instead, bit for bit a bf16 add of it, which gives gradient accumulation
    # without a second gradient in memory.
    _wgrad_cols_op(dy, x, offs, dw, col0, row0, accumulate)


def grouped_gemm_dgrad(dy: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """dx[rows of e] = dy[rows of e] @ w[e] in fp32, rounded once to bf16; rows past offs[-1] are zero."""
    return _dgrad_op(dy, w, offs)


def grouped_gemm_wgrad(dy: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    """dw[e] = dy[rows of e]^T @ x[rows of e] in fp32, rounded once to bf16; empty groups give zeros."""
    return _wgrad_op(dy, x, offs)
