"""How a stage runs, as one value: activation checkpointing, mixed precision, ``torch.compile``.

Part of the stage layer. ``build_schedule``, ``Pipe.build_stage``,
``PipelineStage.from_pipe`` and ``PipelineStage`` take these three keywords; each
builds one :class:`StageOptions` (checked once, with the place that took it) and hands
that value on, so the options travel together with one type from the user's call to
the stage.

Example:
    >>> StageOptions.of(activation_checkpoint=["blocks.*"], where="stage 0")
    StageOptions(activation_checkpoint=('blocks.*',), mixed_precision=None, compile=False)
    >>> StageOptions.of(activation_checkpoint=["blocks.*"], compile=True, where="stage 0")
    Traceback (most recent call last):
    ...
    ValueError: stage 0: compile=True with selective activation_checkpoint=['blocks.*'] is not supported ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .mixed_precision import check_mixed_precision
from .recompute import checkpoint_patterns

__all__ = ["StageOptions"]


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """The options every stage of a schedule runs with (checked: build one with :meth:`of`)."""

    activation_checkpoint: str | tuple[str, ...] | None = None
    """``None`` (keep every activation), ``"full"`` (recompute the stage before its backward) or
    module FQN patterns whose calls are recomputed (selective)."""
    mixed_precision: torch.dtype | None = None
    """``torch.bfloat16`` / ``torch.float16``: the stage runs under ``torch.autocast`` of that dtype."""
    compile: bool | Mapping[str, Any] = False
    """``torch.compile`` the stage (a mapping: ``torch.compile``'s keywords); its I computes the
    weight gradients too (W is empty)."""

    @classmethod
    def of(cls, activation_checkpoint: str | Sequence[str] | None = None, mixed_precision: torch.dtype | None = None,
           compile: bool | Mapping[str, Any] = False, *, where: str = "stage") -> StageOptions:
        """The options from the public keywords, checked; errors name ``where`` (e.g. ``"stage 2"``)."""
        patterns = checkpoint_patterns(activation_checkpoint, where)
        if isinstance(patterns, tuple) and compile:
            raise ValueError(f"{where}: compile=True with selective activation_checkpoint={list(patterns)} is not "
                             "supported (torch.compile does not trace saved-tensor hooks); use "
                             "activation_checkpoint='full' with compile=True, or compile=False")
        check_mixed_precision(mixed_precision, where)
        return cls(activation_checkpoint=patterns, mixed_precision=mixed_precision, compile=compile)

    @property
    def selective(self) -> tuple[str, ...] | None:
        """The module patterns of selective checkpointing (None when it is off or full)."""
        return self.activation_checkpoint if isinstance(self.activation_checkpoint, tuple) else None

    def compiled(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` through ``torch.compile`` when asked (else itself)."""
        if not self.compile:
            return module
        return torch.compile(module, **({} if self.compile is True else dict(self.compile)))  # type: ignore[return-value]
