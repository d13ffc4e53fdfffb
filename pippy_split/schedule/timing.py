"""Timing a schedule's actions as they run: :class:`ActionTiming`, its recorder, and :func:`recorded`.

Sits beside the runtime: :meth:`~pippy_split.schedule.PipelineSchedule.timed_actions` is
:func:`recorded`, which sets an :class:`ActionRecorder` as the
:class:`~pippy_split.schedule.runtime.Interpreter`'s observer for a block; the interpreter
calls it around every compute action. The planner (:mod:`pippy_split.plan.measure`) prices
actions from what it records.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

import torch

from .actions import Action

if TYPE_CHECKING:
    from .runtime import Interpreter

__all__ = ["ActionTiming", "ActionRecorder", "recorded"]


class ActionTiming(NamedTuple):
    """One compute action as :meth:`PipelineSchedule.timed_actions` saw it."""

    action: Action
    start: float
    end: float
    before: Any = None
    after: Any = None

    @property
    def seconds(self) -> float:
        return self.end - self.start


class ActionRecorder:
    """The observer :meth:`PipelineSchedule.timed_actions` hands the runtime: it calls
    :meth:`before` and :meth:`after` around each compute action, which append to ``times``, and
    :meth:`batch` after each batch of comm actions, which appends each of its actions to ``times``
    where ``messages`` is set."""

    def __init__(self, device: torch.device, probe: Callable[[], Any] | None, messages: bool = False) -> None:
        self.times: list[ActionTiming] = []
        self.messages = messages
        self.sync = device.type != "cpu"
        self.probe = probe
        self._open: tuple[float, Any] = (0.0, None)

    def before(self, action: Action) -> None:
        probed = self.probe() if self.probe is not None else None  # before the clock starts: not timed
        if self.sync:
            torch.accelerator.synchronize()  # what ran before (the probe's kernels included) is not timed
        self._open = (time.perf_counter(), probed)

    def after(self, action: Action) -> None:
        if self.sync:
            torch.accelerator.synchronize()
        end = time.perf_counter()
        self.times.append(ActionTiming(action, self._open[0], end, self._open[1],
                                       self.probe() if self.probe is not None else None))

    def batch(self, actions: list[Action], start: float, end: float) -> None:
        """A batch of comm actions posted at ``start``; ``end``: when the runtime went on (a decode
        batch's receives delivered; a training batch's are waited for later, by the compute)."""
        if self.messages:
            self.times.extend(ActionTiming(a, start, end) for a in actions)


@contextlib.contextmanager
def recorded(runtime: Interpreter, device: torch.device, probe: Callable[[], Any] | None = None,
             messages: bool = False) -> Iterator[list[ActionTiming]]:
    """Every compute action ``runtime`` runs inside the block, timed on ``device`` (synchronised around each
    action off CPU) with ``probe()`` before and after it: an :class:`ActionRecorder` is its observer for the
    block, the previous one back after; with ``messages``, each comm action too (its batch's post and
    the runtime going on). What :meth:`~pippy_split.schedule.PipelineSchedule.timed_actions` does."""
    recorder = ActionRecorder(device, probe, messages)
    previous, runtime.observer = runtime.observer, recorder
    try:
        yield recorder.times
    finally:
        runtime.observer = previous
