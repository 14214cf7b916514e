"""Fast fused-linear cross-entropy: per token chunk a bf16 cuBLAS GEMM into fp32 logits, a CuTeDSL row kernel
(lse, loss, and with grad bf16 dlogits in place) and the two gradient GEMMs, all in the forward; the backward
scales by dloss (ce_scale). Never [T, V] fp32 logits, no host sync; peak memory: peak_bytes, docs/ops.md."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nmoe.config import TrainConfig
from nmoe.fast import runtime
from nmoe.fast.op import Kernel, fast_op
from nmoe.fast.runtime import KernelSpec, vector_aligned

CE_FWD = Kernel.by_name("nmoe.fast.kernels.loss", "ce_fwd")
CE_SCALE = Kernel.by_name("nmoe.fast.kernels.loss", "ce_scale")
THREADS = 512
UNROLL = 8
SCALE_THREADS = 256


def peak_bytes(t: int, v: int, h: int, chunk: int, grad: bool) -> int:
    """Extra device bytes, c = min(chunk, T): 4cV + 8T without grad; with grad 4cV + 4VH + 4TH + 8T in the
    forward (fp32 dw, dh), 6VH + 6TH in the backward (plus the bf16 results). At T 8192, H 2048, V 201088,
    chunk 4096: 5.0 GB; the fp32 logits of all tokens take 6.6 GB."""
    base = 4 * min(chunk, t) * v + 8 * t
    return max(base + 4 * v * h + 4 * t * h, 6 * v * h + 6 * t * h) if grad else base


def _check(h: Tensor, w_out: Tensor, targets: Tensor, chunk: int) -> None:
    if h.dim() != 2 or w_out.dim() != 2 or h.shape[1] != w_out.shape[1]:
        raise ValueError(f"cross_entropy: h {tuple(h.shape)} must be [T, D] and w_out {tuple(w_out.shape)} "
                         "[V, D]")
    if targets.shape != (h.shape[0],) or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cross_entropy: targets must be int32/int64 [{h.shape[0]}], got {targets.dtype} "
                         f"{tuple(targets.shape)}")
    if chunk < 1:
        raise ValueError(f"cross_entropy: chunk={chunk} must be >= 1 (tokens per logits chunk)")
    if h.dtype != torch.bfloat16 or w_out.dtype != torch.bfloat16:
        raise ValueError(f"cross_entropy: the fast path takes bf16 h and w_out, got {h.dtype} and "
                         f"{w_out.dtype}; cast them, or use nmoe.reference.loss")
    if w_out.shape[0] == 0:
        raise ValueError("cross_entropy: w_out has no rows (vocab 0); every kept target is out of range")
    if w_out.shape[0] > 2**31 - THREADS * UNROLL:
        raise ValueError(f"cross_entropy: vocab {w_out.shape[0]} exceeds {2**31 - THREADS * UNROLL}: the "
                         "kernel's int32 column index runs to V rounded up to whole "
                         f"{THREADS * UNROLL}-column tiles")


def _fused_impl(h: Tensor, w_out: Tensor, targets: Tensor, ignore_index: int, chunk: int,
                grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, dh, dw) with dloss = 1, the gradients in fp32 (empty when grad is False). A target outside
    [0, V) that is not ignore_index traps the kernel (the CUDA error surfaces at the next sync)."""
    _check(h, w_out, targets, chunk)
    device, arch = runtime.device_arch(h, w_out, targets)
    t, hd = h.shape
    v = w_out.shape[0]
    h, w_out = h.contiguous(), w_out.contiguous()
    kept = targets != ignore_index
    n_kept = kept.sum()
    denom = n_kept.clamp_min(1).to(torch.float32)
    coef = (1.0 / denom).reshape(1)
    tgt = torch.where(kept, torch.where((targets < 0) | (targets >= v), v, targets), -1).to(torch.int32)
    per_row = torch.zeros(t, dtype=torch.float32, device=h.device)
    dh = torch.empty((t, hd) if grad else (0, hd), dtype=torch.float32, device=h.device)
    chunks = t > 0 and v > 0
    # With chunks, the first one's dw GEMM writes dw32 (no zero fill); without, the gradient is zero.
    dw32 = (torch.empty if chunks else torch.zeros)((v, hd) if grad else (0, hd), dtype=torch.float32,
                                                    device=h.device)
    if chunks:
        buf = torch.empty((min(chunk, t), v), dtype=torch.float32, device=h.device)
        launch = CE_FWD.launcher(arch, grad=grad, threads=THREADS, unroll=UNROLL)
        for start in range(0, t, chunk):
            n = min(chunk, t - start)
            hc, logits = h[start:start + n], buf[:n]
            torch.mm(hc, w_out.T, out_dtype=torch.float32, out=logits)
            launch(device, logits.data_ptr(), logits.data_ptr(), tgt[start:].data_ptr(), coef.data_ptr(),
                   per_row[start:].data_ptr(), n, v)
            if grad:
                dlogits = logits.view(torch.bfloat16)[:, :v]
                torch.mm(dlogits, w_out, out_dtype=torch.float32, out=dh[start:start + n])
                if start == 0:
                    torch.mm(dlogits.T, hc, out_dtype=torch.float32, out=dw32)
                else:
                    torch.addmm(dw32, dlogits.T, hc, out_dtype=torch.float32, out=dw32)
    loss = per_row.sum() / denom
    return loss, dh, dw32


