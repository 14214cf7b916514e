"""nmoe.fast.attention (MLA through flash-attn-4): glue and FA4 compile checks on CPU; on the GPU, outputs
and gradients against a float64 MLA written here (independent of the spec), within twice the error of the
same math in bf16 torch ops plus one bf16 ULP of the max (the parity contract), and each catalogued
mutant's formula shown to differ from the correct one by far more than that."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fastcompile import assert_rows_ok, compile_rows
from torch import Tensor

from nmoe.fast import FAST_MODULES
from nmoe.fast import attention as fast_attn
from nmoe.fast.arch import SUPPORTED_ARCHS, ArchError, ArchNotImplemented
from nmoe.fast.attention import KERNELS, check_head_dims, mla_attention
from nmoe.layout import MLAParams
from nmoe.reference import attention as spec_attn
from nmoe.yarn import mla_softmax_scale, yarn_cos_sin

F64 = torch.float64


# ---------------------------------------------------------------------------------------------------
# The float64 MLA, with the knobs the mutants turn.
# ---------------------------------------------------------------------------------------------------


def _rot(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    t0, t1 = t[..., 0::2], t[..., 1::2]
    return torch.stack((t0 * cos - t1 * sin, t0 * sin + t1 * cos), -1).flatten(-2)


def mla64(x: Tensor, p: MLAParams, cos: Tensor, sin: Tensor, h: int, dn: int, dr: int, dv: int,
          scale: float, eps: float, future: int = 0, rope_on: str = "pe", k_rope: bool = True,
          lowprec: torch.dtype = F64) -> Tensor:
    """MLA with every op in `lowprec` (float64: the oracle; bf16: the baseline the contract scales)."""
    b, s, _ = x.shape
    c_, s_ = cos[:s].to(lowprec), sin[:s].to(lowprec)

    def lin(t: Tensor, w: Tensor | None) -> Tensor:
        assert w is not None
        return t @ w.to(lowprec).T

    def rms(t: Tensor, w: Tensor | None) -> Tensor:
        assert w is not None
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.to(lowprec)

    xf = x.to(lowprec)
    q = lin(xf, p.wq) if p.wq is not None else lin(rms(lin(xf, p.wq_a), p.q_norm), p.wq_b)
    q = q.view(b, s, h, dn + dr).transpose(1, 2)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    q_pe = _rot(q[..., :dr] if rope_on == "nope" else q_pe, c_, s_)
    c_kv, k_pe = torch.split(lin(xf, p.wkv_a), [p.kv_norm.shape[0], dr], dim=-1)
    k_pe = _rot(k_pe, c_, s_) if k_rope else k_pe
    kv = lin(rms(c_kv, p.kv_norm), p.wkv_b).view(b, s, h, dn + dv).transpose(1, 2)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    scores = (q_nope @ k_nope.mT + q_pe @ k_pe.unsqueeze(1).mT) * scale
    masked = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1 + future)
    probs = torch.softmax(scores.masked_fill(masked, -math.inf), dim=-1)
    o = (probs @ v).transpose(1, 2).reshape(b, s, h * dv)
    return lin(o, p.wo)


def make(b: int, s: int, dim: int, h: int, dn: int, dr: int, dv: int, q_lora: int, kv_lora: int,
         seed: int, device: str = "cpu") -> tuple[Tensor, MLAParams]:
    g = torch.Generator().manual_seed(seed)

    def lin(o: int, i: int) -> Tensor:
        return (torch.randn(o, i, generator=g, dtype=F64) / math.sqrt(i)).to(torch.bfloat16).to(device)

    def norm_w(n: int) -> Tensor:
        return (1 + 0.1 * torch.randn(n, generator=g, dtype=F64)).to(torch.bfloat16).to(device)

    p = MLAParams(
        wkv_a=lin(kv_lora + dr, dim), kv_norm=norm_w(kv_lora), wkv_b=lin(h * (dn + dv), kv_lora),
        wo=lin(dim, h * dv),
        wq=lin(h * (dn + dr), dim) if q_lora == 0 else None,
        wq_a=lin(q_lora, dim) if q_lora else None, q_norm=norm_w(q_lora) if q_lora else None,
        wq_b=lin(h * (dn + dr), q_lora) if q_lora else None,
    )
    x = torch.randn(b, s, dim, generator=g, dtype=F64).to(torch.bfloat16).to(device)
    return x, p


# ---------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------


def test_attention_is_a_fast_module_with_fa4_kernels_for_both_archs() -> None:
    assert "nmoe.fast.attention" in FAST_MODULES
    assert sorted(k.name for k in KERNELS) == ["fa4_bwd_d192_128", "fa4_fwd_d192_128", "mla_k_h16_128_64_128",
                                                "mla_kv_grad_h16_128_64_128"]
    for spec in KERNELS:
        assert spec.op == "mla_attention"
        assert set(spec.expect) == set(spec.forbid) == set(SUPPORTED_ARCHS)


@pytest.mark.heavy
@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_fa4_compiles_without_gpu(arch: str) -> None:
    """FA4 under FakeTensorMode, its PTX checked for TMA and the arch's MMA (about a minute per arch)."""
    rows = compile_rows("nmoe.fast.attention")
    assert_rows_ok(rows[arch], arch, len(KERNELS))


