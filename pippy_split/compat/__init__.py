"""Drop-in for ``torch.distributed.pipelining``: change one import, keep the code.

    from pippy_split.compat import pipeline, SplitPoint, PipelineStage, ScheduleGPipe
    from pippy_split.compat.schedules import PipelineScheduleMulti, get_schedule_class
    from pippy_split.compat.microbatch import split_args_kwargs_into_chunks, TensorChunkSpec

The names, signatures, return values and exception types of torch 2.13's
public pipelining API, as thin wrappers over pippy_split's own
(``pippy_split.pipeline``, ``Pipe``, ``PipelineStage``, :mod:`pippy_split.schedule`,
:mod:`pippy_split.microbatch`); the objects are ours underneath, so pippy_split's
extras (skip edges, ``sched.loss``, ``simulate``, checkpointing) work on them.
This package never imports ``torch.distributed.pipelining``.

Where the peer differs from pippy_split's own API:

- ``pipeline(module, mb_args, mb_kwargs=None, split_spec=None, split_policy=None)``;
  ``pipe(*args)`` returns a tuple; ``pipe.info()``; ``build_stage(module, i, info, device)``;
- ``PipelineStage(submodule, stage_index, num_stages, device, input_args=None, ...,
  group=None, dw_builder=None)`` with ``.submod``;
- schedules: ``PipelineScheduleSingle`` (one stage) / ``PipelineScheduleMulti`` (a list),
  ``step(..., losses=, return_outputs=, loss_kwargs=)``, ``eval(..., target=, losses=)``,
  no ``loss_fn`` = forward only;
- ``split_args_kwargs_into_chunks`` -> ``(args_chunks, kwargs_chunks)``, each tensor
  chunked on its own; the schedules' ``step``/``eval`` chunk their inputs so too (a keyword
  argument of 8 rows beside positional ones of 64 is fine, as in the peer), while
  pippy_split's own schedules require chunked arguments to agree.

Where this package does more than the peer, on purpose:

- ``torch.compile`` under the zero-bubble schedules (``ScheduleInterleavedZeroBubble``,
  ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``): the peer refuses a stage holding a
  module compiled with ``torch.compile`` (``RuntimeError`` at construction); here such stages
  run under them with the unsplit model's gradients (``tests/compat/test_compile_zero_bubble.py``).
"""

from . import microbatch, schedules, stage
from .pipe import Pipe, PipeInfo, SplitPoint, pipe_split, pipeline
from .schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from .stage import PipelineStage, build_stage

__all__ = ["Pipe", "pipe_split", "SplitPoint", "pipeline", "PipelineStage", "build_stage", "Schedule1F1B",
           "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
           "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "PipeInfo", "microbatch", "schedules", "stage"]
