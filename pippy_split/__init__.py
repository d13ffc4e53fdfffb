"""pippy_split: pipeline parallelism for ordinary PyTorch models.

Public API (re-exports only). The flow, one direction: split (``pipeline()`` →
``Pipe``) → stage (``PipelineStage``) → schedule (pure action lists, lowered with
comms and validated) → runtime (one interpreter); README.md and docs/ say how to use it.

Names are imported on first use (PEP 562), so ``import pippy_split`` and the
``pippy-split`` command's ``--help`` do not import torch; ``ps.pipeline`` and every
other name below resolve exactly as plain imports would.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# name -> the module (relative to this package) that defines it
_HOMES = {
    "clip_grad_norm_": ".clip",
    "PipelineGradScaler": ".grad_scaler",
    **dict.fromkeys(["Microbatches", "Replicate", "TensorChunkSpec", "merge_chunks", "split_args_kwargs"],
                    ".microbatch"),
    "parallelize": ".parallelize",
    **dict.fromkeys(["Candidate", "CommModel", "Plan", "PlanError", "plan"], ".plan"),
    **dict.fromkeys(["Cluster", "ClusterLayout", "ClusterPlan", "ModelShape", "Runtime", "plan_cluster"],
                    ".plan.cluster"),
    **dict.fromkeys(["Action", "PipelineSchedule", "Schedule1F1B", "ScheduleDualPipeV", "ScheduleError",
                     "ScheduleFromOrder", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
                     "ScheduleLoopedBFS", "ScheduleZBVZeroBubble", "build_schedule", "get_schedule_class",
                     "simulate", "stage_to_rank", "validate"], ".schedule"),
    **dict.fromkeys(["MODEL_INPUT", "Edge", "Pipe", "SplitError", "SplitPoint", "SymbolSource", "TensorSpec",
                     "TraceError", "pipe_split", "pipeline"], ".split"),
    "BalanceReport": ".split.balance",
    **dict.fromkeys(["Generation", "GenerationError"], ".generate"),
    **dict.fromkeys(["PipelineAborted", "PipelineError", "PipelineStage", "PipelineTimeout"], ".stage"),
}
_SUBMODULES = {"checkpoint"}  # public submodules reached as attributes (ps.checkpoint.save)

if TYPE_CHECKING:
    from . import checkpoint
    from .clip import clip_grad_norm_
    from .generate import Generation, GenerationError
    from .grad_scaler import PipelineGradScaler
    from .microbatch import Microbatches, Replicate, TensorChunkSpec, merge_chunks, split_args_kwargs
    from .parallelize import parallelize
    from .plan import Candidate, CommModel, Plan, PlanError, plan
    from .plan.cluster import Cluster, ClusterLayout, ClusterPlan, ModelShape, Runtime, plan_cluster
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
    from .stage import PipelineAborted, PipelineError, PipelineStage, PipelineTimeout


class _Package(types.ModuleType):
    """This package's module type: a submodule named like a public function (``plan``,
    ``parallelize``) is not bound over the function when it is imported, as the eager
    ``from .plan import plan`` used to leave it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _HOMES:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and keep the name here."""
    if name in _SUBMODULES:
        value: Any = importlib.import_module(f".{name}", __name__)
    elif name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    elif name == "__version__":
        value = _version()
    else:
        raise AttributeError(f"module 'pippy_split' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})


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


__all__ = ["checkpoint", "clip_grad_norm_", "PipelineGradScaler", "MODEL_INPUT", "Edge", "Pipe", "SplitError",
           "SplitPoint", "SymbolSource", "TensorSpec", "TraceError", "pipe_split", "pipeline", "PipelineAborted", "PipelineError",
           "PipelineStage", "PipelineTimeout", "Replicate", "TensorChunkSpec", "Microbatches", "merge_chunks",
           "split_args_kwargs", "Action", "PipelineSchedule", "Schedule1F1B", "ScheduleDualPipeV", "ScheduleGPipe",
           "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble",
           "ScheduleFromOrder", "ScheduleError", "build_schedule", "get_schedule_class", "simulate", "stage_to_rank",
           "validate", "BalanceReport", "plan", "Plan", "Candidate", "PlanError", "CommModel", "parallelize",
           "Generation", "GenerationError", "Cluster", "ClusterPlan", "plan_cluster", "Runtime",
           "ClusterLayout", "ModelShape"]
