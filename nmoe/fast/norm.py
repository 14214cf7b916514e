"""Fast rmsnorm fwd/bwd: CuTeDSL kernels (nmoe/fast/kernels/norm.py) behind torch custom ops.

nmoe::rmsnorm carries autograd (bwd = nmoe::rmsnorm_bwd). Kernels are specialised per (D, dtypes, vector
width): one CTA per row with the row in registers; dw is summed per CTA, then over CTAs in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nmoe.fast import runtime
from nmoe.fast.limits import VEC_BYTES
from nmoe.fast.op import Kernel, fast_op, save_inputs
from nmoe.fast.runtime import KernelSpec, vector_aligned

RMSNORM_FWD = Kernel.by_name("nmoe.fast.kernels.norm", "rmsnorm_fwd")
RMSNORM_BWD = Kernel.by_name("nmoe.fast.kernels.norm", "rmsnorm_bwd")
RMSNORM_DW = Kernel.by_name("nmoe.fast.kernels.norm", "rmsnorm_dw")
ADD_RMSNORM_FWD = Kernel.by_name("nmoe.fast.kernels.norm", "add_rmsnorm_fwd")
ADD_RMSNORM_BWD = Kernel.by_name("nmoe.fast.kernels.norm", "add_rmsnorm_bwd")
_DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bfloat16", torch.float16: "float16",
                                        torch.float32: "float32"}
_MAX_THREADS = 1024
_TARGET_THREADS = 256
BWD_TARGET_THREADS = 1024
_MAX_REGS_PER_ROW = 64  # fp32 values of one row a thread may hold before it would spill
_BWD_THREADS_PER_SM = 1024
_DW_VEC = 4


@dataclass(frozen=True)
class RowPlan:
    """How one row of width d maps onto a CTA: `threads` lanes each holding `nper` vectors of `vec`."""

    d: int
    vec: int
    nper: int
    threads: int


def plan_row(d: int, vec: int, target_threads: int = _TARGET_THREADS) -> RowPlan:
    """Fewest vectors per thread that keeps the CTA at <= target_threads lanes (<= 1024 for wide rows).
    The bwd targets 1024: it holds three row-sized arrays per thread, and fewer lanes would spill."""
    nv = d // vec
    nper = -(-nv // target_threads)
    if nper * vec > 32:
        nper = -(-nv // _MAX_THREADS)
    if nper * vec > _MAX_REGS_PER_ROW:
        raise ValueError(f"rmsnorm: D={d} needs {nper * vec} fp32 registers per thread "
                         f"(> {_MAX_REGS_PER_ROW}) in the fast kernel; use nmoe.reference.norm for "
                         "such wide rows")
    threads = -(-nv // nper)
    return RowPlan(d, vec, nper, -(-threads // 32) * 32)


def bwd_ctas_per_sm(threads: int) -> int:
    """Resident bwd CTAs per SM the grid is sized for; the kernel is compiled to fit that many."""
    return max(1, _BWD_THREADS_PER_SM // threads)


def _check(x: Tensor, w: Tensor, eps: float) -> None:
    if x.dim() < 1 or w.shape != (x.shape[-1],):
        raise ValueError(
            f"rmsnorm: weight shape {tuple(w.shape)} must be ({x.shape[-1] if x.dim() else '?'},), "
            f"the last dim of x {tuple(x.shape)}; pass a 1-D weight of the normalised width"
        )
    if not eps >= 0.0:
        raise ValueError(f"rmsnorm: eps={eps} must be >= 0; pass the model's norm_eps (e.g. 1e-6)")
    for name, t in (("x", x), ("w", w)):
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"rmsnorm: fast kernels take fp32/bf16/fp16 {name}, got {t.dtype}; cast it, "
                             "or use nmoe.reference.norm")


def _spec(x: Tensor, w: Tensor, target_threads: int = _TARGET_THREADS) -> tuple[dict[str, Any], RowPlan]:
    d = x.shape[-1]
    vec = VEC_BYTES // x.element_size()
    plan = plan_row(d, vec if d % vec == 0 else 1, target_threads)
    return ({"d": d, "vec": plan.vec, "nper": plan.nper, "threads": plan.threads,
             "x_dtype": _DTYPE_NAMES[x.dtype], "w_dtype": _DTYPE_NAMES[w.dtype]}, plan)


def _ptrs(*tensors: Tensor) -> list[int]:
    return [t.data_ptr() for t in tensors]


def row_pitch(x: Tensor, vec: int) -> int:
    """Elements between x's rows when they lie at one pitch, unit-stride and vector-aligned (a last-dim
    slice such as MLA's c_kv in [.., 576]), so the kernel reads them in place; 0 when x must be copied."""
    d = x.shape[-1]
    if x.dim() < 2 or x.is_contiguous() or x.stride(-1) != 1 or x.numel() == 0:
        return 0
    pitch, span = x.stride(-2), x.stride(-2) * x.shape[-2]
    for i in range(x.dim() - 3, -1, -1):
        if x.shape[i] != 1 and x.stride(i) != span:
            return 0
        span *= x.shape[i]
    if pitch < d or pitch % vec or x.data_ptr() % (vec * x.element_size()):
        return 0
    return pitch


