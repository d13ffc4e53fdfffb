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

import contextlib
import ctypes
import errno
import os
import pickle
import shutil
import sys
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["CheckpointError", "save", "load", "saved_keys"]

FORMAT_VERSION = 1
_MODEL = "model."
_STATE = "optim.state."
_GROUPS = "optim.param_groups."
_OPTIM = "optim."
_EXTRA = "extra"
_INFO = "pippy_split"
_METADATA_FILE = ".metadata"  # written by DCP last, once every rank has written its data
_SHOW = 10  # keys listed per kind in an error message


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found, or matched to the model.

    Attributes:
        path: the checkpoint directory.
        missing: keys the model (or optimizer) needs that the checkpoint lacks.
        unexpected: model keys the checkpoint holds that no given module has.
    """

    def __init__(self, message: str, path: str = "", missing: list[str] | None = None,
                 unexpected: list[str] | None = None):
        super().__init__(message)
        self.path = path
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #


def save(path: str | os.PathLike, modules_or_schedule: Any, optimizer: Any = None, *,
         extra: Any = None, no_dist: bool = False) -> str:
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
            initialised (otherwise every rank of the default group must call).

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
    holders = _holders(modules_or_schedule)
    comm = _Comm(no_dist)
    flat, order, err = {}, {}, None
    try:
        flat, order = _collect_model(holders, comm.rank)
        if optimizer is not None:
            _collect_optimizer(_optimizers(optimizer), holders, flat, order, comm.rank)
    except CheckpointError as e:
        err = str(e)
    _raise_any(comm.all_gather(err), f"cannot save checkpoint {path}: ", path)
    if comm.world > 1:
        _drop_keys_owned_elsewhere(flat, order, comm)
    if comm.rank == 0:
        flat[_EXTRA] = extra
        flat[_INFO] = {"format": FORMAT_VERSION, "world_size": comm.world, "torch": torch.__version__}

    tmp, err = (None, None)
    if comm.rank == 0:
        try:
            tmp = _prepare(path)
        except (OSError, CheckpointError) as e:
            err = _reason(path, e)
    tmp, err = comm.broadcast((tmp, err))
    if err is not None:
        raise CheckpointError(f"cannot write checkpoint {path}: {err}", path)

    try:
        with _quiet_dcp():
            _dcp_write(flat, tmp, comm)
    except _RanksFailed as e:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if e.local is not None and not isinstance(e.local, Exception):  # KeyboardInterrupt, SystemExit
            raise e.local
        raise CheckpointError(f"cannot write checkpoint {path}: {e}; "
                              f"the previous checkpoint (if any) is unchanged", path) from e.local

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
    return path


def load(path: str | os.PathLike, modules_or_schedule: Any, optimizer: Any = None, *,
         strict: bool = True, no_dist: bool = False) -> Any:
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
    comm = _Comm(no_dist)
    optimizers = _optimizers(optimizer) if optimizer is not None else []

    found, plan, err = None, None, None
    try:
        found = _find(path)
        plan = _LoadPlan(_read_metadata(found), holders, optimizers)
    except CheckpointError as e:
        err = str(e)
    _raise_any(comm.all_gather(err), "", path)
    if found != path:
        warnings.warn(f"no checkpoint at {path}; loading the previous one from {found} "
                      f"(a save to {path} was interrupted between its two renames)", stacklevel=2)

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
        warnings.warn(message + " (strict=False: loaded the keys that match)", stacklevel=2)

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
    plan.apply_optimizer_state(flat)
    return flat.get(_EXTRA)


def saved_keys(path: str | os.PathLike) -> list[str]:
    """The model FQNs stored in the checkpoint at ``path``, sorted (no process group needed).

    Example:
        >>> saved_keys("ckpt")[:2]  # doctest: +SKIP
        ['blocks.0.attn.proj.bias', 'blocks.0.attn.proj.weight']
    """
    meta = _read_metadata(_find(os.path.abspath(os.fspath(path))))
    return sorted(k[len(_MODEL):] for k in meta.state_dict_metadata if k.startswith(_MODEL))


# --------------------------------------------------------------------------- #
# What this rank holds
# --------------------------------------------------------------------------- #


def _holders(obj: Any) -> list[tuple[int | None, nn.Module]]:
    """``[(stage index or None, module)]`` in stage order for a schedule, Pipe, stage, module or list."""
    from .split import Pipe
    from .stage import PipelineStage

    if isinstance(obj, nn.Module):
        return [(None, _unwrap(obj))]
    if isinstance(obj, Pipe):
        return [(i, obj.get_stage_module(i)) for i in range(obj.num_stages)]
    if isinstance(obj, PipelineStage):
        return [(obj.stage_index, _unwrap(obj.module))]
    stages = getattr(obj, "stages", None)
    if stages is not None and not isinstance(obj, (list, tuple)):  # a schedule
        return _sorted([h for st in stages for h in _holders(st)])
    if isinstance(obj, (list, tuple)):
        if not obj:
            raise TypeError("expected a schedule, a Pipe, a PipelineStage, an nn.Module or a list of them; "
                            "got an empty list")
        return _sorted([h for item in obj for h in _holders(item)])
    raise TypeError("expected a schedule, a Pipe, a PipelineStage, an nn.Module or a list of them; "
                    f"got {type(obj).__name__}")


def _unwrap(module: nn.Module) -> nn.Module:
    """The module whose names are the model's: without a DDP or ``torch.compile`` wrapper."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif isinstance(getattr(module, "_orig_mod", None), nn.Module):  # torch.compile
            module = module._orig_mod
        else:
            return module


