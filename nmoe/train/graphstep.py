"""The forward and backward of a training step as one CUDA graph: the host issues one replay instead of every
kernel, so small ops stop waiting on Python and launches. The optimizer updates parameters in place between
replays (the graph reads them there); clip and optimizer stay eager, their learning rate moves every step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from nmoe.accumulate import adding_to_grads

WARMUP = 2  # side-stream iterations before capture (autograd and cuBLAS set up their state there)

LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]


class GraphError(RuntimeError):
    """The step could not be captured; the message names the fix."""


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    loss: Tensor
    extra: Tensor | None


class GraphedStep:
    """Capture loss_fn(model, inputs, targets) and its backward at the given batch shape; call() replays."""
    # accumulate: a second graph, in the first's memory pool, adds a microbatch's gradients to the buffers the
    # first writes (gradient accumulation, captured inside adding_to_grads). extra(): a tensor each graph
    # computes after its backward.

    def __init__(self, model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
                 accumulate: bool = False, extra: Callable[[], Tensor] | None = None) -> None:
        if inputs.device.type != "cuda":
            raise GraphError(f"train.cuda_graph: the batch is on {inputs.device}; graphs replay GPU work "
                             "only")
        params = [p for p in model.parameters() if p.requires_grad]
        if any(p.grad is not None for p in params):
            raise GraphError("train.cuda_graph: capture needs every .grad None (the graph owns the gradient "
                             "buffers); call zero_grad(set_to_none=True) first")
        self.params = params
        self.inputs, self.targets = inputs.clone(), targets.clone()
        self.first = self._capture(model, loss_fn, extra, None, clear=True)
        self.grads = [p.grad for p in params]
        self.more = (self._capture(model, loss_fn, extra, self.first.graph.pool(), clear=False)
                     if accumulate else None)

    def _capture(self, model: nn.Module, loss_fn: LossFn, extra: Callable[[], Tensor] | None, pool: Any,
                 clear: bool) -> _Captured:
        device = self.inputs.device
        try:
            # Only the first capture warms up: an eager step beside the first graph's pool would need a
            # second set of activations (moonlet at batch 16 ran out of memory there).
            if clear:
                side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(WARMUP):
                        loss_fn(model, self.inputs, self.targets).backward()  # type: ignore[no-untyped-call]
                        for p in self.params:
                            p.grad = None
                torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), adding_to_grads(not clear):
                loss = loss_fn(model, self.inputs, self.targets)
                loss.backward()  # type: ignore[no-untyped-call]
                out = extra() if extra is not None else None
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GraphError(f"train.cuda_graph: capturing the forward and backward failed ({first}); an "
                             "op that syncs with the host or allocates outside the graph cannot be captured, "
                             "nor a step while an eager step's autograd graph is still held (its "
                             "AccumulateGrad nodes keep that step's stream); set train.cuda_graph = false"
                             ) from e
        return _Captured(graph, loss.detach(), out)

    def __call__(self, inputs: Tensor, targets: Tensor, add: bool = False) -> tuple[Tensor, Tensor | None]:
        """Replay on this batch: (loss, extra), the parameters' .grad written (add: added to). The two
        tensors are the graph's own, overwritten by its next replay."""
        if inputs.shape != self.inputs.shape or targets.shape != self.targets.shape:
            raise GraphError(f"train.cuda_graph: batch {tuple(inputs.shape)} differs from the captured "
                             f"{tuple(self.inputs.shape)}; graphs replay one shape (keep data.batch_size and "
                             "seq_len fixed)")
        captured = self.more if add else self.first
        if captured is None:
            raise GraphError("train.cuda_graph: an accumulating replay of a step captured without "
                             "accumulate=True; capture with accumulate=True when train.grad_accum > 1")
        for p, g in zip(self.params, self.grads, strict=True):
            if p.grad is not g:
                raise GraphError("train.cuda_graph: a parameter's .grad was replaced after capture "
                                 "(zero_grad with set_to_none?); the graph writes only the buffers it "
                                 "captured")
        self.inputs.copy_(inputs, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        captured.graph.replay()
        return captured.loss, captured.extra