@pytest.mark.parametrize(("arch", "d_qk", "d_v", "ok"), [
    ("sm_90a", 192, 128, True), ("sm_100a", 192, 128, True), ("sm_90a", 160, 64, True),
    ("sm_100a", 160, 64, False), ("sm_100a", 96, 64, True), ("sm_90a", 12, 8, False),
    ("sm_90a", 264, 128, False), ("sm_100a", 256, 256, True),
])
def test_head_dims_refused_where_fa4_has_no_kernel(arch: str, d_qk: int, d_v: int, ok: bool) -> None:
    if ok:
        check_head_dims(arch, d_qk, d_v)
    else:
        with pytest.raises(ArchNotImplemented, match=r"nmoe\.reference\.attention"):
            check_head_dims(arch, d_qk, d_v)


def test_glue_refuses_bad_inputs_before_any_gpu_work() -> None:
    x, p = make(1, 8, 32, 2, 8, 8, 8, 0, 8, 0)
    cos, sin = yarn_cos_sin(16, 8, 1e4, 1.0, 16, 32.0, 1.0)
    args = (cos, sin, 2, 8, 8, 8, 0.25, 1e-6)
    with pytest.raises(ValueError, match="bf16"):
        mla_attention(x.float(), p, *args)
    with pytest.raises(ValueError, match=r"cos/sin"):
        mla_attention(x, p, cos[:4], sin[:4], *args[2:])
    with pytest.raises(ValueError, match="wo has shape"):
        mla_attention(x, MLAParams(p.wkv_a, p.kv_norm, p.wkv_b, p.wo.T, wq=p.wq), *args)
    with pytest.raises(ArchError, match=r"nmoe\.reference"):
        mla_attention(x, p, *args)


def test_causal_attention_refuses_other_dtypes_and_shapes() -> None:
    q = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 q, k"):
        fast_attn.causal_attention(q.float(), q.float(), q.float(), 0.3)
    with pytest.raises(ValueError, match="bf16 q, k"):
        fast_attn.causal_attention(q, q[:, :4], q, 0.3)