def _sorted(holders: list) -> list:
    # Stage order, so that of two stages on one rank holding a key the lower one wins.
    return sorted(holders, key=lambda h: -1 if h[0] is None else h[0])


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a list of them, got {type(o).__name__}")
    return opts


def _param_names(holders: list) -> dict[int, list[str]]:
    """``id(parameter) -> [its FQNs]`` (a tied parameter has several), first holder's names first."""
    names: dict[int, list[str]] = {}
    for _, module in holders:
        for n, p in module.named_parameters(remove_duplicate=False):
            lst = names.setdefault(id(p), [])
            if n not in lst:
                lst.append(n)
    return names


def _order(stage: int | None, rank: int) -> tuple[int, int]:
    return (-1 if stage is None else stage, rank)


def _collect_model(holders: list, rank: int) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    flat: dict[str, Any] = {}
    order: dict[str, tuple[int, int]] = {}
    for stage, module in holders:
        for k, v in module.state_dict().items():
            key = _MODEL + k
            if key not in flat:  # the same FQN in two stages of this rank: the lower stage's copy
                flat[key] = v.detach() if isinstance(v, torch.Tensor) else v
                order[key] = _order(stage, rank)
    return flat, order


def _collect_optimizer(optimizers: list, holders: list, flat: dict, order: dict, rank: int) -> None:
    names = _param_names(holders)
    stage_of = {}
    for stage, module in holders:
        for n, _ in module.named_parameters(remove_duplicate=False):
            stage_of.setdefault(n, stage)
    for oi, opt in enumerate(optimizers):
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                fqns = names.get(id(p))
                if not fqns:
                    raise CheckpointError(f"parameter {pi} of param group {gi} of optimizer {oi} "
                                          f"(shape {tuple(p.shape)}) belongs to none of the given modules")
                state = opt.state.get(p, {})
                for fqn in fqns:
                    for k, v in state.items():
                        flat[f"{_STATE}{fqn}.{k}"] = v.detach() if isinstance(v, torch.Tensor) else v
                        order[f"{_STATE}{fqn}.{k}"] = _order(stage_of.get(fqn), rank)
                    for k, v in group.items():
                        if k != "params":
                            flat[f"{_GROUPS}{fqn}.{k}"] = v
                            order[f"{_GROUPS}{fqn}.{k}"] = _order(stage_of.get(fqn), rank)


def _drop_keys_owned_elsewhere(flat: dict, order: dict, comm: "_Comm") -> None:
    """Keep only the keys this rank owns: the lowest (stage, rank) holding a key writes it.

    A key is held by several ranks when a module is used by stages on two ranks,
    or by data-parallel replicas. DCP would dedupe such keys itself, but by the
    size of each rank's plan, so which copy is written would depend on the layout.
    """
    order = {k: o for k, o in order.items() if not _is_sharded(flat[k])}  # DCP writes each shard
    best: dict[str, tuple[int, int]] = {}
    for theirs in comm.all_gather(order):
        for k, o in theirs.items():
            if k not in best or o < best[k]:
                best[k] = o
    for k in list(order):
        if best[k] != order[k]:
            del flat[k]


