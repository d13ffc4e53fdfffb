"""Per-block FSDP2 and tensor parallelism on this rank's stages, by module FQN patterns.

Where this sits: after the stages are built (hand-built ``PipelineStage``s, or a schedule
over them) and before the first ``step()``. It only calls torch's own APIs on the stage
modules: ``parallelize_module`` on the modules the ``tp_plan`` patterns name, then
``fully_shard`` on each outermost module an ``fsdp`` pattern names, then on the stage
root, as torchtitan does. The schedule's first step learns the stages' shapes with a
real no-grad forward (:mod:`pippy_split.schedule.manual_shapes`), and a zero-bubble
schedule runs an FSDP2 stage's whole backward in I (see
:meth:`~pippy_split.stage.PipelineStage.check_split_backward`).

Traced stages (from ``pipe.build_stage`` / ``build_schedule``) are one flat ATen graph
whose submodules' ``forward`` never runs, so per-block FSDP2 and TP do not apply to them
(future work); only whole-stage FSDP2 (``fsdp=None``) is done there.

``fsdp_gather="once"`` keeps FSDP2 modules gathered for a whole training step, as many as
``gather_budget`` allows (:mod:`pippy_split.stage.gather_once`): one all-gather per module
and step instead of one per microbatch forward and another per backward.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from .plan.costs import parse_bytes
from .split.module_calls import called_module_names
from .stage.errors import PipelineError
from .stage.gather_once import plan_gather_once
from .stage.stage import PipelineStage

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["parallelize"]


def parallelize(sched_or_stages: Any, *, dp_mesh: DeviceMesh | None = None, tp_mesh: DeviceMesh | None = None,
                fsdp: Sequence[str] | None = None, tp_plan: Mapping[str, Any] | None = None,
                fsdp_gather: str = "per_microbatch", gather_budget: int | str | None = None,
                **fsdp_kwargs: Any) -> list[PipelineStage]:
    """Apply tensor parallelism and FSDP2 to this rank's stages, by FQN patterns.

    Args:
        sched_or_stages: a schedule (its ``.stages``), a ``PipelineStage`` or a list of them;
            call it on every rank, each with its own stages.
        dp_mesh: the data-parallel DeviceMesh dimension (``mesh["dp"]``): with it every
            stage root is ``fully_shard``-ed, after the blocks ``fsdp`` names.
        tp_mesh: the tensor-parallel DeviceMesh dimension (``mesh["tp"]``), for ``tp_plan``.
        fsdp: module FQN patterns relative to the stage module (fnmatch, e.g.
            ``["layers.*"]``): each outermost matching module is ``fully_shard``-ed on
            its own (one all-gather per block). Needs ``dp_mesh``.
        tp_plan: ``{FQN pattern: ParallelStyle}`` (``ColwiseParallel()``, ...), patterns
            relative to the stage module (``"layers.*.attention.wq"``); each module that
            matches gets the style of the first pattern it matches. Needs ``tp_mesh``.
        fsdp_gather: ``"per_microbatch"`` (default): FSDP2 as ``fully_shard`` leaves it, a
            block all-gathered for every microbatch's forward and again for its backward.
            ``"once"``: the FSDP2 modules ``gather_budget`` allows stay gathered from their
            first forward of a training step to its end (:mod:`pippy_split.stage.gather_once`).
            ``eval()`` gathers per microbatch either way.
        gather_budget: with ``fsdp_gather="once"``, the most full-size parameter bytes this
            rank keeps gathered across a step, on top of its shards (an int, or a string
            such as ``"512MiB"``; None: no limit); smallest modules first. Not a rank's whole
            memory (``ps.plan``'s ``memory_budget``): only what keeping parameters gathered adds.
        **fsdp_kwargs: more keywords for every ``fully_shard`` call (``mp_policy=``,
            ``reshard_after_forward=``, ...).

    Returns:
        The stages, parallelized in place.

    Raises:
        PipelineError: an ``fsdp`` or ``tp_plan`` pattern naming a module a traced stage runs
            as traced ops (a split point enters it); names the stage, the module and what works.
        ValueError: a pattern matching no module of this rank's stages (with the closest
            names), or arguments that do not go together as said above (``"once"`` with a
            ``tp_plan`` too: not tested exact yet).

    Example:
        >>> mesh = init_device_mesh("cuda", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))  # doctest: +SKIP
        >>> stage = ps.PipelineStage(my_slice_of_the_model, pp_rank, 2, group=mesh["pp"])  # doctest: +SKIP
        >>> ps.parallelize(stage, dp_mesh=mesh["dp"], fsdp=["layers.*"], tp_mesh=mesh["tp"],  # doctest: +SKIP
        ...                tp_plan={"layers.*.attention.wq": ColwiseParallel(),
        ...                         "layers.*.attention.wo": RowwiseParallel()})
        >>> sched = ps.Schedule1F1B(stage, 8, loss_fn=loss_fn)  # doctest: +SKIP

        Each block gathered once per step, within 2 GiB of gathered parameters per rank:

        >>> ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["layers.*"],  # doctest: +SKIP
        ...                fsdp_gather="once", gather_budget="2GiB")
    """
    stages = _stages_of(sched_or_stages)
    patterns, plan, budget = _checked(stages, fsdp, tp_plan, dp_mesh, tp_mesh, fsdp_gather, gather_budget, fsdp_kwargs)
    for st in stages:
        _parallelize_stage(st.module, dp_mesh, tp_mesh, patterns, plan, fsdp_kwargs)
    if fsdp_gather == "once":
        _keep_gathered(stages, budget, dp_mesh, fsdp_kwargs)
    return stages


def _checked(stages: Sequence[PipelineStage], fsdp: Sequence[str] | None, tp_plan: Mapping[str, Any] | None,
             dp_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None, fsdp_gather: str, gather_budget: int | str | None,
             fsdp_kwargs: Mapping[str, Any]) -> tuple[list[str], dict[str, Any], int | None]:
    """Everything :func:`parallelize` was given, checked before any module is touched (a mistake leaves the
    stages as they were): the ``fsdp`` patterns, the ``tp_plan``, the gather budget in bytes (None: no limit)."""
    patterns, plan = list(fsdp or []), dict(tp_plan or {})
    budget = _gather_options(fsdp_gather, gather_budget, dp_mesh, fsdp_kwargs)
    _check_meshes(patterns, plan, dp_mesh, tp_mesh, fsdp_gather)
    _check_patterns(stages, [*patterns, *plan])
    return patterns, plan, budget


def _parallelize_stage(module: torch.nn.Module, dp_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None,
                       patterns: Sequence[str], plan: Mapping[str, Any], fsdp_kwargs: Mapping[str, Any]) -> None:
    """One stage, in torchtitan's order: TP on the modules ``plan`` names, then FSDP2 on each outermost block
    ``patterns`` name and on the stage root."""
    if plan and tp_mesh is not None:  # checked: a plan comes with its mesh
        _apply_tp(module, tp_mesh, plan)
    if dp_mesh is not None:
        _apply_fsdp(module, dp_mesh, patterns, fsdp_kwargs)


def _check_meshes(patterns: Sequence[str], plan: Mapping[str, Any], dp_mesh: DeviceMesh | None,
                  tp_mesh: DeviceMesh | None, fsdp_gather: str) -> None:
    """Each kind of pattern comes with its mesh; ``"once"`` is not taken with TP (not tested exact)."""
    if patterns and dp_mesh is None:
        raise ValueError(f"parallelize(): fsdp={list(patterns)} needs dp_mesh= (the data-parallel DeviceMesh "
                         "dimension)")
    if plan and tp_mesh is None:
        raise ValueError(f"parallelize(): tp_plan with {len(plan)} entries needs tp_mesh= (the tensor-parallel "
                         "DeviceMesh dimension)")
    if plan and fsdp_gather == "once":
        raise ValueError("parallelize(): fsdp_gather='once' with tp_plan (FSDP2 over TP-sharded blocks) is not "
                         "tested exact yet; use fsdp_gather='per_microbatch' (the default) with TP, or 'once' "
                         "without tp_plan")


def _check_patterns(stages: Sequence[PipelineStage], patterns: Sequence[str]) -> None:
    """Every pattern names a module of this rank's stages, and one a traced stage calls whole."""
    names = {n for st in stages for n, _ in st.module.named_modules() if n}
    _check_match(patterns, names)
    for st in stages:
        if st.pipe is not None and patterns:
            _check_called(st, patterns)


