"""Fast grouped GEMM fwd/dgrad/wgrad (bf16 in, fp32 accumulate), the fwd optionally with swiglu/relu2 fused:
sm_90a CuTeDSL kernels as torch custom ops that read `offs` on the device, so routing changes neither sync
the host nor recompile."""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.activation import relu2_bwd, swiglu_bwd
from nmoe.fast.arch import ArchNotImplemented
from nmoe.fast.runtime import KernelSpec, tma_aligned

_KERNEL_MODULE = "nmoe.fast.kernels.sm90.grouped_gemm"
_WGRAD_MODULE = "nmoe.fast.kernels.sm90.grouped_gemm_wgrad"
# the fused epilogue traces the standalone activation kernels' element math: those files key the cache too
_EPILOGUE_MODULES = ("nmoe.fast.kernels.activation", "nmoe.fast.kernels.swiglu", "nmoe.fast.kernels.combine")
ACTIVATIONS = ("swiglu", "relu2")
BM = 128
BN_CHOICES = (128, 256)
MAX_GROUPS = 1024
_ALIGN = 8
CHECK_OFFS_ENV = "NMOE_CHECK_OFFS"


def _source_sha256(module: str = _KERNEL_MODULE) -> str:
    """The wgrad kernel shares the fwd file's MMA issue; the fused epilogue traces the activation files."""
    return runtime.sources_sha256(*dict.fromkeys((module, _KERNEL_MODULE, *_EPILOGUE_MODULES)))


def _require_sm90(arch: str, op: str) -> None:
    if arch != "sm_90a":
        raise ArchNotImplemented(
            f"{op}: this CuTeDSL grouped GEMM is not implemented for {arch} yet (it is a wgmma/TMA sm_90a "
            "kernel); run on an H100/H200, use nmoe.fast.gemm_sm100 on a B200, or call torch._grouped_mm "
            "explicitly where cuBLAS is acceptable"
        )


def _kernels(arch: str, module: str = _KERNEL_MODULE) -> ModuleType:
    _require_sm90(arch, "grouped_gemm")
    return runtime.kernel_module(module, arch)


def pick_bn(n: int) -> int:
    """Wide N tiles halve the A re-reads; they need N to fill them."""
    return 256 if n % 256 == 0 else 128


