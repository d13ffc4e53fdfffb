"""Checkpoints keyed by the original model's FQNs, so that any pipeline layout loads any other.

Where this sits: beside the flow split → Pipe → stage → schedule → runtime. A stage
module's ``state_dict()`` keys are the unsplit model's own names
(``blocks.2.attn.qkv.weight``), so a checkpoint written from the stages of one
layout is just the model's state dict, spread over the ranks that held it. It is
written with ``torch.distributed.checkpoint`` (DCP), which reads back by key: each
rank loads exactly the keys its stages hold, whatever layout wrote them.

    import pippy_split as ps
    from pippy_split import checkpoint

    sched = ps.build_schedule(pipe, "ZBVZeroBubble", 8, loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for st in sched.stages for p in st.module.parameters()])
    ...
    checkpoint.save("ckpt/step100", sched, opt, extra={"step": 100})   # on every rank

    # later: another split, another number of ranks, or the plain model in one process
    extra = checkpoint.load("ckpt/step100", model, opt2)                 # -> {"step": 100}

Layout on disk: one DCP directory (``.metadata`` plus one ``__<rank>_0.distcp`` file
per writing rank) holding flat keys

    model.<fqn>                        parameters and persistent buffers
    optim.state.<fqn>.<name>           optimizer state (exp_avg, step, ...)
    optim.param_groups.<fqn>.<name>    the hyperparameters of the parameter's group
    extra                              the picklable ``extra`` of ``save``
    pippy_split                        format version and the writing layout

The ``model.`` and ``optim.`` keys are those of ``torch.distributed.checkpoint``'s
own ``{"model": ..., "optim": ...}`` convention with flattened optimizer state,
so an unsplit model can also read the weights with plain DCP,
``dcp.load({"model": model.state_dict()}, checkpoint_id=path)``, and the optimizer
with ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict(...,
options=StateDictOptions(flatten_optimizer_state_dict=True))``.

Safety: a save writes into a fresh sibling ``<path>.tmp-XXXX`` and only when every
rank has finished swaps it with ``<path>`` (an atomic exchange of the two
directories on Linux; elsewhere a rename of the old one to ``<path>.old-XXXX``
first). A save that fails or is killed part-way leaves the previous checkpoint
in place; ``load`` never reads a ``.tmp-`` directory, and finds the ``.old-``
copy if a save died between the two renames of the fallback. Leftovers of
killed saves are removed by the next save to the same path.

No numpy: torch does not depend on it, but its object collectives
(``all_gather_object``, ``broadcast_object_list``, ``gather_object``,
``scatter_object_list``) decode what they receive with ``tensor.numpy()``, and
DCP's multi-rank ``save``/``load`` coordinate through them. So the ranks here
exchange pickles as uint8 tensors themselves (:class:`_Comm`), a save runs DCP's
steps (planner, storage writer) over those, and a load reads on each rank alone
(DCP's global load plan is just the ranks' own plans). The files are DCP's.
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import torch

from .checkpointing.comm import _Comm, _dcp_write, _describe_dcp_error, _quiet_dcp, _RanksFailed
from .checkpointing.files import _commit, _find, _prepare, _read_metadata, _reason
from .checkpointing.keys import (
    _collect_model,
    _collect_optimizer,
    _drop_keys_owned_elsewhere,
    _holders,
    _LoadPlan,
    _optimizers,
)
from .checkpointing.layout import _EXTRA, _INFO, _MODEL, FORMAT_VERSION, CheckpointError, _key_report, _raise_any, _show

__all__ = ["CheckpointError", "save", "load", "saved_keys"]

# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #


def save(path: str | os.PathLike, modules_or_schedule: Any, optimizer: Any = None, *,
         extra: Any = None, no_dist: bool = False, group: Any = None) -> str:
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

    Example:
        >>> save("ckpt", sched, opt, extra={"step": 10})      # every rank  # doctest: +SKIP
        >>> save("ckpt", model)                                # one process, unsplit  # doctest: +SKIP
    """
    path = os.path.abspath(os.fspath(path))
    comm = _Comm(no_dist, group)
    flat = _collect(path, _holders(modules_or_schedule), optimizer, comm)
    if comm.rank == 0:
        flat[_EXTRA] = extra
        flat[_INFO] = {"format": FORMAT_VERSION, "world_size": comm.world, "torch": torch.__version__}
    tmp = _agree_on_tmp(path, comm)
    try:
        with _quiet_dcp():
            _dcp_write(flat, tmp, comm)
    except _RanksFailed as e:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if e.local is not None and not isinstance(e.local, Exception):  # KeyboardInterrupt, SystemExit
            raise e.local  # noqa: B904 - the rank's own KeyboardInterrupt/SystemExit, as it was
        raise CheckpointError(f"cannot write checkpoint {path}: {e}; "
                              f"the previous checkpoint (if any) is unchanged", path) from e.local
    _swap_in(tmp, path, comm)
    return path