def _keep_gathered(stages: Sequence[PipelineStage], budget: int | None, dp_mesh: DeviceMesh | None,
                   fsdp_kwargs: Mapping[str, Any]) -> None:
    """``fsdp_gather="once"``: choose and register the modules kept gathered for a step, with
    the FSDP2 settings the stages were sharded with (:func:`~.stage.gather_once.plan_gather_once`)."""
    policy = fsdp_kwargs.get("mp_policy")
    plan_gather_once(stages, budget, fsdp_kwargs.get("reshard_after_forward", True) is not False,
                     getattr(policy, "param_dtype", None), dp_mesh.ndim if dp_mesh is not None else 1)


def _gather_options(how: Any, budget: Any, dp_mesh: Any, fsdp_kwargs: Mapping[str, Any]) -> int | None:
    """``fsdp_gather`` and ``gather_budget`` checked; the budget in bytes (None: no limit)."""
    if how not in ("per_microbatch", "once"):
        raise ValueError(f"parallelize(): fsdp_gather={how!r}; it is 'per_microbatch' (the default: each block "
                         "gathered for every microbatch's forward and backward) or 'once' (kept gathered for the "
                         "step, within gather_budget)")
    if how == "per_microbatch":
        if budget is not None:
            raise ValueError("parallelize(): gather_budget= applies to fsdp_gather='once'; pass fsdp_gather='once' "
                             "with it, or drop it")
        return None
    if dp_mesh is None:
        raise ValueError("parallelize(): fsdp_gather='once' needs dp_mesh= (FSDP2's data-parallel DeviceMesh "
                         "dimension)")
    keep = fsdp_kwargs.get("reshard_after_forward", True)
    if keep is not None and not isinstance(keep, bool):
        raise ValueError(f"parallelize(): fsdp_gather='once' sets FSDP2's reshard_after_forward for each step and "
                         f"puts it back after; it takes a bool there, not reshard_after_forward={keep!r}")
    return _budget_bytes(budget)


