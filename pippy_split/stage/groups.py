"""The one place a "group" argument becomes a ``torch.distributed`` process group.

Part of the stage layer, used wherever the library takes the pipeline's group:
``PipelineStage``, ``build_schedule`` (and the schedule classes through their
stages), ``plan`` / ``plan.best.build_schedule``, ``checkpoint.save`` / ``load``,
the grad scaler's extra groups and the planner's link measurement. Each accepts a
process group, ``None`` (the default group) or a one-dimensional ``DeviceMesh``,
typically one named dimension of an N-D mesh: ``mesh["pp"]``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import torch
import torch.distributed as dist

from .errors import PipelineError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["process_group", "GroupArg", "PipelineGroup"]

GroupArg = Union["ProcessGroup", "DeviceMesh", None]
"""What a ``group=`` argument takes: a process group, a one-dimensional DeviceMesh
(``mesh["pp"]``), or None for the default group."""


def process_group(group: GroupArg, where: str = "group") -> ProcessGroup | None:
    """``group`` as a process group: a 1-D DeviceMesh (``mesh["pp"]``) becomes its group.

    Args:
        group: ``None`` (the default group), a ``ProcessGroup``, or a ``DeviceMesh``
            of one dimension.
        where: what took the argument, for the error message.

    Returns:
        ``None`` or a ``ProcessGroup``.

    Raises:
        ValueError: a DeviceMesh of more than one dimension (which of its dimensions is
            the pipeline's is not for this library to guess).

    Example:
        >>> process_group(None) is None
        True
    """
    if group is None or not hasattr(group, "get_group"):
        return group
    ndim = getattr(group, "ndim", 1)
    if ndim != 1:
        names = getattr(group, "mesh_dim_names", None)
        pick = f'mesh["{names[-1]}"]' if names else "mesh[<dim name>] (a mesh built with mesh_dim_names=...)"
        raise ValueError(f"{where}: a DeviceMesh of {ndim} dimensions {tuple(names) if names else ''} was given as "
                         f"the pipeline's group; pass the one dimension the pipeline runs over, e.g. {pick}, "
                         "or a process group")
    return group.get_group()


@dataclass(frozen=True, kw_only=True)
class PipelineGroup:
    """The process group a pipeline runs over, with what every collective on it needs:
    the one value the schedule hands its collectives (:mod:`pippy_split.schedule.collectives`,
    :mod:`~pippy_split.schedule.agree`, :mod:`~pippy_split.schedule.dynamic_sizes`).

    Example:
        >>> g = PipelineGroup.of(None, torch.device("cpu"))  # no process group: one rank
        >>> g.rank, g.world, g.group is None
        (0, 1, True)
    """

    group: ProcessGroup | None
    """The ``torch.distributed`` group (``None``: the default group); never a DeviceMesh."""
    rank: int
    """This process's rank in ``group``."""
    world: int
    """The number of ranks in ``group``."""
    device: torch.device
    """Where the collectives' tensors live: the stages' device (NCCL takes CUDA tensors)."""

    @classmethod
    def of(cls, group: GroupArg, device: torch.device | str = "cpu", where: str = "group") -> PipelineGroup:
        """``group`` (a process group, a 1-D DeviceMesh or ``None``) with this process's rank
        and the group's size; rank 0 of 1 without a process group, which is refused where
        the process was launched as one of several ranks (``WORLD_SIZE`` > 1)."""
        pg = process_group(group, where)
        if not (dist.is_available() and dist.is_initialized()):
            launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
            if launched > 1 and pg is None:
                raise PipelineError(f"this process was launched as one of WORLD_SIZE={launched} ranks (torchrun?) "
                                    "but no process group exists: call torch.distributed.init_process_group() "
                                    "before building the schedule, or every rank would run the whole pipeline alone")
            return cls(group=pg, rank=0, world=1, device=torch.device(device))
        return cls(group=pg, rank=dist.get_rank(pg), world=dist.get_world_size(pg), device=torch.device(device))
