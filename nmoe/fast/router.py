"""Fast router top-k and expert counts: CuTeDSL kernels (nmoe/fast/kernels/router.py) behind torch custom ops.

Scores follow a pinned IEEE-op formula (below) because torch's CPU sigmoid/softmax bits are not reproducible.
"""

# torch's CPU sigmoid/softmax bits change with the SIMD path and the element's tail position, so only a
# formula of round-to-nearest fp32 add/sub/mul/div ops is reproducible bit for bit on any machine:
#   exp(x): x < -104 -> 0, x > 89 -> inf, NaN -> x; else n = (x*LOG2E + 1.5*2^23) - 1.5*2^23,
#           r = (x - n*LN2_HI) - n*LN2_LO, q = Horner(1/5040, 1/720, 1/120, 1/24, 1/6, 1/2) in r,
#           p = 1 + (r + (r*r)*q), exp = (p * 2^(n>>1)) * 2^(n - (n>>1))
#   sigmoid(x) = 1 / (1 + exp(-x));  softmax(x)_i = exp(x_i - max x) / (sum in ascending expert id)
# LOG2E 0x3FB8AA3B, LN2_HI 0x3F317200, LN2_LO 0x35BFBE8E (fp32 bits). NaN logits or bias abort the
# kernel (the spec raises), since raising needs a host sync.

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.limits import MAX_EXPERTS, ROUTER_MAX_GROUPS, ROUTER_MAX_K
from nmoe.fast.op import Kernel, fast_op, save_inputs
from nmoe.fast.runtime import KernelSpec

SCORE_FUNCS = ("sigmoid", "softmax")
_INT32_LIMIT = 2**31
ROUTER_TOPK = Kernel("nmoe.fast.kernels.router", "router_topk",
                     lambda km, E, k, softmax, n_groups, topk_groups: km.compile_args(E, k, softmax, n_groups,
                                                                                      topk_groups))
EXPERT_COUNTS = Kernel("nmoe.fast.kernels.router", "expert_counts",
                       lambda km, E, ids_bits: km.counts_args(E, ids_bits))


