"""Tensor parallelism at a pipeline cut, for :func:`~pippy_split.integrations.torchtitan.pipeline_llm`.

torchtitan's ``parallelize_fn`` applies TP by calling the model part's ``parallelize(parallel_dims)``,
which shards each of its torchtitan modules and makes the activations between blocks DTensors on
the ``tp`` mesh. A stage module answers that call (:func:`parallelize_children`), and
:class:`TensorParallelCut` carries those DTensors across the cuts, where pippy_split's stages send
plain tensors of the traced shape. Imports torchtitan only where TP is asked for (it is torchtitan's
own there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..compat.stage import PipelineStage
from ..split.spec import MODEL_INPUT

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement

__all__ = ["TensorParallelCut", "parallelize_children"]


class TensorParallelCut:
    """Where a stage meets the next under torchtitan's TP (its ``partial_dtensor`` backend).

    There the residual stream between blocks is a DTensor on the ``tp`` mesh, in the layout
    ``tok_embeddings`` declares for its output (``Shard(1)`` with sequence parallelism, else
    ``Replicate()``); values cross stages here as plain tensors of the traced (whole) shape. So
    the sender's DTensor leaves as its full tensor (gathered over ``tp``; in backward each ``tp``
    rank keeps its own part of the gradient) and the receiver makes it that DTensor again
    (replicated, then redistributed to the layout; in backward the gradient is gathered whole,
    the same on every ``tp`` rank, and sent back). A DTensor leaving a stage in another layout is
    refused by name on its forward, never sent as something else.

    Example (without TP there is no cut to carry):
        >>> from types import SimpleNamespace
        >>> TensorParallelCut.of(torch.nn.Linear(2, 2), SimpleNamespace(tp_enabled=False)) is None
        True
    """

    def __init__(self, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> None:
        self.mesh, self.placements = mesh, placements

    @classmethod
    def of(cls, model: torch.nn.Module, parallel_dims: Any) -> TensorParallelCut | None:
        """The cut of ``model`` under ``parallel_dims`` (None without TP): the layout read from
        ``model.tok_embeddings``' torchtitan ``sharding_config`` (``out_dst_shardings``)."""
        if not getattr(parallel_dims, "tp_enabled", False):
            return None
        sharding = getattr(getattr(model, "tok_embeddings", None), "_sharding_config", None)
        layout = getattr(sharding, "out_dst_shardings", None)
        if layout is None:
            raise NotImplementedError(
                "pippy_split's pipeline_llm under tensor parallelism: the model's tok_embeddings declares no "
                "sharding_config.out_dst_shardings, which says how the activations between blocks are laid out "
                "over tp (torchtitan sets it in the model config's update_from_config). What works: a torchtitan "
                "decoder config updated from the job config, or tp=1")
        from torchtitan.protocols.sharding import resolve_placements  # TP is torchtitan's own here

        mesh = parallel_dims.resolve_shared_mesh([layout])
        return cls(mesh, tuple(resolve_placements(layout, mesh)))

    @staticmethod
    def check(stage_modules: list[torch.nn.Module]) -> None:
        """Refuse, by name, a split whose stage holds a tensor outside every module that shards
        itself (a cut entered its module). Run on every rank over every stage, so each refuses."""
        for i, module in enumerate(stage_modules):
            _refuse_traced_state(module, i)

    def prepare(self, stage: PipelineStage) -> None:
        """Make ``stage``'s module a TP-ready part: received activations rebuilt as DTensors, and
        DTensor outputs sent whole (hooks on the stage module, made for the pipeline: pippy_split's
        stage module or torchtitan's copy of its part). A hand-built stage (the compat route) gets
        the previous stage's outputs as its floating-point arguments."""
        part = stage.submod
        received: list[int] | None = None  # None: every floating-point argument
        if stage.in_slots is not None:
            received = [slot.index for slot in stage.in_slots if slot.edge is not None
                        and slot.edge.src_stage != MODEL_INPUT and slot.edge.spec.dtype.is_floating_point]
        if stage.stage_index > 0 and received != []:
            part.register_forward_pre_hook(lambda _, args: self.received(args, received))
        if not stage.is_last:
            part.register_forward_hook(lambda _, __, out: self.sent(out, stage.stage_index))

    def received(self, args: tuple[Any, ...], indices: list[int] | None) -> tuple[Any, ...]:
        """``args`` with each received activation (plain, whole) as the layout's DTensor: those at
        ``indices``, or (None) every floating-point tensor that is not a DTensor yet."""
        from torch.distributed.tensor import DTensor, Replicate

        whole = [Replicate()] * len(self.placements)

        def is_received(i: int, a: Any) -> bool:
            if indices is not None:
                return i in indices
            return isinstance(a, torch.Tensor) and a.is_floating_point() and not isinstance(a, DTensor)

        return tuple(DTensor.from_local(a, self.mesh, whole, run_check=False).redistribute(self.mesh, self.placements)
                     if is_received(i, a) else a for i, a in enumerate(args))

    def sent(self, out: Any, stage_index: int) -> Any:
        """``out`` with each DTensor (it must have the layout) as its full tensor."""
        from torch.distributed.tensor import DTensor

        def whole(i: int, t: Any) -> Any:
            if not isinstance(t, DTensor):
                return t
            if tuple(t.placements) != self.placements:
                raise NotImplementedError(
                    f"pippy_split's pipeline_llm: stage {stage_index}'s output {i} is a DTensor with placements "
                    f"{t.placements}, not the layout {self.placements} of the activations between blocks that "
                    "the next stage rebuilds it in. What works: cuts between blocks (the default), where only "
                    "the residual stream crosses")
            return t.full_tensor()

        if isinstance(out, (tuple, list)):
            return type(out)(whole(i, t) for i, t in enumerate(out))
        return whole(0, out)


def _refuse_traced_state(part: torch.nn.Module, stage_index: int) -> None:
    """Under TP every parameter and buffer must sit in a module that shards itself
    (``parallelize``); a cut that entered a module leaves its tensors in traced glue, unsharded."""
    traced = [name for name, _ in [*part.named_parameters(), *part.named_buffers()]
              if not _in_parallelizable(part, name)]
    if traced:
        raise NotImplementedError(
            f"pippy_split's pipeline_llm under tensor parallelism: stage {stage_index} holds {traced[:4]} as traced "
            "ops (a cut entered their module), which torchtitan's parallelize() cannot shard. What works: cuts at "
            "module boundaries (the balanced default moves them to block starts; module_fqns_per_model_part "
            "naming whole modules)")


def _in_parallelizable(part: torch.nn.Module, name: str) -> bool:
    module, atoms = part, name.split(".")[:-1]
    for atom in atoms:
        module = module.get_submodule(atom)
        if module is not part and callable(getattr(module, "parallelize", None)):
            return True
    return False


def parallelize_children(part: torch.nn.Module, parallel_dims: Any) -> None:
    """A model part's ``parallelize(parallel_dims)`` (what torchtitan's ``parallelize_fn`` calls for
    TP): as torchtitan's root ``Module.parallelize``, each child module that speaks its protocol
    parallelizes itself; wrappers that do not (AC's) are looked through.

    Example:
        >>> part = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> parallelize_children(part, parallel_dims=None)  # no module speaks torchtitan's protocol: nothing to do
    """
    queue = list(part.children())
    while queue:
        child = queue.pop()
        parallelize = getattr(child, "parallelize", None)
        if callable(parallelize):
            parallelize(parallel_dims)
        else:
            queue.extend(child.children())
