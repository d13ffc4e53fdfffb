"""The one place a "group" argument becomes a ``torch.distributed`` process group.

Part of the stage layer, used wherever the library takes the pipeline's group:
``PipelineStage``, ``build_schedule`` (and the schedule classes through their
stages), ``plan`` / ``plan.best.build_schedule``, ``checkpoint.save`` / ``load``,
the grad scaler's extra groups and the planner's link measurement. Each accepts a
process group, ``None`` (the default group) or a one-dimensional ``DeviceMesh``,
typically one named dimension of an N-D mesh: ``mesh["pp"]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["process_group", "GroupArg"]

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