def check_topk_args(logits: Tensor, bias: Tensor, k: int, score_func: str, n_groups: int,
                    topk_groups: int) -> None:
    """The spec's argument checks plus the kernel's limits; shapes only, so no host sync."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"router_topk: logits must be fp32 [T,E], got {logits.dtype} {tuple(logits.shape)}; "
                         "cast with .float() (the fast kernel reads fp32 only)")
    e = logits.shape[1]
    if bias.shape != (e,) or not bias.dtype.is_floating_point:
        raise ValueError(f"router_topk: bias must be a float [E] = ({e},) tensor, got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"router_topk: score_func {score_func!r} unknown; use one of {SCORE_FUNCS}")
    if n_groups < 1 or e % n_groups != 0:
        raise ValueError(f"router_topk: n_groups={n_groups} must be >= 1 and divide E={e}")
    if n_groups > 1 and e // n_groups < 2:
        raise ValueError(f"router_topk: group size {e // n_groups} < 2; top-2 group scores need >= 2")
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"router_topk: topk_groups={topk_groups} must lie in [1, n_groups={n_groups}]")
    avail = e if n_groups == 1 else topk_groups * (e // n_groups)
    if not 1 <= k <= avail:
        raise ValueError(f"router_topk: k={k} must lie in [1, {avail}] (experts reachable after group limit)")
    if e > MAX_EXPERTS or k > ROUTER_MAX_K or n_groups > ROUTER_MAX_GROUPS:
        raise ValueError(f"router_topk: the fast kernel takes E <= {MAX_EXPERTS}, k <= {ROUTER_MAX_K}, "
                         f"n_groups <= {ROUTER_MAX_GROUPS}; got E={e}, k={k}, n_groups={n_groups}; raise the "
                         "limits in nmoe/fast/limits.py (registers grow with E/32, k and n_groups)")


def _router_topk_impl(logits: Tensor, bias: Tensor, k: int, score_func: str, n_groups: int,
                      topk_groups: int) -> tuple[Tensor, Tensor]:
    device, arch = runtime.device_arch(logits, bias)
    check_topk_args(logits, bias, k, score_func, n_groups, topk_groups)
    t, e = logits.shape
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return w, ids
    if t >= _INT32_LIMIT:
        raise ValueError(f"router_topk: T={t} tokens exceed the kernel's int32 token index; split the batch")
    lg = logits.contiguous()
    b = bias.to(torch.float32).contiguous()
    launch = ROUTER_TOPK.launcher(arch, E=e, k=k, softmax=score_func == "softmax", n_groups=n_groups,
                                  topk_groups=topk_groups)
    launch(device, lg.data_ptr(), b.data_ptr(), w.data_ptr(), ids.data_ptr(), t)
    return w, ids


def _router_topk_fake(logits: Tensor, bias: Tensor, k: int, score_func: str, n_groups: int,
                      topk_groups: int) -> tuple[Tensor, Tensor]:
    t = logits.shape[0]
    return (torch.empty(t, k, dtype=torch.float32, device=logits.device),
            torch.empty(t, k, dtype=torch.int64, device=logits.device))


def _expert_counts_impl(ids: Tensor, n_experts: int) -> Tensor:
    device, arch = runtime.device_arch(ids)
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_counts: ids must be int32/int64, got {ids.dtype}")
    if not 1 <= n_experts <= MAX_EXPERTS:
        raise ValueError(f"expert_counts: n_experts={n_experts} must lie in [1, {MAX_EXPERTS}]")
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device)
    flat = ids.reshape(-1).contiguous()
    n = flat.numel()
    if n == 0:
        return counts
    if n >= _INT32_LIMIT:
        raise ValueError(f"expert_counts: {n} slots exceed the kernel's int32 slot index; split the batch")
    bits = 64 if flat.dtype == torch.int64 else 32
    EXPERT_COUNTS.launcher(arch, E=n_experts, ids_bits=bits)(device, flat.data_ptr(), counts.data_ptr(), n)
    return counts


def _expert_counts_fake(ids: Tensor, n_experts: int) -> Tensor:
    return torch.empty(n_experts, dtype=torch.int64, device=ids.device)


def _logits_dtype(x: Tensor, wr: Tensor) -> torch.dtype:
    if x.dim() != 2 or wr.dim() != 2 or x.shape[1] != wr.shape[1]:
        raise ValueError(f"router_logits: need x [T,H], wr [E,H]; got {tuple(x.shape)}, {tuple(wr.shape)}")
    if not (x.dtype.is_floating_point and wr.dtype.is_floating_point):
        raise ValueError(f"router_logits: x and wr must be float tensors, got {x.dtype} and {wr.dtype}")
    return torch.promote_types(torch.float32, torch.promote_types(x.dtype, wr.dtype))


def _router_logits_impl(x: Tensor, wr: Tensor) -> Tensor:
    runtime.device_arch(x, wr)
    acc = _logits_dtype(x, wr)
    if x.dtype == wr.dtype and x.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x, wr.t(), out_dtype=torch.float32)
    if acc == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        raise ValueError("router_logits: fp32 operands with torch.set_float32_matmul_precision("
                         f"{torch.get_float32_matmul_precision()!r}) would round them to TF32/bf16; set it "
                         "to 'highest', or pass bf16 x and router weight (exact products, fp32 accumulate)")
    return torch.mm(x.to(acc), wr.to(acc).t())


def _router_logits_fake(x: Tensor, wr: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], wr.shape[0], dtype=_logits_dtype(x, wr))


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b of bf16 operands: exact products, fp32 accumulate, fp32 out (tensor cores on the GPU)."""
    return torch.mm(a, b, out_dtype=torch.float32) if a.is_cuda else torch.mm(a.float(), b.float())


