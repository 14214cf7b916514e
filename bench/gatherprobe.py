"""Where the gathering up projection loses to the TMA-fed one: `python bench/gatherprobe.py --out FILE` times
both (swiglu, h kept; conftest's sustained_ms) on the layer rows under router routings and synthetic balanced
ones; `--one ROUTING CONFIG` runs one gathered call (`--tma`: the TMA-fed one on permute's copy),
`--wgrad`/`--dense` a c1 up wgrad or its mm, `--wgrad-rows ROUTING CONFIG` the layer's up wgrad on
router routing, x read through slot on the N side (`--x-on-m`: x^T @ dh, x on M; `--tma`: on permute's
copy; the last of four calls inside the NVTX range "probe"), all for ncu."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import nvtx_probe, sustained_ms
from torchbase import LAYER_ALIGN, LAYER_CONFIGS, layer_inputs

from nmoe.fast.dispatch import permute
from nmoe.fast.gemm import sm90
from nmoe.fast.limits import GEMM_BM
from nmoe.fast.router import router_logits, router_topk

ROUTINGS = ("uniform", "zipf", "blocked", "strided", "shuffled", "spread")
"""Router routings, then balanced ones (T*K/E rows per expert, whole M tiles): blocked gives each expert
contiguous tokens and a token's K experts adjacent ids; strided every (T/R)-th token; shuffled a random token
set per expert; spread, shuffled's, but a token's K experts E/K ids apart, so no two run close in time."""


def routed(cfg: tuple[int, ...], routing: str) -> tuple[Tensor, Tensor, Tensor]:
    """(x, w13, ids [T, K]) of a layer row under the named routing."""
    t, _, _, e, k = cfg
    by_router = routing in ("uniform", "zipf")
    mc, p, x, _ = layer_inputs(cfg, routing if by_router else "uniform", LAYER_ALIGN)
    assert p.w13 is not None
    if by_router:
        with torch.no_grad():
            _, ids = router_topk(router_logits(x, p.router_w), p.router_bias, k, mc.score_func,
                                 mc.n_expert_groups, mc.n_limited_groups)
        return x.detach(), p.w13.detach(), ids
    rows = t * k // e
    tok = torch.arange(t, device="cuda")[:, None]
    if routing == "strided":
        block = tok % (t // rows)
    elif routing in ("shuffled", "spread"):
        block = torch.randperm(t, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
        block = block[:, None] // rows
    else:
        block = tok // rows
    slots = torch.arange(k, device="cuda")[None, :]
    if routing == "spread":
        if e % k:
            raise ValueError(f"spread routing needs K | E, got E={e}, K={k}")
        return x.detach(), p.w13.detach(), block + slots * (e // k)
    return x.detach(), p.w13.detach(), (block * k + slots) % e


def row(cfg: tuple[int, ...], routing: str) -> dict[str, Any]:
    x, w, ids = routed(cfg, routing)
    with torch.no_grad():
        pm = permute(x, ids, cfg[3], LAYER_ALIGN)
        k = ids.shape[1]
        gathered = sustained_ms(lambda: sm90.grouped_gemm_act_gathered(x, pm.slot, k, w, pm.offs, "swiglu"))
        tma = sustained_ms(lambda: sm90.grouped_gemm_act_h(pm.xp, w, pm.offs, "swiglu"))
    counts = pm.counts.float()
    flops = 2.0 * cfg[0] * cfg[4] * 2 * cfg[2] * cfg[1]
    return {"cfg": list(cfg), "routing": routing, "gathered_ms": gathered, "tma_ms": tma,
            "gathered_tflops": flops / gathered / 1e9, "tma_tflops": flops / tma / 1e9,
            "max_over_mean": float(counts.max() / counts.mean()),
            "m_tiles": int(((pm.counts + GEMM_BM - 1) // GEMM_BM).sum()),
            "full_m_tiles": cfg[0] * k // GEMM_BM}


def wgrad_calls(cfg: tuple[int, ...], routing: str,
                align: int = LAYER_ALIGN) -> tuple[dict[str, Callable[[], object]], float]:
    """The layer's up wgrad dh^T @ x on the named routing (dh seeded randn over permute's rows): x read
    through slot on M (x^T @ dh) and on N, and TMA-fed on permute's copy; with its FLOPs over those rows."""
    x, _, ids = routed(cfg, routing)
    with torch.no_grad():
        pm = permute(x, ids, cfg[3], align)
    g = torch.Generator(device="cuda").manual_seed(2)
    dh = torch.randn(pm.xp.shape[0], 2 * cfg[2], device="cuda", generator=g).to(torch.bfloat16)
    k = ids.shape[1]
    calls: dict[str, Callable[[], object]] = {
        "x_on_m": partial(sm90.grouped_gemm_wgrad_gathered, x, dh, pm.slot, k, pm.offs, "dy"),
        "x_on_n": partial(sm90.grouped_gemm_wgrad_gathered, dh, x, pm.slot, k, pm.offs, "x"),
        "tma_on_copy": partial(sm90.grouped_gemm_wgrad, dh, pm.xp, pm.offs),
    }
    return calls, 2.0 * pm.xp.shape[0] * 2 * cfg[2] * cfg[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gatherprobe", description=__doc__)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--one", nargs=2, metavar=("ROUTING", "CONFIG"))
    ap.add_argument("--wgrad", action="store_true")
    ap.add_argument("--wgrad-rows", nargs=2, metavar=("ROUTING", "CONFIG"))
    ap.add_argument("--x-on-m", action="store_true", help="with --wgrad-rows: x gathered as the M operand")
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--tma", action="store_true",
                    help="with --one or --wgrad-rows: the TMA-fed kernel on permute's copy")
    ap.add_argument("--routings", default=",".join(ROUTINGS), help="comma-separated: " + " ".join(ROUTINGS))
    args = ap.parse_args(argv)
    if args.tma and not (args.one or args.wgrad_rows):
        ap.error("--tma picks the kernel --one or --wgrad-rows runs; give one of them")
    if args.one:
        cfg = LAYER_CONFIGS[int(args.one[1])]
        x, w, ids = routed(cfg, args.one[0])
        with torch.no_grad():
            pm = permute(x, ids, cfg[3], LAYER_ALIGN)
            for _ in range(3):
                if args.tma:
                    sm90.grouped_gemm_act_h(pm.xp, w, pm.offs, "swiglu")
                else:
                    sm90.grouped_gemm_act_gathered(x, pm.slot, ids.shape[1], w, pm.offs, "swiglu")
    elif args.wgrad_rows:
        calls, _ = wgrad_calls(LAYER_CONFIGS[int(args.wgrad_rows[1])], args.wgrad_rows[0])
        with torch.no_grad():
            nvtx_probe(calls["tma_on_copy" if args.tma else "x_on_m" if args.x_on_m else "x_on_n"])
    elif args.wgrad or args.dense:
        t, h, i, e, k = LAYER_CONFIGS[0]
        g = torch.Generator(device="cuda").manual_seed(1)
        dy = torch.randn(t * k, 2 * i, device="cuda", generator=g).to(torch.bfloat16)
        xs = torch.randn(t * k, h, device="cuda", generator=g).to(torch.bfloat16)
        offs = torch.full((e,), t * k // e, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
        wd = torch.randn(2 * i, h, device="cuda", generator=g).to(torch.bfloat16)
        for _ in range(3):
            sm90.grouped_gemm_wgrad(dy, xs, offs) if args.wgrad else xs @ wd.T
    else:
        rows = [row(LAYER_CONFIGS[c], r) for c in (2, 0) for r in args.routings.split(",")]
        text = json.dumps(rows, indent=1)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
