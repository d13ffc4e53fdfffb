"""pippy_split: pipeline parallelism for ordinary PyTorch models.

Public API (re-exports only). The flow, one direction: split (``pipeline()`` →
``Pipe``) → stage (``PipelineStage``) → schedule (pure action lists, lowered with
comms and validated) → runtime (one interpreter); README.md says how to use it.
"""

from . import checkpoint
from .clip import clip_grad_norm_
from .grad_scaler import PipelineGradScaler
from .microbatch import Microbatches, Replicate, TensorChunkSpec, merge_chunks, split_args_kwargs
from .parallelize import parallelize
from .plan import Candidate, CommModel, Plan, PlanError, plan
from .schedule import (
    Action,
    PipelineSchedule,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleError,
    ScheduleFromOrder,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    build_schedule,
    get_schedule_class,
    simulate,
    stage_to_rank,
    validate,
)
from .split import (
    MODEL_INPUT,
    Edge,
    Pipe,
    SplitError,
    SplitPoint,
    SymbolSource,
    TensorSpec,
    TraceError,
    pipe_split,
    pipeline,
)
from .split.balance import BalanceReport
from .stage import PipelineError, PipelineStage, PipelineTimeout

__all__ = ["checkpoint", "clip_grad_norm_", "PipelineGradScaler", "MODEL_INPUT", "Edge", "Pipe", "SplitError", "SplitPoint", "SymbolSource", "TensorSpec", "TraceError",
           "pipe_split", "pipeline", "PipelineError", "PipelineStage", "PipelineTimeout", "Replicate",
           "TensorChunkSpec", "Microbatches", "merge_chunks", "split_args_kwargs", "Action", "PipelineSchedule", "Schedule1F1B",
           "ScheduleDualPipeV", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
           "ScheduleLoopedBFS", "ScheduleZBVZeroBubble", "ScheduleFromOrder", "ScheduleError", "build_schedule", "get_schedule_class",
           "simulate", "stage_to_rank", "validate", "BalanceReport", "plan", "Plan", "Candidate", "PlanError",
           "CommModel", "parallelize"]
