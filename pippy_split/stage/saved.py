"""What a stage keeps of a microbatch for its backward, and how it watches what autograd saves.

Part of the stage layer, used by ``stage.py``: the per-microbatch record, the
recording of the storages autograd saves (which sent outputs may drop their
memory), and small helpers of the backward passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .loss import LossRule

__all__ = ["SavedMicrobatch", "LastStageResult", "Recompute", "WeightCaptures", "CaptureGrads", "WeightRoots", "WeightWork",
           "recording_saved", "accumulate", "module_device", "edge_if_checkpointed"]


@dataclass
class Recompute:
    """Full activation checkpointing: what rebuilds a microbatch's graph right before its
    backward (the forward ran without one), until it is rebuilt."""

    kwargs: dict[str, Any]
    target: Any
    rng: Any  # the RNG state the forward ran under (``recompute.rng_state``)
    loss: LossRule | None


@dataclass
class WeightCaptures:
    """After F (or a recompute) under the I/W split: the op outputs W needs, by capture index."""

    values: list[torch.Tensor | GradientEdge]  # an op output, or its autograd edge under selective checkpointing
    params: list[list[torch.nn.Parameter]]  # per capture: the parameters W differentiates it for
    whole_now: list[torch.nn.Parameter]  # parameters I computes in full for this microbatch


@dataclass
class CaptureGrads:
    """After I: each capture that got a gradient, with it; W runs the weight part of each op."""

    grads: list[tuple[torch.Tensor | GradientEdge, torch.Tensor, list[torch.nn.Parameter]]]  # (capture, grad, params)


@dataclass
class WeightRoots:
    """After I on a stage without a capture plan: W runs backward again from these roots,
    for the stage's parameters only."""

    tensors: list[torch.Tensor]
    grads: list[torch.Tensor | None]


# What W of a microbatch has to do, by state: captures (after F), their gradients or the
# roots (after I); None: nothing (no split plan yet, or I computed the weight gradients too).
WeightWork = Union[WeightCaptures, CaptureGrads, WeightRoots, None]


@dataclass
class LastStageResult:
    """The last stage's result of one microbatch, kept for the whole step."""

    output: Any  # the model's output, in the model's structure, detached
    loss: torch.Tensor | None = None  # its loss, detached and unscaled (None without a loss)


@dataclass
class SavedMicrobatch:
    """What a stage keeps of one microbatch between its forward and its backward."""

    inputs: list[Any]
    outputs: tuple
    loss: torch.Tensor | None = None  # last stage: the microbatch's loss (``rule.loss``)
    rule: LossRule | None = None  # ... and the step's rule its backward starts from
    weight_work: WeightWork = None
    graph_storages: set[int] = field(default_factory=set)  # storages autograd saved for backward
    recompute: Recompute | None = None


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
