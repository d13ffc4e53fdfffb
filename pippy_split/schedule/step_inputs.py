"""What a step reads from its call on this rank: :class:`StepCallReader`.

Part of the schedule layer, under :class:`~.pipeline_schedule.PipelineSchedule`: a step's
positional and keyword inputs split into microbatches (where this rank runs a stage that
reads model inputs), flattened as the trace took them, the targets split (where it holds
the last stage) and checked against the last stage's output shape, and the dynamic sizes
read off the inputs: every check a rank makes alone, before the step's agreement
(:mod:`.agree`) and before any message. What a step reads of the split is taken once,
when the schedule is built, so a step runs no code of ``split/``.

Example:
    >>> import pippy_split as ps
    >>> pipe = ps.pipeline(torch.nn.Linear(4, 2), None, (torch.randn(2, 4),))
    >>> inputs = StepCallReader([pipe.build_stage(0)], rank=0)
    >>> ctx = StepContext(n_microbatches=2, train=False)
    >>> _ = inputs.read(ctx, (torch.randn(4, 4),), {}, None, Chunking(None, None), None)
    >>> [len(flat) for flat in ctx.flat_inputs], ctx.flat_inputs[0][0].shape
    ([1, 1], torch.Size([2, 4]))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import torch  # noqa: F401 - the example uses it

from ..microbatch import MicrobatchError, split_args_kwargs
from ..microbatch.chunking import any_per_microbatch
from ..split.spec import InputKind
from ..stage.errors import PipelineError
from ..stage.stage import PipelineStage
from .dynamic_sizes import SizeReader, inputs_given_anyway
from .manual_shapes import refuse_unequal_microbatches
from .runtime import StepContext
from .target_check import TargetCheck

if TYPE_CHECKING:
    from ..stage.model_io import ModelInputs

__all__ = ["StepCallReader", "Chunking"]


class Chunking(NamedTuple):
    """How ``step()``'s positional and keyword inputs split into microbatches (the schedule's
    ``args_chunk_spec`` / ``kwargs_chunk_spec``)."""

    args: Any
    kwargs: Any


class StepCallReader:
    """What this rank's stages read of a step's call, made once per schedule."""

    def __init__(self, stages: Sequence[PipelineStage], rank: int) -> None:
        self.rank = rank
        self.first = next((s for s in stages if s.is_first), None)
        self.last = next((s for s in stages if s.is_last), None)
        self.pipe = stages[0].pipe
        pipe = self.pipe
        self.model_inputs: ModelInputs | None = pipe.model_inputs if pipe is not None else None
        self.arg_names: list[str] | None = pipe.arg_names if pipe is not None else None
        self.sizes = SizeReader(pipe.symbols, pipe.input_names) if pipe is not None and pipe.symbols else None
        """Reads each microbatch's dynamic sizes off the inputs (None: the split has none)."""
        self.reads_inputs = self.first is not None or any(  # a later stage may read a model input itself
            s.pipe is not None and any(sl.kind is InputKind.MODEL for sl in s.in_slots or []) for s in stages)
        self._target_check: TargetCheck | None = None  # made at the first step (loss_fn may change until then)

    def read(self, ctx: StepContext, args: tuple, kwargs: dict, target: Any, chunking: Chunking,
             loss_fn: Callable | None) -> Any:
        """Split this rank's inputs and targets into ``ctx``; no communication. Returns the
        dynamic sizes this rank read off its inputs (a tensor, zeros where it has none)."""
        n = ctx.n_microbatches
        if self.reads_inputs:
            self._split_inputs(ctx, args, kwargs, chunking)
        if self.last is not None and ctx.train:
            ctx.targets = self._split_targets(target, n, loss_fn)
        ctx.per_microbatch = any_per_microbatch(args, kwargs, target)
        if self.pipe is None and ctx.mb_args is not None:
            refuse_unequal_microbatches(ctx.mb_args, ctx.mb_kwargs or [])
        if self.pipe is None or self.model_inputs is None:
            return None
        flat = ctx.flat_inputs if self.reads_inputs or self.sizes is None else inputs_given_anyway(
            self.model_inputs, self.arg_names, args, kwargs, n, chunking.args, chunking.kwargs)
        sizes = self.sizes(flat, n) if self.sizes is not None else None
        if ctx.targets is not None and self.last is not None and loss_fn is not None:
            if self._target_check is None or self._target_check.loss_fn is not loss_fn:
                self._target_check = TargetCheck(loss_fn, self.pipe, self.last.stage_index, self.last.device)
            # dynamic dims: only the sizes of stage 0's inputs are the step's (others are checked against them later)
            self._target_check(ctx.targets, flat if self.first is not None or not self.pipe.symbols else None)
        return sizes

    def _split_inputs(self, ctx: StepContext, args: tuple, kwargs: dict, chunking: Chunking) -> None:
        if not args and not kwargs:
            first = self.first
            raise PipelineError(f"rank {self.rank} holds stage {first.stage_index if first else '?'} which reads "
                                "the model inputs, but step() was called without inputs")
        mbs = split_args_kwargs(tuple(args), dict(kwargs), ctx.n_microbatches, chunking.args, chunking.kwargs,
                                names=self.arg_names)
        if self.model_inputs is not None:
            ctx.flat_inputs = [_flat_microbatch(self.model_inputs, mb, a, k) for mb, (a, k) in enumerate(mbs)]
        ctx.mb_args = [a for a, _ in mbs]
        ctx.mb_kwargs = [k for _, k in mbs]

    def _split_targets(self, target: Any, n: int, loss_fn: Callable | None) -> list[Any]:
        assert self.last is not None
        if loss_fn is None:
            raise PipelineError(f"rank {self.rank} holds the last stage ({self.last.stage_index}) but the schedule has "
                                "no loss_fn: pass loss_fn= to the schedule (or use eval() for forward only)")
        if target is None:
            raise PipelineError(f"rank {self.rank} holds the last stage ({self.last.stage_index}) and needs target= in "
                                "step()")
        return [t[0][0] for t in split_args_kwargs((target,), {}, n, names=["target"])]


def _flat_microbatch(inputs: ModelInputs, mb: int, args: tuple, kwargs: dict) -> list[Any]:
    """One microbatch's model inputs, flat; a shape the trace cannot take names the microbatch."""
    try:
        return inputs.flatten(args, kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, MicrobatchError):
            raise
        raise type(e)(f"microbatch {mb}: {e}") from e
