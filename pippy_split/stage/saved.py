"""What a stage keeps of a microbatch for its backward, and how it watches what autograd saves.

Part of the stage layer, used by ``stage.py``: the per-microbatch record, the
recording of the storages autograd saves (which sent outputs may drop their
memory), and small helpers of the backward passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

__all__ = ["SavedMicrobatch", "recording_saved", "accumulate", "module_device", "edge_if_checkpointed"]


@dataclass
class SavedMicrobatch:
    """What a stage keeps of one microbatch between its forward and its backward."""

    inputs: list[Any]
    outputs: tuple
    loss: torch.Tensor | None = None
    weight_work: list = field(default_factory=list)
    weight_params: list = field(default_factory=list)  # per capture: the parameters W differentiates it for
    whole_now: list = field(default_factory=list)  # parameters I computes in full for this microbatch
    graph_storages: set[int] = field(default_factory=set)  # storages autograd saved for backward
    recompute: Any = None  # activation checkpointing: (kwargs, target, RNG state, LossRule) until recomputed


class recording_saved:
    """Record the storage of every tensor autograd saves for backward (when ``on``)."""

    def __init__(self, storages: set[int], on: bool) -> None:
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack) if on else None
        self.storages = storages

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.storages.add(t.untyped_storage().data_ptr())
        # detached: packing t itself (an op's own output, with grad_fn) ties its node into a
        # reference cycle, and a graph the I/W split retains for W would outlive the step
        return t.detach()

    def __enter__(self) -> None:
        if self.hooks is not None:
            self.hooks.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(*exc)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def accumulate(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """Add ``g`` to ``p.grad`` as autograd would (a copy when there is none yet)."""
    if g is None:
        return
    if p.grad is None:
        p.grad = g.detach().clone()
    else:
        p.grad.add_(g)


def module_device(module: torch.nn.Module) -> torch.device:
    """Where a module's parameters (else buffers) live; the CPU for a module with neither."""
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")


def edge_if_checkpointed(value: Any, checkpointed: bool) -> Any:
    """Under selective checkpointing, a captured op output kept as its autograd edge only
    (so its storage can go); otherwise ``value`` itself."""
    if checkpointed and isinstance(value, torch.Tensor) and value.requires_grad and value.grad_fn is not None:
        return get_gradient_edge(value)
    return value