def test_mla64_is_the_spec_in_float64() -> None:
    """The test oracle's own check, on a q-LoRA and a plain-wq layer."""
    for q_lora in (0, 8):
        x, p = make(2, 9, 32, 2, 8, 8, 16, q_lora, 8, q_lora)
        cos, sin = yarn_cos_sin(32, 8, 1e4, 4.0, 16, 32.0, 1.0)
        sp = spec_attn.MLAParams(**{f: getattr(p, f) for f in p.__dataclass_fields__})
        want = spec_attn.mla_attention(x.to(F64), sp, cos, sin, 2, 8, 8, 16, 0.3, 1e-6)
        got = mla64(x, p, cos, sin, 2, 8, 8, 16, 0.3, 1e-6)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _fa4_parameters() -> dict[str, list[str]]:
    """Parameter names of FA4's _flash_attn_fwd and _flash_attn_bwd in the installed flash-attn-4, read
    from its source (importing it would import cutlass for one arch)."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("flash_attn")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "cute" / "interface.py"
    names = {node.name: [a.arg for a in node.args.args + node.args.kwonlyargs]
             for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
    return {f: names[f] for f in ("_flash_attn_fwd", "_flash_attn_bwd")}


class _FA4Stand:
    """FA4's _flash_attn_fwd and _flash_attn_bwd in float64 torch on CPU, with their parameter names and
    result shapes, so the glue's calls, layouts and gradients run without a GPU."""

    def __init__(self) -> None:
        self.names = _fa4_parameters()
        self.calls: list[dict[str, Any]] = []

    def _check(self, fn: str, positional: int, kwargs: dict[str, Any]) -> None:
        names = self.names[fn]
        unknown = set(kwargs) - set(names[positional:])
        assert not unknown and names[:3] == ["q", "k", "v"], unknown

    @staticmethod
    def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        s = q.shape[1]
        qf, kf, vf = (t.to(F64).transpose(1, 2) for t in (q, k, v))
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = torch.softmax((qf @ kf.mT * scale).masked_fill(future, -math.inf), dim=-1)
        return (probs @ vf).transpose(1, 2)

    def _flash_attn_fwd(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> tuple[Any, ...]:
        self._check("_flash_attn_fwd", 3, kwargs)
        self.calls.append({"stage": "fwd", "shapes": (q.shape, k.shape, v.shape), **kwargs})
        assert kwargs["causal"] is True and kwargs["return_lse"] is True
        out = self._attend(q, k, v, kwargs["softmax_scale"]).to(q.dtype)
        lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
        return out, lse, None, None, None

    def _flash_attn_bwd(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, lse: Tensor,
                        **kwargs: Any) -> tuple[Tensor, Tensor, Tensor]:
        self._check("_flash_attn_bwd", 6, kwargs)
        self.calls.append({"stage": "bwd", "shapes": (q.shape, k.shape, v.shape), **kwargs})
        assert kwargs["causal"] is True and out.shape == dout.shape
        leaves = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad():
            self._attend(*leaves, kwargs["softmax_scale"]).backward(dout.to(F64))
        dq, dk, dv = (t.grad.to(q.dtype) for t in leaves if t.grad is not None)
        if kwargs.get("dv") is not None:
            return dq, dk, kwargs["dv"].copy_(dv)
        return dq, dk, dv


def _stand_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    from nmoe.fast.rope import table_plan

    table_plan(x, cos, sin)
    return _rot(x.to(F64), cos.to(F64), sin.to(F64)).to(x.dtype)


def _stand_rope_inplace(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> None:
    from nmoe.fast.rope import row_pitch

    row_pitch(x)
    x.copy_(_stand_rope(x, cos, -sin if inverse else sin))


def _stand_mla_k(kv: Tensor, k_pe: Tensor, dn: int) -> Tensor:
    b, s, h, _ = kv.shape
    return torch.cat((kv[..., :dn], k_pe.unsqueeze(2).expand(b, s, h, k_pe.shape[-1])), dim=-1)


def _stand_mla_kv_grad(dk: Tensor, dkv: Tensor, dn: int) -> Tensor:
    dkv[..., :dn] = dk[..., :dn]
    return dk[..., dn:].to(F64).sum(2).to(dk.dtype)


def _stand_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_attn, "rope_inplace", _stand_rope_inplace)
    monkeypatch.setattr(fast_attn, "mla_k", _stand_mla_k)
    monkeypatch.setattr(fast_attn, "mla_kv_grad", _stand_mla_kv_grad)


def _stand_rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.to(F64)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.to(F64)).to(x.dtype)


