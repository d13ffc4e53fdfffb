"""Generation on the split you train: a KV cache per stage, lanes in flight, live weights.

Where this sits: beside the training flow, reusing it. ``pipe.generate`` and
``sched.generate`` hand over here. :mod:`.decode_model` is the decode step as a module,
:mod:`.program` its trace cut where the training pipe is cut (each stage keeps its own
layers' cache), :mod:`.stage_step` one stage's step for a lane, :mod:`.lanes` each lane's
slots (what it feeds, which waiting row takes a finished row's slot) and what the rows
produced, :mod:`.sampling` the token choice, :mod:`.local` the one-process driver and
:mod:`.distributed` the driver on the schedule's ranks. The decode order itself is data
of the schedule layer (:mod:`pippy_split.schedule.decode_order`: built, lowered,
validated, simulated by ``ps.simulate``, run by the training runtime's ``Interpreter``).
``Pipe`` and ``PipelineSchedule`` sit below this package, so it hands them its drivers
(:mod:`pippy_split.split.hand_over`).
"""

from __future__ import annotations

from ..split.hand_over import Generation, provide
from .distributed import generate_in_process, generate_on_schedule
from .errors import GenerationError
from .options import GenerateOptions

provide("pipe", generate_in_process)  # Pipe.generate and PipelineSchedule.generate call these
provide("schedule", generate_on_schedule)

__all__ = ["Generation", "GenerateOptions", "GenerationError"]
