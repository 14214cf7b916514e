"""Fast MLA attention: cuBLAS projections (torch), the fast rmsnorm and rope, causal flash-attn-4 (CuTeDSL).

flash-attn-4 loads cutlass at import, so it is imported only after runtime.import_cutlass(arch). Its
compile checks run under torch's FakeTensorMode with FLASH_ATTENTION_ARCH set, as FA4 supports for CPU hosts.
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.arch import SUPPORTED_ARCHS, ArchError, ArchNotImplemented
from nmoe.fast.limits import VEC_BYTES
from nmoe.fast.norm import rmsnorm
from nmoe.fast.op import Kernel, fast_op
from nmoe.fast.rope import apply_rope, rope_inplace
from nmoe.fast.runtime import KernelSpec, vector_aligned
from nmoe.layout import MLAParams, check_mla_params

# The backward accumulates dq in a fixed order (FA4's semaphore path): training resumes bitwise.
DETERMINISTIC = True
# Head dims FA4 4.0.0b36 runs per arch (its _validate_head_dims): sm_90a any multiple of 8 in [8, 256];
# sm_100a multiples of 8 up to 128, plus DeepSeek's (192, 128) and (256, 256).
_HEAD_ALIGN = 8
_SM100_EXTRA = ((192, 128), (256, 256))
# SM counts FA4 sizes its schedule for when compiled without a GPU (H100/H200, B200).
_CHECK_SMS = {"sm_90a": 132, "sm_100a": 148}


def check_head_dims(arch: str, d_qk: int, d_v: int) -> None:
    """Refuse head dims FA4 has no kernel for on `arch`, naming the ones it has."""
    aligned = d_qk % _HEAD_ALIGN == 0 and d_v % _HEAD_ALIGN == 0
    if arch == "sm_90a":
        ok = aligned and 8 <= d_qk <= 256 and 8 <= d_v <= 256
        have = "multiples of 8 in [8, 256]"
    else:
        ok = aligned and ((8 <= d_qk <= 128 and 8 <= d_v <= 128) or (d_qk, d_v) in _SM100_EXTRA)
        have = "multiples of 8 up to 128, or (192, 128), or (256, 256)"
    if not ok:
        raise ArchNotImplemented(
            f"mla_attention: flash-attn-4 has no {arch} kernel for q/k head dim {d_qk} "
            f"(= qk_nope_head_dim + qk_rope_head_dim) and v head dim {d_v}; it runs {have}. Pick such head "
            "dims in the model config, or use nmoe.reference.attention"
        )


def flash_interface(arch: str) -> ModuleType:
    """flash_attn.cute.interface, imported after cutlass is fixed to `arch`."""
    runtime.import_cutlass(arch)
    import flash_attn.cute.interface as fa

    module: ModuleType = fa
    return module


def causal_attention(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float) -> Tensor:
    """softmax(q k^T * scale, causal) v over [B, S, H, D] bf16 through FA4: fp32 scores and softmax in
    registers, bf16 probabilities into the PV product, bf16 out; differentiable."""
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3] or \
            {q.dtype, k.dtype, v.dtype} != {torch.bfloat16}:
        got = ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in (q, k, v))
        raise ValueError(f"causal_attention: takes bf16 q, k [B, S, H, D_qk] and v [B, S, H, D_v], got {got}")
    _, arch = runtime.device_arch(q, k, v)
    check_head_dims(arch, q.shape[-1], v.shape[-1])
    o: Tensor = _Causal.apply(q, k, v, softmax_scale, flash_interface(arch))  # type: ignore[no-untyped-call]
    return o


def _fa4_fwd(fa: ModuleType, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """FA4's causal forward: the bf16 output and the fp32 row logsumexp its backward takes."""
    out, lse, *_ = fa._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
    return out, lse


def _fa4_bwd(fa: ModuleType, q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, lse: Tensor,
             scale: float, dv: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """FA4's causal backward: (dq, dk, dv), dq and dk new tensors the caller owns; dv written into `dv`
    (any view of v's shape with unit last stride) when given."""
    dq, dk, dv_ = fa._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=True,
                                     deterministic=DETERMINISTIC, dv=dv)
    return dq, dk, dv_


