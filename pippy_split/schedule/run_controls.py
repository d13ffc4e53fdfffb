"""A schedule's probe and knob on its runtime: :class:`RunControls`, a base of the schedule classes.

Part of the schedule layer (… → **schedule** → runtime): what a user turns or watches on
the one :class:`~.runtime.Interpreter` a :class:`~.pipeline_schedule.PipelineSchedule`
runs its actions on, apart from the step itself: per-action timings
(:meth:`RunControls.timed_actions`) and whether sent outputs are freed
(:attr:`RunControls.release_sent_outputs`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch  # noqa: F401 - the examples use it

from .timing import ActionRecorder, ActionTiming

if TYPE_CHECKING:
    from ..stage.stage import PipelineStage
    from .runtime import Interpreter

__all__ = ["RunControls"]


class RunControls:
    """The runtime's probe and memory knob (a base of :class:`~.pipeline_schedule.PipelineSchedule`)."""

    # state the schedule holds (set in PipelineSchedule.__init__)
    stages: Sequence[PipelineStage]
    _runtime: Interpreter

    @contextlib.contextmanager
    def timed_actions(self, probe: Callable[[], Any] | None = None) -> Iterator[list[ActionTiming]]:
        """Record every compute action this rank runs inside the block: its start and end
        (``time.perf_counter()`` seconds) and, with ``probe``, what ``probe()`` returns right
        before and right after it (e.g. ``torch.cuda.memory_allocated``). A time includes
        waiting for the action's received inputs; on an accelerator the device is
        synchronised around each action (which slows the run: for measuring, not training).

        Example:
            >>> import pippy_split as ps; from torch.nn import Linear, ReLU, Sequential
            >>> pipe = ps.pipeline(Sequential(Linear(4, 8), ReLU(), Linear(8, 2)), ["2"], (torch.randn(2, 4),))
            >>> sched = ps.build_schedule(pipe, "ZBVZeroBubble", 4, loss_fn=torch.nn.functional.mse_loss)
            >>> with sched.timed_actions() as times: _ = sched.step(torch.randn(8, 4), target=torch.randn(8, 2))
            >>> [str(t.action) for t in times][:4], all(t.seconds >= 0 for t in times)
            (['0F0', '1F0', '1I0', '1W0'], True)
        """
        recorder = ActionRecorder(self.stages[0].device, probe)
        previous, self._runtime.observer = self._runtime.observer, recorder
        try:
            yield recorder.times
        finally:
            self._runtime.observer = previous

    @property
    def release_sent_outputs(self) -> bool | None:
        """Free the memory of a forward output once it is sent to another rank.

        Backward needs only the output's autograd node and shape, so its values are
        dropped unless autograd saved them. ``None`` (default): on accelerators
        (CUDA's caching allocator makes it free), not on CPU, where handing the pages
        back costs more time than it saves (see docs/performance.md). ``True`` /
        ``False`` force it.

        Example:
            >>> import pippy_split as ps
            >>> sched = ps.build_schedule(ps.pipeline(torch.nn.Linear(4, 2), None, (torch.randn(2, 4),)), "GPipe", 2)
            >>> sched.release_sent_outputs is None  # the default: released on accelerators, kept on CPU
            True
            >>> sched.release_sent_outputs = True   # also on CPU: less memory, slower steps
        """
        return self._runtime.release_sent

    @release_sent_outputs.setter
    def release_sent_outputs(self, on: bool | None) -> None:
        self._runtime.release_sent = None if on is None else bool(on)
        self._runtime.track_sent_outputs()
