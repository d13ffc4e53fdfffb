"""Writing a checkpoint: :func:`save`, the same call on every rank.

Part of :mod:`pippy_split.checkpoint` (its docstring has the layout and the
guarantees): collect this rank's keys (``keys``), drop those another rank writes,
write into a fresh sibling directory with DCP's steps over numpy-free collectives
(``comm``), and swap it in once every rank is done (``files``).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from ..stage.groups import GroupArg
from .comm import Comm, RanksFailed, dcp_write, quiet_dcp
from .files import commit, failure_reason, prepare_tmp
from .keys import collect_model, collect_optimizer, drop_keys_owned_elsewhere, holders_of, optimizer_list
from .layout import EXTRA_KEY, FORMAT_VERSION, INFO_KEY, CheckpointError, raise_any

__all__ = ["save"]


def save(path: str | os.PathLike, modules_or_schedule: Any, optimizer: Any = None, *,
         extra: Any = None, no_dist: bool = False, group: GroupArg = None) -> str:
    """Write this rank's part of a checkpoint to the directory ``path``; the same call on every rank.

    Args:
        path: the checkpoint directory (created, or replaced as a whole). Its parent
            is created if needed. An existing non-empty directory that is not a
            checkpoint is never replaced.
        modules_or_schedule: what this rank holds: a schedule (its ``.stages``), a
            ``Pipe`` (all its stages, in one process), a ``PipelineStage``, an
            ``nn.Module`` (e.g. the unsplit model), or a list of those.
        optimizer: an optimizer (or a list of them) over parameters of those
            modules; its state is stored by parameter FQN.
        extra: any picklable object (step count, RNG state, data position...),
            returned by :func:`load`. Rank 0's copy is written.
        no_dist: write from this process alone even if a process group is
            initialised (otherwise every rank of ``group`` must call).
        group: the ranks that write this checkpoint together, a process group or a
            1-D DeviceMesh; default the default group. It must hold every rank with
            a part of the model, data-parallel replicas included (a replica's copy is
            written once); pass one only where other ranks of the world run other
            models (each group its own ``path``).

    Returns:
        ``path``, absolute.

    Raises:
        CheckpointError: the directory cannot be created or written (the message
            names the path and the OS reason), on every rank; the previous
            checkpoint at ``path``, if any, is left as it was.

    A key held by several stages or ranks (a tied weight, a data-parallel replica)
    is written once, from the lowest stage index holding it (then the lowest rank).

    Example (one process, the unsplit model; on ranks: ``save(path, sched, opt, extra=...)``):
        >>> import shutil, tempfile; d = tempfile.mkdtemp()
        >>> model = torch.nn.Linear(2, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> sorted(os.listdir(save(os.path.join(d, "ckpt"), model, opt, extra={"step": 10})))  # DCP's files
        ['.metadata', '__0_0.distcp']
        >>> shutil.rmtree(d)
    """
    path = os.path.abspath(os.fspath(path))
    comm = Comm(no_dist, group)
    flat = _collect(path, holders_of(modules_or_schedule), optimizer, comm)
    if comm.rank == 0:
        flat[EXTRA_KEY] = extra
        flat[INFO_KEY] = {"format": FORMAT_VERSION, "world_size": comm.world, "torch": torch.__version__}
    tmp = _agree_on_tmp(path, comm)
    try:
        with quiet_dcp():
            dcp_write(flat, tmp, comm)
    except RanksFailed as e:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if e.local is not None and not isinstance(e.local, Exception):  # KeyboardInterrupt, SystemExit
            raise e.local  # noqa: B904 - the rank's own KeyboardInterrupt/SystemExit, as it was
        raise CheckpointError(f"cannot write checkpoint {path}: {e}; "
                              f"the previous checkpoint (if any) is unchanged", path) from e.local
    _swap_in(tmp, path, comm)
    return path


def _swap_in(tmp: str, path: str, comm: Comm) -> None:
    """Rank 0 makes the complete ``tmp`` be ``path``; every rank returns after the swap."""
    # dcp_write returns once the coordinator has written .metadata, i.e. after every
    # rank's data is on disk; only then does rank 0 swap the directories.
    err = None
    if comm.rank == 0:
        try:
            commit(tmp, path)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            err = failure_reason(path, e)
    err = comm.broadcast(err)  # also the barrier: every rank returns after the swap
    if err is not None:
        raise CheckpointError(f"cannot replace checkpoint {path}: {err}; "
                              f"the previous checkpoint (if any) is unchanged", path)


def _collect(path: str, holders: list, optimizer: Any, comm: Comm) -> dict:
    """This rank's flat ``{key: value}`` to write (the keys it owns); raises on every rank alike."""
    flat: dict[str, Any] = {}
    order: dict[str, tuple[int, int]] = {}
    err: str | None = None
    try:
        flat, order = collect_model(holders, comm.rank)
        if optimizer is not None:
            collect_optimizer(optimizer_list(optimizer), holders, flat, order, comm.rank)
    except CheckpointError as e:
        err = str(e)
    raise_any(comm.all_gather(err), f"cannot save checkpoint {path}: ", path)
    if comm.world > 1:
        drop_keys_owned_elsewhere(flat, order, comm)
    return flat


def _agree_on_tmp(path: str, comm: Comm) -> str:
    """Rank 0 makes the temporary sibling directory every rank writes into."""
    tmp, err = (None, None)
    if comm.rank == 0:
        try:
            tmp = prepare_tmp(path)
        except (OSError, CheckpointError) as e:
            err = failure_reason(path, e)
    tmp, err = comm.broadcast((tmp, err))
    if err is not None:
        raise CheckpointError(f"cannot write checkpoint {path}: {err}", path)
    return tmp