@pytest.mark.parametrize("q_lora", [0, 16])
def test_glue_wires_rope_shared_key_fa4_call_and_every_gradient_on_cpu(monkeypatch: pytest.MonkeyPatch,
                                                                      q_lora: int) -> None:
    """The glue around the kernels (projections, rope on q's last dr columns and on the one shared key,
    nope|rope concatenation, v slice, FA4's keyword call) equals the float64 MLA when the kernels are
    float64 stand-ins, in value and in the gradient of x and every weight; each mutant is told apart."""
    fa = _FA4Stand()
    monkeypatch.setattr(fast_attn, "apply_rope", _stand_rope)
    _stand_heads(monkeypatch)
    monkeypatch.setattr(fast_attn, "rmsnorm", _stand_rms)
    monkeypatch.setattr(fast_attn, "flash_interface", lambda arch: fa)
    monkeypatch.setattr(fast_attn.runtime, "device_arch", lambda *ts: (0, "sm_90a"))
    b, s, dim, h, dn, dr, dv = 2, 6, 32, 3, 16, 8, 24
    x, p = make(b, s, dim, h, dn, dr, dv, q_lora, 8, 11 + q_lora)
    cos, sin = yarn_cos_sin(16, dr, 1e4, 4.0, 8, 32.0, 1.0)
    scale = 0.21
    dy = torch.randn(b, s, dim, generator=torch.Generator().manual_seed(2), dtype=F64)

    def run(fn: Any, dtype: torch.dtype) -> tuple[Tensor, dict[str, Tensor]]:
        leaves = {"x": x.to(dtype).clone()}
        leaves.update({f: getattr(p, f).to(dtype).clone() for f in p.__dataclass_fields__
                       if getattr(p, f) is not None})
        for t in leaves.values():
            t.requires_grad_(True)
        pp = MLAParams(**{f: leaves.get(f) for f in p.__dataclass_fields__})
        out = fn(leaves["x"], pp)
        out.backward(dy.to(out.dtype))
        return out.detach().to(F64), {k: v.grad.to(F64) for k, v in leaves.items() if v.grad is not None}

    glue, g_glue = run(lambda xx, pp: mla_attention(xx, pp, cos, sin, h, dn, dr, dv, scale, 1e-6),
                       torch.bfloat16)
    want, g_want = run(lambda xx, pp: mla64(xx, pp, cos, sin, h, dn, dr, dv, scale, 1e-6), F64)
    shapes = ((b, s, h, dn + dr), (b, s, h, dn + dr), (b, s, h, dv))
    assert [(c["stage"], c["shapes"]) for c in fa.calls] == [("fwd", shapes), ("bwd", shapes)]
    assert all(c["softmax_scale"] == scale for c in fa.calls)
    assert fa.calls[1]["deterministic"] is fast_attn.DETERMINISTIC
    weights = [f for f in p.__dataclass_fields__ if getattr(p, f) is not None]
    assert set(g_glue) == set(g_want) == {"x", *weights}

    def err(a: Tensor, ref: Tensor) -> float:
        return float((a - ref).abs().max() / ref.abs().max())

    tol = 2.0**-5
    assert err(glue, want) < tol
    for name in g_want:
        assert err(g_glue[name], g_want[name]) < tol, name
    for knobs in ({"future": 1}, {"rope_on": "nope"}, {"k_rope": False}):
        wrong = mla64(x, p, cos, sin, h, dn, dr, dv, scale, 1e-6, **knobs)
        assert err(wrong.to(F64), want) > 4 * tol, knobs


