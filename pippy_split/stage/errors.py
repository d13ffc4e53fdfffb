"""Errors raised while running a pipeline: they name stage, microbatch and peer."""

from __future__ import annotations

__all__ = ["PipelineError", "PipelineTimeout"]


class PipelineError(RuntimeError):
    """Something went wrong in a pipeline step; the message names stage index,
    microbatch and (for communication) the peer stage and its rank."""


class PipelineTimeout(PipelineError):
    """A blocking wait ran past its timeout; the message says what was awaited."""
