"""The peer's multi-stage runtime options (torch 2.15): FSDP residency and prefetch
(``max_active_stages``, ``unshard_lookahead``), deferred gradient-reduction waits
(``defer_reduce_grad_wait``) and a bound on sends in flight (``max_outstanding_sends``).

Part of the drop-in (:mod:`pippy_split.compat`), called by the constructors in
:mod:`.schedules`. None of them changes a step's losses, outputs or gradients in the peer:
they decide when the peer's own action list all-gathers FSDP parameters, waits for a
reduce-scatter or waits for a send. pippy_split's runtime has no such actions:

- an FSDP2 module all-gathers its parameters in its own pre-forward / pre-backward hooks and
  reshards per ``fully_shard(reshard_after_forward=...)``; its prefetching is FSDP2's
  (``module.set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``), which
  is where ``max_active_stages`` and ``unshard_lookahead`` have their equivalent;
- FSDP2's reduce-scatter runs on its own stream and is waited for by FSDP2 before the
  gradients are read, so ``defer_reduce_grad_wait`` has nothing to defer;
- every send of a step stays in flight until it is delivered (delivered ones are freed as
  the step goes), so no bound ``max_outstanding_sends`` is enforced.

So each option is checked as the peer checks it (a bad value is the same kind of error) and
accepted; a value other than the default, where it would steer the peer (the FSDP options on
a rank holding an FSDP2 stage, a send bound anywhere), warns once with what applies instead.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..schedule.pipeline_schedule import PipelineSchedule

__all__ = ["check_runtime_options"]


def check_runtime_options(sched: PipelineSchedule, max_active_stages: int, unshard_lookahead: Any, defer_reduce_grad_wait: bool,
                          max_outstanding_sends: int | None) -> None:
    """Check the four options on the schedule ``sched`` was just built as; warn where one is not driven.

    Raises:
        ValueError: ``max_active_stages`` not a positive int; ``unshard_lookahead`` neither
            ``"full"``, ``"auto"`` nor a tuple of one int in ``[1, max_active_stages]`` per pipeline
            rank; ``max_outstanding_sends`` not None or a non-negative int.

    Example:
        >>> class S: stages, placement = [], {0: 0, 1: 1}
        >>> check_runtime_options(S(), 3, (1, 2), False, None)   # accepted, nothing to warn about
        >>> check_runtime_options(S(), 0, "full", False, None)
        Traceback (most recent call last):
        ...
        ValueError: max_active_stages must be a positive int, got 0
    """
    if isinstance(max_active_stages, bool) or not isinstance(max_active_stages, int) or max_active_stages < 1:
        raise ValueError(f"max_active_stages must be a positive int, got {max_active_stages!r}")
    ranks = len(set(sched.placement.values()))
    if unshard_lookahead not in ("full", "auto"):
        if not isinstance(unshard_lookahead, tuple) or len(unshard_lookahead) != ranks or not all(
                isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= max_active_stages
                for k in unshard_lookahead):
            raise ValueError(f"unshard_lookahead must be 'full', 'auto' or a tuple of {ranks} ints (one per pipeline "
                             f"rank) in [1, max_active_stages={max_active_stages}], got {unshard_lookahead!r}")
    if max_outstanding_sends is not None and (isinstance(max_outstanding_sends, bool)
                                              or not isinstance(max_outstanding_sends, int) or max_outstanding_sends < 0):
        raise ValueError(f"max_outstanding_sends must be None or a non-negative int, got {max_outstanding_sends!r}")
    name = type(sched).__name__
    if max_outstanding_sends is not None:
        warnings.warn(f"{name}(max_outstanding_sends={max_outstanding_sends}): accepted, not enforced: pippy_split "
                      "keeps each send in flight until delivered and frees delivered ones during the step; results "
                      "are the same, memory held by sends is not bounded", stacklevel=3)
    given = {k: v for k, v, default in (("max_active_stages", max_active_stages, 3),
                                        ("unshard_lookahead", unshard_lookahead, "full"),
                                        ("defer_reduce_grad_wait", defer_reduce_grad_wait, False)) if v != default}
    if given and _holds_fsdp(sched):
        shown = ", ".join(f"{k}={v!r}" for k, v in given.items())
        warnings.warn(f"{name}({shown}): accepted, not driven: FSDP2's own hooks all-gather, prefetch and reduce "
                      "here; set residency with fully_shard(reshard_after_forward=...) and prefetch with "
                      "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch; results are the same",
                      stacklevel=3)


def _holds_fsdp(sched: PipelineSchedule) -> bool:
    if not sched.stages:
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for st in sched.stages for m in st.module.modules())
