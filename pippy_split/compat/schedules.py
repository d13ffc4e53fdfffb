"""``torch.distributed.pipelining.schedules``'s classes over :mod:`pippy_split.schedule`.

Part of the drop-in (:mod:`pippy_split.compat`). Each class is our schedule of
the same name (``isinstance(s, pippy_split.ScheduleGPipe)`` holds) with the
peer's constructor, and ``step``/``eval`` as the peer has them:

- ``PipelineScheduleSingle`` (``ScheduleGPipe``, ``Schedule1F1B``) take one stage,
  ``PipelineScheduleMulti`` (the rest) a list of this rank's stages;
- ``step(*args, target=, losses=, return_outputs=True, loss_kwargs=None, **kwargs)``:
  ``losses`` is replaced by the step's per-microbatch losses, ``loss_kwargs`` go to
  ``loss_fn``; without a ``loss_fn`` the step is forward-only on every rank;
- ``eval(*args, target=, losses=, **kwargs)``: forward only, and with a target the
  per-microbatch losses land in ``losses``;
- ``ScheduleInterleaved1F1B`` with one stage per rank runs 1F1B;
- ``step``/``eval`` chunk each input tensor by its own size, as the peer does (a keyword
  argument of 8 rows beside positional ones of 64 is fine); pippy_split's own schedules
  require chunked arguments to agree.

Extra keyword arguments of the peer that change nothing here
(``backward_requires_autograd``, ``defer_pp_recv``, ``use_full_backward``) are accepted.

Example (one stage, so this process is the whole pipeline; on several ranks each builds
``pipe.build_stage(rank, device)``):
    >>> from pippy_split.compat import pipeline
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)); x = torch.randn(8, 4)
    >>> pipe = pipeline(model, (x[:2],), split_spec={})
    >>> sched = ScheduleGPipe(pipe.build_stage(0, torch.device("cpu")), 4, loss_fn=torch.nn.functional.mse_loss)
    >>> losses = []
    >>> out = sched.step(x, target=torch.zeros(8, 4), losses=losses)   # out and losses on the last rank
    >>> out.shape, len(losses)
    (torch.Size([8, 4]), 4)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Callable

import torch

from .. import schedule as _core
from ..microbatch import Microbatches, merge_chunks, split_args_kwargs
from ..stage import PipelineStage
from .microbatch import TensorChunkSpec, peer_chunk_specs

__all__ = ["get_schedule_class", "PipelineScheduleSingle", "PipelineScheduleMulti", "Schedule1F1B", "ScheduleGPipe",
           "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
           "ScheduleDualPipeV"]



def _step(self: _core.PipelineSchedule, *args: Any, target: Any = None, losses: list | None = None,
          return_outputs: bool = True, loss_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """One step over the whole batch, split into ``n_microbatches``.

    Args:
        *args / **kwargs: the model's inputs (needed where stage 0 lives).
        target: the loss target (needed where the last stage lives).
        losses: a list, replaced by this step's per-microbatch losses (last stage's rank).
        return_outputs: False returns None instead of the merged outputs.
        loss_kwargs: extra keyword arguments for ``loss_fn``.

    Returns:
        The merged outputs on the rank holding the last stage, else None.

    Without a ``loss_fn`` the step runs forward only (no gradients) on every rank.
    """
    with _chunked_like_the_peer(self, args, kwargs):
        return _run_step(self, *args, target=target, losses=losses, return_outputs=return_outputs,
                         loss_kwargs=loss_kwargs, **kwargs)


def _run_step(self: _core.PipelineSchedule, *args: Any, target: Any, losses: list | None, return_outputs: bool,
              loss_kwargs: dict[str, Any] | None, **kwargs: Any) -> Any:
    if self.loss_fn is None:
        out = _core.PipelineSchedule.eval(self, *args, **kwargs)
        if losses is not None and _holds_last(self):
            raise RuntimeError(f"{type(self).__name__}.step(losses=...): the schedule has no loss_fn, so there are "
                               "no losses; pass loss_fn= to the schedule")
        return out if return_outputs else None
    saved = self.loss_fn
    if loss_kwargs:
        self.loss_fn = functools.partial(saved, **loss_kwargs)
    try:
        out = _core.PipelineSchedule.step(self, *args, target=target, losses=losses, **kwargs)
    finally:
        self.loss_fn = saved
    return out if return_outputs else None


def _eval(self: _core.PipelineSchedule, *args: Any, target: Any = None, losses: list | None = None,
          **kwargs: Any) -> Any:
    """Forward only over the whole batch (no gradients), also before the first ``step()``.

    Args:
        *args / **kwargs: the model's inputs (needed where stage 0 lives).
        target: with a ``loss_fn``, the per-microbatch losses are computed ...
        losses: ... and replace this list's contents (last stage's rank).

    Returns:
        The merged outputs on the rank holding the last stage, else None.
    """
    with _chunked_like_the_peer(self, args, kwargs):
        return _run_eval(self, *args, target=target, losses=losses, **kwargs)


def _run_eval(self: _core.PipelineSchedule, *args: Any, target: Any, losses: list | None, **kwargs: Any) -> Any:
    if target is None or losses is None or self.loss_fn is None or not _holds_last(self):
        return _core.PipelineSchedule.eval(self, *args, **kwargs)
    per_mb: list[Any] = []
    merge_spec = self.output_merge_spec

    def keep(values: list) -> Any:  # our merge calls a callable spec with every microbatch's output
        per_mb.extend(values)
        return merge_chunks(values, merge_spec)

    self.output_merge_spec = keep
    try:
        out = _core.PipelineSchedule.eval(self, *args, **kwargs)
    finally:
        self.output_merge_spec = merge_spec
    if isinstance(out, Microbatches):  # given per-microbatch inputs: the outputs were not merged
        per_mb = list(out)
    device = next(st for st in self.stages if st.is_last).device
    targets = [a[0] for a, _ in split_args_kwargs((target,), {}, self.n_microbatches, names=["target"])]
    with torch.no_grad():
        losses[:] = [self.loss_fn(o, t.to(device) if isinstance(t, torch.Tensor) else t)
                     for o, t in zip(per_mb, targets)]
    return out


@contextlib.contextmanager
def _chunked_like_the_peer(sched: _core.PipelineSchedule, args: tuple, kwargs: dict) -> Iterator[None]:
    """For one ``step``/``eval``: the schedule's chunk specs replaced by per-tensor chunkers
    (:func:`~pippy_split.compat.microbatch.peer_chunk_specs`), so every input tensor is chunked
    by its own size, as the peer does. A rank given no inputs keeps the specs it has."""
    saved = sched.args_chunk_spec, sched.kwargs_chunk_spec
    if args or kwargs:
        sched.args_chunk_spec, sched.kwargs_chunk_spec = peer_chunk_specs(args, kwargs, sched.n_microbatches, *saved)
    try:
        yield
    finally:
        sched.args_chunk_spec, sched.kwargs_chunk_spec = saved


def _holds_last(sched: _core.PipelineSchedule) -> bool:
    return any(st.is_last for st in sched.stages)


class PipelineScheduleSingle(_core.PipelineSchedule):
    """Base of the schedules with one stage per rank (``ScheduleGPipe``, ``Schedule1F1B``)."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True) -> None:
        name = type(self).__name__
        if not self.order_name:
            raise TypeError(f"{name} is a base class; use ScheduleGPipe or Schedule1F1B")
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{name} takes this rank's one PipelineStage, got {type(stage).__name__}; for several "
                            "stages per rank use ScheduleInterleaved1F1B, ScheduleLoopedBFS, ...")
        super().__init__(stage, n_microbatches, loss_fn, scale_grads=scale_grads, args_chunk_spec=args_chunk_spec,
                         kwargs_chunk_spec=kwargs_chunk_spec, output_merge_spec=output_merge_spec)

    step = _step
    eval = _eval


