"""Drop-in for ``torch.distributed.pipelining``: change one import, keep the code.

    from pippy_split.compat import pipeline, SplitPoint, PipelineStage, ScheduleGPipe
    from pippy_split.compat.schedules import PipelineScheduleMulti, get_schedule_class
    from pippy_split.compat.microbatch import split_args_kwargs_into_chunks, TensorChunkSpec

The names, signatures, return values and exception types of the public pipelining API
of torch 2.13, 2.14 and 2.15 (their union; ``tests/compat/peer_surfaces.json`` records each), as thin wrappers over pippy_split's own
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

What torch 2.14 and 2.15 added, and what it means here:

- ``step``/``eval(arg_mbs=, kwarg_mbs=, target_mbs=)``: microbatches already split become
  :class:`pippy_split.Microbatches` (:mod:`.presplit`), so they may differ in size (in a dim
  the pipe was traced dynamic in); outputs are merged as the peer merges them where they
  concatenate, else returned one per microbatch;
- ``step(finalize_gradients=False)``: FSDP2 stages keep gradient sync off for the step, so their
  gradients accumulate unreduced until a step with True (elsewhere gradients accumulate in
  ``.grad`` across steps anyway, as in the peer);
- ``max_active_stages``, ``unshard_lookahead``, ``defer_reduce_grad_wait``,
  ``max_outstanding_sends`` on the multi-stage schedules: checked as the peer checks them and
  accepted; FSDP2's own hooks and our transport decide what they decide in the peer, and a value
  that would steer the peer warns with the equivalent (:mod:`.runtime_options`);
- ``PipelineStage.register_forward_context`` with ``PipelineStageInfo``; ``PipelineActivationLiveness``
  and ``analyze_pipeline_activation_liveness`` over our order (:mod:`.liveness`);
- the action IR's ``WAIT_SEND_F``/``WAIT_SEND_B``/``WAIT_REDUCE_GRAD`` (private in the peer) have no
  action here: a send stays in flight until delivered, FSDP2 waits for its own reduce-scatter.

Where this package does more than the peer, on purpose:

- ``torch.compile`` under the zero-bubble schedules (``ScheduleInterleavedZeroBubble``,
  ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``): the peer refuses a stage holding a
  module compiled with ``torch.compile`` (``RuntimeError`` at construction); here such stages
  run under them with the unsplit model's gradients (``tests/compat/test_compile_zero_bubble.py``).
"""

from . import microbatch, schedules, stage
from .liveness import PipelineActivationLiveness, analyze_pipeline_activation_liveness
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
from .stage import PipelineStage, PipelineStageInfo, build_stage

__all__ = ["analyze_pipeline_activation_liveness", "Pipe", "pipe_split", "SplitPoint", "pipeline", "PipelineStage",
           "PipelineActivationLiveness", "PipelineStageInfo", "build_stage", "Schedule1F1B",
           "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
           "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "PipeInfo", "microbatch", "schedules", "stage"]
