"""Where the layers above the split plug into it: the stage builder and the generate drivers,
and what ``generate`` returns.

``Pipe.build_stage``, ``Pipe.generate`` and ``PipelineSchedule.generate`` are public methods
of classes that ``stage/`` and ``generate/`` build on, so they cannot import them (the layers
import one way). Instead each of those packages hands its entry point here when it is
imported, and the methods call what was handed. ``pippy_split`` loads its names on first use
(PEP 562), so the first call loads the providing package by name if nothing has yet: a
plug-in's load, not an import this layer builds on (nothing here uses its names).

Example:
    >>> sorted(driver(kind).__name__ for kind in ("pipe", "schedule", "stage"))
    ['from_pipe', 'generate_in_process', 'generate_on_schedule']
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch

__all__ = ["provide", "driver", "Generation", "StageOptionsView"]

_PROVIDERS = {"pipe": "pippy_split.generate.distributed", "schedule": "pippy_split.generate.distributed",
              "stage": "pippy_split.stage"}

_drivers: dict[str, Callable[..., Any]] = {}


def provide(kind: str, fn: Callable[..., Any]) -> None:
    """Register ``fn`` as the entry point of ``kind``: ``"stage"`` builds a stage of a Pipe
    (``PipelineStage.from_pipe``); ``"pipe"`` / ``"schedule"`` generate in one process / on a
    schedule's ranks."""
    _drivers[kind] = fn


def driver(kind: str) -> Callable[..., Any]:
    """The entry point of ``kind`` (its package is loaded on first use)."""
    if kind not in _drivers:
        importlib.import_module(_PROVIDERS[kind])  # it calls provide()
    return _drivers[kind]


class StageOptionsView(Protocol):
    """The stage options ``Pipe.build_stage(options=)`` hands the stage builder: what this layer knows of
    :class:`pippy_split.stage.options.StageOptions`, which the stage layer (above this one) defines."""

    @property
    def activation_checkpoint(self) -> str | tuple[str, ...] | None: ...

    @property
    def mixed_precision(self) -> torch.dtype | None: ...

    @property
    def compile(self) -> bool | Mapping[str, Any]: ...


@dataclass(frozen=True)
class Generation:
    """The output of ``sched.generate`` / ``pipe.generate``, the same on every rank.

    Example:
        >>> out = Generation(torch.tensor([[5, 6, 7]]), None)
        >>> out.sequences.shape
        torch.Size([1, 3])
    """

    sequences: torch.Tensor
    """``(batch, prompt_len + max_new_tokens)`` int64: each prompt followed by its new tokens;
    after a row's ``eos_token_id`` the rest of the row is ``pad_token_id``."""
    logprobs: torch.Tensor | None
    """``(batch, max_new_tokens)`` float32: ``log_softmax`` of the model's logits at the chosen
    token (before temperature, top-k, top-p), 0 where the row had finished; None unless
    ``return_logprobs=True``."""
