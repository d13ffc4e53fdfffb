"""Give a stage of a ``meta``-device model real storage on its rank's device.

Used by ``Pipe.build_stage``: a model built on the meta device traces and splits
like any other, and each rank then allocates only its own stages' parameters —
filled from a state dict (original FQNs) or by the owning modules'
``reset_parameters()`` — so no rank ever holds the whole model.
"""

from __future__ import annotations

import copy
import difflib
import zlib
from typing import Any, Callable, Iterable, Mapping, cast

import torch

from .errors import SplitError

__all__ = ["materialize_stage", "check_state_dict", "load_stage_state", "fill_stage", "init_from_owners", "named_tensors",
           "set_tensor", "share_tensors"]

_SHOW = 10  # keys named per kind in an error message


def named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by name, a tied tensor under each of its names."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    out.update(dict(module.named_buffers(remove_duplicate=False)))
    return out


def set_tensor(module: torch.nn.Module, fqn: str, value: torch.Tensor) -> None:
    """Make ``value`` the parameter or buffer ``fqn`` of ``module`` (the object itself, no copy)."""
    owner_path, _, leaf = fqn.rpartition(".")
    owner = module.get_submodule(owner_path)
    if leaf in owner._parameters:
        owner._parameters[leaf] = cast(torch.nn.Parameter, value)
    else:
        owner._buffers[leaf] = value


def share_tensors(dst: torch.nn.Module, src: torch.nn.Module) -> list[str]:
    """Point ``dst``'s parameters and buffers at ``src``'s tensors of the same name (the same
    objects: an update of one is seen by the other); returns the names ``src`` does not hold.

    Example:
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> share_tensors(a, b), a.weight is b.weight
        ([], True)
    """
    tensors = named_tensors(src)
    missing = []
    for name, t in named_tensors(dst).items():
        new = tensors.get(name)
        if new is None:
            missing.append(name)
        elif new is not t:
            set_tensor(dst, name, new)
    return missing


def materialize_stage(module: torch.nn.Module, model: torch.nn.Module, device: torch.device | str,
                      state_dict: Mapping[str, torch.Tensor] | None = None, seed: int = 0,
                      canonical: Mapping[str, str] | None = None, strict: bool = True) -> torch.nn.Module:
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
        strict: with a ``state_dict``, a tensor it lacks is an error; ``False``
            initialises those from their owners instead.
    """
    tensors = named_tensors(module)
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
            set_tensor(module, name, new)
    fresh = named_tensors(module)
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
        meta = _fill_from_state_dict(module, fresh, meta, state_dict, strict)
    if meta:
        _reset_from_owners(fresh, meta, model, device, seed, canonical or {})
    return module


def _fill_from_state_dict(module: torch.nn.Module, fresh: dict, meta: dict, state_dict: Mapping[str, Any],
                          strict: bool) -> dict:
    """Copy ``state_dict``'s values into the new tensors; returns the ones still to initialise."""
    # Non-persistent buffers (rotary inv_freq) are in no state dict: their owners rebuild them.
    persistent = set(module.state_dict().keys())
    computed = {n: t for n, t in meta.items() if n not in persistent and n not in state_dict}
    missing = [n for n in meta if n not in state_dict and n not in computed]
    if missing and strict:
        raise SplitError(f"state_dict lacks {len(missing)} tensor(s) this stage needs: "
                         f"{_with_matches(missing, state_dict)}; pass strict=False to initialise them "
                         "from their modules' reset_parameters() instead")
    loaded = [n for n in meta if n not in computed and n not in missing]
    wrong: list[str] = []
    with torch.no_grad():
        for name in loaded:
            value = state_dict[name]  # read once: a lazy mapping (SafetensorsStateDict) reads it from disk
            if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(fresh[name].shape):
                wrong.append(f"{name}: {tuple(value.shape)} vs {tuple(fresh[name].shape)}")
            elif not wrong:  # after a wrong shape the stage is refused: nothing more to copy
                fresh[name].copy_(value)
    if wrong:
        raise SplitError(f"state_dict holds {len(wrong)} tensor(s) of another shape (state_dict vs model): "
                         f"{', '.join(wrong[:_SHOW])}")
    return {n: t for n, t in meta.items() if n not in loaded}


def fill_stage(module: torch.nn.Module, stage_index: int, model: torch.nn.Module | None, known: Iterable[str],
               device: torch.device | str | None, state_dict: Mapping[str, Any] | None = None, seed: int = 0,
               canonical: Mapping[str, str] | None = None, strict: bool = True) -> None:
    """What ``Pipe.build_stage`` does to one stage's tensors before it becomes a stage.

    A stage on ``meta`` is allocated on ``device`` (:func:`materialize_stage`); a real
    one takes ``state_dict``'s values (:func:`load_stage_state`). Either way a key of
    ``state_dict`` that names no tensor of the model (``known``: every model key) is
    an error under ``strict``, as is a key the stage needs that it lacks.
    """
    tensors = list(module.parameters()) + list(module.buffers())
    if any(t.is_meta for t in tensors):
        if state_dict is not None and strict:
            _, unexpected = check_state_dict([], state_dict, known, stage_index)
            if unexpected:
                raise SplitError(_key_message(stage_index, [], unexpected, state_dict, list(known)))
        target = torch.device(device) if device is not None else torch.device("cpu")
        # model may be None: that works only when state_dict fills every tensor
        materialize_stage(module, cast(torch.nn.Module, model), target, state_dict=state_dict, seed=seed, canonical=canonical,
                          strict=strict)
    elif state_dict is not None:
        load_stage_state(module, state_dict, known, stage_index, strict=strict)


