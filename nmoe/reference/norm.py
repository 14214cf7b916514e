"""RMSNorm spec: `(x * rsqrt(mean(x^2) + eps)) * w` over the last dim, rounded once to the input dtype.

Math runs in fp32 (fp64 for fp64 inputs, so gradcheck sees the exact function).
"""

import torch
from torch import Tensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _check(x: Tensor, w: Tensor, eps: float) -> None:
    if x.dim() < 1 or w.shape != (x.shape[-1],):
        raise ValueError(
            f"rmsnorm: weight shape {tuple(w.shape)} must be ({x.shape[-1] if x.dim() else '?'},), "
            f"the last dim of x {tuple(x.shape)}; pass a 1-D weight of the normalised width"
        )
    if not eps >= 0.0:
        raise ValueError(f"rmsnorm: eps={eps} must be >= 0; pass the model's norm_eps (e.g. 1e-6)")


def rmsnorm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """y = x * rsqrt(mean(x^2) + eps) * w in fp32 (fp64 for fp64 x), one rounding to x.dtype."""
    _check(x, w, eps)
    acc = _acc_dtype(x.dtype)
    xf = x.to(acc)
    r = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return (xf * r * w.to(acc)).to(x.dtype)


def rmsnorm_bwd(dy: Tensor, x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(dx, dw) of rmsnorm: dx = r*(g - x*r^2*mean(g*x)) with g = dy*w; dw = sum over rows of dy*x*r.

    fp32 internal like the forward; dx rounded once to x.dtype, dw once to w.dtype.
    """
    _check(x, w, eps)
    if dy.shape != x.shape:
        raise ValueError(f"rmsnorm_bwd: dy shape {tuple(dy.shape)} must equal x shape {tuple(x.shape)}")
    acc = _acc_dtype(torch.promote_types(x.dtype, dy.dtype))
    xf = x.to(acc)
    dyf = dy.to(acc)
    r = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    g = dyf * w.to(acc)
    dx = r * (g - xf * (r * r) * (g * xf).mean(dim=-1, keepdim=True))
    dw = (dyf * (xf * r)).reshape(-1, x.shape[-1]).sum(dim=0)
    return dx.to(x.dtype), dw.to(w.dtype)


def add_rmsnorm(h: Tensor, a: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(s, y): the residual stream s = h + a rounded once to h's dtype, and y = rmsnorm(s, w, eps); one op,
    so a fast path reads the stream once for a block's residual add and the norm that follows it."""
    if a.shape != h.shape or a.dtype != h.dtype:
        raise ValueError(f"add_rmsnorm: a is {a.dtype} {tuple(a.shape)}, h is {h.dtype} {tuple(h.shape)}; "
                         "the residual branch must match the stream's shape and dtype")
    s = h + a
    return s, rmsnorm(s, w, eps)


def add_rmsnorm_bwd(ds: Tensor, dy: Tensor, s: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(dh, dw) of add_rmsnorm: dh (= da) = ds + rmsnorm_bwd's dx, that dx rounded to s's dtype first and
    the sum rounded once more, as autograd adds the two; dw as rmsnorm_bwd's."""
    if ds.shape != s.shape or ds.dtype != s.dtype:
        raise ValueError(f"add_rmsnorm_bwd: ds is {ds.dtype} {tuple(ds.shape)}, s is {s.dtype} "
                         f"{tuple(s.shape)}; the stream's gradient must match the stream")
    dx, dw = rmsnorm_bwd(dy, s, w, eps)
    return ds + dx, dw
