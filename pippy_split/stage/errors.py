"""Errors raised while running a pipeline: they name stage, microbatch and peer."""

from __future__ import annotations

__all__ = ["PipelineError", "PipelineTimeout", "PipelineAborted"]


class PipelineError(RuntimeError):
    """Something went wrong in a pipeline step; the message names stage index,
    microbatch and (for communication) the peer stage and its rank."""


class PipelineTimeout(PipelineError):
    """A blocking wait ran past its timeout; the message says what was awaited."""


class PipelineAborted(PipelineError):
    """A rank failed in the middle of a step (after the step's first message), and this
    schedule's process group no longer carries its messages. The message names the rank
    that failed first, where (stage, microbatch, action) and its error. Every later
    ``step()`` / ``eval()`` of the schedule raises it again at once, on every rank: build
    a new process group and schedule (in a notebook, restart the ranks) and resume from a
    checkpoint. A failure *before* the first message (a bad input, a target that does not
    fit the output) is a plain error instead, and the next step works."""
