"""Generation on the split you train: a KV cache per stage, lanes in flight, live weights.

Where this sits: beside the training flow, reusing it. ``pipe.generate`` and
``sched.generate`` hand over here. :mod:`.decode_model` is the decode step as a module,
:mod:`.program` its trace cut where the training pipe is cut (each stage keeps its own
layers' cache; :mod:`.phased` and :mod:`.recurrent` for a recurrent state, :mod:`.programs`
which of them a pipe decodes with), :mod:`.stage_step` one stage's step for a lane,
:mod:`.lanes` each lane's slots (what it feeds, which waiting row takes a finished row's slot)
and what the rows produced, :mod:`.sampling` the token choice and :mod:`.distributed` the one
driver, in one process or on the schedule's ranks. The decode order itself is data
of the schedule layer (:mod:`pippy_split.schedule.decode_order`: built, lowered,
validated, simulated by ``ps.simulate``, run by the training runtime's ``Interpreter``).
``Pipe`` and ``PipelineSchedule`` sit below this package, so :mod:`.distributed` hands them
its drivers when it is loaded (:mod:`pippy_split.split.hand_over`). Importing this package
stays light (its errors and options): a command that only reports a generate error loads no
tracing code.
"""

from __future__ import annotations

from typing import Any

from .errors import GenerationError
from .options import GenerateOptions

__all__ = ["Generation", "GenerateOptions", "GenerationError"]


def __getattr__(name: str) -> Any:
    if name == "Generation":  # its home is the hand-over module below the split (PEP 562: loaded on use)
        from ..split.hand_over import Generation

        return Generation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