def _core_grads(monkeypatch: pytest.MonkeyPatch, b: int = 2, s: int = 5, h: int = 3, dn: int = 4,
                dr: int = 6, dv: int = 8) -> dict[str, Any]:
    """_MLACore's output and input gradients in float64 (kernel and FA4 stand-ins), beside autograd through
    an independent composition: slices, the rotation, concatenation, a broadcast shared key, attention."""
    _stand_heads(monkeypatch)
    fa = _FA4Stand()
    g = torch.Generator().manual_seed(4)
    q0 = torch.randn(b, s, h * (dn + dr), generator=g, dtype=F64)
    kv0 = torch.randn(b, s, h, dn + dv, generator=g, dtype=F64)
    kpe0 = torch.randn(b, s, dr, generator=g, dtype=F64)
    cos, sin = yarn_cos_sin(8, dr, 1e4, 4.0, 8, 32.0, 1.0)
    c, sn = cos[:s].unsqueeze(1), sin[:s].unsqueeze(1)
    do = torch.randn(b, s, h, dv, generator=g, dtype=F64)
    rotated: list[Tensor] = []

    def grads(fn: Any) -> tuple[Tensor, list[Tensor]]:
        leaves = [t.clone().requires_grad_(True) for t in (q0, kv0, kpe0)]
        out = fn(*(t.clone() for t in leaves))
        out.backward(do)
        return out.detach(), [t.grad for t in leaves]

    def composed(q: Tensor, kv: Tensor, kpe: Tensor) -> Tensor:
        q4 = q.view(b, s, h, dn + dr)
        qr = torch.cat((q4[..., :dn], _rot(q4[..., dn:], c, sn)), -1)
        qr.retain_grad()
        rotated.append(qr)
        k = torch.cat((kv[..., :dn], kpe.unsqueeze(2).expand(b, s, h, dr)), -1)
        return fa._attend(qr, k, kv[..., dn:], 0.37)

    got = grads(lambda q, kv, kpe: fast_attn._MLACore.apply(q, kv, kpe, c, sn, dn, 0.37, fa)[0])
    want = grads(composed)
    return {"got": got, "want": want, "dq_rotated": rotated[0].grad, "c": c, "sn": sn,
            "dims": (b, s, h, dn, dr)}


def _shared_input_case() -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(9)
    x, w1, w2 = (torch.randn(shape, generator=g, dtype=F64) for shape in ((2, 3, 8), (5, 8), (4, 8)))
    d1, d2 = torch.randn(2, 3, 5, generator=g, dtype=F64), torch.randn(2, 3, 4, generator=g, dtype=F64)
    return x, w1, w2, d1, d2


def test_shared_input_projections_gradcheck() -> None:
    """MLA's two projections of x as one Function: F.linear's values, every gradient checked in float64."""
    x, w1, w2, _, _ = _shared_input_case()
    leaves = (x.requires_grad_(), w1.requires_grad_(), w2.requires_grad_())
    got = fast_attn._SharedInput.apply(*leaves)
    assert all(torch.equal(a, b) for a, b in zip(got, (F.linear(x, w1), F.linear(x, w2)), strict=True))
    assert torch.autograd.gradcheck(fast_attn._SharedInput.apply, leaves)


