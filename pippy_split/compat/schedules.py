"""``torch.distributed.pipelining.schedules``'s classes over :mod:`pippy_split.schedule`.

Part of the drop-in (:mod:`pippy_split.compat`). Each class is our schedule of
the same name (``isinstance(s, pippy_split.ScheduleGPipe)`` holds) with the
peer's constructor, and ``step``/``eval`` as the peer has them:

- ``PipelineScheduleSingle`` (``ScheduleGPipe``, ``Schedule1F1B``) take one stage (or a list of
  one, as ``ps.build_schedule`` hands it),
  ``PipelineScheduleMulti`` (the rest) a list of this rank's stages;
- ``step(*args, target=, losses=, return_outputs=True, loss_kwargs=None, arg_mbs=, kwarg_mbs=,
  target_mbs=, finalize_gradients=True, **kwargs)``: ``losses`` is replaced by the step's
  per-microbatch losses, ``loss_kwargs`` go to ``loss_fn``; without a ``loss_fn`` the step is
  forward-only on every rank; ``arg_mbs``/... take microbatches already split (:mod:`.presplit`);
- ``eval(*args, target=, losses=, **kwargs)``: forward only, and with a target the
  per-microbatch losses land in ``losses``;
- ``ScheduleInterleaved1F1B`` with one stage per rank runs 1F1B;
- ``step``/``eval`` chunk each input tensor by its own size, as the peer does (a keyword
  argument of 8 rows beside positional ones of 64 is fine); pippy_split's own schedules
  require chunked arguments to agree.

Extra keyword arguments of the peer that change nothing here
(``backward_requires_autograd``, ``defer_pp_recv``, ``use_full_backward``) are accepted; the
FSDP and send options of 2.15's multi-stage schedules as :mod:`.runtime_options` says.

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
from typing import Any, Callable, Literal

import torch

from .. import schedule as _core
from ..microbatch import Microbatches, merge_chunks, split_args_kwargs
from ..stage import PipelineStage
from .liveness import PipelineActivationLiveness, analyze_pipeline_activation_liveness
from .microbatch import TensorChunkSpec, peer_chunk_specs
from .presplit import merged, presplit_inputs
from .runtime_options import check_runtime_options

__all__ = ["analyze_pipeline_activation_liveness", "get_schedule_class", "PipelineActivationLiveness",
           "PipelineScheduleSingle", "PipelineScheduleMulti", "Schedule1F1B", "ScheduleGPipe",
           "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
           "ScheduleDualPipeV"]



def _step(self: _core.PipelineSchedule, *args: Any, target: Any = None, losses: list | None = None,
          return_outputs: bool = True, loss_kwargs: dict[str, Any] | None = None, arg_mbs: Any = None,
          kwarg_mbs: Any = None, target_mbs: Any = None, finalize_gradients: bool = True, **kwargs: Any) -> Any:
    """One step over the whole batch, split into ``n_microbatches``, or over microbatches already split.

    Args:
        *args / **kwargs: the model's inputs (needed where stage 0 lives).
        target: the loss target (needed where the last stage lives).
        losses: a list, replaced by this step's per-microbatch losses (last stage's rank).
        return_outputs: False returns None instead of the merged outputs.
        loss_kwargs: extra keyword arguments for ``loss_fn``.
        arg_mbs / kwarg_mbs / target_mbs: instead of ``*args`` / ``**kwargs`` / ``target``, one
            tuple / dict / target per microbatch (torch 2.14+); they become
            :class:`pippy_split.Microbatches`, so microbatches may differ in size.
        finalize_gradients: False leaves an FSDP2 stage's gradients unreduced and accumulating
            until a later step with True reduces the sum (torch 2.15+); no effect elsewhere,
            where gradients accumulate in ``.grad`` across steps anyway.

    Returns:
        The merged outputs on the rank holding the last stage, else None (pre-split microbatches
        that differ in a dim the merge cannot join: their outputs, as ``Microbatches``).

    Without a ``loss_fn`` the step runs forward only (no gradients) on every rank.
    """
    given = presplit_inputs(self.n_microbatches, args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs, "step")
    with _gradient_sync_deferred(self, not finalize_gradients):
        if given is None:
            with _chunked_like_the_peer(self, args, kwargs):
                return _run_step(self, *args, target=target, losses=losses, return_outputs=return_outputs,
                                 loss_kwargs=loss_kwargs, **kwargs)
        mb_args, mb_kwargs, mb_target = given
        out = _run_step(self, *mb_args, target=mb_target, losses=losses, return_outputs=return_outputs,
                        loss_kwargs=loss_kwargs, **mb_kwargs)
    return merged(out, self.output_merge_spec)


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
          arg_mbs: Any = None, kwarg_mbs: Any = None, target_mbs: Any = None, **kwargs: Any) -> Any:
    """Forward only over the whole batch (no gradients), also before the first ``step()``.

    Args:
        *args / **kwargs: the model's inputs (needed where stage 0 lives).
        target: with a ``loss_fn``, the per-microbatch losses are computed ...
        losses: ... and replace this list's contents (last stage's rank).
        arg_mbs / kwarg_mbs / target_mbs: microbatches already split, as for ``step``.

    Returns:
        The merged outputs on the rank holding the last stage, else None.
    """
    given = presplit_inputs(self.n_microbatches, args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs, "eval")
    if given is None:
        with _chunked_like_the_peer(self, args, kwargs):
            return _run_eval(self, *args, target=target, losses=losses, **kwargs)
    mb_args, mb_kwargs, mb_target = given
    return merged(_run_eval(self, *mb_args, target=mb_target, losses=losses, **mb_kwargs), self.output_merge_spec)


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


@contextlib.contextmanager
def _gradient_sync_deferred(sched: _core.PipelineSchedule, defer: bool) -> Iterator[None]:
    """``step(finalize_gradients=False)``: for one step, every FSDP2 module of this rank's stages
    keeps its gradients unreduced (FSDP2 accumulates them unsharded), though the runtime turns
    gradient sync on for each stage's last backward; a later step reduces the accumulated sum.
    The override lives on the module for the step only."""
    if not defer:
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    held = [m for st in sched.stages for m in st.module.modules() if isinstance(m, FSDPModule)]
    for m in held:
        m.set_requires_gradient_sync(False, recurse=False)
        # the runtime's set_grad_sync(module, True) on the last backward finds this instead
        object.__setattr__(m, "set_requires_gradient_sync", functools.partial(_keep_sync_off, m))
    try:
        yield
    finally:
        for m in held:
            object.__delattr__(m, "set_requires_gradient_sync")


def _keep_sync_off(module: Any, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
    type(module).set_requires_gradient_sync(module, False, recurse=recurse)


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
        if isinstance(stage, (list, tuple)) and len(stage) == 1:
            stage = stage[0]  # ps.build_schedule hands every class this rank's stages as a list
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

    def register_custom_function(self, computation_type: Any, custom_function: Callable[..., None]) -> None:
        """The peer's hook to run a user's function for one action kind of its IR; refused here.

        Raises:
            NotImplementedError: always: the runtime dispatches every action kind of pippy_split's
                own IR (F, B, I, W and the sends and receives) to its handlers; a stage's forward
                can be wrapped with ``register_forward_context``, its weight gradients computed by
                a ``dw_builder``, and a whole custom order run with ``ScheduleFromOrder``.
        """
        raise NotImplementedError(f"{type(self).__name__}.register_custom_function({computation_type!r}, ...) is not "
                                  "supported: wrap a stage's forward with stage.register_forward_context(...), give "
                                  "PipelineStage(dw_builder=...) for weight gradients, or run your own action order "
                                  "with pippy_split.schedule.ScheduleFromOrder")


class ScheduleGPipe(PipelineScheduleSingle, _core.ScheduleGPipe):
    """GPipe: all forwards, then all backwards; one stage per rank."""


class Schedule1F1B(PipelineScheduleSingle, _core.Schedule1F1B):
    """1F1B (PipeDream-Flush); one stage per rank."""


def _multi_init(self: PipelineScheduleMulti, stages: list[PipelineStage], n_microbatches: int,
                loss_fn: Callable | None = None, args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
                kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
                output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True,
                backward_requires_autograd: bool = True, defer_pp_recv: bool = False, max_active_stages: int = 3,
                unshard_lookahead: Literal["full", "auto"] | tuple[int, ...] = "full", *,
                defer_reduce_grad_wait: bool = False, max_outstanding_sends: int | None = None) -> None:
    """The peer's constructor of a multi-stage schedule (``backward_requires_autograd`` and
    ``defer_pp_recv`` are accepted and change nothing; the FSDP and send options as
    :func:`~pippy_split.compat.runtime_options.check_runtime_options` says)."""
    PipelineScheduleMulti.__init__(self, stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                                   output_merge_spec, scale_grads=scale_grads)
    check_runtime_options(self, max_active_stages, unshard_lookahead, defer_reduce_grad_wait, max_outstanding_sends)


class ScheduleLoopedBFS(PipelineScheduleMulti, _core.ScheduleLoopedBFS):
    """Breadth-first looped schedule; any number of stages per rank (rank r holds r, r+p, ...)."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 output_merge_spec: dict[str, Any] | tuple[Any] | None = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False, max_active_stages: int = 3,
                 unshard_lookahead: Literal["full", "auto"] | tuple[int, ...] = "full", *,
                 defer_reduce_grad_wait: bool = False, max_outstanding_sends: int | None = None) -> None:
        PipelineScheduleMulti.__init__(self, stages, n_microbatches, loss_fn, None, None, output_merge_spec,
                                       scale_grads=scale_grads)
        check_runtime_options(self, max_active_stages, unshard_lookahead, defer_reduce_grad_wait,
                              max_outstanding_sends)


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
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False, max_active_stages: int = 3,
                 unshard_lookahead: Literal["full", "auto"] | tuple[int, ...] = "full", *,
                 defer_reduce_grad_wait: bool = False, max_outstanding_sends: int | None = None) -> None:
        if isinstance(stages, (list, tuple)) and len(stages) == 1:
            self.order_name = _core.Schedule1F1B.order_name  # interleaving one chunk is 1F1B
        PipelineScheduleMulti.__init__(self, stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                                       output_merge_spec, scale_grads=scale_grads)
        check_runtime_options(self, max_active_stages, unshard_lookahead, defer_reduce_grad_wait,
                              max_outstanding_sends)


# The peer's private common base of PipelineScheduleSingle and PipelineScheduleMulti. Code written
# for the peer names it (torchtitan's type checks, the peer's own get_schedule_class test), so
# issubclass(get_schedule_class(name), _PipelineSchedule) holds here as there.
_PipelineSchedule = _core.PipelineSchedule

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