def _is_sharded(value: Any) -> bool:
    """A DTensor (FSDP2, tensor parallel): each rank holds a shard of one key."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, DTensor)


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #


class _LoadPlan:
    """Which checkpoint keys this rank reads, into which tensors, and what does not match."""

    def __init__(self, meta: Any, holders: list, optimizers: list) -> None:
        self.entries = meta.state_dict_metadata  # key -> TensorStorageMetadata | BytesStorageMetadata
        self.optimizers = optimizers
        self.model: dict[str, Any] = {}
        for _, module in holders:
            for k, v in module.state_dict().items():
                self.model.setdefault(k, v)
        self.model_keys = set(self.model)
        on_meta = [k for k, v in self.model.items() if isinstance(v, torch.Tensor) and v.is_meta]
        if on_meta:
            raise CheckpointError(f"{len(on_meta)} tensors are on the meta device, which holds no data "
                                  f"({_show(on_meta)}); materialize the modules first, e.g. "
                                  "module.to_empty(device=...), then load")
        self.missing = sorted(k for k in self.model if _MODEL + k not in self.entries)
        self.mismatched = []
        for k, v in self.model.items():
            md = self.entries.get(_MODEL + k)
            if isinstance(v, torch.Tensor) and hasattr(md, "size") and tuple(md.size) != tuple(v.shape):
                self.mismatched.append(f"{k}: {tuple(md.size)} vs {tuple(v.shape)}")
        # Optimizer: for each parameter, the FQN whose state to read (any of its names).
        self.source: dict[int, str] = {}
        self.params: dict[int, torch.nn.Parameter] = {}
        if optimizers:
            by_fqn: dict[str, list[str]] = {}
            for key in self.entries:
                if key.startswith(_OPTIM):
                    prefix = _STATE if key.startswith(_STATE) else _GROUPS
                    fqn = key[len(prefix):].rpartition(".")[0]
                    by_fqn.setdefault(fqn, []).append(key)
            self.by_fqn = by_fqn
            names = _param_names(holders)
            for opt in optimizers:
                for group in opt.param_groups:
                    for p in group["params"]:
                        fqns = names.get(id(p), [])
                        have = [f for f in fqns if any(k.startswith(_GROUPS) for k in by_fqn.get(f, ()))]
                        if have:
                            self.source[id(p)] = have[0]
                            self.params[id(p)] = p
                        elif fqns:
                            self.missing.append(f"optimizer state of {fqns[0]}")
                        else:
                            raise CheckpointError(f"the optimizer holds a parameter (shape {tuple(p.shape)}) "
                                                  "that belongs to none of the given modules")

    def unexpected_against(self, all_ranks_keys: list[list[str]]) -> list[str]:
        wanted = {k for keys in all_ranks_keys for k in keys}
        return sorted(k[len(_MODEL):] for k in self.entries if k.startswith(_MODEL) and k[len(_MODEL):] not in wanted)

    def destination(self) -> dict[str, Any]:
        """The flat dict DCP loads into: this rank's tensors (in place) and placeholders."""
        flat: dict[str, Any] = {}
        for k, v in self.model.items():
            if _MODEL + k in self.entries:
                flat[_MODEL + k] = v
        for pid, fqn in self.source.items():
            param = self.params[pid]
            for key in self.by_fqn[fqn]:
                md = self.entries[key]
                if not hasattr(md, "size"):
                    flat[key] = None  # a pickled object; DCP replaces the placeholder
                elif _is_sharded(param) and tuple(md.size) == tuple(param.shape):
                    flat[key] = torch.empty_like(param, dtype=md.properties.dtype)  # this rank's shard only
                else:
                    flat[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        if _EXTRA in self.entries:
            flat[_EXTRA] = None
        return flat

    def apply_optimizer_state(self, flat: dict) -> None:
        for opt in self.optimizers:
            sd = opt.state_dict()  # parameters as indices, in param_groups order
            state = dict(sd["state"])  # a parameter the checkpoint knows nothing of keeps its state
            for group, saved_group in zip(opt.param_groups, sd["param_groups"]):
                hyper_from = None
                for p, idx in zip(group["params"], saved_group["params"]):
                    fqn = self.source.get(id(p))
                    if fqn is None:
                        continue
                    hyper_from = hyper_from or fqn
                    s = {key[len(_STATE) + len(fqn) + 1:]: flat[key] for key in self.by_fqn[fqn]
                         if key.startswith(_STATE)}
                    if s:
                        state[idx] = s
                    else:  # saved before its first step
                        state.pop(idx, None)
                if hyper_from is not None:
                    prefix = f"{_GROUPS}{hyper_from}."
                    for key in self.by_fqn[hyper_from]:
                        name = key[len(prefix):]
                        if key.startswith(prefix) and name in saved_group and name != "params":
                            saved_group[name] = flat[key]
            sd["state"] = state
            opt.load_state_dict(sd)  # moves state to each parameter's device and dtype


def _raise_any(errors: list, prefix: str, path: str) -> None:
    """Raise on every rank alike when any rank found a problem (so that no rank hangs).

    ``errors`` is one message or None per rank; ranks with the same message are named together.
    """
    by_message: dict[str, list[int]] = {}
    for rank, e in enumerate(errors):
        if e is not None:
            by_message.setdefault(e, []).append(rank)
    if not by_message:
        return
    if len(errors) == 1:
        raise CheckpointError(prefix + next(iter(by_message)), path)
    parts = [f"{m} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for m, r in by_message.items()]
    raise CheckpointError(prefix + "; ".join(parts), path)


def _show(keys: list[str]) -> str:
    more = f" ... and {len(keys) - _SHOW} more" if len(keys) > _SHOW else ""
    return ", ".join(keys[:_SHOW]) + more


def _key_report(path: str, missing: list[str], unexpected: list[str]) -> str:
    parts = [f"checkpoint {path} does not match the model"]
    if missing:
        parts.append(f"{len(missing)} missing keys (needed, not in the checkpoint): {_show(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys (in the checkpoint, in no given module): {_show(unexpected)}")
    return "; ".join(parts)


def _read_metadata(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}", path) from e


def _find(path: str) -> str:
    """``path`` if it is a complete checkpoint; else the backup a save left between its two renames."""
    if os.path.isfile(os.path.join(path, _METADATA_FILE)):
        return path
    if not os.path.exists(path):
        backups = [b for b in _siblings(path, ".old-") if os.path.isfile(os.path.join(b, _METADATA_FILE))]
        if backups:
            return max(backups, key=os.path.getmtime)
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist", path)
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}: it is not a directory", path)
    raise CheckpointError(f"no checkpoint at {path}: the directory has no {_METADATA_FILE} "
                          "(not a checkpoint written by pippy_split.checkpoint / torch.distributed.checkpoint)", path)


# --------------------------------------------------------------------------- #
# Writing safely
# --------------------------------------------------------------------------- #


def _siblings(path: str, infix: str) -> list[str]:
    parent, base = os.path.split(path)
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return [os.path.join(parent, n) for n in names if n.startswith(base + infix)]


def _is_replaceable(path: str) -> bool:
    """An existing ``path`` may be replaced only if it is a checkpoint or an empty directory."""
    if not os.path.lexists(path):
        return True
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    return os.path.isfile(os.path.join(path, _METADATA_FILE)) or not os.listdir(path)


def _prepare(path: str) -> str:
    """Check ``path`` can be replaced, clear leftovers of killed saves, make the temporary directory."""
    parent, base = os.path.split(path)
    if not base:
        raise CheckpointError("the path names no directory")
    if not _is_replaceable(path):
        kind = ("a symbolic link" if os.path.islink(path) else "a file" if not os.path.isdir(path)
                else "a directory that is not a checkpoint and is not empty")
        raise CheckpointError(f"it exists and is {kind}; refusing to replace it")
    _check_ancestors(parent)
    os.makedirs(parent, exist_ok=True)
    for stale in _siblings(path, ".tmp-"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=base + ".tmp-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a checkpoint is usually shared
    return tmp


def _check_ancestors(parent: str) -> None:
    """Name the file in the way when some ancestor of the directory is not a directory."""
    p = parent
    while p and not os.path.exists(p):
        up = os.path.dirname(p)
        if up == p:
            return
        p = up
    if p and not os.path.isdir(p):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), p)


