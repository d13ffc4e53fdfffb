"""``torch.distributed.pipelining.stage``'s names: ``PipelineStage``, ``PipelineStageInfo`` and ``build_stage``.

Part of the drop-in (:mod:`pippy_split.compat`). ``PipelineStage`` is our
:class:`pippy_split.PipelineStage` with the peer's constructor, ``.submod``,
``.group_rank`` / ``.group_size``, ``dw_builder`` and (torch 2.15)
``register_forward_context``; it runs in our schedules and in
:mod:`pippy_split.compat.schedules` alike.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ..stage import PipelineStage as _CoreStage

__all__ = ["PipelineStage", "PipelineStageInfo", "build_stage"]


@dataclass(frozen=True, kw_only=True)
class PipelineStageInfo:
    """Which forward a context registered with :meth:`PipelineStage.register_forward_context` is entered for.

    Attributes:
        stage_index: the stage.
        microbatch_index: the microbatch of this step.
        is_metadata_inference: always False here: the probe that learns a hand-built stage's
            output shapes on its first step calls the module outside the context (the peer
            enters it for its dynamic probe, with True).
    """

    stage_index: int
    microbatch_index: int
    is_metadata_inference: bool = False


ForwardContext = Callable[[PipelineStageInfo], contextlib.AbstractContextManager[None]]


class PipelineStage(_CoreStage):
    """One stage of a hand-split model, with torch.distributed.pipelining's signature.

    Args:
        submodule: the stage's module; it gets the previous stage's outputs as
            positional inputs (stage 0: the step's inputs).
        stage_index / num_stages: this stage and the total.
        device: where it runs.
        input_args / output_args / output_grads / input_grads: example values; accepted
            for compatibility and not needed: shapes are learnt on the first step.
        group: the pipeline's process group (default: the world).
        dw_builder: ``() -> runner``; with it, the weight-gradient half of a split
            backward (``W``) calls ``runner()`` instead of autograd, and a full
            backward calls it right after the input gradients (as in the peer).
        get_mesh: ``(mesh_dim_names, mesh_layout) -> DeviceMesh | None``, the peer's way to rebuild a
            DTensor received from another stage (torchtitan passes it always). Accepted and kept
            (``stage.get_mesh``); values cross stages here as plain tensors, so a stage whose
            forward returns a DTensor is refused by name on its first forward (call
            ``.full_tensor()`` or ``.to_local()`` at the cut, or move the cut).
        **options: pippy_split's own stage options (``inputs_from``, ``outputs_to``,
            ``activation_checkpoint``, ...), passed through.

    Example (on each rank, ``stage = PipelineStage(layers[rank], rank, world, device)``):
        >>> layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        >>> stage = PipelineStage(layers[1], 1, 2, torch.device("cpu"))  # stage 1 of 2
        >>> stage.submod is layers[1], stage.is_last, stage.group_size  # no process group here: 1
        (True, True, 1)
    """

    def __init__(self, submodule: torch.nn.Module, stage_index: int, num_stages: int, device: torch.device | None,
                 input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
                 output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
                 output_grads: torch.Tensor | tuple[torch.Tensor | None, ...] | None = None,
                 input_grads: torch.Tensor | tuple[torch.Tensor | None, ...] | None = None,
                 group: dist.ProcessGroup | None = None,
                 dw_builder: Callable[[], Callable[..., None]] | None = None,
                 get_mesh: Any = None, **options: Any) -> None:
        super().__init__(submodule, stage_index, num_stages, device, group, **options)
        self.get_mesh = get_mesh
        self.dw_builder = dw_builder
        self._dw_runners: dict[int, Callable[..., None]] = {}
        self._forward_contexts: OrderedDict[int, ForwardContext] = OrderedDict()  # a RemovableHandle needs a weakref

    def register_forward_context(self, context_factory: ForwardContext) -> RemovableHandle:
        """Enter ``context_factory(PipelineStageInfo(...))`` around this stage's forward of every
        microbatch (in ``step`` and ``eval``; on the last stage the loss is computed inside it too).

        Args:
            context_factory: ``info -> context manager``, called once per forward.

        Returns:
            A handle; ``handle.remove()`` unregisters it.

        Raises:
            RuntimeError: a context is already registered (one at a time, as in the peer).

        Example:
            >>> stage = PipelineStage(torch.nn.Linear(2, 2), 0, 1, torch.device("cpu"))
            >>> handle = stage.register_forward_context(lambda info: contextlib.nullcontext())
            >>> handle.remove()
        """
        if self._forward_contexts:
            raise RuntimeError(f"stage {self.stage_index}: a forward context is already registered; remove its "
                               "handle first")
        handle = RemovableHandle(self._forward_contexts)
        self._forward_contexts[handle.id] = context_factory
        return handle

    def forward(self, mb: int, args: list[Any], kwargs: Mapping[str, Any] | None = None, **options: Any) -> tuple:
        if not self._forward_contexts:
            outs = super().forward(mb, args, kwargs, **options)
        else:
            factory = next(iter(self._forward_contexts.values()))
            with factory(PipelineStageInfo(stage_index=self.stage_index, microbatch_index=mb)):
                outs = super().forward(mb, args, kwargs, **options)
        if self.get_mesh is not None and not self.is_last:
            _refuse_dtensor_outputs(self.stage_index, outs)
        return outs

    @property
    def submod(self) -> torch.nn.Module:
        """The stage's module (``self.module``); assignable before the first step, as torchtitan does
        after its ``parallelize_fn`` (``stage.submod = model_part``)."""
        return self.module

    @submod.setter
    def submod(self, module: torch.nn.Module) -> None:
        if module is self.module:
            return
        if self.held_microbatches:
            raise RuntimeError(f"stage {self.stage_index}: stage.submod assigned while microbatches are in flight; "
                               "assign it between steps")
        self.module = module
        self._call = self.options.compiled(module)  # what forward calls: the new module
        self._region_call = None  # rebuilt from the new module on first use

    @property
    def group_rank(self) -> int:
        """This process's rank in the stage's group (0 without a process group)."""
        return dist.get_rank(self.group) if dist.is_available() and dist.is_initialized() else 0

    @property
    def group_size(self) -> int:
        """Ranks in the stage's group (1 without a process group)."""
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    # ---- dw_builder: the weight half of backward runs the user's runner ------------
    def backward(self, mb: int, *args: Any, **kwargs: Any) -> dict[int, torch.Tensor]:
        grads = super().backward(mb, *args, **kwargs)
        if self.dw_builder is not None:
            self.dw_builder()()
        return grads

    def backward_input(self, mb: int, *args: Any, **kwargs: Any) -> dict[int, torch.Tensor]:
        if self.dw_builder is None:
            return super().backward_input(mb, *args, **kwargs)
        grads = super().backward(mb, *args, **kwargs)  # autograd through the module; the runner does the weights
        self._dw_runners[mb] = self.dw_builder()
        return grads

    def backward_weight(self, mb: int, *args: Any, **kwargs: Any) -> None:
        if self.dw_builder is None:
            return super().backward_weight(mb, *args, **kwargs)
        self._dw_runners.pop(mb)()

    def clear(self) -> None:
        super().clear()
        self._dw_runners.clear()