def _budget_bytes(budget: Any) -> int | None:
    if budget is None:
        return None
    works = ("gather_budget= takes a number of bytes >= 0: an int, or a string such as '512MiB' or '2GB' (units B, "
             "KB, MB, GB, TB, KiB, MiB, GiB, TiB), or None for no limit")
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise ValueError(f"parallelize(): {works}; got {budget!r} ({type(budget).__name__})")
    try:
        value = parse_bytes(budget)
    except ValueError:
        raise ValueError(f"parallelize(): {works}; got {budget!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"parallelize(): {works}; got {budget!r}")
    return int(value)


def _stages_of(obj: Any) -> list[PipelineStage]:
    if isinstance(obj, PipelineStage):
        return [obj]
    stages = list(getattr(obj, "stages", obj))
    bad = [type(s).__name__ for s in stages if not isinstance(s, PipelineStage)]
    if not stages or bad:
        raise ValueError(f"parallelize() takes a schedule, a PipelineStage or a list of them; got {bad or 'nothing'}")
    return stages


def _check_called(stage: PipelineStage, patterns: Sequence[str]) -> None:
    """A traced stage runs the user's own ``forward`` only for the modules it calls whole;
    a pattern naming traced glue (a module the cut enters, or one whose call signature
    export could not keep) would silently not take effect there."""
    called = called_module_names(stage.module)
    glue = sorted({n for n, _ in stage.module.named_modules() if n and n not in called
                   and any(fnmatch.fnmatchcase(n, p) for p in patterns)
                   and any(isinstance(x, torch.nn.Parameter) for x in stage.module.get_submodule(n).parameters())})
    if glue:
        raise PipelineError(f"stage {stage.stage_index}: parallelize() cannot apply per-block FSDP2 or a TP style to "
                            f"{glue[:4]}: the stage runs {'it' if len(glue) == 1 else 'them'} as traced ops, not "
                            "through the module's own forward (a split point enters the module, or export could not "
                            "keep its call signature, e.g. it takes a cache object: pass use_cache=False). What works: "
                            "patterns naming modules the stage calls whole "
                            f"({sorted(n for n in called if n.count('.') <= 1)[:4]}), or fsdp=None for whole-stage "
                            "FSDP2, or hand-built stages")


def _check_match(patterns: Sequence[str], names: set[str]) -> None:
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            close = difflib.get_close_matches(pattern, sorted(names), n=4, cutoff=0.5)
            raise ValueError(f"parallelize(): pattern {pattern!r} matches no module of this rank's stages; closest "
                             f"module names: {close or sorted(names)[:6]}")


def _apply_tp(module: torch.nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, Any]) -> None:
    resolved = {}
    for name, _ in module.named_modules():
        style = next((s for p, s in plan.items() if name and fnmatch.fnmatchcase(name, p)), None)
        if style is not None:
            resolved[name] = style
    if resolved:
        parallelize_module(module, tp_mesh, resolved)


def _apply_fsdp(module: torch.nn.Module, dp_mesh: DeviceMesh, patterns: Sequence[str], kwargs: Mapping[str, Any]) -> None:
    blocks: list[str] = []
    for name, _ in module.named_modules():
        if name and not any(name.startswith(b + ".") for b in blocks) and any(
                fnmatch.fnmatchcase(name, p) for p in patterns):
            blocks.append(name)
    for name in blocks:
        fully_shard(module.get_submodule(name), mesh=dp_mesh, **kwargs)
    fully_shard(module, mesh=dp_mesh, **kwargs)