class _Causal(torch.autograd.Function):
    """FA4's causal forward and backward as one autograd node, with none of FA4's other options."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, scale: float, fa: ModuleType) -> Tensor:
        out, lse = _fa4_fwd(fa, q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.fa = scale, fa
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        return (*_fa4_bwd(ctx.fa, q, k, v, out, dout, lse, ctx.scale), None, None)


def mla_attention(
    x: Tensor,
    p: MLAParams,
    cos: Tensor,
    sin: Tensor,
    n_heads: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    softmax_scale: float,
    norm_eps: float,
) -> Tensor:
    """Causal MLA over bf16 x [B, S, dim] -> [B, S, dim]; cos/sin fp32 [>=S, rope/2] from yarn_cos_sin.

    Every intermediate is bf16 (projections accumulate in fp32); differentiable in x and every weight.
    """
    if x.dim() != 3 or x.dtype != torch.bfloat16:
        raise ValueError(f"mla_attention: fast path takes bf16 x [B, S, dim], got {x.dtype} "
                         f"{tuple(x.shape)}; cast x to bf16, or use nmoe.reference.attention")
    if min(n_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim) < 1 or qk_rope_head_dim % 2:
        raise ValueError(
            f"mla_attention: n_heads={n_heads}, qk_nope_head_dim={qk_nope_head_dim}, "
            f"qk_rope_head_dim={qk_rope_head_dim}, v_head_dim={v_head_dim} must be >= 1 (rope dim even)"
        )
    b, s, dim = x.shape
    dn, dr, dv, h = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, n_heads
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] < s or cos.shape[1] != dr // 2:
        raise ValueError(
            f"mla_attention: cos/sin shapes {tuple(cos.shape)}/{tuple(sin.shape)} must be "
            f"[>= {s}, {dr // 2}]; build them with nmoe.yarn.yarn_cos_sin(max_seq_len, "
            "qk_rope_head_dim, ...)"
        )
    check_mla_params(p, dim, h, dn, dr, dv)
    _, arch = runtime.device_arch(x, cos, sin)
    check_head_dims(arch, dn + dr, dv)
    if x.numel() == 0:
        return x.new_zeros(x.shape)

    def lin(t: Tensor, w: Tensor) -> Tensor:
        return F.linear(t, w.to(x.dtype))

    cos_s, sin_s = cos[:s], sin[:s]
    wq = p.wq if p.wq is not None else p.wq_a
    assert wq is not None
    q, kv_a = _SharedInput.apply(x, wq.to(x.dtype), p.wkv_a.to(x.dtype))  # type: ignore[no-untyped-call]
    if p.wq is None:
        assert p.q_norm is not None and p.wq_b is not None
        q = lin(rmsnorm(q, p.q_norm, norm_eps), p.wq_b)
    c_kv, k_pe = torch.split(kv_a, [int(p.kv_norm.shape[0]), dr], dim=-1)
    k_pe = apply_rope(k_pe, cos_s, sin_s)
    kv = lin(rmsnorm(c_kv, p.kv_norm, norm_eps), p.wkv_b).view(b, s, h, dn + dv)
    o, _ = _MLACore.apply(q, kv, k_pe, cos_s.unsqueeze(1), sin_s.unsqueeze(1), dn,  # type: ignore[no-untyped-call]
                          softmax_scale, flash_interface(arch))
    return lin(o.reshape(b, s, h * dv), p.wo)


class _SharedInput(torch.autograd.Function):
    """(x @ w1^T, x @ w2^T), MLA's two projections of x: the backward adds the second dx in its GEMM's
    epilogue (addmm, beta 1) onto the first, where autograd adds two dx tensors in a kernel of its own."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w1: Tensor, w2: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(x, w1, w2)
        return F.linear(x, w1), F.linear(x, w2)

    @staticmethod
    def backward(ctx: Any, d1: Tensor, d2: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, w1, w2 = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])
        g1, g2 = d1.reshape(-1, d1.shape[-1]), d2.reshape(-1, d2.shape[-1])
        dx = dw1 = dw2 = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(g1, w1).addmm_(g2, w2).view(x.shape)
        if ctx.needs_input_grad[1]:
            dw1 = g1.T @ rows
        if ctx.needs_input_grad[2]:
            dw2 = g2.T @ rows
        return dx, dw1, dw2


MLA_K = Kernel.by_name("nmoe.fast.kernels.mla", "mla_k")
MLA_KV_GRAD = Kernel.by_name("nmoe.fast.kernels.mla", "mla_kv_grad")


