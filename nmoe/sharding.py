"""Expert parallelism's bookkeeping, shared by the model, the trainer and checkpoints: which parameters hold
one rank's experts only, how their gradients are reduced and normed, and the keys they are saved under."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

ATTR = "_nmoe_expert_shard"
"""Attribute holding the ExpertShard of a parameter whose leading dim is this rank's experts only."""

AllReduceSum = Callable[[Tensor], None]


@dataclass(frozen=True)
class ExpertShard:
    """Rank `rank` of `world` expert-parallel ranks holds experts [rank*n_local, (rank+1)*n_local)."""

    rank: int
    world: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"ExpertShard: rank {self.rank} must lie in [0, world={self.world})")

    def rows(self, n_experts: int) -> slice:
        if n_experts % self.world:
            raise ValueError(f"expert parallelism over {self.world} ranks needs model.n_routed_experts "
                             f"({n_experts}) divisible by {self.world}; change one of them")
        n_local = n_experts // self.world
        return slice(self.rank * n_local, (self.rank + 1) * n_local)

    @property
    def suffix(self) -> str:
        """Checkpoint key suffix: every rank saves its experts under its own keys."""
        return f"@experts{self.rank}of{self.world}"


def mark(p: Tensor, shard: ExpertShard) -> None:
    setattr(p, ATTR, shard)


def shard_of(p: Tensor) -> ExpertShard | None:
    s = getattr(p, ATTR, None)
    return s if isinstance(s, ExpertShard) else None


def full_numel(p: Tensor) -> int:
    """Elements of the parameter over every rank (the FLOP count of a sharded expert stack)."""
    s = shard_of(p)
    return p.numel() * (1 if s is None else s.world)


def reduce_grads(params: Iterable[Tensor], world: int, all_reduce_sum: AllReduceSum) -> None:
    """Data + expert parallel gradients of a loss averaged over ranks: replicated parameters are summed
    across ranks and divided by world; an expert-sharded one already holds every rank's tokens'
    contribution (RDEP brought them to its owner), so it is only divided by world, never communicated."""
    for p in params:
        if p.grad is None:
            continue
        if shard_of(p) is None:
            all_reduce_sum(p.grad)
        p.grad.div_(world)


def grad_norm(norms: list[Tensor], sharded: list[bool], all_reduce_sum: AllReduceSum | None) -> Tensor:
    """Global L2 norm (fp32 0-dim, on the device) from per-gradient norms: replicated gradients count once
    (every rank holds the same after reduce_grads), expert-sharded ones are summed over ranks."""
    if not any(sharded):
        total: Tensor = torch.linalg.vector_norm(torch.stack(norms))
        return total

    def sq(ns: list[Tensor]) -> Tensor:
        return torch.stack(ns).square().sum() if ns else norms[0].new_zeros(())

    own = sq([n for n, s in zip(norms, sharded, strict=True) if s])
    if all_reduce_sum is not None:
        all_reduce_sum(own)
    return (sq([n for n, s in zip(norms, sharded, strict=True) if not s]) + own).sqrt()


def checkpoint_keys(named: Iterable[tuple[str, Tensor]]) -> dict[str, str]:
    """name -> saved key for every expert-sharded parameter (others keep their name)."""
    out = {}
    for name, p in named:
        s = shard_of(p)
        if s is not None:
            out[name] = name + s.suffix
    return out
