"""Give a stage of a ``meta``-device model real storage on its rank's device.

Used by ``Pipe.build_stage``: a model built on the meta device traces and splits
like any other, and each rank then allocates only its own stages' parameters —
filled from a state dict (original FQNs) or by the owning modules'
``reset_parameters()`` — so no rank ever holds the whole model.
"""

from __future__ import annotations

import copy
import zlib
from typing import Mapping

import torch

from .errors import SplitError

__all__ = ["materialize_stage"]


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(dict(module.named_buffers(remove_duplicate=False)))
    return out


def _set(module: torch.nn.Module, fqn: str, value: torch.Tensor) -> None:
    owner_path, _, leaf = fqn.rpartition(".")
    owner = module.get_submodule(owner_path)
    if leaf in owner._parameters:
        owner._parameters[leaf] = value
    else:
        owner._buffers[leaf] = value


def materialize_stage(module: torch.nn.Module, model: torch.nn.Module, device: torch.device | str,
                      state_dict: Mapping[str, torch.Tensor] | None = None, seed: int = 0,
                      canonical: Mapping[str, str] | None = None) -> torch.nn.Module:
    """Allocate every meta tensor of ``module`` on ``device`` and fill it.

    Args:
        module: a stage module whose tensors may be on ``meta``.
        model: the (meta) model the stage came from; its submodules' ``reset_parameters``
            initialise the stage when no ``state_dict`` is given.
        device: where the stage runs.
        state_dict: values by original FQN (a full or partial model state dict).
        seed: base seed; each owning module is seeded by its FQN, so every rank
            initialises a shared (tied) parameter identically.
        canonical: ``{fqn: first FQN of the same tensor}``; a tied parameter is always
            initialised by the module owning its first name.
    """
    tensors = _tensors(module)
    meta = {n: t for n, t in tensors.items() if t.is_meta}
    if not meta:
        return module
    _retarget_graph(module, torch.device(device))
    groups: dict[int, list[str]] = {}
    for name, t in meta.items():
        groups.setdefault(id(t), []).append(name)
    for names in groups.values():
        old = meta[names[0]]
        new = torch.empty_like(old, device=device)
        new = torch.nn.Parameter(new, requires_grad=old.requires_grad) if isinstance(old, torch.nn.Parameter) else new
        for name in names:  # tied names stay one tensor
            _set(module, name, new)
    fresh = _tensors(module)
    # Constants torch.export lifted out of forward (``_const_*``: e.g. the empty
    # tensors a KV cache starts from) are no part of any state dict. An empty one
    # needs no values; a non-empty one on meta lost its values when it was made.
    consts = [n for n in meta if n.rpartition(".")[2].startswith("_const_")]
    lost = [n for n in consts if meta[n].numel() > 0]
    if lost:
        raise SplitError(
            f"cannot rebuild {lost[:10]} on {device}: torch.export lifted these constants out of forward while the "
            "model was on meta, so their values were never computed. Create them in forward from real data "
            "(not from a meta tensor), or build the model off meta"
        )
    meta = {n: t for n, t in meta.items() if n not in consts}
    if state_dict is not None:
        # Non-persistent buffers (rotary inv_freq) are in no state dict: their owners rebuild them.
        persistent = set(module.state_dict().keys())
        computed = {n: t for n, t in meta.items() if n not in persistent and n not in state_dict}
        missing = [n for n in meta if n not in state_dict and n not in computed]
        if missing:
            raise SplitError(f"state_dict lacks {len(missing)} tensor(s) this stage needs: {missing[:10]}")
        with torch.no_grad():
            for name in meta:
                if name not in computed:
                    fresh[name].copy_(state_dict[name])
        meta = computed
    if meta:
        _reset_from_owners(fresh, meta, model, device, seed, canonical or {})
    return module


def _reset_from_owners(fresh: dict, meta: dict, model: torch.nn.Module, device, seed: int,
                       canonical: Mapping[str, str]) -> None:
    by_owner: dict[str, list[tuple[str, str]]] = {}
    for name in meta:
        source = canonical.get(name, name)
        by_owner.setdefault(source.rpartition(".")[0], []).append((name, source.rpartition(".")[2]))
    cannot = []
    for owner_path, pairs in sorted(by_owner.items()):
        owner = model.get_submodule(owner_path)
        names, leaves = [n for n, _ in pairs], [leaf for _, leaf in pairs]
        # The owner's reset_parameters(), else a Hugging Face model's _init_weights(module)
        # (which also recomputes rotary inv_freq buffers).
        if hasattr(owner, "reset_parameters"):
            init = lambda m: m.reset_parameters()  # noqa: E731
        elif callable(getattr(model, "_init_weights", None)):
            init = model._init_weights
        else:
            cannot.extend(names)
            continue
        clone = copy.deepcopy(owner)
        clone.to_empty(device=device, recurse=False)
        for leaf in leaves:  # a tensor counts as initialised only if the initialiser writes it
            _fill_sentinel(getattr(clone, leaf))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + zlib.crc32(owner_path.encode()))
            init(clone)
        untouched = {leaf for leaf in leaves if _is_sentinel(getattr(clone, leaf))}
        if untouched:  # e.g. a buffer computed in __init__ (BatchNorm's running stats are reset, so they pass)
            cannot.extend(n for n, leaf in zip(names, leaves) if leaf in untouched)
            names, leaves = [n for n, l in zip(names, leaves) if l not in untouched], [l for l in leaves if l not in untouched]
        with torch.no_grad():
            for name, leaf in zip(names, leaves):
                fresh[name].copy_(getattr(clone, leaf))
    if cannot:
        raise SplitError(
            f"cannot initialise {cannot[:10]} on {device}: the owning modules have no reset_parameters() (or they "
            "are buffers computed in __init__). Pass state_dict= to build_stage, or build those buffers off meta"
        )


def _fill_sentinel(t: torch.Tensor) -> None:
    with torch.no_grad():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).min)
        # bool: no value marks "unset"; treated as untouched below


def _is_sentinel(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return True
    return bool((t == torch.iinfo(t.dtype).min).any())


def _retarget_graph(module: torch.nn.Module, device: torch.device) -> None:
    """A graph traced from a meta model names ``device=meta`` in its ops (``arange``,
    ``to``, export's metadata asserts): point them at ``device``."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return
    meta = torch.device("meta")
    swap = lambda a: device if isinstance(a, torch.device) and a == meta else a  # noqa: E731
    changed = False
    for node in graph.nodes:
        args = torch.fx.node.map_aggregate(node.args, swap)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs, changed = args, kwargs, True
    if changed:
        module.recompile()
