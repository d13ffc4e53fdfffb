"""FSDP2 blocks kept gathered for a whole training step, chosen by a byte budget.

Part of the stage layer. Per-block FSDP2 (``ps.parallelize(fsdp=[...])``) all-gathers a
block for every forward and again for every backward of every microbatch: ``2 m`` all-gathers
per block and step. A block kept gathered is all-gathered once, by its first forward of the
step, and stays unsharded through every later forward and backward of the step; its gradients
accumulate unsharded and are reduce-scattered once, on the stage's last backward (the
runtime turns FSDP2's gradient sync on only there). The cost is the block's full parameters
held for the whole step instead of for one action.

Which modules are kept (:func:`choose_kept`): the smallest first, ties in module order, while
their full parameter bytes fit the budget. Every module kept saves about the same number of
all-gathers whatever its size (``2 m - 1`` for a block, ``m - 1`` for a stage root, which FSDP2
already keeps from forward to backward), so the smallest first removes the most all-gathers
per byte held.

The blocks not kept are gathered per action as before, with one saving that holds no more
memory: a forward ends with a stage's last block and a backward with its first, and the
next action on the rank often starts with that same block (1F1B's steady state alternates
F and B on a stage). That block stays gathered into the next action, and is freed when an
action starts that does not begin with it (a forward hook and a hook on the stage outputs'
gradients mark the start of each forward and backward). At most one block not kept is
gathered at a time, as with plain FSDP2.

Only torch's own FSDP2 controls are used: at the start of a training step
(:func:`begin_step`) each kept module gets ``set_reshard_after_forward(False)`` and
``set_reshard_after_backward(False)`` (a stage's last block not kept the first, its first
block the second); at its end (:func:`end_step`, after the last backward's reduce-scatter
and before the caller's optimizer) they are set back and ``reshard()`` frees the gathered
parameters, so between steps every parameter is its shard again and the next step gathers
what the optimizer wrote. The runtime's existing data-parallel hooks call both
(:mod:`.data_parallel`); ``eval()`` (no gradients) is not a training step and gathers as
FSDP2 does.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed.fsdp import FSDPModule

__all__ = ["GatherUnit", "choose_kept", "fsdp_units", "plan_gather_once", "kept_modules", "begin_step", "end_step"]

@dataclass(frozen=True)
class GatherUnit:
    """One FSDP2 module of a stage: what one all-gather fetches.

    Attributes:
        stage: the stage index.
        name: its FQN in the stage module (``""``: the stage root).
        module: the ``fully_shard``-ed module.
        nbytes: its own parameters (not those of FSDP2 modules under it) at full size, in
            the dtype FSDP2 gathers them in.
        reshard_after_forward: set back at the step's end; None for a stage root, whose
            value FSDP2 chooses (it keeps a root gathered from forward to backward) and
            which is left alone.
    """

    stage: int
    name: str
    module: torch.nn.Module
    nbytes: int
    reshard_after_forward: bool | None

    def __str__(self) -> str:
        return f"stage {self.stage} {self.name or '(root)'}"


def choose_kept(sizes: Sequence[int], budget: int | None) -> list[int]:
    """Indices of the modules kept gathered, in order: the smallest first (ties in order)
    while the total fits ``budget`` bytes; all of them with no budget.

    Example:
        >>> choose_kept([100, 10, 100, 50], 160)
        [0, 1, 3]
        >>> choose_kept([100, 100], 99)
        []
    """
    if budget is None:
        return list(range(len(sizes)))
    kept, total = [], 0
    for i in sorted(range(len(sizes)), key=lambda i: (sizes[i], i)):
        if total + sizes[i] > budget:
            break  # the rest are at least as large
        kept.append(i)
        total += sizes[i]
    return sorted(kept)


def fsdp_units(stage_index: int, module: torch.nn.Module, reshard_after_forward: bool = True,
               param_dtype: torch.dtype | None = None, dp_dims: int = 1) -> list[GatherUnit]:
    """Every ``fully_shard``-ed module of a stage, in module order, with its own parameter bytes
    as an all-gather over the data-parallel mesh (its first ``dp_dims`` dimensions) returns
    them (in ``param_dtype``, a mixed-precision policy's, or each parameter's own dtype).
    The sizes come from global shapes, so every data-parallel peer of a stage chooses alike."""
    wrapped = {id(m) for m in module.modules() if isinstance(m, FSDPModule)}
    fsdp = [(n, m) for n, m in module.named_modules() if id(m) in wrapped]
    units = []
    for name, m in fsdp:
        prefix = f"{name}." if name else ""
        nested = {id(p) for n2, m2 in fsdp if m2 is not m and n2.startswith(prefix) for p in m2.parameters()}
        size = sum(_gathered_numel(p, dp_dims) * (p.element_size() if param_dtype is None else param_dtype.itemsize)
                   for p in m.parameters() if id(p) not in nested)
        units.append(GatherUnit(stage_index, name, m, size, None if m is module else reshard_after_forward))
    return units


def _gathered_numel(p: torch.Tensor, dp_dims: int) -> int:
    """Elements of ``p`` once FSDP2 has gathered it: its global size, less any sharding on
    mesh dimensions after the data-parallel ones (tensor parallelism stays sharded)."""
    n = p.numel()
    placements = getattr(p, "placements", ())
    for dim, placement in enumerate(placements):
        if dim >= dp_dims and placement.is_shard():
            n //= p.device_mesh.size(dim)  # type: ignore[attr-defined]  # a DTensor
    return n


class _Rank:
    """This rank's stages under one plan: whether a training step is running, and the blocks
    that may be handed from one action to the next (each stage's first and last block not
    kept gathered for the step)."""

    def __init__(self) -> None:
        self.active = False
        self.handed: list[Any] = []

    def release(self, keep: Any) -> None:
        """An action starts: every handed-over block but ``keep`` (the one it starts with) goes
        back to its shard, so at most one block not kept is gathered at a time."""
        for m in self.handed:
            if m is not keep:
                m.reshard()


@dataclass
class _StagePlan:
    kept: tuple[tuple[str, bool | None], ...]  # (FQN, reshard_after_forward to put back)
    first: Any  # the first and last FSDP2 blocks not kept (None: none), in module order
    last: Any
    last_after_forward: bool
    rank: _Rank


# stage module -> its plan; the plan holds no reference to the stage module (it would keep its key alive)
_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, _StagePlan] = weakref.WeakKeyDictionary()


def plan_gather_once(stages: Sequence[Any], budget: int | None, reshard_after_forward: bool = True,
                     param_dtype: torch.dtype | None = None, dp_dims: int = 1) -> list[GatherUnit]:
    """Choose, over all of this rank's stages together, the FSDP2 modules kept gathered for a
    training step (:func:`choose_kept`), register them with their stage modules and hook
    the hand-over of the blocks not kept; returns the kept ones. A budget too small for any
    module keeps none.

    ``stages``: PipelineStages whose modules FSDP2 already wraps; ``reshard_after_forward``:
    the blocks' own setting (``fully_shard``'s), put back at each step's end.
    """
    units = [u for st in stages
             for u in fsdp_units(st.stage_index, st.module, reshard_after_forward, param_dtype, dp_dims)]
    chosen = set(choose_kept([u.nbytes for u in units], budget))
    kept = [u for i, u in enumerate(units) if i in chosen]
    rank = _Rank()
    for st in stages:
        mine = [u for u in units if u.stage == st.stage_index]
        blocks = [u.module for i, u in enumerate(units) if u in mine and i not in chosen and u.module is not st.module]
        plan = _StagePlan(tuple((u.name, u.reshard_after_forward) for u in mine if u in kept),
                          blocks[0] if blocks else None, blocks[-1] if blocks else None, reshard_after_forward, rank)
        rank.handed += [m for m in (plan.first, plan.last) if m is not None and m not in rank.handed]
        if st.module not in _PLANS:
            st.module.register_forward_pre_hook(_forward_starts)
            st.module.register_forward_hook(_watch_backward)
        _PLANS[st.module] = plan
    return kept


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1  # as FSDP2 tells (a recompute runs forwards in backward)


def _forward_starts(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
    plan = _PLANS.get(module)
    if plan is not None and plan.rank.active and not _in_backward():
        plan.rank.release(keep=plan.first)


def _watch_backward(module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
    """Hook the start of this microbatch's backward of the stage (its outputs' gradients)."""
    plan = _PLANS.get(module)
    if plan is None or not plan.rank.active or plan.first is None or not torch.is_grad_enabled() or _in_backward():
        return
    tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        rank, last = plan.rank, plan.last
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda _: rank.release(keep=last), mode="any")


def kept_modules(module: torch.nn.Module) -> list[str]:
    """The FQNs (``""``: the stage root) of the FSDP2 modules of this stage module kept gathered
    for a step; empty: none, or no plan."""
    plan = _PLANS.get(module)
    return [name for name, _ in plan.kept] if plan is not None else []


def begin_step(module: torch.nn.Module) -> None:
    """Start of a step: keep this stage's chosen modules gathered once gathered, and let its
    first and last blocks not kept outlast their action into the next. Only for a training
    step (gradients enabled); ``eval()`` runs under ``no_grad`` and gathers as FSDP2 does."""
    plan = _PLANS.get(module)
    if plan is None or not torch.is_grad_enabled():
        return
    for name, after_forward in plan.kept:
        m: Any = module.get_submodule(name)
        m.reshard()  # a step that failed after gathering left it unsharded: gather what is current
        if after_forward is not None:
            m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
    if plan.first is not None:
        plan.rank.release(keep=None)
        plan.first.set_reshard_after_backward(False, recurse=False)  # a backward ends with it
        plan.last.set_reshard_after_forward(False, recurse=False)  # a forward ends with it
    plan.rank.active = True


def end_step(module: torch.nn.Module) -> None:
    """End of a training step, after its last backward and before the optimizer: every kept
    or handed-over module back to its shard, and FSDP2's own resharding as it was."""
    plan = _PLANS.get(module)
    if plan is None:
        return
    plan.rank.active = False
    for name, after_forward in plan.kept:
        m: Any = module.get_submodule(name)
        m.set_reshard_after_backward(True, recurse=False)
        if after_forward is not None:
            m.set_reshard_after_forward(after_forward, recurse=False)
        m.reshard()
    if plan.first is not None:
        plan.first.set_reshard_after_backward(True, recurse=False)
        plan.last.set_reshard_after_forward(plan.last_after_forward, recurse=False)
        plan.rank.release(keep=None)
