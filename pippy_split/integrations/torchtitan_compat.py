"""torchtitan's own pipeline code, run on :mod:`pippy_split.compat` instead of ``torch.distributed.pipelining``.

torchtitan's ``pipeline_parallel.py`` imports the pipelining API by name (``PipelineStage``,
``get_schedule_class``, the schedule base classes, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``, ``_PipelineSchedule``, ``_PipelineScheduleRuntime``).
:func:`compat_pipelining` points those names of that module at :mod:`pippy_split.compat` for a
block, and :func:`compat_pipeline_llm` is torchtitan's own ``pipeline_llm`` called inside it:
torchtitan's FQN lists, its ``_split_module`` deep copies, its ``parallelize_fn`` and its
``stage.submod = model_part`` all run unmodified, and the stages and schedule are pippy_split's.

    spec = dataclasses.replace(llama3.model_registry("8B"), pipelining_fn=compat_pipeline_llm)

Imports torchtitan (the ``pippy_split[torchtitan]`` extra) where it is installed; nothing else in
pippy_split does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

try:  # the pippy_split[torchtitan] extra; without it the module imports and says so when called
    import torchtitan.distributed.pipeline_parallel as _tt_pp
except ImportError:
    _tt_pp = None

from ..compat import schedules as _compat_schedules
from ..compat.stage import PipelineStage
from .torchtitan_tensor_parallel import TensorParallelCut

__all__ = ["compat_pipeline_llm", "compat_pipelining", "PIPELINING_NAMES"]


class _PipelineScheduleRuntime(_compat_schedules.PipelineScheduleMulti):
    """Stands for the peer's CSV-driven runtime: torchtitan builds it only for
    ``pipeline_parallel_schedule_csv``, which is refused here by name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "pipeline_parallel_schedule_csv on pippy_split.compat: the peer's CSV runtime is not provided; name a "
            "schedule in pipeline_parallel_schedule, or load the order with pippy_split's own Action CSV reader "
            "and run it with pippy_split.schedule.ScheduleFromOrder")


# Each name torchtitan 0.3.0's pipeline_parallel.py imports from torch.distributed.pipelining, and its answer here.
PIPELINING_NAMES: dict[str, Any] = {
    "PipelineStage": PipelineStage,
    "get_schedule_class": _compat_schedules.get_schedule_class,
    "PipelineScheduleMulti": _compat_schedules.PipelineScheduleMulti,
    "PipelineScheduleSingle": _compat_schedules.PipelineScheduleSingle,
    "ScheduleDualPipeV": _compat_schedules.ScheduleDualPipeV,
    "ScheduleZBVZeroBubble": _compat_schedules.ScheduleZBVZeroBubble,
    "_PipelineSchedule": _compat_schedules._PipelineSchedule,
    "_PipelineScheduleRuntime": _PipelineScheduleRuntime,
}


@contextlib.contextmanager
def compat_pipelining() -> Iterator[None]:
    """For the block, torchtitan's ``pipeline_parallel`` module resolves the pipelining API to
    :mod:`pippy_split.compat` (:data:`PIPELINING_NAMES`); the names are put back after.

    Raises:
        ImportError: torchtitan's ``pipeline_parallel`` no longer imports one of the names (another
            torchtitan than 0.3.0): the message names it.

    Example (torchtitan's own pipeline_llm, on pippy_split.compat):
        >>> PIPELINING_NAMES["PipelineStage"] is PipelineStage
        True
        >>> # with compat_pipelining(): torchtitan.distributed.pipeline_parallel.pipeline_llm(model, ...)
    """
    if _tt_pp is None:
        raise ImportError("compat_pipelining needs torchtitan: pip install 'pippy-split[torchtitan]' (and, without "
                          "CUDA, pip install --no-deps triton==3.8.0)")
    missing = [n for n in PIPELINING_NAMES if not hasattr(_tt_pp, n)]
    if missing:
        raise ImportError(f"torchtitan.distributed.pipeline_parallel has no {missing}: compat_pipelining knows the names "
                          "torchtitan 0.3.0 imports from torch.distributed.pipelining")
    saved = {n: getattr(_tt_pp, n) for n in PIPELINING_NAMES}
    for name, value in PIPELINING_NAMES.items():
        setattr(_tt_pp, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(_tt_pp, name, value)


def compat_pipeline_llm(model: torch.nn.Module, **kwargs: Any) -> tuple[Any, list[torch.nn.Module], bool, bool]:
    """torchtitan's own ``pipeline_llm`` (its FQN lists per stage), with stages and schedule from :mod:`pippy_split.compat`.

    Args:
        model: the model the Trainer built (on ``meta``).
        **kwargs: what the Trainer passes a ``pipelining_fn`` (``parallel_dims=``, ``training=``, ...).

    Returns:
        What torchtitan's ``pipeline_llm`` returns: ``(schedule, model_parts, has_first_stage,
        has_last_stage)``; the schedule takes the Trainer's ``step(arg_mbs=, kwarg_mbs=,
        target_mbs=, losses=, loss_kwargs=, return_outputs=False)``. Under tensor parallelism the
        activations torchtitan's parts exchange as DTensors cross each cut whole
        (:class:`~pippy_split.integrations.torchtitan_tensor_parallel.TensorParallelCut`).

    Example:
        >>> callable(compat_pipeline_llm)   # spec = dataclasses.replace(spec, pipelining_fn=compat_pipeline_llm)
        True
    """
    with compat_pipelining():
        schedule, parts, has_first, has_last = _tt_pp.pipeline_llm(model, **kwargs)
    cut = TensorParallelCut.of(model, kwargs["parallel_dims"])  # TP: torchtitan's DTensors cross the cuts
    if cut is not None:
        for stage in schedule.stages:
            cut.prepare(stage)
    return schedule, parts, has_first, has_last