def _mla_dims(kv: tuple[int, ...], k_pe: tuple[int, ...], dn: int) -> dict[str, int]:
    """(h, dn, dr, dv) of shapes kv [B, S, H, dn + dv] and k_pe [B, S, dr], each width whole 16-byte
    vectors; checked before anything is allocated or launched."""
    dims = {"h": kv[2], "dn": dn, "dr": k_pe[-1], "dv": kv[-1] - dn} if len(kv) == 4 and k_pe else {}
    if not dims or k_pe != (*kv[:2], dims["dr"]) or min(dims.values()) < 1 or \
            any(v % (VEC_BYTES // 2) for v in (dn, dims["dr"], dims["dv"])):
        raise ValueError(f"mla k assembly: kv {kv} [B, S, H, dn + dv], k_pe {k_pe} [B, S, dr], dn {dn}: head "
                         f"dims must be positive multiples of {VEC_BYTES // 2} (whole 16-byte vectors)")
    return dims


def _mla_k_impl(kv: Tensor, k_pe: Tensor, dn: int) -> Tensor:
    dims = _mla_dims(tuple(kv.shape), tuple(k_pe.shape), dn)
    device, arch = runtime.device_arch(kv, k_pe)
    b, s, h, _ = kv.shape
    k = torch.empty((b, s, h, dn + dims["dr"]), dtype=kv.dtype, device=kv.device)
    if k.numel():
        kvc, pec = vector_aligned(kv, VEC_BYTES), vector_aligned(k_pe, VEC_BYTES)
        MLA_K.launcher(arch, **dims)(device, kvc.data_ptr(), pec.data_ptr(), k.data_ptr(), b * s * h)
    return k


def _mla_k_fake(kv: Tensor, k_pe: Tensor, dn: int) -> Tensor:
    return kv.new_empty((*kv.shape[:3], dn + k_pe.shape[-1]))


def _mla_kv_grad_impl(dk: Tensor, dkv: Tensor, dn: int) -> Tensor:
    if dk.dim() != 4 or dkv.dim() != 4 or dkv.shape[:3] != dk.shape[:3]:
        raise ValueError(f"mla_kv_grad: dk {tuple(dk.shape)} and dkv {tuple(dkv.shape)} must be [B, S, H, D] "
                         "sharing [B, S, H]")
    b, s, h, width = dk.shape
    dims = _mla_dims(tuple(dkv.shape), (b, s, width - dn), dn)
    if not dkv.is_contiguous() or dkv.data_ptr() % VEC_BYTES or dkv.dtype != dk.dtype:
        raise ValueError(f"mla_kv_grad: dkv is written in place, so it must be contiguous, {VEC_BYTES}-byte "
                         f"aligned and of dk's dtype {dk.dtype} (got {dkv.dtype}, strides {dkv.stride()})")
    device, arch = runtime.device_arch(dk, dkv)
    dk_pe = torch.empty((b, s, dims["dr"]), dtype=dk.dtype, device=dk.device)
    if dkv.numel():
        MLA_KV_GRAD.launcher(arch, **dims)(device, vector_aligned(dk, VEC_BYTES).data_ptr(), dkv.data_ptr(),
                                           dk_pe.data_ptr(), b * s * h)
    return dk_pe


def _mla_kv_grad_fake(dk: Tensor, dkv: Tensor, dn: int) -> Tensor:
    return dk.new_empty((*dk.shape[:2], dk.shape[-1] - dn))


_mla_k_op = fast_op("mla_k", _mla_k_impl, _mla_k_fake)
_mla_kv_grad_op = fast_op("mla_kv_grad", _mla_kv_grad_impl, _mla_kv_grad_fake, mutates=("dkv",))


def mla_k(kv: Tensor, k_pe: Tensor, dn: int) -> Tensor:
    """MLA's key [B, S, H, dn + dr]: each head's kv[..., :dn] beside the shared rope key k_pe [B, S, dr]."""
    return _mla_k_op(kv, k_pe, dn)


def mla_kv_grad(dk: Tensor, dkv: Tensor, dn: int) -> Tensor:
    """The gradients of mla_k's inputs: dk[..., :dn] into dkv[..., :dn] (its v part, v's gradient, left as
    it is), and dk_pe, returned: the sum over heads of dk[..., dn:], in fp32 in head order, rounded once."""
    return _mla_kv_grad_op(dk, dkv, dn)


class _MLACore(torch.autograd.Function):
    """Causal attention of q (the [B, S, H * (dn + dr)] projection, its rope parts rotated where they lie),
    k (mla_k) and v (a view of kv), with no copy of q. FA4 is called directly, so its dq is this node's to
    rotate back in place; FA4 writes dv into dkv's v columns and one pass fills the rest (mla_kv_grad)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, kv: Tensor, k_pe: Tensor, cos: Tensor, sin: Tensor, dn: int,
                scale: float, fa: ModuleType) -> tuple[Tensor, Tensor]:
        b, s, h, _ = kv.shape
        q4 = q.view(b, s, h, -1)
        rope_inplace(q4[..., dn:], cos, sin)
        ctx.mark_dirty(q)
        k = mla_k(kv, k_pe, dn)
        out, lse = _fa4_fwd(fa, q4, k, kv[..., dn:], scale)
        ctx.save_for_backward(q, k, kv, out, lse, cos, sin)
        ctx.dn, ctx.scale, ctx.fa = dn, scale, fa
        ctx.set_materialize_grads(False)
        return out, q

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dq_rotated: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, kv, out, lse, cos, sin = ctx.saved_tensors
        dn = ctx.dn
        b, s, h, _ = kv.shape
        dkv = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
        dq, dk, _ = _fa4_bwd(ctx.fa, q.view(b, s, h, -1), k, kv[..., dn:], out,
                             torch.zeros_like(out) if dout is None else dout, lse, ctx.scale, dkv[..., dn:])
        if dq_rotated is not None:
            dq.add_(dq_rotated.view(dq.shape))
        rope_inplace(dq[..., dn:], cos, sin, inverse=True)
        dk_pe = mla_kv_grad(dk, dkv, dn)
        return dq.view(q.shape), dkv, dk_pe, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------
# Compile checks: FA4 compiled for one arch on a host without a GPU, its PTX kept.
# ---------------------------------------------------------------------------------------------------


def _fake_semaphore(x: Tensor, leading_dim: int, alignment: int = 16, static_modes: Any = None,
                    stride_order: Any = None) -> Any:
    """FA4's semaphore conversion (utils.convert_from_dlpack_leading_static) through the TVM-FFI DLPack
    path, the one its other tensors take: the plain path asks CUDA for a fake tensor's device."""
    from cutlass.cute.runtime import from_dlpack

    order = x.dim_order() if stride_order is None else stride_order
    t = from_dlpack(x, assumed_align=alignment, enable_tvm_ffi=True)
    for i in range(x.ndim):
        if i != leading_dim and (static_modes is None or i not in static_modes):
            t = t.mark_compact_shape_dynamic(mode=i, stride_order=order)
    return t


@contextmanager
def _fa4_compile_hooks(fa: ModuleType, directory: str) -> Iterator[None]:
    """FA4 calls cute.compile itself: add --keep-ptx to those calls, and let its deterministic backward's
    semaphores convert on fake tensors, for the duration of a compile check."""
    import cutlass.cute as cute

    original, convert = cute.compile, fa.utils.convert_from_dlpack_leading_static

    def compile_keep(*args: Any, options: str = "", **kwargs: Any) -> Any:
        return original(*args, options=f"{options} --keep-ptx --dump-dir={directory}".strip(), **kwargs)

    cute.compile = compile_keep  # type: ignore[assignment]
    fa.utils.convert_from_dlpack_leading_static = _fake_semaphore
    try:
        yield
    finally:
        cute.compile = original
        fa.utils.convert_from_dlpack_leading_static = convert


def _fa4_target(arch: str) -> None:
    """Point FA4's kernel choice at `arch` on a host whose GPU (if any) is not the target."""
    preset = os.environ.get("FLASH_ATTENTION_ARCH")
    if preset not in (None, arch):
        raise ArchError(f"FLASH_ATTENTION_ARCH={preset} but {arch} was requested; compile in a fresh process")
    os.environ["FLASH_ATTENTION_ARCH"] = arch
    os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", str(_CHECK_SMS[arch]))
    fa = flash_interface(arch)
    if fa._get_device_arch() != int(arch[3:-1]):
        raise ArchError(f"flash-attn-4 in this process already targets sm_{fa._get_device_arch()}; "
                        f"compile {arch} in a fresh process (python -m nmoe.fast.compilecheck --arch {arch})")


def fa4_ptx(stage: str, d_qk: int, d_v: int, arch: str) -> str:
    """PTX of FA4's causal bf16 forward (stage 'fwd') or its backward kernels ('bwd'), compiled on fake
    tensors (no GPU, no memory) exactly as the autograd nodes call them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _fa4_target(arch)
    fa = flash_interface(arch)
    for stage_fn in (fa._flash_attn_fwd, fa._flash_attn_bwd, fa._bwd_preprocess, fa._bwd_postprocess_convert):
        stage_fn.compile_cache.clear()  # a cached kernel would be reused without writing its PTX
    scale = d_qk**-0.5
    with tempfile.TemporaryDirectory(prefix="nmoe-fa4-") as d, _fa4_compile_hooks(fa, d), FakeTensorMode():
        def t(dim: int) -> Tensor:
            return torch.empty(2, 256, 4, dim, dtype=torch.bfloat16, device="cuda")

        q, k, v = t(d_qk), t(d_qk), t(d_v)
        out, lse = _fa4_fwd(fa, q, k, v, scale)
        if stage == "bwd":
            _fa4_bwd(fa, q, k, v, out, torch.empty_like(out), lse, scale)
        paths = sorted(glob.glob(os.path.join(d, "*.ptx")))
        want = "Backward" if stage == "bwd" else "Forward"
        ptx = [Path(p).read_text() for p in paths if want in Path(p).name]
    if not ptx:
        raise RuntimeError(f"flash-attn-4 wrote no {stage} PTX for {arch} (an FA4 compile cache hit? unset "
                           "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED)")
    return "\n".join(ptx)


def _no_build(kernels: ModuleType, **spec: Any) -> tuple[Any, tuple[Any, ...]]:
    raise TypeError("flash-attn-4 builds and launches its own kernels (_fa4_fwd, _fa4_bwd); only ptx() "
                    "applies")


@dataclass(frozen=True)
class FA4Kernel(Kernel):
    """FA4's kernels of one stage as a Kernel: FA4 compiles them itself, so ptx() runs that compile; the
    module is this glue, whose import graph holds every nmoe source the op runs."""

    def ptx(self, arch: str, **spec: Any) -> str:
        return fa4_ptx(spec["stage"], spec["d_qk"], spec["d_v"], arch)


FA4 = FA4Kernel("nmoe.fast.attention", "fa4", _no_build)


# Hopper runs warpgroup MMAs, Blackwell tcgen05 MMAs, both fed by TMA; a spill would be local memory.
_MMA = {"sm_90a": (r"\bwgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16\b",),
        "sm_100a": (r"\btcgen05\.mma\.cta_group::[12]\.kind::f16\b",)}
_TMA = r"\bcp\.async\.bulk\.tensor\.4d\b"
_FORBID = (r"\b(ld|st)\.local\b",)


def _fa4_spec(stage: str, d_qk: int, d_v: int) -> KernelSpec:
    return KernelSpec(
        op="mla_attention", name=f"fa4_{stage}_d{d_qk}_{d_v}",
        compile=FA4.compiler(stage=stage, d_qk=d_qk, d_v=d_v),
        expect={a: (rf"\.target {a}\b", _TMA, *_MMA[a]) for a in SUPPORTED_ARCHS},
        forbid={a: _FORBID for a in SUPPORTED_ARCHS}, launched_here=False,
    )


# The assembly kernels move 16-byte vectors (and the head sum rounds fp32 to bf16 once); MLA's head dims.
_MLA_DIMS = {"h": 16, "dn": 128, "dr": 64, "dv": 128}
_MLA_SPECS = tuple(
    runtime.portable_spec("mla_attention", f"{kernel.name}_h16_128_64_128", kernel.compiler(**_MLA_DIMS),
                          (runtime.LD128, runtime.ST128, *extra), _FORBID)
    for kernel, extra in ((MLA_K, ()),
                          (MLA_KV_GRAD, (r"\badd\.(rn\.)?f32(x2)?\b", r"\bcvt\.rn\.bf16(x2)?\.f32\b")))
)
KERNELS: tuple[KernelSpec, ...] = (_fa4_spec("fwd", 192, 128), _fa4_spec("bwd", 192, 128), *_MLA_SPECS)
