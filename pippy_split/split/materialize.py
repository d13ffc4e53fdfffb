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
    if state_dict is not None:
        missing = [n for n in meta if n not in state_dict]
        if missing:
            raise SplitError(f"state_dict lacks {len(missing)} tensor(s) this stage needs: {missing[:10]}")
        with torch.no_grad():
            for name in meta:
                fresh[name].copy_(state_dict[name])
        return module
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
        if not hasattr(owner, "reset_parameters") or any(leaf in owner._buffers for leaf in leaves):
            cannot.extend(names)
            continue
        clone = copy.deepcopy(owner)
        clone.to_empty(device=device, recurse=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + zlib.crc32(owner_path.encode()))
            clone.reset_parameters()
        with torch.no_grad():
            for name, leaf in zip(names, leaves):
                fresh[name].copy_(getattr(clone, leaf))
    if cannot:
        raise SplitError(
            f"cannot initialise {cannot[:10]} on {device}: the owning modules have no reset_parameters() (or they "
            "are buffers computed in __init__). Pass state_dict= to build_stage, or build those buffers off meta"
        )