def picks_dense(g: Tensor, ids: Tensor, e: int) -> Tensor:
    """[T,E] from g [T,K] at columns ids, zero elsewhere: a top-k gradient as the logits' shape."""
    return g.new_zeros(g.shape[0], e).scatter_(1, ids, g)


def _split_bf16(g: Tensor, ids: Tensor | None, e: int) -> Tensor:
    """fp32 g as bf16 [T,2E] = [hi | lo], hi + lo = g to 16 of its 24 significand bits: one bf16 GEMM over
    the pair sums both terms in its fp32 accumulator, where an fp32 GEMM would run on CUDA cores."""
    hi = g.to(torch.bfloat16)
    lo = (g - hi.float()).to(torch.bfloat16)
    if ids is None:
        return torch.cat([hi, lo], dim=1)
    pair = hi.new_zeros(g.shape[0], 2, e)
    pair[:, 0].scatter_(1, ids, hi)
    pair[:, 1].scatter_(1, ids, lo)
    return pair.view(g.shape[0], 2 * e)


def logits_grads(g: Tensor, x: Tensor, wr: Tensor, need_dx: bool, need_dwr: bool,
                 dx_add: Tensor | None = None,
                 ids: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
    """(dx, dwr) of router_logits for g = dL/dlogits ([T,K] at columns ids, zero elsewhere, given ids);
    dx_add (x's other gradient) joins dx in its GEMM (addmm, beta 1). bf16 operands: g split into two bf16
    halves (2^-16 relative, under the bf16 results' rounding), bf16 dx from its GEMM; else full fp32 GEMMs."""
    e, h = wr.shape
    if x.dtype == wr.dtype == torch.bfloat16:
        gp = _split_bf16(g.float(), ids, e)
        dx = None
        if need_dx:
            w2 = torch.cat([wr, wr])
            dx = torch.mm(gp, w2) if dx_add is None else torch.addmm(dx_add, gp, w2)
        dwr = _mm_f32(gp.t(), x).view(2, e, h).sum(0).to(wr.dtype) if need_dwr else None
        return dx, dwr
    if ids is not None:
        g = picks_dense(g, ids, e)
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        dx = dwr = None
        if need_dx:
            w32 = wr.to(g.dtype)
            dx = (torch.mm(g, w32) if dx_add is None else torch.addmm(dx_add.to(g.dtype), g, w32)).to(x.dtype)
        dwr = torch.mm(g.t(), x.to(g.dtype)).to(wr.dtype) if need_dwr else None
    finally:
        torch.set_float32_matmul_precision(prev)
    return dx, dwr


def _router_logits_backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None]:
    x, wr = ctx.saved_tensors
    return logits_grads(g, x, wr, *ctx.needs_input_grad[:2])


def _check_bias_update(bias: Tensor, counts: Tensor, rate: float, clamp: float) -> None:
    if bias.dim() != 1 or counts.shape != bias.shape:
        raise ValueError(f"bias_update: bias {tuple(bias.shape)}, counts {tuple(counts.shape)} must be [E]")
    if bias.dtype != torch.float32 or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"bias_update: need fp32 bias and integer counts, got {bias.dtype}, {counts.dtype}")
    if not rate >= 0 or not clamp > 0:
        raise ValueError(f"bias_update: need rate >= 0 and clamp > 0, got rate={rate}, clamp={clamp}")


def _bias_update_impl(bias: Tensor, counts: Tensor, rate: float, clamp: float) -> Tensor:
    runtime.device_arch(bias, counts)
    _check_bias_update(bias, counts, rate, clamp)
    c = counts.to(torch.int64)
    direction = torch.sign(c.sum() - bias.numel() * c).to(torch.float32)
    step = direction * float(torch.tensor(rate, dtype=torch.float32))
    return torch.clamp(bias + step, min=-clamp, max=clamp)


def _bias_update_fake(bias: Tensor, counts: Tensor, rate: float, clamp: float) -> Tensor:
    _check_bias_update(bias, counts, rate, clamp)
    return torch.empty_like(bias)


