"""Exceptions raised while tracing and splitting a model into a Pipe."""

from __future__ import annotations

__all__ = ["SplitError", "TraceError"]


class SplitError(ValueError):
    """A split spec that cannot be honoured (unknown FQN, empty stage, too many stages)."""


class TraceError(RuntimeError):
    """``torch.export`` could not trace the model; carries export's reason."""
