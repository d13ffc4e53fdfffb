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
    :meth:`before` and :meth:`after` around each compute action, which append to ``times``."""

    def __init__(self, device: torch.device, probe: Callable[[], Any] | None) -> None:
        self.times: list[ActionTiming] = []
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


@contextlib.contextmanager
def recorded(runtime: Interpreter, device: torch.device, probe: Callable[[], Any] | None = None,
             ) -> Iterator[list[ActionTiming]]:
    """Every compute action ``runtime`` runs inside the block, timed on ``device`` (synchronised around each
    action off CPU) with ``probe()`` before and after it: an :class:`ActionRecorder` is its observer for the
    block, the previous one back after. What :meth:`~pippy_split.schedule.PipelineSchedule.timed_actions` does."""
    recorder = ActionRecorder(device, probe)
    previous, runtime.observer = runtime.observer, recorder
    try:
        yield recorder.times
    finally:
        runtime.observer = previous
