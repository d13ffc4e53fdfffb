"""Timing a schedule's actions as they run: :class:`ActionTiming` and its recorder.

Sits beside the runtime: :meth:`~pippy_split.schedule.PipelineSchedule.timed_actions`
sets an :class:`ActionRecorder` as the :class:`~pippy_split.schedule.runtime.Interpreter`'s
observer, which calls it around every compute action; the planner
(:mod:`pippy_split.plan.measure`) prices actions from what it records.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import torch

from .actions import Action

__all__ = ["ActionTiming", "ActionRecorder"]


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