def check_state_dict(needed: Iterable[str], state_dict: Mapping[str, Any], known: Iterable[str],
                     stage_index: int) -> tuple[list[str], list[str]]:
    """``(missing, unexpected)`` of a state dict given to one stage's ``build_stage``.

    Args:
        needed: the stage's own state-dict keys (original FQNs).
        state_dict: what the user passed: the whole model's, or part of it.
        known: every key of the model (all stages); a key outside it is unexpected,
            a key of another stage is not.
        stage_index: for the message.

    Example:
        >>> check_state_dict(["w"], {"module.w": 1}, ["w"], 0)
        (['w'], ['module.w'])
    """
    known = set(known)
    missing = sorted(k for k in needed if k not in state_dict)
    unexpected = sorted(k for k in state_dict if k not in known)
    return missing, unexpected


def load_stage_state(module: torch.nn.Module, state_dict: Mapping[str, Any], known: Iterable[str],
                     stage_index: int, strict: bool = True) -> None:
    """Copy ``state_dict``'s values for this stage into ``module`` (its keys are original FQNs).

    With ``strict`` (the default), a key the stage needs that ``state_dict`` lacks, or
    a key that names no tensor of the model (a typo, a ``module.`` prefix), is a
    :class:`SplitError` naming both lists and the closest matches; ``strict=False``
    loads the keys that match and keeps the module's values for the rest.

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> load_stage_state(m, {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, ["weight", "bias"], 0)
        >>> float(m.weight.abs().sum())
        0.0
    """
    needed = list(module.state_dict().keys())
    missing, unexpected = check_state_dict(needed, state_dict, known, stage_index)
    if strict and (missing or unexpected):
        raise SplitError(_key_message(stage_index, missing, unexpected, state_dict, needed))
    module.load_state_dict({k: state_dict[k] for k in needed if k in state_dict}, strict=False)


def _key_message(stage_index: int, missing: list[str], unexpected: list[str], state_dict: Mapping[str, Any],
                 needed: list[str]) -> str:
    parts = [f"build_stage({stage_index}, state_dict=...) does not match the model"]
    if missing:
        parts.append(f"state_dict lacks {len(missing)} key(s) stage {stage_index} needs: "
                     f"{_with_matches(missing, state_dict, first=unexpected)}")
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) of state_dict name no parameter or buffer of the model: "
                     f"{_with_matches(unexpected, needed)}")
    parts.append("pass strict=False to load the keys that match and keep the others as they are")
    return "; ".join(parts)


def _with_matches(keys: list[str], candidates: Iterable[str], first: Iterable[str] = ()) -> str:
    """``a (did you mean 'b'?), c ...``: the first keys, each with its closest candidate
    (looked for in ``first`` before the others: a missing key is likeliest misnamed as
    one of the unexpected ones)."""
    pools = [[str(c) for c in first], [str(c) for c in candidates]]
    shown = []
    for k in keys[:_SHOW]:
        close = next((c for pool in pools for c in difflib.get_close_matches(k, pool, n=1, cutoff=0.6)), None)
        shown.append(f"{k} (did you mean {close!r}?)" if close else k)
    more = f" ... and {len(keys) - _SHOW} more" if len(keys) > _SHOW else ""
    return ", ".join(shown) + more


def init_from_owners(tensors: Mapping[str, torch.Tensor], model: torch.nn.Module, device: torch.device | str,
                     seed: int = 0) -> None:
    """Fill ``tensors`` (``{original FQN: tensor}``, already allocated) in place, each from its owning
    module of ``model``: a copy of the owner on ``device`` runs its ``reset_parameters()``, else its
    ``init_states(buffer_device=)`` (torchtitan), else the model's ``_init_weights`` (Hugging Face),
    seeded by the owner's FQN. A tensor no initialiser writes is a :class:`SplitError` naming it.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2)); w = torch.full((2, 2), float("nan"))
        >>> init_from_owners({"0.weight": w}, model, "cpu"); bool(w.isnan().any())
        False
    """
    _reset_from_owners(dict(tensors), dict(tensors), model, device, seed, {})


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
        # The owner's reset_parameters(), else its init_states(buffer_device=) (torchtitan's module
        # protocol: parameters and computed buffers such as a rope cache), else a Hugging Face
        # model's _init_weights(module) (which also recomputes rotary inv_freq buffers).
        if hasattr(owner, "reset_parameters"):
            init: Callable[[Any], Any] = lambda m: m.reset_parameters()  # noqa: E731
        elif callable(getattr(owner, "init_states", None)):
            init = lambda m: m.init_states(buffer_device=torch.device(device))  # noqa: E731
        elif callable(getattr(model, "_init_weights", None)):
            init = cast(Callable[[Any], Any], model._init_weights)
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
            f"cannot initialise {cannot[:10]} on {device}: the owning modules have no reset_parameters() or "
            "init_states() (or they are buffers computed in __init__). Pass state_dict= holding them to build_stage "
            "(non-persistent buffers included), or build those buffers off meta"
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
        cast(torch.fx.GraphModule, module).recompile()
