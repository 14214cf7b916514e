"""Fused-linear cross-entropy fwd+bwd at the production head (T 8192, H 2048, V 201088), nmoe vs the same
chunked algorithm written in torch ops, both timed eagerly (CUDA events, L2 flushed) in the same run.

FLOP floor: three bf16 GEMMs of 2TVH each (logits, dh, dw) = 6TVH; the row kernel's bytes (fp32 logits
read twice, bf16 dlogits written: 10TV) hide under them at the dense ceiling. Peak memory is measured for
both (torch.cuda.max_memory_allocated over the inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import cuda_median_ms, mismatch, record
from torch import Tensor
from torchbase import CE_CHUNK as CHUNK
from torchbase import CE_IGNORE as IGN
from torchbase import CE_SHAPE as SHAPE
from torchbase import ce_inputs


def ce_torch_chunked(h: Tensor, w: Tensor, tg: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, dh, dw): per chunk fp32 logits, softmax - onehot, two GEMMs; torch ops only."""
    kept = tg != IGN
    n = kept.sum().clamp_min(1).float()
    total = torch.zeros((), device=h.device)
    dh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=h.device)
    for s in range(0, h.shape[0], chunk):
        hc, kc = h[s:s + chunk], kept[s:s + chunk]
        tc = torch.where(kc, tg[s:s + chunk], 0)
        logits = torch.mm(hc, w.T, out_dtype=torch.float32)
        lse = torch.logsumexp(logits, -1)
        total = total + torch.where(kc, lse - logits.gather(1, tc[:, None]).squeeze(1), 0.0).sum()
        p = torch.exp(logits - lse[:, None])
        p[torch.arange(p.shape[0], device=h.device), tc] -= 1.0
        g = (p * (kc[:, None] / n)).bfloat16()
        del logits, p
        dh[s:s + chunk] = torch.mm(g, w, out_dtype=torch.float32)
        dw += torch.mm(g.T, hc, out_dtype=torch.float32)
    return total / n, dh.to(h.dtype), dw.to(w.dtype)


def _peak(step: Callable[[], object]) -> int:
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def test_bench_cross_entropy_fwd_bwd(benchmark: Any) -> None:
    from nmoe.fast import loss as fl
    t, hd, v = SHAPE
    h, w, tg = ce_inputs()

    def fast() -> None:
        h.grad = w.grad = None
        fl.cross_entropy(h, w, tg, IGN, CHUNK).backward()

    def base() -> None:
        ce_torch_chunked(h.detach(), w.detach(), tg, CHUNK)

    fast()
    ref = ce_torch_chunked(h.detach(), w.detach(), tg, CHUNK)
    assert h.grad is not None and w.grad is not None
    check = mismatch(fl.cross_entropy(h.detach(), w.detach(), tg, IGN, CHUNK), ref[0], rtol=1e-4) or \
        mismatch(h.grad, ref[1], rtol=2**-6, atol=2**-6 * float(ref[1].abs().max())) or \
        mismatch(w.grad, ref[2], rtol=2**-6, atol=2**-6 * float(ref[2].abs().max()))
    peak_fast, peak_base = _peak(fast), _peak(base)
    ms, base_ms = cuda_median_ms(fast), cuda_median_ms(base)
    row = record("cross_entropy_fwd_bwd", {"T": t, "H": hd, "V": v, "chunk": CHUNK}, ms,
                 flops=6.0 * t * v * hd, baseline=("torch_chunked_eager", base_ms))
    row.update(timing="eager", peak_bytes=peak_fast, baseline_peak_bytes=peak_base,
               stated_peak_bytes=fl.peak_bytes(t, v, hd, CHUNK, True), fp32_logits_bytes=4 * t * v,
               baseline_check=check or "ok")
    benchmark.extra_info.update(row)
    benchmark.pedantic(lambda: (fast(), torch.cuda.synchronize()), rounds=3, iterations=1, warmup_rounds=1)
    assert check is None, f"fast cross_entropy disagrees with the torch chunked baseline: {check}"
    assert peak_fast < 4 * t * v, "the fast path held fp32 logits of all tokens"


def test_bench_cross_entropy_fwd(benchmark: Any) -> None:
    from nmoe.fast import loss as fl
    t, hd, v = SHAPE
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(t, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(v, hd, device="cuda", generator=g) / hd**0.5).bfloat16()
    tg = torch.randint(0, v, (t,), device="cuda", generator=g)
    ms = cuda_median_ms(lambda: fl.cross_entropy(h, w, tg, IGN, CHUNK))
    row = record("cross_entropy_fwd", {"T": t, "H": hd, "V": v, "chunk": CHUNK}, ms, flops=2.0 * t * v * hd,
                 nbytes=8.0 * t * v)
    row.update(timing="eager", peak_bytes=_peak(lambda: fl.cross_entropy(h, w, tg, IGN, CHUNK)))
    benchmark.extra_info.update(row)
    benchmark.pedantic(lambda: (fl.cross_entropy(h, w, tg, IGN, CHUNK), torch.cuda.synchronize()), rounds=3,
                       iterations=1, warmup_rounds=1)


STEP_TOKENS = 65536
"""Tokens of one moonlet microbatch (16 x 4096), the T the chunk rows time the trainer's head at."""


@pytest.mark.parametrize("chunk", [4096, 8192, 16384])
def test_bench_cross_entropy_chunk(benchmark: Any, chunk: int) -> None:
    """The trainer's head at one microbatch per chunk size: each chunk's fp32 [chunk, V] logits buffer against
    the dw accumulator's read and write per chunk (fp32 [V, H], 3.3 GB at moonlet's head)."""
    from nmoe.fast import loss as fl
    _, hd, v = SHAPE
    g = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(STEP_TOKENS, hd, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, hd, device="cuda", generator=g) / hd**0.5).bfloat16().requires_grad_()
    tg = torch.randint(0, v, (STEP_TOKENS,), device="cuda", generator=g)

    def fast() -> None:
        h.grad = w.grad = None
        fl.cross_entropy(h, w, tg, IGN, chunk).backward()

    peak = _peak(fast)
    ms = cuda_median_ms(fast, warmup=2, reps=5)
    row = record("cross_entropy_fwd_bwd_chunk", {"T": STEP_TOKENS, "H": hd, "V": v, "chunk": chunk}, ms,
                 flops=6.0 * STEP_TOKENS * v * hd)
    row.update(timing="eager", peak_bytes=peak,
               stated_peak_bytes=fl.peak_bytes(STEP_TOKENS, v, hd, chunk, True))
    benchmark.extra_info.update(row)
    benchmark.pedantic(lambda: (fast(), torch.cuda.synchronize()), rounds=1, iterations=1, warmup_rounds=0)
