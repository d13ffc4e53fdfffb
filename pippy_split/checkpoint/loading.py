"""Reading a checkpoint: :func:`load` (the same call on every rank) and :func:`saved_keys`.

Part of :mod:`pippy_split.checkpoint` (its docstring has the layout and the
guarantees): find a complete checkpoint (``files``), match its keys to what this
rank holds (``keys``), check them over every rank, and read this rank's keys alone.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.api import CheckpointException

from ..stage.groups import GroupArg
from .comm import Comm, describe_dcp_error, quiet_dcp
from .files import find_checkpoint, read_metadata
from .keys import LoadPlan, holders_of, optimizer_list
from .layout import EXTRA_KEY, MODEL_PREFIX, CheckpointError, key_report, raise_any, show_keys

__all__ = ["load", "saved_keys"]


def load(path: str | os.PathLike, modules_or_schedule: Any, optimizer: Any = None, *,
         strict: bool = True, no_dist: bool = False, group: GroupArg = None) -> Any:
    """Load this rank's keys of the checkpoint at ``path`` in place; the same call on every rank.

    Any layout loads any other: keys are the original model's FQNs, so a
    checkpoint of 4 stages on 2 ranks loads into 2 stages on 2 ranks, into the
    unsplit model in one process, and the reverse.

    Args:
        path: the checkpoint directory written by :func:`save`.
        modules_or_schedule: as for :func:`save`.
        optimizer: an optimizer (or list) over parameters of those modules; its
            state and hyperparameters are set from the checkpoint by parameter FQN.
            Build it the same way as the one that was saved.
        strict: raise if the modules need keys the checkpoint lacks or if the
            checkpoint holds model keys that no rank's modules have. With
            ``strict=False`` matching keys are loaded and the rest is reported
            with a warning.
        no_dist: load in this process alone even if a process group is initialised.
        group: the ranks that load together (checked as one: missing and unexpected
            keys are counted over them), a process group or a 1-D DeviceMesh;
            default the default group.

    Returns:
        The ``extra`` object given to :func:`save` (None if none).

    Raises:
        CheckpointError: no checkpoint at ``path``; or (strict) missing and
            unexpected keys, listing the first 10 of each and their counts; or
            shapes that differ. Raised on every rank alike.

    Example (one process, the unsplit model; on ranks: ``load(path, sched, opt)``, any layout):
        >>> import shutil, tempfile, torch; from pippy_split.checkpoint import save
        >>> d = tempfile.mkdtemp(); path = save(os.path.join(d, "ckpt"), torch.nn.Linear(2, 2), extra={"step": 10})
        >>> load(path, torch.nn.Linear(2, 2))
        {'step': 10}
        >>> shutil.rmtree(d)
    """
    path = os.path.abspath(os.fspath(path))
    holders = holders_of(modules_or_schedule)
    comm = Comm(no_dist, group)
    optimizers = optimizer_list(optimizer) if optimizer is not None else []
    found, plan, err = None, None, None
    try:
        found = find_checkpoint(path)
        plan = LoadPlan(read_metadata(found), holders, optimizers)
    except CheckpointError as e:
        err = str(e)
    raise_any(comm.all_gather(err), "", path)
    assert found is not None and plan is not None  # set on every rank, or raise_any raised
    if found != path:
        warnings.warn(f"no checkpoint at {path}; loading the previous one from {found} "
                      f"(a save to {path} was interrupted between its two renames)", stacklevel=2)
    _check_keys(path, plan, comm, strict)
    flat = _read(path, found, plan, comm)
    plan.apply_optimizer_state(flat)
    return flat.get(EXTRA_KEY)


def _check_keys(path: str, plan: LoadPlan, comm: Comm, strict: bool) -> None:
    """Missing, unexpected and misshapen keys over every rank: an error (or, not strict, a warning) on each."""
    unexpected = plan.unexpected_against(comm.all_gather(sorted(plan.model_keys)))
    reports = comm.all_gather((plan.missing, plan.mismatched))
    missing = sorted({k for m, _ in reports for k in m})
    mismatched = sorted({k for _, mm in reports for k in mm})
    if mismatched:
        raise CheckpointError(f"checkpoint {path} does not match the model: {len(mismatched)} tensors "
                              f"differ in shape (checkpoint vs model): {show_keys(mismatched)}", path)
    if missing or unexpected:
        message = key_report(path, missing, unexpected)
        if strict:
            raise CheckpointError(message, path, missing, unexpected)
        warnings.warn(message + " (strict=False: loaded the keys that match)", stacklevel=3)


def _read(path: str, found: str, plan: LoadPlan, comm: Comm) -> dict:
    """Read this rank's keys from ``found`` into the plan's tensors; the ranks agree on the outcome."""
    # Reading needs no coordination: DCP's global load plan is each rank's own plan
    # (``create_default_global_load_plan`` returns them unchanged), so every rank reads
    # alone, without DCP's object collectives (they need numpy, which torch does not
    # install), and the ranks then agree on the outcome.
    flat = plan.destination()
    local, err = None, None
    try:
        with quiet_dcp():
            dcp_load(flat, storage_reader=FileSystemReader(found),
                     planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                     no_dist=True)
    except (Exception, CheckpointException) as e:
        local, err = e, describe_dcp_error(e, name_ranks=False)
    try:
        raise_any(comm.all_gather(err), f"cannot read checkpoint {found}: ", path)
    except CheckpointError as e:
        raise e from local
    return flat


def saved_keys(path: str | os.PathLike) -> list[str]:
    """The model FQNs stored in the checkpoint at ``path``, sorted (no process group needed).

    Example:
        >>> import shutil, tempfile, torch
        >>> from pippy_split.checkpoint import save
        >>> d = tempfile.mkdtemp()
        >>> saved_keys(save(os.path.join(d, "ckpt"), torch.nn.Sequential(torch.nn.Linear(2, 2))))
        ['0.bias', '0.weight']
        >>> shutil.rmtree(d)
    """
    meta = read_metadata(find_checkpoint(os.path.abspath(os.fspath(path))))
    return sorted(k[len(MODEL_PREFIX):] for k in meta.state_dict_metadata if k.startswith(MODEL_PREFIX))