class PipelineScheduleMulti(_core.PipelineSchedule):
    """Base of the schedules that take a list of this rank's stages."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, use_full_backward: bool | None = None,
                 scale_grads: bool = True, backward_requires_autograd: bool = True) -> None:
        name = type(self).__name__
        if not self.order_name:
            raise TypeError(f"{name} is a base class; use one of its subclasses (ScheduleInterleaved1F1B, "
                            "ScheduleZBVZeroBubble, ...) or pippy_split.schedule.ScheduleFromOrder for your own order")
        if isinstance(stages, PipelineStage) or not isinstance(stages, (list, tuple)):
            raise TypeError(f"{name} takes a list of this rank's stages, got {type(stages).__name__}; pass [stage]")
        super().__init__(list(stages), n_microbatches, loss_fn, scale_grads=scale_grads,
                         args_chunk_spec=args_chunk_spec, kwargs_chunk_spec=kwargs_chunk_spec,
                         output_merge_spec=output_merge_spec)

    step = _step
    eval = _eval

    @property
    def pipeline_order(self) -> dict[int, list[_core.Action | None]]:
        """Every rank's compute actions (``F``, ``B``, ``I``, ``W``), ``None`` = idle."""
        return self.order

    @property
    def stage_index_to_group_rank(self) -> dict[int, int]:
        """Which rank holds each stage."""
        return dict(self.placement)


