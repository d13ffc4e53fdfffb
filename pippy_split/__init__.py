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


def _version() -> str:
    """The installed distribution's version; where this package runs from a source checkout
    that was never installed (only on ``sys.path``), the version its ``pyproject.toml`` states."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pippy-split")
    except PackageNotFoundError:
        pass
    import os
    import re

    pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        with open(pyproject, encoding="utf-8") as f:
            found = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
    except OSError:
        found = None
    return found.group(1) if found else "0+unknown"


__version__ = _version()

__all__ = ["checkpoint", "clip_grad_norm_", "PipelineGradScaler", "MODEL_INPUT", "Edge", "Pipe", "SplitError", "SplitPoint", "SymbolSource", "TensorSpec", "TraceError",
           "pipe_split", "pipeline", "PipelineError", "PipelineStage", "PipelineTimeout", "Replicate",
           "TensorChunkSpec", "Microbatches", "merge_chunks", "split_args_kwargs", "Action", "PipelineSchedule", "Schedule1F1B",
           "ScheduleDualPipeV", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
           "ScheduleLoopedBFS", "ScheduleZBVZeroBubble", "ScheduleFromOrder", "ScheduleError", "build_schedule", "get_schedule_class",
           "simulate", "stage_to_rank", "validate", "BalanceReport", "plan", "Plan", "Candidate", "PlanError",
           "CommModel", "parallelize"]