def test_sep_mla_fast_second_dx_dropped() -> None:
    """dx = d1 @ w1 + d2 @ w2: without the second GEMM's addend, the kv projection's gradient is lost."""
    x, w1, w2, d1, d2 = _shared_input_case()
    correct, mutated = d1 @ w1 + d2 @ w2, d1 @ w1
    assert not torch.allclose(correct, mutated, rtol=1e-3)
    xx = x.clone().requires_grad_()
    torch.autograd.backward(fast_attn._SharedInput.apply(xx, w1, w2), (d1, d2))
    assert xx.grad is not None
    torch.testing.assert_close(xx.grad, correct, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("kv_shape", "pe_shape", "dn"), [
    ((2, 3, 4, 256), (2, 3, 60), 128),   # rope dim not whole 16-byte vectors
    ((2, 3, 4, 256), (2, 5, 64), 128),   # k_pe of other tokens than kv
    ((2, 3, 4, 128), (2, 3, 64), 128),   # no v part left in kv
])
def test_mla_assembly_refuses_shapes_before_any_gpu_work(kv_shape: tuple[int, ...], pe_shape: tuple[int, ...],
                                                         dn: int) -> None:
    kv, k_pe = torch.zeros(kv_shape, dtype=torch.bfloat16), torch.zeros(pe_shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dims must be positive multiples of 8"):
        fast_attn.mla_k(kv, k_pe, dn)


def test_kv_grad_refuses_a_dkv_it_cannot_write_in_place() -> None:
    dk = torch.zeros(1, 2, 2, 16 + 8, dtype=torch.bfloat16)
    dkv = torch.zeros(1, 2, 2, 16 + 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="written in place"):
        fast_attn.mla_kv_grad(dk, dkv.transpose(1, 2), 16)
    with pytest.raises(ValueError, match="written in place"):
        fast_attn.mla_kv_grad(dk, dkv.float(), 16)


def test_core_values_and_gradients_equal_autograd_of_the_composition(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _core_grads(monkeypatch)
    for a, w in zip([r["got"][0], *r["got"][1]], [r["want"][0], *r["want"][1]], strict=True):
        torch.testing.assert_close(a, w, rtol=1e-12, atol=1e-12)


def test_sep_mla_fast_dq_rope_not_inverse(monkeypatch: pytest.MonkeyPatch) -> None:
    """q's rope-part gradient is FA4's dq turned by -angle; turning it by +angle is the mutant."""
    r = _core_grads(monkeypatch)
    b, s, h, dn, dr = r["dims"]
    tail = r["dq_rotated"][..., dn:]
    forward_turn = _rot(tail, r["c"], r["sn"])
    want_tail = r["want"][1][0].view(b, s, h, dn + dr)[..., dn:]
    assert (forward_turn - want_tail).abs().max() > 0.5
    torch.testing.assert_close(r["got"][1][0], r["want"][1][0], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
# (B, S, dim, heads, d_nope, d_rope, d_v, q_lora, kv_lora)
SHAPES = [(2, 256, 512, 4, 128, 64, 128, 256, 128), (1, 1000, 256, 2, 64, 32, 64, 0, 64),
          (2, 1, 64, 2, 16, 8, 16, 32, 32), (1, 77, 128, 3, 32, 32, 32, 0, 32)]


def _case(shape: tuple[int, ...], seed: int, scale: float | None = None) -> dict[str, Any]:
    b, s, dim, h, dn, dr, dv, rq, rkv = shape
    x, p = make(b, s, dim, h, dn, dr, dv, rq, rkv, seed)
    cos, sin = yarn_cos_sin(max(s, 8), dr, 1e4, 40.0, 64, 32.0, 1.0)
    sc = scale if scale is not None else mla_softmax_scale(dn + dr, 40.0, 0.707, max(s, 8), 64)
    return {"x": x, "p": p, "cos": cos, "sin": sin, "dims": (h, dn, dr, dv), "scale": sc}


def _to(c: dict[str, Any], device: str) -> dict[str, Any]:
    p = c["p"]
    moved = MLAParams(**{f: None if getattr(p, f) is None else getattr(p, f).to(device)
                         for f in p.__dataclass_fields__})
    return {**c, "x": c["x"].to(device), "p": moved, "cos": c["cos"].to(device), "sin": c["sin"].to(device)}


def _fast(c: dict[str, Any]) -> Tensor:
    g = _to(c, "cuda")
    return mla_attention(g["x"], g["p"], g["cos"], g["sin"], *g["dims"], g["scale"], 1e-6)


def _ref(c: dict[str, Any], lowprec: torch.dtype = F64, device: str = "cpu", **knobs: Any) -> Tensor:
    g = _to(c, device)
    return mla64(g["x"], g["p"], g["cos"], g["sin"], *g["dims"], g["scale"], 1e-6, lowprec=lowprec,
                 **knobs).to(F64).cpu()


def _err(a: Tensor, b: Tensor) -> float:
    return float((a.to(F64).cpu() - b.to(F64).cpu()).abs().max())


def _bound(c: dict[str, Any], ref: Tensor) -> float:
    """The parity contract: 2 * max|bf16 torch - ref64| + one bf16 ULP (2^-8 relative) of max|ref64|."""
    low = _ref(c, torch.bfloat16, "cuda")
    return 2 * _err(low, ref) + 2.0**-8 * float(ref.abs().max())


@gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_mla_attention_forward_within_contract(shape: tuple[int, ...]) -> None:
    c = _case(shape, 1)
    ref = _ref(c)
    y = _fast(c)
    assert y.dtype == torch.bfloat16 and y.shape == c["x"].shape
    assert _err(y, ref) <= _bound(c, ref)


@gpu
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_mla_attention_gradients_within_contract(shape: tuple[int, ...]) -> None:
    """Gradients of x and every weight, against float64 autograd, under the same ratio contract."""
    c = _case(shape, 2)
    g = torch.Generator().manual_seed(3)
    dy = torch.randn(c["x"].shape, generator=g, dtype=F64)

    def grads(run: Any, dtype: torch.dtype, device: str) -> dict[str, Tensor]:
        d = _to(c, device)
        leaves = {"x": d["x"].to(dtype)}
        leaves.update({f: getattr(d["p"], f).to(dtype) for f in d["p"].__dataclass_fields__
                       if getattr(d["p"], f) is not None})
        for t in leaves.values():
            t.requires_grad_(True)
        p = MLAParams(**{f: leaves.get(f) for f in d["p"].__dataclass_fields__})
        out = run(leaves["x"], p, d)
        out.backward(dy.to(device, out.dtype))
        return {k: v.grad.to(F64).cpu() for k, v in leaves.items() if v.grad is not None}

    def fast(x: Tensor, p: MLAParams, d: dict[str, Any]) -> Tensor:
        return mla_attention(x, p, d["cos"], d["sin"], *d["dims"], d["scale"], 1e-6)

    def ref(x: Tensor, p: MLAParams, d: dict[str, Any]) -> Tensor:
        return mla64(x, p, d["cos"], d["sin"], *d["dims"], d["scale"], 1e-6, lowprec=x.dtype)

    want = grads(ref, F64, "cpu")
    got = grads(fast, torch.bfloat16, "cuda")
    low = grads(ref, torch.bfloat16, "cuda")
    assert set(got) == set(want)
    for name in want:
        bound = 2 * _err(low[name], want[name]) + 2.0**-8 * float(want[name].abs().max())
        assert _err(got[name], want[name]) <= bound, name


@gpu
def test_mla_attention_backward_is_deterministic() -> None:
    c = _to(_case(SHAPES[0], 4), "cuda")
    runs = []
    for _ in range(2):
        x = c["x"].clone().requires_grad_(True)
        y = mla_attention(x, c["p"], c["cos"], c["sin"], *c["dims"], c["scale"], 1e-6)
        y.float().square().sum().backward()
        assert x.grad is not None
        runs.append(x.grad.clone())
    assert torch.equal(runs[0].view(torch.int16), runs[1].view(torch.int16))


@gpu
def test_mla_attention_empty_batch() -> None:
    c = _to(_case((1, 4, 64, 2, 16, 8, 16, 0, 16), 9), "cuda")
    y = mla_attention(c["x"][:0], c["p"], c["cos"], c["sin"], *c["dims"], c["scale"], 1e-6)
    assert y.shape == (0, 4, 64) and y.dtype == torch.bfloat16


@gpu
def test_causal_attention_refuses_unsupported_head_dims() -> None:
    q = torch.zeros(1, 8, 1, 12, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ArchNotImplemented, match="head dim 12"):
        fast_attn.causal_attention(q, q, q[..., :8], 0.3)


# ---------------------------------------------------------------------------------------------------
# Separating inputs for the mutants of mutations/catalog/fast_attention.py: the mutated formula differs
# from the correct one by more than 4x the contract's bound, then the fast path is within the bound.
# ---------------------------------------------------------------------------------------------------


def _separates(c: dict[str, Any], **knobs: Any) -> None:
    ref = _ref(c)
    bound = _bound(c, ref)
    assert _err(_ref(c, **knobs), ref) > 4 * bound, knobs
    assert _err(_fast(c), ref) <= bound


@gpu
def test_sep_mla_fast_causal_off_by_one() -> None:
    _separates(_case(SHAPES[0], 5), future=1)


@gpu
def test_sep_mla_fast_softmax_scale_no_mscale() -> None:
    c = _case(SHAPES[0], 6)
    assert c["scale"] != (128 + 64) ** -0.5
    ref = _ref(c)
    bound = _bound(c, ref)
    plain = _ref({**c, "scale": (128 + 64) ** -0.5})
    assert _err(plain, ref) > 4 * bound
    assert _err(_fast(c), ref) <= bound


@gpu
def test_sep_mla_fast_rope_on_nope_part() -> None:
    _separates(_case(SHAPES[0], 7), rope_on="nope")


@gpu
def test_sep_mla_fast_k_rope_dropped() -> None:
    _separates(_case(SHAPES[0], 8), k_rope=False)


# ---------------------------------------------------------------------------------------------------
# GPU: the k / dkv assembly kernels, bitwise.
# ---------------------------------------------------------------------------------------------------
def _grid16(shape: tuple[int, ...], seed: int) -> Tensor:
    """bf16 multiples of 1/16 below 16 in magnitude: 8 significant bits (bf16-exact), and a sum of 16 of them
    is exact in fp32, so the float64 sum rounded once is what fp32 head-order addition rounds."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-255, 256, shape, generator=g).to(F64) / 16).to(torch.bfloat16)


def _assembly_case(seed: int) -> tuple[Tensor, ...]:
    b, s, h, dn, dr, dv = 2, 33, 16, 128, 64, 128
    kv, k_pe = _grid16((b, s, h, dn + dv), seed), _grid16((b, s, dr), seed + 1)
    dk, dv_ = _grid16((b, s, h, dn + dr), seed + 2), _grid16((b, s, h, dv), seed + 3)
    return kv, k_pe, dk, dv_


@gpu
def test_mla_k_and_kv_grad_bitwise() -> None:
    kv, k_pe, dk, dv = _assembly_case(30)
    dn = 128
    k = fast_attn.mla_k(kv.cuda(), k_pe.cuda(), dn).cpu()
    assert torch.equal(k[..., :dn], kv[..., :dn])
    assert torch.equal(k[..., dn:], k_pe[:, :, None, :].expand_as(k[..., dn:]))
    dkv = torch.cat((torch.full_like(kv[..., :dn], 7.0), dv), dim=-1).cuda()
    dk_pe = fast_attn.mla_kv_grad(dk.cuda(), dkv, dn).cpu()
    assert torch.equal(dkv[..., :dn].cpu(), dk[..., :dn]) and torch.equal(dkv[..., dn:].cpu(), dv)
    assert torch.equal(dk_pe, dk[..., dn:].to(F64).sum(2).to(torch.bfloat16))


@gpu
def test_mla_assembly_ops_pass_opcheck() -> None:
    kv, k_pe, dk, _ = (t.cuda() for t in _assembly_case(33))
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.nmoe.mla_k.default, (kv, k_pe, 128), test_utils=tests)
    torch.library.opcheck(torch.ops.nmoe.mla_kv_grad.default, (dk, torch.zeros_like(kv), 128),
                          test_utils=tests)


@gpu
def test_sep_mla_fast_k_pe_grad_one_head() -> None:
    kv, _, dk, _ = _assembly_case(31)
    want = dk[..., 128:].to(F64).sum(2).to(torch.bfloat16)
    assert not torch.equal(dk[:, :, 0, 128:], want)
    assert torch.equal(fast_attn.mla_kv_grad(dk.cuda(), torch.zeros_like(kv).cuda(), 128).cpu(), want)


@gpu
def test_sep_mla_fast_k_pe_from_wrong_column() -> None:
    kv, k_pe, _, _ = _assembly_case(32)
    shifted = torch.cat((k_pe[:, 1:], k_pe[:, :1]), dim=1)
    assert not torch.equal(shifted, k_pe)
    k = fast_attn.mla_k(kv.cuda(), k_pe.cuda(), 128).cpu()
    assert torch.equal(k[..., 128:], k_pe[:, :, None, :].expand_as(k[..., 128:]))
