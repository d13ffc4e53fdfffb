"""How a schedule's step starts on this rank, before its first message: :class:`StepStart`.

Part of the schedule layer, under :class:`~.pipeline_schedule.PipelineSchedule`, which makes
one when it is built and runs it at the start of every ``step()`` and ``eval()``. First come
the checks this rank can make alone: a split backward still exact (a wrapper such as
``fully_shard`` applied after construction makes I run the whole backward), the call read into
microbatches (:class:`~.step_inputs.StepCallReader`), ``loss_count``'s items of this rank's
targets. Then, where the step needs one (:meth:`StepStart.agrees`), the one all-reduce in which
every rank learns that all passed and what they share (:func:`.agree.agree_before_step`): the
batch's item count and each microbatch's dynamic sizes. A check failed on one rank is raised on
every rank alike, before any rank waits for a message; a step without the agreement runs no
collective before its messages, and a rank failing its own checks stops the others through the
failure channel (:class:`~.agree.FailureChannel`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..stage.groups import PipelineGroup
from ..stage.stage import PipelineStage
from .agree import StepGuard, agree_before_step
from .collectives import item_count, refuse_no_items
from .dynamic_sizes import share_sizes
from .runtime import StepContext
from .step_inputs import Chunking, StepCallReader

__all__ = ["StepStart"]


class StepStart:
    """The start of one schedule's steps on this rank: its checks, then the step's agreement where needed.

    Args:
        stages: this rank's stages.
        inputs: what a step reads of its call on this rank (made once per schedule).
        group: the schedule's pipeline group.
        last_where: the last stage and its rank, in words (``"stage 3 (rank 1)"``), for errors.
        splits_backward: whether the order splits the backward into I and W.
    """

    def __init__(self, stages: Sequence[PipelineStage], inputs: StepCallReader, group: PipelineGroup,
                 last_where: str, splits_backward: bool) -> None:
        self.stages = list(stages)
        self.last = next((s for s in self.stages if s.is_last), None)  # where this rank holds it
        self.inputs = inputs
        self.group = group
        self.last_where = last_where
        self.splits_backward = splits_backward
        self.ran: set[bool] = set()
        """The kinds of call (train: True, eval: False) that have run a step; the schedule adds to it."""

    def agrees(self, train: bool, counted: bool, every_step: bool) -> bool:
        """Whether this step starts with the agreement (the same answer on every rank): while no
        step of this kind has run (a mistake in the first batches leaves the schedule usable),
        with ``loss_count`` (``counted``: its items), with dynamic shapes (their sizes), or with
        ``every_step`` (the schedule's ``agree_every_step``)."""
        return every_step or train not in self.ran or self.inputs.sizes is not None or counted

    def context(self, args: tuple, kwargs: dict, target: Any, *, train: bool, n: int, guard: StepGuard,
                chunking: Chunking, loss_fn: Callable | None, loss_count: Callable[[Any], Any] | None,
                every_step: bool) -> tuple[StepContext, float | None]:
        """This step's inputs on this rank, and the batch's item count (``loss_count``'s, agreed by
        every rank; None without ``loss_count`` or outside training)."""
        ctx = StepContext(n_microbatches=n, train=train)
        error: Exception | None = None
        counted = train and loss_count is not None
        local_items = None
        agrees = self.agrees(train, counted, every_step)
        if not agrees:  # a failed check now stops every rank through the failure channel
            guard.communicating("in its own checks before its first message")
        sizes = None
        try:
            if self.splits_backward and train:  # a wrapper (fully_shard) applied after construction
                for st in self.stages:
                    st.check_split_backward()  # I runs the whole backward
            sizes = self.inputs.read(ctx, args, kwargs, target, chunking, loss_fn)
            if counted and self.last is not None and ctx.targets is not None:
                assert loss_count is not None
                local_items = item_count(loss_count, ctx.targets, self.last_where)
        except Exception as e:  # raised on every rank alike below, before any rank waits for a message
            if not agrees:
                raise
            error = e
        share = None
        if agrees:  # else nothing to share: no loss_count, static shapes (see agrees)
            sizes_reader = self.inputs.sizes
            if sizes_reader is not None and sizes is None:  # this rank failed before reading them
                sizes = sizes_reader(None, n)
            agreed = agree_before_step(error, self.group, "step()" if train else "eval()",
                                       share=local_items, sizes=sizes)
            share = agreed.share
            if counted:
                refuse_no_items(share if share is not None else 0.0, self.last_where)
            if sizes_reader is not None and agreed.sizes is not None and sizes is not None:
                ctx.bindings = share_sizes(sizes_reader.symbols, agreed.sizes, sizes, self.group)
        return ctx, share