def _commit(tmp: str, path: str) -> None:
    """Make the complete checkpoint in ``tmp`` be ``path``; the old one is never half-replaced."""
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)  # holds the old checkpoint now
    else:
        backup = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=os.path.dirname(path))
        os.rmdir(backup)
        os.rename(path, backup)
        # A kill here leaves no ``path`` but a complete ``backup``, which load() finds.
        os.rename(tmp, path)
        shutil.rmtree(backup, ignore_errors=True)
    for stale in _siblings(path, ".old-"):  # backups of earlier interrupted saves
        shutil.rmtree(stale, ignore_errors=True)
    _fsync_dir(os.path.dirname(path))


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two directories (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM):
        return False  # the filesystem (or kernel) cannot exchange: fall back to two renames
    raise OSError(code, os.strerror(code), b)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _reason(path: str, e: BaseException) -> str:
    if isinstance(e, OSError):
        where = f" ({e.filename})" if e.filename and os.fspath(e.filename) != path else ""
        return f"{e.strerror or e}{where}"
    return str(e)


def _describe_dcp_error(e: BaseException, name_ranks: bool = True) -> str:
    """DCP wraps rank failures in a CheckpointException; name the ranks and their errors.

    ``name_ranks=False`` where DCP ran in this process alone (its rank 0 is this rank)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, Mapping) and failures:
        parts = []
        for rank, err in sorted(failures.items()):
            inner = err[0] if isinstance(err, tuple) else err  # (exception, traceback summary)
            parts.append(f"{f'rank {rank}: ' if name_ranks else ''}{type(inner).__name__}: {inner}")
        return "; ".join(parts)
    return f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------- #
# DCP's save protocol over numpy-free collectives
# --------------------------------------------------------------------------- #


class _RanksFailed(Exception):
    """A step of the save failed on some ranks; raised on every rank alike.

    ``str()`` names each failed rank (where there are several) and its error;
    ``local`` is this rank's own exception, if it failed."""

    def __init__(self, failures: dict[int, str], local: BaseException | None, world: int) -> None:
        super().__init__("; ".join(f"rank {r}: {m}" if world > 1 else m for r, m in sorted(failures.items())))
        self.failures = failures
        self.local = local