class ScheduleGPipe(PipelineScheduleSingle, _core.ScheduleGPipe):
    """GPipe: all forwards, then all backwards; one stage per rank."""


class Schedule1F1B(PipelineScheduleSingle, _core.Schedule1F1B):
    """1F1B (PipeDream-Flush); one stage per rank."""


def _multi_init(self: PipelineScheduleMulti, stages: list[PipelineStage], n_microbatches: int,
                loss_fn: Callable | None = None, args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
                output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True,
                backward_requires_autograd: bool = True, defer_pp_recv: bool = False) -> None:
    """The peer's constructor of a multi-stage schedule (``backward_requires_autograd`` and
    ``defer_pp_recv`` are accepted and change nothing)."""
    PipelineScheduleMulti.__init__(self, stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                                   output_merge_spec, scale_grads=scale_grads)


class ScheduleLoopedBFS(PipelineScheduleMulti, _core.ScheduleLoopedBFS):
    """Breadth-first looped schedule; any number of stages per rank (rank r holds r, r+p, ...)."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False) -> None:
        PipelineScheduleMulti.__init__(self, stages, n_microbatches, loss_fn, None, None, output_merge_spec,
                                       scale_grads=scale_grads)


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti, _core.ScheduleInterleavedZeroBubble):
    """Zero bubble (ZB-H1) on looped placement, backward split into I and W; any stages per rank."""

    __init__ = _multi_init


class ScheduleZBVZeroBubble(PipelineScheduleMulti, _core.ScheduleZBVZeroBubble):
    """ZB-V: V placement, exactly 2 stages per rank (rank r holds r and 2p - 1 - r)."""

    __init__ = _multi_init


class ScheduleDualPipeV(PipelineScheduleMulti, _core.ScheduleDualPipeV):
    """DualPipeV: V placement, exactly 2 stages per rank, n_microbatches >= 2p - 1."""

    __init__ = _multi_init


class ScheduleInterleaved1F1B(PipelineScheduleMulti, _core.ScheduleInterleaved1F1B):
    """Interleaved 1F1B on looped placement (rank r holds r, r+p, ...); with one
    stage per rank it is 1F1B."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                 kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False) -> None:
        if isinstance(stages, (list, tuple)) and len(stages) == 1:
            self.order_name = _core.Schedule1F1B.order_name  # interleaving one chunk is 1F1B
        PipelineScheduleMulti.__init__(self, stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                                       output_merge_spec, scale_grads=scale_grads)


_BY_NAME = {
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "GPipe": ScheduleGPipe,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "PipelineScheduleSingle": PipelineScheduleSingle,
    "PipelineScheduleMulti": PipelineScheduleMulti,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}


def get_schedule_class(schedule_name: str) -> type:
    """The class for a schedule name, case-insensitive (``"1F1B"``, ``"ZBVZeroBubble"``, ...).

    Raises:
        ValueError: an unknown name; the message lists the valid ones.

    Example:
        >>> get_schedule_class("interleaved1f1b").__name__
        'ScheduleInterleaved1F1B'
    """
    key = str(schedule_name).lower()
    for name, cls in _BY_NAME.items():
        if key in (name.lower(), cls.__name__.lower()):
            return cls
    raise ValueError(f"Unknown schedule name {schedule_name!r}. The valid options are {list(_BY_NAME)}")
