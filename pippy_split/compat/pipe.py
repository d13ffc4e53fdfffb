"""``pipeline()``, ``Pipe`` and ``PipeInfo`` with torch.distributed.pipelining's shapes.

Part of the drop-in (:mod:`pippy_split.compat`), at the split end of the flow
(split → **Pipe** → stage → schedule → runtime). A thin layer over
:func:`pippy_split.pipeline`: the peer's argument order, a ``Pipe`` that is an
``nn.Module`` whose call returns a flat tuple of outputs, ``pipe.info()`` and
``pipe.build_stage(...)`` returning a :class:`pippy_split.compat.PipelineStage`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from ..microbatch import merge_chunks, split_args_kwargs
from ..split import Pipe as _CorePipe
from ..split import SplitPoint, pipe_split
from ..split import pipeline as _core_pipeline
from .stage import PipelineStage, adopt

__all__ = ["Pipe", "PipeInfo", "SplitPoint", "pipe_split", "pipeline"]


@dataclass(frozen=True)
class PipeInfo:
    """What ``build_stage`` needs to know about a pipe (``pipe.info()``)."""

    graph: torch.fx.Graph
    """The traced graph of the whole model."""
    num_stages: int
    """Number of stages."""
    has_loss_and_backward: bool = False
    """Always False: the loss is the schedule's ``loss_fn``, never traced into the pipe."""
    pipe: _CorePipe | None = field(default=None, repr=False, compare=False)
    """The :class:`pippy_split.Pipe` the stages are built from."""


class Pipe(torch.nn.Module):
    """A traced, split model in torch.distributed.pipelining's shape (an ``nn.Module``).

    ``split_gm.submod_pp_<i>`` are the stage modules (state_dict keys = the model's
    FQNs), ``pipe(*args)`` runs them in this process and returns the model's
    outputs as a flat tuple, ``core_pipe`` is the :class:`pippy_split.Pipe` with
    edges, summary and everything else. Build one with :func:`pipeline`.

    Args:
        core_pipe: the split model.
        example_batch: the traced microbatch's batch size (dim 0 of its tensors): a
            call with k times as many rows runs as k microbatches, merged on dim 0
            (the peer runs the whole batch through graphs traced on one microbatch).
    """

    def __init__(self, core_pipe: _CorePipe, example_batch: int | None = None) -> None:
        super().__init__()
        self.core_pipe = core_pipe
        self.example_batch = example_batch
        self.split_gm = torch.nn.Module()
        for i in range(core_pipe.num_stages):
            self.split_gm.add_module(f"submod_pp_{i}", core_pipe.get_stage_module(i))
        self.has_loss_and_backward = False
        self.loss_spec = None

    @property
    def num_stages(self) -> int:
        return self.core_pipe.num_stages

    def forward(self, *args: Any, **kwargs: Any) -> tuple:
        """All stages in this process; the model's outputs flattened into a tuple."""
        k = self._microbatches_in(args, kwargs)
        if k == 1:
            return tuple(pytree.tree_leaves(self.core_pipe(*args, **kwargs)))
        outs = [self.core_pipe(*a, **kw) for a, kw in split_args_kwargs(args, kwargs, k)]
        return tuple(pytree.tree_leaves(merge_chunks(outs)))

    def _microbatches_in(self, args: tuple, kwargs: dict) -> int:
        """k when every batched input has k times the traced batch size, else 1."""
        sizes = _batch_sizes((args, kwargs))
        if self.example_batch is None or len(sizes) != 1:
            return 1
        size = sizes.pop()
        return size // self.example_batch if size > self.example_batch and size % self.example_batch == 0 else 1

    def get_stage_module(self, stage_idx: int) -> torch.nn.Module:
        """The module of stage ``stage_idx``."""
        self._check(stage_idx)
        return self.core_pipe.get_stage_module(stage_idx)

    def info(self) -> PipeInfo:
        """The :class:`PipeInfo` for :func:`pippy_split.compat.build_stage`."""
        return PipeInfo(self.core_pipe.graph, self.num_stages, False, pipe=self.core_pipe)

    def build_stage(self, stage_index: int, device: torch.device | None,
                    group: torch.distributed.ProcessGroup | None = None) -> PipelineStage:
        """The :class:`pippy_split.compat.PipelineStage` of one stage, its module moved to ``device``.

        Example (each rank builds its own stage: ``pipe.build_stage(rank, device)``):
            >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]); x = torch.randn(2, 8)
            >>> pipe = pipeline(model, (x,), split_spec={"2": SplitPoint.BEGINNING})
            >>> stage = pipe.build_stage(1, torch.device("cpu"))
            >>> stage.stage_index, sorted(stage.submod.state_dict())
            (1, ['2.bias', '2.weight', '3.bias', '3.weight'])
        """
        self._check(stage_index)
        return adopt(self.core_pipe.build_stage(stage_index, device, group))

    def _check(self, stage_index: int) -> None:
        if not 0 <= stage_index < self.num_stages:
            raise ValueError(f"Invalid stage index {stage_index}: the pipe has {self.num_stages} stages")

    def __repr__(self) -> str:
        return repr(self.core_pipe)

    def _repr_html_(self) -> str:
        return self.core_pipe._repr_html_()

    def __rich__(self) -> Any:
        return self.core_pipe.__rich__()


def pipeline(module: torch.nn.Module, mb_args: tuple[Any, ...], mb_kwargs: dict[str, Any] | None = None,
             split_spec: dict[str, SplitPoint] | None = None,
             split_policy: Callable[[torch.fx.GraphModule], torch.fx.GraphModule] | None = None) -> Pipe:
    """Trace ``module`` on one microbatch and split it (torch.distributed.pipelining's order).

    Args:
        module: the model; it is not modified.
        mb_args / mb_kwargs: one microbatch of positional / keyword inputs.
        split_spec: ``{fqn: SplitPoint.BEGINNING | END}`` (ours or torch's SplitPoint);
            ``None`` cuts at ``pipe_split()`` calls. pippy_split's other forms (a list
            of FQNs, an int N to balance N stages) work too.
        split_policy: a pass over the peer's traced graph; not supported
            (``NotImplementedError``): use ``split_spec``, e.g. an int.

    Returns:
        The :class:`Pipe`.

    Example:
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]); x_mb = torch.randn(2, 8)
        >>> pipe = pipeline(model, (x_mb,), split_spec={"2": SplitPoint.BEGINNING})  # e.g. {"layers.2": ...}
        >>> out = pipe(x_mb)[0]  # the peer's flat tuple of outputs
        >>> torch.testing.assert_close(out, model(x_mb))
    """
    if split_policy is not None:
        raise NotImplementedError("pipeline(split_policy=...) is not supported: pass split_spec={fqn: SplitPoint}, "
                                  "a list of FQNs, or an int N to balance N stages by cost")
    if not isinstance(mb_args, tuple):
        mb_args = (mb_args,)
    sizes = _batch_sizes((mb_args, mb_kwargs))
    return Pipe(_core_pipeline(module, split_spec, mb_args=mb_args, mb_kwargs=mb_kwargs),
                sizes.pop() if len(sizes) == 1 else None)


def _batch_sizes(tree: Any) -> set[int]:
    return {t.shape[0] for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim() > 0}
