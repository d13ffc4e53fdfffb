"""What a zoo factory returns (:class:`ZooEntry`) and the helper factories split with.

The factories (``gpt.py``, ``llama.py``, ...) import these from here, and
:mod:`pippy_split.zoo` re-exports them, so the package's ``__init__`` imports its
factories and nothing imports it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["ZooEntry", "layer_split"]


@dataclass(frozen=True)
class ZooEntry:
    """A reference model together with what is needed to pipeline and train it."""

    model: nn.Module
    """The model, built under the factory's seed, in train mode."""
    args: tuple
    """Example positional inputs for one full batch (batch size divisible by 8)."""
    kwargs: dict
    """Example keyword inputs; may hold non-tensor values (e.g. a float scale)."""
    split_spec: Any
    """FQNs of submodules to split at the beginning of, e.g. ``["blocks.2"]``."""
    num_stages: int
    """Number of stages the split spec produces (``len(split_spec) + 1``)."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    """``loss_fn(output, target) -> scalar``, or None for forward-only models."""
    target: torch.Tensor | None
    """Target for ``loss_fn`` matching ``args``' batch, or None."""
    description: str
    """One line saying what the entry exercises."""

    def __post_init__(self) -> None:
        spec = self.split_spec
        if isinstance(spec, (list, tuple)) and len(spec) + 1 != self.num_stages:
            raise ValueError(
                f"split_spec {self.split_spec!r} makes {len(self.split_spec) + 1} stages, "
                f"but num_stages={self.num_stages}"
            )
        if (self.loss_fn is None) != (self.target is None):
            raise ValueError("loss_fn and target must be given together")


def layer_split(prefix: str, n_layer: int, num_stages: int) -> list[str]:
    """Split points that cut ``prefix.0 .. prefix.{n_layer-1}`` into even stages.

    Example:
        >>> layer_split("blocks", 4, 4)
        ['blocks.1', 'blocks.2', 'blocks.3']
    """
    if not 1 <= num_stages <= n_layer:
        raise ValueError(f"num_stages={num_stages} must be between 1 and n_layer={n_layer}")
    return [f"{prefix}.{s * n_layer // num_stages}" for s in range(1, num_stages)]