def tile_upper_bound(m: int, n: int, n_groups: int, bn: int) -> int:
    """Most tiles any routing of m rows into n_groups groups (plus the zero tail) can make."""
    return (-(-m // BM) + n_groups + 1) * -(-n // bn)


def _check_offs_on_host(op: str, offs: Tensor, m: int) -> None:
    """Opt-in (NMOE_CHECK_OFFS=1) validation; it syncs the host, so the hot path leaves it off."""
    if os.environ.get(CHECK_OFFS_ENV, "") not in ("1", "true") or torch.cuda.is_current_stream_capturing():
        return
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if any(e < s for s, e in zip(starts, ends, strict=True)) or (ends and ends[-1] > m):
        raise ValueError(f"{op}: offs {ends} must be non-decreasing, >= 0 and <= {m} rows; fix the counts")


def check_routing(op: str, offs: Tensor, n_groups: int | None, m: int) -> None:
    """The checks every grouped kernel shares: offs int32 [E] (E = n_groups where the weights fix it), the
    group table's size, and int32 row coordinates."""
    e = offs.numel() if n_groups is None else n_groups
    want = "E" if n_groups is None else str(e)
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() != e:
        raise ValueError(f"{op}: offs must be int32 [{want}] cumulative group ends, got {offs.dtype} "
                         f"{tuple(offs.shape)}; build it with torch.cumsum(counts, 0).to(torch.int32)")
    if e > MAX_GROUPS:
        raise ValueError(f"{op}: {e} groups exceed the kernel's table of {MAX_GROUPS}; split the "
                         "experts into several calls")
    if m >= 2**31:
        raise ValueError(f"{op}: {m} rows exceed the kernel's int32 row coordinates; split M")


def _check(op: str, a: Tensor, w: Tensor, offs: Tensor, a_name: str, red_dim: int) -> None:
    for name, t in ((a_name, a), ("w", w)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{op}: {name} is {t.dtype}; the fast kernel takes bfloat16 (cast with "
                             ".to(torch.bfloat16), or use nmoe.reference.gemm for other dtypes)")
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[red_dim]:
        raise ValueError(f"{op}: need {a_name} [M, R] and w [E, N, K] with R = w.shape[{red_dim}], got "
                         f"{tuple(a.shape)} and {tuple(w.shape)}")
    check_routing(op, offs, w.shape[0], a.shape[0])
    if w.shape[1] % _ALIGN or w.shape[2] % _ALIGN:
        raise ValueError(f"{op}: w's N={w.shape[1]} and K={w.shape[2]} must be multiples of {_ALIGN} (TMA "
                         "needs 16-byte row strides); pad the expert weights")


def _launch(op: str, a: Tensor, w: Tensor, offs: Tensor, out: Tensor, w_k_major: bool,
            bn: int | None = None, act_out: Tensor | None = None, activation: str = "none") -> None:
    """out[M, n] = per-group a[M, k] @ B_e^T with B_e = w[e] (K-major) or w[e]^T (dgrad); with an
    activation the same kernel also writes act_out = act(out) (both zero where out is)."""
    outs = (out,) if act_out is None else (out, act_out)
    arch = runtime.require_arch(a, w, offs, *outs)
    _require_sm90(arch, op)
    m, k = a.shape
    n = out.shape[1]
    if m == 0 or n == 0:
        return
    if k == 0 or w.shape[0] == 0:
        for t in outs:
            t.zero_()
        return
    _check_offs_on_host(op, offs, m)
    bn = pick_bn(n) if bn is None else bn
    if bn not in BN_CHOICES:
        raise ValueError(f"{op}: tile width {bn} unsupported; choose one of {BN_CHOICES}")
    kmod = _kernels(arch)
    name = "grouped_gemm_fwd" if w_k_major else "grouped_gemm_dgrad"
    if activation != "none":
        name = f"grouped_gemm_fwd_{activation}"
    key = runtime.cache_key(name, _source_sha256(), arch, {"n": n, "k": k, "bn": bn})
    n_ctas = min(runtime.sm_count(out.device), tile_upper_bound(m, n, w.shape[0], bn))
    from cutlass import BFloat16, Int32

    ptrs = [kmod.pointer(BFloat16, t.data_ptr()) for t in (a, w, out, outs[-1])]
    ptrs.append(kmod.pointer(Int32, offs.data_ptr(), 4))
    runtime.run_compiled(key, lambda: kmod.compile_args(n, k, bn, w_k_major, activation), out.device,
                         (*ptrs, m, w.shape[0], n_ctas))


def _launch_wgrad(dy: Tensor, x: Tensor, offs: Tensor, dw: Tensor, bn: int | None = None) -> None:
    """dw[e] = dy[rows of e]^T @ x[rows of e]; groups without rows get zeros."""
    arch = runtime.require_arch(dy, x, offs, dw)
    _require_sm90(arch, "grouped_gemm_wgrad")
    m = dy.shape[0]
    n_groups, n, k = dw.shape
    if dw.numel() == 0:
        return
    if m == 0:
        dw.zero_()
        return
    _check_offs_on_host("grouped_gemm_wgrad", offs, m)
    bn = pick_bn(k) if bn is None else bn
    if bn not in BN_CHOICES:
        raise ValueError(f"grouped_gemm_wgrad: tile width {bn} unsupported; choose one of {BN_CHOICES}")
    kmod = _kernels(arch, _WGRAD_MODULE)
    key = runtime.cache_key("grouped_gemm_wgrad", _source_sha256(_WGRAD_MODULE), arch,
                            {"n": n, "k": k, "bn": bn})
    n_ctas = min(runtime.sm_count(dw.device), n_groups * -(-n // BM) * -(-k // bn))
    from cutlass import BFloat16, Int32

    ptrs = [kmod.pointer(BFloat16, t.data_ptr()) for t in (dy, x, dw)]
    ptrs.append(kmod.pointer(Int32, offs.data_ptr(), 4))
    runtime.run_compiled(key, lambda: kmod.compile_args(n, k, bn), dw.device, (*ptrs, m, n_groups, n_ctas))


def _check_wgrad(dy: Tensor, x: Tensor, offs: Tensor) -> None:
    op = "grouped_gemm_wgrad"
    for name, t in (("dy", dy), ("x", x)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{op}: {name} is {t.dtype}; the fast kernel takes bfloat16 (cast with "
                             ".to(torch.bfloat16), or use nmoe.reference.gemm for other dtypes)")
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: need dy [M, N] and x [M, K], got {tuple(dy.shape)} and {tuple(x.shape)}")
    check_routing(op, offs, None, dy.shape[0])
    if dy.shape[1] % _ALIGN or x.shape[1] % _ALIGN:
        raise ValueError(f"{op}: N={dy.shape[1]} and K={x.shape[1]} must be multiples of {_ALIGN} (TMA needs "
                         "16-byte row strides); pad the expert weights")


def _fwd_impl(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    _check("grouped_gemm", x, w, offs, "x", 2)
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.bfloat16, device=x.device)
    _launch("grouped_gemm", tma_aligned("grouped_gemm", "x", x), tma_aligned("grouped_gemm", "w", w),
            offs.contiguous(), y, True)
    return y


def _fwd_fake(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


def _dgrad_impl(dy: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    _check("grouped_gemm_dgrad", dy, w, offs, "dy", 1)
    dx = torch.empty(dy.shape[0], w.shape[2], dtype=torch.bfloat16, device=dy.device)
    _launch("grouped_gemm_dgrad", tma_aligned("grouped_gemm_dgrad", "dy", dy),
            tma_aligned("grouped_gemm_dgrad", "w", w), offs.contiguous(), dx, False)
    return dx


def _dgrad_fake(dy: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return dy.new_empty(dy.shape[0], w.shape[2])


def _wgrad_impl(dy: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    _check_wgrad(dy, x, offs)
    dw = torch.empty(offs.numel(), dy.shape[1], x.shape[1], dtype=torch.bfloat16, device=dy.device)
    _launch_wgrad(tma_aligned("grouped_gemm_wgrad", "dy", dy), tma_aligned("grouped_gemm_wgrad", "x", x),
                  offs.contiguous(), dw)
    return dw


def _wgrad_fake(dy: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    return dy.new_empty(offs.shape[0], dy.shape[1], x.shape[1])


_fwd_op = runtime.register_custom_op("nmoe::grouped_gemm", _fwd_impl, _fwd_fake)
_dgrad_op = runtime.register_custom_op("nmoe::grouped_gemm_dgrad", _dgrad_impl, _dgrad_fake)
_wgrad_op = runtime.register_custom_op("nmoe::grouped_gemm_wgrad", _wgrad_impl, _wgrad_fake)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    x, w, offs = ctx.saved_tensors
    dx = _dgrad_op(grad, w, offs) if ctx.needs_input_grad[0] else None
    dw = _wgrad_op(grad, x, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _act_width(w: Tensor, activation: str) -> int:
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
    width = _act_width(w, activation)
    _check("grouped_gemm_act", x, w, offs, "x", 2)
    h = torch.empty(x.shape[0], w.shape[1], dtype=torch.bfloat16, device=x.device)
    a = torch.empty(x.shape[0], width, dtype=torch.bfloat16, device=x.device)
    op = "grouped_gemm_act"
    _launch(op, tma_aligned(op, "x", x), tma_aligned(op, "w", w), offs.contiguous(), h, True, act_out=a,
            activation=activation)
    return a, h


def _act_fake(x: Tensor, w: Tensor, offs: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    width = _act_width(w, activation)
    return x.new_empty(x.shape[0], width), x.new_empty(x.shape[0], w.shape[1])


_act_op = runtime.register_custom_op("nmoe::grouped_gemm_act", _act_impl, _act_fake)


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


_act_op.register_autograd(_act_backward, setup_context=_act_setup_context)


def grouped_gemm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """y[rows of e] = x[rows of e] @ w[e]^T in fp32, rounded once to bf16; rows past offs[-1] are zero."""
    if runtime.require_arch(x, w, offs) == "sm_100a":
        from nmoe.fast import gemm_sm100

        return gemm_sm100.grouped_gemm(x, w, offs)
    out: Tensor = _fwd_op(x, w, offs)
    return out


def grouped_gemm_act(x: Tensor, w: Tensor, offs: Tensor, activation: str) -> Tensor:
    """act(grouped_gemm(x, w, offs)) from one kernel (swiglu [M, N/2], relu2 [M, N]) that also writes h,
    so the activation never re-reads h from memory and the backward keeps h instead of recomputing it."""
    _act_width(w, activation)
    arch = runtime.require_arch(x, w, offs)
    if arch != "sm_90a":
        raise ArchNotImplemented(
            f"grouped_gemm_act: the fused epilogue is an sm_90a kernel, not implemented for {arch} yet; "
            f"compose nmoe.fast.activation.{activation}(nmoe.fast.gemm.grouped_gemm(x, w, offs)) there"
        )
    a: Tensor = _act_op(x, w, offs, activation)[0]
    return a


def grouped_gemm_fp8(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor, offs: Tensor) -> Tensor:
    """e4m3 experts: wgmma with fp32 promotion per 128-K block on sm_90a, tcgen05 block-scaled on sm_100a."""
    if runtime.require_arch(xq, wq, offs) == "sm_90a":
        from nmoe.fast import gemm_fp8

        return gemm_fp8.grouped_gemm_fp8(xq, xs, wq, ws, offs)
    from nmoe.fast import gemm_sm100

    return gemm_sm100.grouped_gemm_fp8(xq, xs, wq, ws, offs)


def grouped_gemm_nvfp4(x_packed: Tensor, x_bs: Tensor, x_ts: Tensor, w_packed: Tensor, w_bs: Tensor,
                       w_ts: Tensor, offs: Tensor) -> Tensor:
    """NVFP4 experts need sm_100a's block-scaled MMA; sm_90a has none, so it refuses with the remedy."""
    if runtime.require_arch(x_packed, w_packed, offs) != "sm_100a":
        raise ArchNotImplemented(
            "grouped_gemm_nvfp4: sm_90a has no NVFP4 block-scaled MMA; use expert_dtype = \"bf16\" on "
            "H100/H200, or run nvfp4 on a B200 (sm_100a)"
        )
    from nmoe.fast import gemm_sm100

    return gemm_sm100.grouped_gemm_nvfp4(x_packed, x_bs, x_ts, w_packed, w_bs, w_ts, offs)


def grouped_gemm_dgrad(dy: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """dx[rows of e] = dy[rows of e] @ w[e] in fp32, rounded once to bf16; rows past offs[-1] are zero."""
    out: Tensor = _dgrad_op(dy, w, offs)
    return out


def grouped_gemm_wgrad(dy: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    """dw[e] = dy[rows of e]^T @ x[rows of e] in fp32, rounded once to bf16; empty groups give zeros."""
    out: Tensor = _wgrad_op(dy, x, offs)
    return out


def _ptx(n: int, k: int, bn: int, w_k_major: bool | None, activation: str, arch: str) -> str:
    """PTX of the fwd (w_k_major True, optionally with a fused activation), dgrad (False) or wgrad (None)."""
    if w_k_major is None:
        kmod = _kernels(arch, _WGRAD_MODULE)
        host, args = kmod.compile_args(n, k, bn)
    else:
        kmod = _kernels(arch)
        host, args = kmod.compile_args(n, k, bn, w_k_major, activation)
    return runtime.compile_ptx(host, args)


# Hopper tensor-core MMA fed by the TMA engine; 128-bit epilogue stores; setmaxnreg for the producer/consumer
# split; local memory would mean spilled accumulators.
_EXPECT_SM90 = (r"\.target sm_90a\b", r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16",
                r"cp\.async\.bulk\.tensor", r"\bst\.global\.v4\.b32\b", r"\bsetmaxnreg\.inc",
                r"\bstmatrix\.sync")
_FORBID_SM90 = (r"\b(ld|st)\.local\b", r"\bmma\.sync\b")


# wgrad zeroes the rows of its last box that belong to the next group with ordinary stores, which the
# tensor cores may read only after an async-proxy fence.
_EXPECT_WGRAD = (*_EXPECT_SM90, r"\bfence\.proxy\.async\.shared::cta\b")


# The fused epilogue must round like the standalone activations: canonical NaN selects, no ftz arithmetic
# (libdevice expf's ex2.approx.ftz acts on a range-reduced argument and is exempt), IEEE division.
_EXPECT_EPILOGUE = (*_EXPECT_SM90, r"\bsetp\.nan\.f32\b")
_FORBID_EPILOGUE = (*_FORBID_SM90, r"\b(mul|add|sub|div|fma)(\.r[nzmp])?\.ftz\.f32\b",
                    r"\bdiv\.(approx|full)(\.ftz)?\.f32\b")


def _spec(name: str, n: int, k: int, bn: int, w_k_major: bool | None, activation: str = "none") -> KernelSpec:
    expect = _EXPECT_WGRAD if w_k_major is None else _EXPECT_SM90
    fused = activation != "none"
    return KernelSpec(
        op="grouped_gemm_act" if fused else "grouped_gemm",
        name=name,
        compile=functools.partial(_ptx, n, k, bn, w_k_major, activation),
        expect={"sm_90a": _EXPECT_EPILOGUE if fused else expect},
        forbid={"sm_90a": _FORBID_EPILOGUE if fused else _FORBID_SM90},
    )


# Representative classes: the up projection (N = 2I, K = H), the down projection, their dgrad and wgrad, and
# the up projection with each fused activation at both tile widths.
KERNELS: tuple[KernelSpec, ...] = (
    _spec("grouped_gemm_fwd_n128", 2048, 4096, 128, True),
    _spec("grouped_gemm_fwd_n256", 4096, 1024, 256, True),
    _spec("grouped_gemm_dgrad_n128", 1024, 4096, 128, False),
    _spec("grouped_gemm_wgrad_n256", 2048, 4096, 256, None),
    _spec("grouped_gemm_act_swiglu_n128", 2048, 4096, 128, True, "swiglu"),
    _spec("grouped_gemm_act_swiglu_n256", 4096, 1024, 256, True, "swiglu"),
    _spec("grouped_gemm_act_relu2_n128", 1024, 4096, 128, True, "relu2"),
    _spec("grouped_gemm_act_relu2_n256", 4096, 1024, 256, True, "relu2"),
)