def _fused_fake(h: Tensor, w_out: Tensor, targets: Tensor, ignore_index: int, chunk: int,
                grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    rows, vrows = (h.shape[0], w_out.shape[0]) if grad else (0, 0)
    return (torch.empty((), dtype=torch.float32, device=h.device),
            torch.empty((rows, h.shape[1]), dtype=torch.float32, device=h.device),
            torch.empty((vrows, h.shape[1]), dtype=torch.float32, device=h.device))


_ce_op = fast_op("cross_entropy", _fused_impl, _fused_fake)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    ctx.save_for_backward(output[1], output[2])
    ctx.grad = inputs[5]


def _scale_impl(grad: Tensor, dloss: Tensor) -> Tensor:
    out = torch.empty(grad.shape, dtype=torch.bfloat16, device=grad.device)
    if grad.numel():
        device, arch = runtime.device_arch(grad, dloss)
        s = dloss.to(torch.float32).reshape(1).contiguous()
        launch = CE_SCALE.launcher(arch, threads=SCALE_THREADS)
        launch(device, vector_aligned(grad, 16).data_ptr(), s.data_ptr(), out.data_ptr(), grad.numel())
    return out


def _scale_fake(grad: Tensor, dloss: Tensor) -> Tensor:
    return torch.empty(grad.shape, dtype=torch.bfloat16, device=grad.device)


_scale_op = fast_op("ce_scale", _scale_impl, _scale_fake)


def _scaled(grad: Tensor, dloss: Tensor) -> Tensor:
    """bf16(dloss * grad) of an fp32 gradient: the fp32 product rounded once, in one vectorised pass (torch's
    mixed-dtype mul took 1.74 ms for moonlet's head, 3x its bytes at the copy ceiling)."""
    return _scale_op(grad, dloss)


def _backward(ctx: Any, dloss: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
    dh, dw = ctx.saved_tensors
    if not ctx.grad:
        raise RuntimeError("cross_entropy: backward through a call made without grad; call it with "
                           "h or w_out requiring grad under torch.enable_grad()")
    return _scaled(dh, dloss), _scaled(dw, dloss), None, None, None, None


_ce_op.autograd(_backward, _setup)


def cross_entropy(h: Tensor, w_out: Tensor, targets: Tensor, ignore_index: int = -100,
                  chunk: int = TrainConfig.ce_chunk) -> Tensor:
    """Mean CE over kept tokens of softmax(h @ w_out^T) as a 0-dim fp32 tensor (0 when none is kept);
    differentiable w.r.t. h and w_out, its gradient computed in this one pass."""
    grad = torch.is_grad_enabled() and (h.requires_grad or w_out.requires_grad)
    loss, _, _ = _ce_op(h, w_out, targets, ignore_index, chunk, grad)
    return loss


def cross_entropy_bwd(dloss: Tensor | float, h: Tensor, w_out: Tensor, targets: Tensor,
                      ignore_index: int = -100, chunk: int = TrainConfig.ce_chunk) -> tuple[Tensor, Tensor]:
    """(dh, dw_out) of cross_entropy: dloss * (softmax - onehot)/n_kept through the two GEMMs per chunk."""
    _, dh, dw = _ce_op(h.detach(), w_out.detach(), targets, ignore_index, chunk, True)
    scale = torch.as_tensor(dloss, dtype=torch.float32, device=h.device)
    return _scaled(dh, scale), _scaled(dw, scale)


# ex2.approx (not .ftz) carries exp: its ~2 ulp error sits inside the contract's V-term; log is the
# DSL's accurate software log2; local memory would mean the unrolled tile spilled.
_FORBID = (r"\.ftz\b", r"\b(ld|st)\.local\b")
# dlogits overwrite the row they are computed from: every tile's loads must precede its barrier and every
# bf16 store follow it (a load after the last barrier, or a store before it, is the race), and .nc loads
# are only defined on memory the kernel never writes.
_GRAD_FORBID = (r"(?s)\bbar\.sync\b(?:(?!\bbar\.sync\b).)*\bld\.global\b(?:(?!\bbar\.sync\b).)*\Z",
                r"(?s)\bst\.global\.b16\b.*\bbar\.sync\b", r"\bld\.global\.nc\b")
_EXPECT = (r"\bex2\.approx\.f32\b", r"\bshfl\.sync\.bfly\.b32\b", r"\bbar\.sync\b",
           r"\bld\.global(\.nc)?\.b32\b", r"\bmax\.f32\b")
_GRAD = (r"\bcvt\.rn\.bf16\.f32\b", r"\bst\.global\.b16\b", r"\btrap;")


# The scale multiplies in fp32 (sm_100a packs pairs into mul.f32x2) and rounds once to bf16, 16-byte
# vectors in and out.
_SCALE_MUL = {"sm_90a": (r"\bmul(\.rn)?\.f32\s",), "sm_100a": (r"\bmul(\.rn)?\.f32x2\s",)}


def _kernel_specs() -> tuple[KernelSpec, ...]:
    fwd = tuple(
        runtime.portable_spec("cross_entropy_bwd" if grad else "cross_entropy", f"ce_fwd_{tag}",
                              CE_FWD.compiler(grad=grad, threads=THREADS, unroll=UNROLL),
                              _EXPECT + (_GRAD if grad else ()), _FORBID + (_GRAD_FORBID if grad else ()))
        for grad, tag in ((False, "nograd"), (True, "grad"))
    )
    scale = runtime.portable_spec("cross_entropy_bwd", "ce_scale", CE_SCALE.compiler(threads=SCALE_THREADS),
                                  (runtime.LD128, runtime.ST128, r"\bcvt\.rn\.bf16x2\.f32\b"), _FORBID,
                                  _SCALE_MUL)
    return (*fwd, scale)


KERNELS: tuple[KernelSpec, ...] = _kernel_specs()