def _attempt(fn) -> tuple[tuple[bool, Any], BaseException | None]:
    try:
        return (True, fn()), None
    except BaseException as e:  # DCP's own steps catch BaseException too; re-raised after the collective
        return (False, _describe_dcp_error(e, name_ranks=False)), e


def _dcp_write(flat: dict, directory: str, comm: "_Comm") -> None:
    """``torch.distributed.checkpoint.save(flat, ...)`` into ``directory``, collectives by ``comm``.

    The same steps as DCP's ``save`` (local plans, the coordinator's global plan and
    metadata, every rank's writes, the coordinator's ``.metadata``), through the
    public ``SavePlanner`` / ``StorageWriter`` interface, but with ``comm``'s
    collectives instead of DCP's: those are torch's ``gather_object`` /
    ``scatter_object_list`` / ``broadcast_object_list``, which decode with
    ``tensor.numpy()`` and fail with ``Numpy is not available`` where numpy is not
    installed (torch does not depend on it). The files are DCP's own.
    Raises :class:`_RanksFailed` on every rank when any rank fails a step.
    """
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    planner = DefaultSavePlanner(flatten_state_dict=False, dedup_save_to_lowest_rank=True)
    writer = FileSystemWriter(directory)
    coordinator = comm.rank == 0
    metadata = None

    def local_plan():
        planner.set_up_planner(state_dict=flat, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=comm.rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_plan(plans):
        nonlocal metadata
        plans, metadata = planner.create_global_plan(plans)
        return writer.prepare_global_plan(plans)

    def write():
        writes = writer.write_data(planner.finish_plan(central), planner)
        writes.wait()
        return writes.value()

    def finish(results):
        writer.finish(metadata=metadata, results=results)

    central = _reduce(comm, local_plan, global_plan, scatter=True)
    _reduce(comm, write, finish, scatter=False)


def _reduce(comm: "_Comm", local_fn, global_fn, scatter: bool) -> Any:
    """Run ``local_fn`` on every rank, ``global_fn`` on their results on rank 0, and hand
    back rank 0's answer: its ``scatter``-ed element for this rank, or the whole of it."""
    outcome, local = _attempt(local_fn)
    outcomes = comm.gather(outcome)
    reply: Any = None
    if comm.rank == 0:
        failures = {r: v for r, (ok, v) in enumerate(outcomes) if not ok}
        if not failures:
            (ok, value), local0 = _attempt(lambda: global_fn([v for _, v in outcomes]))
            if ok:
                reply = [(True, v) for v in value] if scatter else (True, value)
            else:
                failures, local = {0: value}, local0
        if failures:
            reply = [(False, failures)] * comm.world if scatter else (False, failures)
    ok, value = comm.scatter(reply) if scatter else comm.broadcast(reply)
    if not ok:
        raise _RanksFailed(value, local, comm.world)
    return value


@contextlib.contextmanager
def _quiet_dcp():
    # DCP warns on every single-process call, even when asked for one with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# --------------------------------------------------------------------------- #
# Process group helpers (every call is collective when a group is on)
# --------------------------------------------------------------------------- #


class _Comm:
    """Object collectives over the default group that need no numpy.

    torch's own (``all_gather_object`` and the like) turn the received bytes back
    into objects with ``tensor.numpy()``; numpy is not a dependency of torch, so
    on a fresh machine they fail with ``RuntimeError: Numpy is not available``.
    These pickle into a ``bytearray`` that a uint8 tensor shares
    (``torch.frombuffer``) and send that tensor, padded to the longest.
    """

    def __init__(self, no_dist: bool) -> None:
        self.on = (not no_dist) and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.on else 0
        self.world = dist.get_world_size() if self.on else 1

    def _device(self) -> torch.device:
        """Where the group's collectives take tensors: the CPU unless the only backend is a device's."""
        backend = str(dist.get_backend())
        if backend in ("gloo", "mpi") or "cpu:" in backend:  # "cpu:gloo,cuda:nccl": the CPU one
            return torch.device("cpu")
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        return torch.device("cpu") if acc is None else torch.device(acc.type, torch.accelerator.current_device_index())

    @staticmethod
    def _decode(tensor: torch.Tensor, size: int) -> Any:
        buf = bytearray(size)
        torch.frombuffer(buf, dtype=torch.uint8).copy_(tensor[:size])
        return pickle.loads(buf)

    def _encode(self, obj: Any) -> tuple[bytes, list[int], torch.device]:
        """This rank's pickle, every rank's size (one all_gather), the device to send on."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        device = self._device()
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device))
        return data, [int(n.item()) for n in sizes], device

    @staticmethod
    def _padded(data: bytes, size: int, device: torch.device) -> torch.Tensor:
        buf = bytearray(size)
        buf[:len(data)] = data
        return torch.frombuffer(buf, dtype=torch.uint8).to(device)

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        data, sizes, device = self._encode(obj)
        longest = max(sizes)
        out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(self.world)]
        dist.all_gather(out, self._padded(data, longest, device))
        return [self._decode(t, n) for t, n in zip(out, sizes)]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        data, sizes, device = self._encode(obj)
        longest = max(sizes)
        out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(self.world)]
        dist.gather(self._padded(data, longest, device), out if self.rank == 0 else None, dst=0)
        return [self._decode(t, n) for t, n in zip(out, sizes)] if self.rank == 0 else None

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        device = self._device()
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(size, src=0)
        payload = self._padded(data, int(size.item()), device)
        dist.broadcast(payload, src=0)
        return self._decode(payload, int(size.item()))

    def scatter(self, objs: list[Any] | None) -> Any:
        """Element ``rank`` of rank 0's list, on each rank."""
        if self.world == 1:
            return objs[0]
        return self.broadcast(objs)[self.rank]