def _refuse_dtensor_outputs(stage_index: int, outs: Any) -> None:
    for i, out in enumerate(outs if isinstance(outs, (tuple, list)) else (outs,)):
        if isinstance(out, DTensor):
            raise NotImplementedError(
                f"stage {stage_index}: output {i} is a DTensor ({out.placements} on mesh {out.device_mesh.mesh_dim_names}); "
                "PipelineStage(get_mesh=...) is accepted, but values cross stages here as plain tensors, so a DTensor "
                "cannot be rebuilt on the next stage. Make the stage's output a plain tensor (.full_tensor() or "
                ".to_local() at the cut), or cut where no DTensor crosses")


def adopt(stage: _CoreStage) -> PipelineStage:
    """The same stage (all its state, shared) as a compat :class:`PipelineStage`."""
    out = PipelineStage.__new__(PipelineStage)
    out.__dict__.update(stage.__dict__)
    out.dw_builder = None
    out.get_mesh = None
    out._dw_runners = {}
    out._forward_contexts = OrderedDict()
    return out


def build_stage(stage_module: torch.nn.Module, stage_index: int, pipe_info: Any, device: torch.device | None,
                group: dist.ProcessGroup | None = None) -> PipelineStage:
    """The stage ``stage_index`` of a traced pipe, from ``pipe.info()`` (as the peer's ``build_stage``).

    Args:
        stage_module: the stage's module, normally ``pipe.get_stage_module(stage_index)``
            (a wrapped copy of it, e.g. by DDP, is run in its place).
        stage_index: which stage.
        pipe_info: ``pipe.info()`` of a :func:`pippy_split.compat.pipeline` pipe.
        device: where the stage runs.
        group: the pipeline's process group (default: the world).

    Returns:
        The :class:`PipelineStage`, with the traced edges (skip connections included).

    Example:
        >>> from pippy_split.compat import SplitPoint, pipeline
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> pipe = pipeline(model, (torch.randn(2, 4),), split_spec={"2": SplitPoint.BEGINNING})
        >>> stage = build_stage(pipe.get_stage_module(1), 1, pipe.info(), torch.device("cpu"))  # on rank 1
        >>> stage.stage_index, sorted(stage.submod.state_dict())
        (1, ['2.bias', '2.weight'])
    """
    pipe = getattr(pipe_info, "pipe", None)
    if pipe is None:
        raise TypeError(f"build_stage needs the PipeInfo of a pippy_split.compat pipe (pipe.info()), got "
                        f"{type(pipe_info).__name__}")
    if not 0 <= stage_index < pipe.num_stages:
        raise ValueError(f"Invalid stage index {stage_index}: the pipe has {pipe.num_stages} stages")
    stage = adopt(pipe.build_stage(stage_index, device, group))
    if stage_module is not pipe.get_stage_module(stage_index):
        stage.module = stage_module
    return stage
