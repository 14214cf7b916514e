"""Per-step numbers computed from tensors: router health, peak FLOPs for MFU, memory."""

from __future__ import annotations

import math
import resource
from collections.abc import Sequence
from typing import Final

import torch
from torch import Tensor

PEAK_BF16_FLOPS: Final[dict[str, float]] = {"H100": 989e12, "H200": 989e12, "B200": 2250e12}


def router_stats(
    names: Sequence[str], counts: Sequence[Tensor], biases: Sequence[Tensor]
) -> dict[str, float]:
    """Per MoE layer: load CV (std/mean), entropy of the load distribution / log E, max load / mean, bias
    range (max - min), and each expert's share of the layer's routed tokens (`load/<e>`, summing to 1).
    All layers come to the host in one copy."""
    if not counts:
        return {}
    tensors = [t.detach().reshape(-1).double() for t in (*counts, *biases)]
    host = torch.split(torch.cat(tensors).cpu(), [t.numel() for t in tensors])
    out: dict[str, float] = {}
    for name, load, bias in zip(names, host[: len(counts)], host[len(counts):], strict=True):
        e, total = load.numel(), float(load.sum())
        mean = total / e
        p = load / total if total > 0 else torch.full_like(load, 1.0 / e)
        nz = p[p > 0]
        ent = float(-(nz * nz.log()).sum()) / math.log(e) if e > 1 else 1.0
        out[f"router/{name}/load_cv"] = float(load.std(correction=0)) / mean if mean > 0 else 0.0
        out[f"router/{name}/entropy"] = ent
        out[f"router/{name}/max_load"] = float(load.max()) / mean if mean > 0 else 0.0
        out[f"router/{name}/bias_range"] = float(bias.max() - bias.min())
        share = (load / total if total > 0 else torch.zeros_like(load)).tolist()
        out |= {f"router/{name}/load/{i}": v for i, v in enumerate(share)}
    return out


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU, or None where MFU has no meaning (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def memory_stats(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"mem/allocated_gb": torch.cuda.memory_allocated(device) / 2**30,
                "mem/max_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    return {"mem/max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
