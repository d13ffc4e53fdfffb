"""What a rank holds (modules, optimizers) as checkpoint keys, and the plan to load them.

Part of :mod:`pippy_split.checkpoint`: a save collects ``model.<fqn>`` and
``optim.*`` keys from the given modules and optimizers (:func:`collect_model`,
:func:`collect_optimizer`); a load matches the checkpoint's keys to them
(:class:`LoadPlan`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..split import Pipe
from ..stage import PipelineStage
from .comm import Comm
from .layout import EXTRA_KEY, GROUPS_PREFIX, MODEL_PREFIX, OPTIM_PREFIX, STATE_PREFIX, CheckpointError, show_keys


def holders_of(obj: Any) -> list[tuple[int | None, nn.Module]]:
    """``[(stage index or None, module)]`` in stage order for a schedule, Pipe, stage, module or list."""
    if isinstance(obj, nn.Module):
        return [(None, _unwrap(obj))]
    if isinstance(obj, Pipe):
        return [(i, obj.get_stage_module(i)) for i in range(obj.num_stages)]
    if isinstance(obj, PipelineStage):
        return [(obj.stage_index, _unwrap(obj.module))]
    stages = getattr(obj, "stages", None)
    if stages is not None and not isinstance(obj, (list, tuple)):  # a schedule
        return _sorted([h for st in stages for h in holders_of(st)])
    if isinstance(obj, (list, tuple)):
        if not obj:
            raise TypeError("expected a schedule, a Pipe, a PipelineStage, an nn.Module or a list of them; "
                            "got an empty list")
        return _sorted([h for item in obj for h in holders_of(item)])
    raise TypeError("expected a schedule, a Pipe, a PipelineStage, an nn.Module or a list of them; "
                    f"got {type(obj).__name__}")


def _unwrap(module: nn.Module) -> nn.Module:
    """The module whose names are the model's: without a DDP or ``torch.compile`` wrapper."""
    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif isinstance(inner := getattr(module, "_orig_mod", None), nn.Module):  # torch.compile
            module = inner
        else:
            return module


def _sorted(holders: list) -> list:
    # Stage order, so that of two stages on one rank holding a key the lower one wins.
    return sorted(holders, key=lambda h: -1 if h[0] is None else h[0])


def optimizer_list(optimizer: Any) -> list[torch.optim.Optimizer]:
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


def collect_model(holders: list, rank: int) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    flat: dict[str, Any] = {}
    order: dict[str, tuple[int, int]] = {}
    for stage, module in holders:
        for k, v in module.state_dict().items():
            key = MODEL_PREFIX + k
            if key not in flat:  # the same FQN in two stages of this rank: the lower stage's copy
                flat[key] = v.detach() if isinstance(v, torch.Tensor) else v
                order[key] = _order(stage, rank)
    return flat, order


def collect_optimizer(optimizers: list, holders: list, flat: dict, order: dict, rank: int) -> None:
    names = _param_names(holders)
    stage_of: dict[Any, Any] = {}
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
                        flat[f"{STATE_PREFIX}{fqn}.{k}"] = v.detach() if isinstance(v, torch.Tensor) else v
                        order[f"{STATE_PREFIX}{fqn}.{k}"] = _order(stage_of.get(fqn), rank)
                    for k, v in group.items():
                        if k != "params":
                            flat[f"{GROUPS_PREFIX}{fqn}.{k}"] = v
                            order[f"{GROUPS_PREFIX}{fqn}.{k}"] = _order(stage_of.get(fqn), rank)


def drop_keys_owned_elsewhere(flat: dict, order: dict, comm: Comm) -> None:
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
    return isinstance(value, DTensor)



class LoadPlan:
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
                                  f"({show_keys(on_meta)}); materialize the modules first, e.g. "
                                  "module.to_empty(device=...), then load")
        self.missing = sorted(k for k in self.model if MODEL_PREFIX + k not in self.entries)
        self.mismatched = []
        for k, v in self.model.items():
            md = self.entries.get(MODEL_PREFIX + k)
            if isinstance(v, torch.Tensor) and hasattr(md, "size") and tuple(md.size) != tuple(v.shape):
                self.mismatched.append(f"{k}: {tuple(md.size)} vs {tuple(v.shape)}")
        # Optimizer: for each parameter, the FQN whose state to read (any of its names).
        self.source: dict[int, str] = {}
        self.params: dict[int, torch.nn.Parameter] = {}
        if optimizers:
            by_fqn: dict[str, list[str]] = {}
            for key in self.entries:
                if key.startswith(OPTIM_PREFIX):
                    prefix = STATE_PREFIX if key.startswith(STATE_PREFIX) else GROUPS_PREFIX
                    fqn = key[len(prefix):].rpartition(".")[0]
                    by_fqn.setdefault(fqn, []).append(key)
            self.by_fqn = by_fqn
            names = _param_names(holders)
            for opt in optimizers:
                for group in opt.param_groups:
                    for p in group["params"]:
                        fqns = names.get(id(p), [])
                        have = [f for f in fqns if any(k.startswith(GROUPS_PREFIX) for k in by_fqn.get(f, ()))]
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
        return sorted(k[len(MODEL_PREFIX):] for k in self.entries if k.startswith(MODEL_PREFIX) and k[len(MODEL_PREFIX):] not in wanted)

    def destination(self) -> dict[str, Any]:
        """The flat dict DCP loads into: this rank's tensors (in place) and placeholders."""
        flat: dict[str, Any] = {}
        for k, v in self.model.items():
            if MODEL_PREFIX + k in self.entries:
                flat[MODEL_PREFIX + k] = v
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
        if EXTRA_KEY in self.entries:
            flat[EXTRA_KEY] = None
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
                    s = {key[len(STATE_PREFIX) + len(fqn) + 1:]: flat[key] for key in self.by_fqn[fqn]
                         if key.startswith(STATE_PREFIX)}
                    if s:
                        state[idx] = s
                    else:  # saved before its first step
                        state.pop(idx, None)
                if hyper_from is not None:
                    prefix = f"{GROUPS_PREFIX}{hyper_from}."
                    for key in self.by_fqn[hyper_from]:
                        name = key[len(prefix):]
                        if key.startswith(prefix) and name in saved_group and name != "params":
                            saved_group[name] = flat[key]
            sd["state"] = state
            opt.load_state_dict(sd)  # moves state to each parameter's device and dtype