_topk_op = fast_op("router_topk", _router_topk_impl, _router_topk_fake)
_counts_op = fast_op("expert_counts", _expert_counts_impl, _expert_counts_fake)
_logits_op = fast_op("router_logits", _router_logits_impl, _router_logits_fake)
_logits_op.autograd(_router_logits_backward, save_inputs(0, 1))
_bias_update_op = fast_op("bias_update", _bias_update_impl, _bias_update_fake)


def router_logits(x: Tensor, wr: Tensor) -> Tensor:
    """x @ wr^T [T,E] in fp32 (fp64 for fp64 operands): exact products, fp32 accumulate, order unpinned."""
    return _logits_op(x, wr)


def bias_update(bias: Tensor, counts: Tensor, rate: float, clamp: float) -> Tensor:
    """Aux-loss-free step on device: clamp(bias + fp32(rate) * sign(sum(counts) - E*counts), +-clamp)."""
    return _bias_update_op(bias, counts, rate, clamp)


def router_topk(logits: Tensor, bias: Tensor, k: int, score_func: str, n_groups: int = 1,
                topk_groups: int = 1) -> tuple[Tensor, Tensor]:
    """(weights fp32 [T,k], ids int64 [T,k]) in selection order; same contract as the spec op."""
    return _topk_op(logits, bias, k, score_func, n_groups, topk_groups)


def expert_counts(ids: Tensor, n_experts: int) -> Tensor:
    """int64 [E] slots per expert; an id outside [0, E) aborts the kernel (the spec raises)."""
    return _counts_op(ids, n_experts)


# Bitwise needs every fp32 op rounded on its own: no fma (contracted or not), no approximate
# ex2/rcp/div, no flush-to-zero, no mul.f32/add.f32 without .rn (ptxas may fuse those), no
# NaN-dropping max/min, and no spills. printf stages its arguments with st.local, so only ld.local. Each
# pick's warp argmax is two integer reductions (the value's order key, then the lowest id holding it).
_SCORE_FORBID = (r"\bfma\.", r"\bex2\.", r"\brcp\.approx", r"\bdiv\.(approx|full)", r"\.ftz\b",
                 r"\b(mul|add|sub)\.f32\b", r"\b(max|min)(\.[a-z0-9]+)*\.f32\b", r"\bld\.local\b")
_SCORE_EXPECT = (r"\bmul\.rn\.f32\b", r"\badd\.rn\.f32\b", r"\bsub\.rn\.f32\b", r"\bdiv\.rn\.f32\b",
                 r"\bcvt\.rzi\.s32\.f32\b", r"\bshfl\.sync\.bfly\.b32\b", r"\btrap;",
                 r"\bredux\.sync\.max\.s32\b", r"\bredux\.sync\.min\.s32\b")


def _topk_spec(name: str, e: int, k: int, score_func: str, n_groups: int, topk_groups: int) -> KernelSpec:
    extra = (r"\bshfl\.sync\.idx\.b32\b",) if score_func == "softmax" else ()
    return runtime.portable_spec("router_topk", name,
                                 ROUTER_TOPK.compiler(E=e, k=k, softmax=score_func == "softmax",
                                                      n_groups=n_groups, topk_groups=topk_groups),
                                 (*_SCORE_EXPECT, *extra), _SCORE_FORBID)


KERNELS: tuple[KernelSpec, ...] = (
    _topk_spec("router_topk_sigmoid_e256_k8_g8", 256, 8, "sigmoid", 8, 4),
    _topk_spec("router_topk_softmax_e64_k6", 64, 6, "softmax", 1, 1),
    runtime.portable_spec("permute", "expert_counts_e256", EXPERT_COUNTS.compiler(E=256, ids_bits=64),
                          (r"\batom\.shared\.add\.u32\b", r"\batom\.global\.add\.u64\b", r"\btrap;"),
                          (r"\bld\.local\b",)),
)