def _x_rows(x: Tensor, spec: dict[str, Any], align: int) -> Tensor:
    """x as the plain kernels read it: in place at its row pitch (spec["pitch"] set), else a copy."""
    pitch = row_pitch(x, spec["vec"])
    if pitch:
        spec["pitch"] = pitch
        return x
    return vector_aligned(x, align)


def _rmsnorm_impl(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return _fwd(x, None, w, eps)[1]


def _check_branch(name: str, a: Tensor, x: Tensor) -> None:
    if a.shape != x.shape or a.dtype != x.dtype:
        raise ValueError(f"{name}: {a.dtype} {tuple(a.shape)} must match the stream's {x.dtype} "
                         f"{tuple(x.shape)}; cast or reshape the residual branch")


def _fwd(x: Tensor, a: Tensor | None, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(s, y): y = rmsnorm(s), s = x, or with a the stream x + a rounded once (written by the kernel)."""
    _check(x, w, eps)
    if a is not None:
        _check_branch("add_rmsnorm: a", a, x)
    device, arch = runtime.device_arch(*(t for t in (x, a, w) if t is not None))
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = x if a is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return s, y
    spec, plan = _spec(x, w)
    align = plan.vec * x.element_size()
    xc = vector_aligned(x, align) if a is not None else _x_rows(x, spec, align)
    wc = vector_aligned(w, min(VEC_BYTES, plan.vec * w.element_size()))
    rows = x.numel() // plan.d
    if a is None:
        RMSNORM_FWD.launcher(arch, **spec)(device, *_ptrs(xc, wc, y), rows, eps)
    else:
        ac = vector_aligned(a, align)
        ADD_RMSNORM_FWD.launcher(arch, **spec)(device, *_ptrs(xc, ac, wc, s, y), rows, eps)
    return s, y


def _rmsnorm_fake(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _rmsnorm_bwd_impl(dy: Tensor, x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _bwd(dy, None, x, w, eps)


def _bwd(dy: Tensor, ds: Tensor | None, x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(dx, dw) of rmsnorm at x; with ds (add_rmsnorm's stream gradient) dx = ds + dx, each rounded."""
    _check(x, w, eps)
    if dy.shape != x.shape:
        raise ValueError(f"rmsnorm_bwd: dy shape {tuple(dy.shape)} must equal x shape {tuple(x.shape)}")
    if dy.dtype != x.dtype:
        raise ValueError(f"rmsnorm_bwd: dy is {dy.dtype} but x is {x.dtype}; cast dy to x's dtype")
    if ds is not None:
        _check_branch("add_rmsnorm_bwd: ds", ds, x)
    device, arch = runtime.device_arch(dy, x, w)
    d = x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dw = torch.zeros(w.shape, dtype=w.dtype, device=w.device)
    rows = x.numel() // d if d else 0
    if rows == 0:
        return dx, dw
    spec, plan = _spec(x, w, BWD_TARGET_THREADS)
    spec["ctas_per_sm"] = bwd_ctas_per_sm(plan.threads)
    align = plan.vec * x.element_size()
    xc = vector_aligned(x, align) if ds is not None else _x_rows(x, spec, align)
    dyc = vector_aligned(dy, align)
    wc = vector_aligned(w, min(VEC_BYTES, plan.vec * w.element_size()))
    ctas = min(rows, runtime.sm_count(device) * spec["ctas_per_sm"])
    parts = torch.empty((ctas, d), dtype=torch.float32, device=x.device)
    if ds is None:
        RMSNORM_BWD.launcher(arch, **spec)(device, *_ptrs(dyc, xc, wc, dx, parts), rows, eps, ctas)
    else:
        dsc = vector_aligned(ds, align)
        ADD_RMSNORM_BWD.launcher(arch, **spec)(device, *_ptrs(dyc, dsc, xc, wc, dx, parts), rows, eps, ctas)
    dw_vec = _DW_VEC if d % _DW_VEC == 0 else 1
    RMSNORM_DW.launcher(arch, vec=dw_vec, w_dtype=spec["w_dtype"])(device, *_ptrs(parts, dw), ctas, d)
    return dx, dw


def _rmsnorm_bwd_fake(dy: Tensor, x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(w.shape, dtype=w.dtype, device=w.device))


_rmsnorm_op = fast_op("rmsnorm", _rmsnorm_impl, _rmsnorm_fake)
_rmsnorm_bwd_op = fast_op("rmsnorm_bwd", _rmsnorm_bwd_impl, _rmsnorm_bwd_fake)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    x, w = ctx.saved_tensors
    dx, dw = _rmsnorm_bwd_op(grad.to(x.dtype), x, w, ctx.inputs[2])
    return dx, dw, None


_rmsnorm_op.autograd(_backward, save_inputs(0, 1))


def rmsnorm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """y = x * (1/sqrt(mean(x^2) + eps)) * w in fp32, one rounding to x.dtype; differentiable."""
    return _rmsnorm_op(x, w, eps)


def rmsnorm_bwd(dy: Tensor, x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(dx, dw): dx = r*(g - x*r^2*mean(g*x)), g = dy*w, rounded to x.dtype; dw = sum_rows dy*x*r."""
    return _rmsnorm_bwd_op(dy, x, w, eps)


def _add_impl(h: Tensor, a: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _fwd(h, a, w, eps)


def _add_fake(h: Tensor, a: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(h), torch.empty_like(h)


def _add_bwd_impl(ds: Tensor, dy: Tensor, s: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _bwd(dy, ds, s, w, eps)


def _add_bwd_fake(ds: Tensor, dy: Tensor, s: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(s), torch.empty(w.shape, dtype=w.dtype, device=w.device)


_add_op = fast_op("add_rmsnorm", _add_impl, _add_fake)
_add_bwd_op = fast_op("add_rmsnorm_bwd", _add_bwd_impl, _add_bwd_fake)


def _add_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    ctx.save_for_backward(output[0], inputs[2])
    ctx.eps = inputs[3]


def _add_backward(ctx: Any, ds: Tensor | None, dy: Tensor | None) -> tuple[Tensor, Tensor, Tensor, None]:
    s, w = ctx.saved_tensors
    ds = torch.zeros_like(s) if ds is None else ds
    dy = torch.zeros_like(s) if dy is None else dy
    dh, dw = _add_bwd_op(ds, dy, s, w, ctx.eps)
    return dh, dh, dw, None


_add_op.autograd(_add_backward, _add_setup)


def add_rmsnorm(h: Tensor, a: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(s, y): the stream s = h + a rounded once, and y = rmsnorm(s), in one pass over the rows;
    differentiable (dh = da = ds + the norm's dx, one kernel)."""
    return _add_op(h, a, w, eps)


def add_rmsnorm_bwd(ds: Tensor, dy: Tensor, s: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(dh, dw) of add_rmsnorm at its stream s: dh = ds + dx, dx rounded to s's dtype first; dw as
    rmsnorm_bwd's."""
    return _add_bwd_op(ds, dy, s, w, eps)


# rsqrt.approx / sqrt.approx / div.approx / div.full are not correctly rounded (r must be 1/sqrt.rn);
# ftz would zero subnormal x (the spec scales them up by r); local memory means the row spilled.
_FORBID = (r"\b(rsqrt|sqrt|rcp|div|ex2|lg2)\.approx\b", r"\bdiv\.full\b", r"\.ftz\b", r"\b(ld|st)\.local\b")
_ROW = (runtime.LD128, runtime.ST128, r"\bshfl\.sync\.bfly\.b32\b", r"\bbar\.sync\b", r"\bsqrt\.rn\.f32\b",
        r"\bdiv\.rn\.f32\b", r"\bmul\.rn\.f32\b")
_BF16_OUT = r"\bcvt\.rn\.bf16x2\.f32\b"
# MLA's c_kv: 512 of each 576-wide row, read in place; a load narrower than 16 bytes means the pitch cost
# the vector width.
_NARROW_LOAD = r"\bld\.global(\.[a-z]+)*\.(b|u|s|f)(8|16|32|64)\b"
# (D, x dtype, w dtype) of the compile checks: the benchmark widths, DeepSeek-V3's 7168, a ragged width.
_CHECKED = ((4096, "bfloat16", "bfloat16"), (1536, "bfloat16", "float32"), (7168, "bfloat16", "bfloat16"),
            (4096, "float32", "float32"))


def _row_spec(d: int, x_dtype: str, w_dtype: str, target_threads: int = _TARGET_THREADS) -> dict[str, Any]:
    vec = VEC_BYTES // {"bfloat16": 2, "float16": 2, "float32": 4}[x_dtype]
    plan = plan_row(d, vec if d % vec == 0 else 1, target_threads)
    return {"d": d, "vec": plan.vec, "nper": plan.nper, "threads": plan.threads, "x_dtype": x_dtype,
            "w_dtype": w_dtype}


def _norm_spec(op: str, name: str, kernel: Kernel, spec: dict[str, Any],
               expect: tuple[str, ...], forbid: tuple[str, ...] = ()) -> KernelSpec:
    return runtime.portable_spec(op, name, kernel.compiler(**spec), expect, (*_FORBID, *forbid))


def _kernel_specs() -> tuple[KernelSpec, ...]:
    out: list[KernelSpec] = []
    for d, xd, wd in _CHECKED:
        tag = f"d{d}_{xd[0]}{xd[-2:]}_{wd[0]}{wd[-2:]}"
        cvt = (_BF16_OUT,) if xd == "bfloat16" else ()
        out.append(_norm_spec("rmsnorm", f"rmsnorm_fwd_{tag}", RMSNORM_FWD, _row_spec(d, xd, wd),
                              (*_ROW, *cvt)))
        bwd = _row_spec(d, xd, wd, BWD_TARGET_THREADS)
        bwd["ctas_per_sm"] = bwd_ctas_per_sm(bwd["threads"])
        out.append(_norm_spec("rmsnorm_bwd", f"rmsnorm_bwd_{tag}", RMSNORM_BWD, bwd,
                              (*_ROW, r"\badd\.rn\.f32\b", *cvt)))
        out.append(_norm_spec("add_rmsnorm", f"add_rmsnorm_fwd_{tag}", ADD_RMSNORM_FWD, _row_spec(d, xd, wd),
                              (*_ROW, r"\badd\.rn\.f32\b", *cvt)))
        out.append(_norm_spec("add_rmsnorm_bwd", f"add_rmsnorm_bwd_{tag}", ADD_RMSNORM_BWD, bwd,
                              (*_ROW, r"\badd\.rn\.f32\b", *cvt)))
    fwd = {**_row_spec(512, "bfloat16", "bfloat16"), "pitch": 576}
    bwd = {**_row_spec(512, "bfloat16", "bfloat16", BWD_TARGET_THREADS), "pitch": 576}
    bwd["ctas_per_sm"] = bwd_ctas_per_sm(bwd["threads"])
    out.append(_norm_spec("rmsnorm", "rmsnorm_fwd_d512_pitch576", RMSNORM_FWD, fwd, (*_ROW, _BF16_OUT),
                          (_NARROW_LOAD,)))
    out.append(_norm_spec("rmsnorm_bwd", "rmsnorm_bwd_d512_pitch576", RMSNORM_BWD, bwd, (*_ROW, _BF16_OUT),
                          (_NARROW_LOAD,)))
    dw = {"vec": _DW_VEC, "w_dtype": "bfloat16"}
    out.append(_norm_spec("rmsnorm_bwd", "rmsnorm_dw_bf16", RMSNORM_DW, dw,
                          (runtime.LD128, r"\badd\.rn\.f32\b", _BF16_OUT)))
    return tuple(out)


KERNELS: tuple[KernelSpec, ...] = _kernel_specs()
