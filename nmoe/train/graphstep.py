"""The forward and backward of a training step as one CUDA graph: the host issues one replay instead of every
kernel, so small ops stop waiting on Python and launches. The optimizer updates parameters in place between
replays (the graph reads them there); clip and optimizer stay eager, their learning rate moves every step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

WARMUP = 2  # side-stream iterations before capture (autograd and cuBLAS set up their state there)


class GraphError(RuntimeError):
    """The step could not be captured; the message names the fix."""


class GraphedStep:
    """Capture loss_fn(model, inputs, targets) and its backward at the given batch shape; call() replays."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor],
                 inputs: Tensor, targets: Tensor) -> None:
        if inputs.device.type != "cuda":
            raise GraphError(f"train.cuda_graph: the batch is on {inputs.device}; graphs replay GPU work "
                             "only")
        params = [p for p in model.parameters() if p.requires_grad]
        if any(p.grad is not None for p in params):
            raise GraphError("train.cuda_graph: capture needs every .grad None (the graph owns the gradient "
                             "buffers); call zero_grad(set_to_none=True) first")
        self.params = params
        self.inputs, self.targets = inputs.clone(), targets.clone()
        side = torch.cuda.Stream(inputs.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(inputs.device))
        try:
            with torch.cuda.stream(side):
                for _ in range(WARMUP):
                    loss_fn(model, self.inputs, self.targets).backward()  # type: ignore[no-untyped-call]
                    for p in params:
                        p.grad = None
            torch.cuda.current_stream(inputs.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.loss = loss_fn(model, self.inputs, self.targets)
                self.loss.backward()  # type: ignore[no-untyped-call]
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GraphError(f"train.cuda_graph: capturing the forward and backward failed ({first}); an "
                             "op that syncs with the host or allocates outside the graph cannot be captured, "
                             "nor a step while an eager step's autograd graph is still held (its "
                             "AccumulateGrad nodes keep that step's stream); set train.cuda_graph = false"
                             ) from e
        self.grads = [p.grad for p in params]

    def __call__(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Replay on this batch; the loss tensor and the parameters' .grad hold the results."""
        if inputs.shape != self.inputs.shape or targets.shape != self.targets.shape:
            raise GraphError(f"train.cuda_graph: batch {tuple(inputs.shape)} differs from the captured "
                             f"{tuple(self.inputs.shape)}; graphs replay one shape (keep data.batch_size and "
                             "seq_len fixed)")
        for p, g in zip(self.params, self.grads, strict=True):
            if p.grad is not g:
                raise GraphError("train.cuda_graph: a parameter's .grad was replaced after capture "
                                 "(zero_grad with set_to_none?); the graph writes only the buffers it "
                                 "captured")
        self.inputs.copy_(inputs, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        self.graph.replay()
        return self.loss