def _swap_in(tmp: str, path: str, comm: _Comm) -> None:
    """Rank 0 makes the complete ``tmp`` be ``path``; every rank returns after the swap."""
    # _dcp_write returns once the coordinator has written .metadata, i.e. after every
    # rank's data is on disk; only then does rank 0 swap the directories.
    err = None
    if comm.rank == 0:
        try:
            _commit(tmp, path)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            err = _reason(path, e)
    err = comm.broadcast(err)  # also the barrier: every rank returns after the swap
    if err is not None:
        raise CheckpointError(f"cannot replace checkpoint {path}: {err}; "
                              f"the previous checkpoint (if any) is unchanged", path)


def _collect(path: str, holders: list, optimizer: Any, comm: _Comm) -> dict:
    """This rank's flat ``{key: value}`` to write (the keys it owns); raises on every rank alike."""
    flat: dict[str, Any] = {}
    order: dict[str, tuple[int, int]] = {}
    err: str | None = None
    try:
        flat, order = _collect_model(holders, comm.rank)
        if optimizer is not None:
            _collect_optimizer(_optimizers(optimizer), holders, flat, order, comm.rank)
    except CheckpointError as e:
        err = str(e)
    _raise_any(comm.all_gather(err), f"cannot save checkpoint {path}: ", path)
    if comm.world > 1:
        _drop_keys_owned_elsewhere(flat, order, comm)
    return flat


def _agree_on_tmp(path: str, comm: _Comm) -> str:
    """Rank 0 makes the temporary sibling directory every rank writes into."""
    tmp, err = (None, None)
    if comm.rank == 0:
        try:
            tmp = _prepare(path)
        except (OSError, CheckpointError) as e:
            err = _reason(path, e)
    tmp, err = comm.broadcast((tmp, err))
    if err is not None:
        raise CheckpointError(f"cannot write checkpoint {path}: {err}", path)
    return tmp


def load(path: str | os.PathLike, modules_or_schedule: Any, optimizer: Any = None, *,
         strict: bool = True, no_dist: bool = False, group: Any = None) -> Any:
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

    Example:
        >>> extra = load("ckpt", sched, opt)        # every rank, any layout  # doctest: +SKIP
        >>> load("ckpt", model)                     # one process, unsplit  # doctest: +SKIP
    """
    path = os.path.abspath(os.fspath(path))
    holders = _holders(modules_or_schedule)
    comm = _Comm(no_dist, group)
    optimizers = _optimizers(optimizer) if optimizer is not None else []
    found, plan, err = None, None, None
    try:
        found = _find(path)
        plan = _LoadPlan(_read_metadata(found), holders, optimizers)
    except CheckpointError as e:
        err = str(e)
    _raise_any(comm.all_gather(err), "", path)
    assert found is not None and plan is not None  # set on every rank, or _raise_any raised
    if found != path:
        warnings.warn(f"no checkpoint at {path}; loading the previous one from {found} "
                      f"(a save to {path} was interrupted between its two renames)", stacklevel=2)
    _check_keys(path, plan, comm, strict)
    flat = _read(path, found, plan, comm)
    plan.apply_optimizer_state(flat)
    return flat.get(_EXTRA)


def _check_keys(path: str, plan: _LoadPlan, comm: _Comm, strict: bool) -> None:
    """Missing, unexpected and misshapen keys over every rank: an error (or, not strict, a warning) on each."""
    unexpected = plan.unexpected_against(comm.all_gather(sorted(plan.model_keys)))
    reports = comm.all_gather((plan.missing, plan.mismatched))
    missing = sorted({k for m, _ in reports for k in m})
    mismatched = sorted({k for _, mm in reports for k in mm})
    if mismatched:
        raise CheckpointError(f"checkpoint {path} does not match the model: {len(mismatched)} tensors "
                              f"differ in shape (checkpoint vs model): {_show(mismatched)}", path)
    if missing or unexpected:
        message = _key_report(path, missing, unexpected)
        if strict:
            raise CheckpointError(message, path, missing, unexpected)
        warnings.warn(message + " (strict=False: loaded the keys that match)", stacklevel=3)


def _read(path: str, found: str, plan: _LoadPlan, comm: _Comm) -> dict:
    """Read this rank's keys from ``found`` into the plan's tensors; the ranks agree on the outcome."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException

    # Reading needs no coordination: DCP's global load plan is each rank's own plan
    # (``create_default_global_load_plan`` returns them unchanged), so every rank reads
    # alone, without DCP's object collectives (they need numpy, which torch does not
    # install), and the ranks then agree on the outcome.
    flat = plan.destination()
    local, err = None, None
    try:
        with _quiet_dcp():
            dcp_load(flat, storage_reader=FileSystemReader(found),
                     planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                     no_dist=True)
    except (Exception, CheckpointException) as e:
        local, err = e, _describe_dcp_error(e, name_ranks=False)
    try:
        _raise_any(comm.all_gather(err), f"cannot read checkpoint {found}: ", path)
    except CheckpointError as e:
        raise e from local
    return flat


def saved_keys(path: str | os.PathLike) -> list[str]:
    """The model FQNs stored in the checkpoint at ``path``, sorted (no process group needed).

    Example:
        >>> saved_keys("ckpt")[:2]  # doctest: +SKIP
        ['blocks.0.attn.proj.bias', 'blocks.0.attn.proj.weight']
    """
    meta = _read_metadata(_find(os.path.abspath(os.fspath(path))))
    return sorted(k[len(_MODEL):] for k in meta.state_dict_metadata if k.startswith(_MODEL))


