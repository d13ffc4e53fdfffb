"""Split a step's inputs into microbatches and merge per-microbatch outputs back.

Sits at the two ends of a pipeline step: the runtime calls
:func:`split_args_kwargs` on the arguments of ``schedule.step(...)`` before the
first stage runs, and :func:`merge_chunks` on the last stage's outputs once every
microbatch has come through.

A *chunk spec* says how one value is split (or merged):

- ``TensorChunkSpec(dim)``: chunk tensors along ``dim`` (merge: concatenate);
- ``Replicate``: every microbatch gets the same value (merge: all must agree);
- a callable: custom, ``(value, n) -> list of n values`` for splitting and
  ``(list of n values) -> value`` for merging;
- ``None``: the default, i.e. tensors with at least one dimension use dim 0 and
  everything else is replicated;
- for merging only, ``"sum"`` or ``"mean"``: reduce elementwise over microbatches.

Specs follow pytree *prefix* rules: a leaf spec placed at a container applies to
everything inside it, and a container spec (tuple/list/dict, or any class that
``torch.utils._pytree`` can flatten) is matched against the value's own structure.
Errors name the offending argument by path: ``args[0]``, ``kwargs['mask']``,
``args[1][0]``, or ``input_ids`` when the model's parameter names are passed.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "MicrobatchError",
    "TensorChunkSpec",
    "Replicate",
    "split_args_kwargs",
    "merge_chunks",
]


class MicrobatchError(ValueError):
    """An input cannot be split into, or an output merged from, microbatches."""


@dataclass(frozen=True)
class TensorChunkSpec:
    """Chunk tensors along dimension ``dim`` (negative counts from the end).

    Example:
        >>> split_args_kwargs((torch.zeros(3, 4),), {}, 2, (TensorChunkSpec(1),))[0][0][0].shape
        torch.Size([3, 2])
    """

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"TensorChunkSpec.dim must be an int, got {self.dim!r}")


class _ReplicateType(enum.Enum):
    # An enum member is a singleton that survives pickling and copying, which a
    # pipeline spec travelling to other ranks needs.
    Replicate = "Replicate"

    def __repr__(self) -> str:
        return "Replicate"


Replicate = _ReplicateType.Replicate
"""Give every microbatch the same value (not a copy); when merging, require that
all microbatches produced equal values and return one of them."""

_REDUCTIONS = ("sum", "mean")


# --------------------------------------------------------------------------- #
# Shared helpers: spec classification, one-level flattening, error paths.
# --------------------------------------------------------------------------- #


def _show(path: str) -> str:
    """Render an argument path for a message: ``'x'``, ``'args[0]'``, ``kwargs['m']``."""
    return path if "'" in path else f"'{path}'"


def _is_container(value: Any) -> bool:
    # torch.Size is a pytree node, but it unflattens to a plain tuple: keep it whole.
    return not isinstance(value, (torch.Tensor, torch.Size)) and not pytree.tree_is_leaf(value)


def _is_custom(spec: Any) -> bool:
    return callable(spec) and not isinstance(spec, (TensorChunkSpec, _ReplicateType, type))


def _raw_key(entry: Any) -> Any:
    """The plain key behind a pytree KeyEntry (dict key, attribute name or index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def _flatten_one(value: Any, path: str) -> tuple[list[tuple[Any, str, Any]], pytree.TreeSpec]:
    """Flatten exactly one level of a container: ``([(key, path, child)], treespec)``."""

    def is_leaf(x: Any) -> bool:
        return x is not value  # everything below the root stays whole

    try:
        keyed, spec = pytree.tree_flatten_with_path(value, is_leaf=is_leaf)
        items = [(_raw_key(kp[0]), path + pytree.keystr(kp), c) for kp, c in keyed]
    except ValueError:
        # A class registered without key names: fall back to positions.
        leaves, spec = pytree.tree_flatten(value, is_leaf=is_leaf)
        items = [(i, f"{path}[{i}]", c) for i, c in enumerate(leaves)]
    return items, spec


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor of shape {tuple(value.shape)}"
    if _is_container(value):
        items, _ = _flatten_one(value, "")
        return f"{type(value).__name__} with keys {[k for k, _, _ in items]}"
    return type(value).__name__


def _child_specs(value: Any, items: list, spec: Any, path: str) -> list:
    """Align a container spec with the children of ``value`` (pytree prefix match)."""
    if not _is_container(value):
        raise MicrobatchError(
            f"chunk spec for argument {_show(path)} is a {type(spec).__name__}, "
            f"but the argument is a {_describe(value)}"
        )
    if isinstance(spec, Mapping):
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            raise MicrobatchError(
                f"chunk spec for argument {_show(path)} is a dict, but the argument is a "
                f"{type(value).__name__}; give a list/tuple spec"
            )
        # Keys the value lacks are ignored: an optional entry may be absent.
        return [spec.get(key) for key, _, _ in items]
    if isinstance(spec, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            raise MicrobatchError(
                f"chunk spec for argument {_show(path)} is a {type(spec).__name__}, "
                f"but the argument is a {_describe(value)}"
            )
        if len(spec) != len(items):
            raise MicrobatchError(
                f"chunk spec for argument {_show(path)} has {len(spec)} entries, "
                f"but the argument has {len(items)}"
            )
        return list(spec)
    # Any other registered container used as a spec must mirror the value's type.
    spec_items, _ = _flatten_one(spec, path)
    if type(spec) is not type(value) or len(spec_items) != len(items):
        raise MicrobatchError(
            f"chunk spec for argument {_show(path)} is a {_describe(spec)}, "
            f"but the argument is a {_describe(value)}"
        )
    return [s for _, _, s in spec_items]


def _check_leaf_spec(spec: Any, path: str, allowed: tuple[str, ...] = ()) -> None:
    if spec is None or spec is Replicate or isinstance(spec, TensorChunkSpec):
        return
    if spec in allowed or _is_custom(spec):
        return
    raise MicrobatchError(f"invalid chunk spec {spec!r} for argument {_show(path)}")


# --------------------------------------------------------------------------- #
# Splitting
# --------------------------------------------------------------------------- #


@dataclass
class _SplitState:
    """What one split call has seen so far: batch sizes must agree across arguments."""

    n: int
    allow_uneven: bool
    first: tuple[str, int, int] | None = None  # (path, size, dim) of the first chunked tensor


def split_args_kwargs(
    args: tuple,
    kwargs: dict | None,
    n: int,
    args_chunk_spec: Any = None,
    kwargs_chunk_spec: Any = None,
    *,
    allow_uneven: bool = False,
    names: Sequence[str] | None = None,
) -> list[tuple[tuple, dict]]:
    """Split positional and keyword arguments into ``n`` microbatches.

    Args:
        args: positional arguments of one step.
        kwargs: keyword arguments of one step (``None`` means ``{}``).
        n: number of microbatches (>= 1).
        args_chunk_spec: ``None`` (default for all), one leaf spec for all, or a
            tuple with one spec (leaf or nested pytree) per positional argument.
        kwargs_chunk_spec: ``None``, one leaf spec, or a dict keyed like
            ``kwargs``; missing keys use the default, unknown keys are ignored.
        allow_uneven: allow a batch size not divisible by ``n``; chunks then
            differ in size by at most one (the first ones are larger), as with
            ``torch.tensor_split``.
        names: parameter names of the positional arguments, used in messages.

    Returns:
        A list of ``n`` ``(args, kwargs)`` pairs. Tensor chunks are views of the
        inputs; replicated values are the same objects in every microbatch.

    Raises:
        MicrobatchError: a batch smaller than ``n``, not divisible by ``n`` (unless
            ``allow_uneven``), chunked tensors whose batch sizes disagree, or a
            spec that does not fit its argument. The message names the argument.

    Example:
        >>> x, mask = torch.arange(8).view(4, 2), torch.ones(2, 4)
        >>> mbs = split_args_kwargs((x, "relu"), {"mask": mask}, 2,
        ...                         kwargs_chunk_spec={"mask": TensorChunkSpec(1)})
        >>> mbs[1][0][0].tolist(), mbs[1][0][1], mbs[1][1]["mask"].shape
        ([[4, 5], [6, 7]], 'relu', torch.Size([2, 2]))
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise MicrobatchError(f"number of microbatches must be an int >= 1, got {n!r}")
    kwargs = {} if kwargs is None else kwargs
    state = _SplitState(n=n, allow_uneven=allow_uneven)
    arg_specs = _top_level_arg_specs(args, args_chunk_spec)
    split_args = [
        _split(a, s, _arg_name(i, names), state) for i, (a, s) in enumerate(zip(args, arg_specs))
    ]
    split_kwargs = {
        k: _split(v, _kwarg_spec(kwargs_chunk_spec, k), f"kwargs[{k!r}]", state)
        for k, v in kwargs.items()
    }
    return [
        (tuple(parts[i] for parts in split_args), {k: parts[i] for k, parts in split_kwargs.items()})
        for i in range(n)
    ]


def _arg_name(i: int, names: Sequence[str] | None) -> str:
    return names[i] if names is not None and i < len(names) else f"args[{i}]"


def _top_level_arg_specs(args: tuple, spec: Any) -> list:
    if isinstance(spec, (list, tuple)):
        if len(spec) != len(args):
            raise MicrobatchError(
                f"args_chunk_spec has {len(spec)} entries but {len(args)} positional "
                "arguments were given"
            )
        return list(spec)
    _check_leaf_spec(spec, "args")
    return [spec] * len(args)  # one leaf spec (or None) for every argument


def _kwarg_spec(spec: Any, key: str) -> Any:
    if isinstance(spec, Mapping):
        return spec.get(key)
    _check_leaf_spec(spec, "kwargs")
    return spec


def _split(value: Any, spec: Any, path: str, st: _SplitState) -> list:
    """Split one value (and everything inside it) under ``spec`` into ``st.n`` parts."""
    if _is_container(spec):
        if value is None:
            return [None] * st.n  # an optional argument left out: nothing to split
        items, treespec = _flatten_one(value, path) if _is_container(value) else ([], None)
        specs = _child_specs(value, items, spec, path)
        parts = [_split(c, s, p, st) for (_, p, c), s in zip(items, specs)]
        return [pytree.tree_unflatten([part[i] for part in parts], treespec) for i in range(st.n)]
    _check_leaf_spec(spec, path)
    if spec is Replicate:
        return [value] * st.n
    if _is_custom(spec):
        return _split_custom(value, spec, path, st.n)
    return _split_tree(value, spec, path, st)


def _split_custom(value: Any, fn: Callable, path: str, n: int) -> list:
    parts = fn(value, n)
    if not isinstance(parts, Sequence) or len(parts) != n:
        got = f"{len(parts)} values" if isinstance(parts, Sequence) else type(parts).__name__
        raise MicrobatchError(
            f"custom chunk spec {fn!r} for argument {_show(path)} returned {got}, expected a "
            f"list of {n}"
        )
    return list(parts)


def _split_tree(value: Any, spec: TensorChunkSpec | None, path: str, st: _SplitState) -> list:
    """Default/TensorChunkSpec split: chunk tensors, replicate other leaves."""
    if isinstance(value, torch.Tensor):
        if spec is None and value.dim() == 0:
            return [value] * st.n  # a scalar has no batch dimension to chunk
        return _chunk_tensor(value, 0 if spec is None else spec.dim, path, st)
    if not _is_container(value):
        return [value] * st.n
    items, treespec = _flatten_one(value, path)
    parts = [_split_tree(c, spec, p, st) for _, p, c in items]
    return [pytree.tree_unflatten([part[i] for part in parts], treespec) for i in range(st.n)]


def _chunk_tensor(t: torch.Tensor, dim: int, path: str, st: _SplitState) -> list[torch.Tensor]:
    if t.dim() == 0 or not -t.dim() <= dim < t.dim():
        raise MicrobatchError(
            f"argument {_show(path)} has shape {tuple(t.shape)}, cannot chunk along dim {dim}"
        )
    dim = dim % t.dim()
    size = t.shape[dim]
    if st.first is None:
        st.first = (path, size, dim)
        _check_batch_size(path, size, dim, st)
    elif size != st.first[1]:
        other, other_size, other_dim = st.first
        raise MicrobatchError(
            f"argument {_show(path)} has batch size {size} along dim {dim}, but argument "
            f"{_show(other)} has batch size {other_size} along dim {other_dim}; chunked "
            "arguments must agree"
        )
    return list(torch.tensor_split(t, st.n, dim=dim))


def _check_batch_size(path: str, size: int, dim: int, st: _SplitState) -> None:
    if size < st.n:
        raise MicrobatchError(
            f"argument {_show(path)} has batch size {size} along dim {dim}, smaller than "
            f"{st.n} microbatches"
        )
    if size % st.n and not st.allow_uneven:
        raise MicrobatchError(
            f"argument {_show(path)} has batch size {size} along dim {dim}, not divisible "
            f"into {st.n} microbatches (pass allow_uneven=True to allow unequal chunks)"
        )


# --------------------------------------------------------------------------- #
# Merging
# --------------------------------------------------------------------------- #


def merge_chunks(chunks: Sequence[Any], spec: Any = None) -> Any:
    """Merge the outputs of every microbatch, in microbatch order, into one value.

    Args:
        chunks: one output per microbatch, all with the same structure
            (tensors, None, numbers, and tuple/list/dict/pytree containers such
            as Hugging Face ``ModelOutput``; containers are rebuilt as the same type).
        spec: ``None`` (concatenate tensors along dim 0; a floating-point 0-dim
            tensor, such as a model's own loss, is averaged over microbatches; other
            scalars and values must be equal in every microbatch), ``TensorChunkSpec(dim)``,
            ``Replicate``, ``"sum"``, ``"mean"``, a callable over the list of
            values, or a container of these matching the output (prefix rules).

    Returns:
        The merged value. ``None`` stays ``None``.

    Raises:
        MicrobatchError: microbatch outputs differ in structure, a default-merged
            scalar differs between microbatches (pick ``"sum"``/``"mean"``), or a
            spec does not fit the output. The message names the output path.

    Example:
        >>> outs = [(torch.ones(2, 3), torch.tensor(1.0)), (torch.zeros(2, 3), torch.tensor(3.0))]
        >>> logits, loss = merge_chunks(outs, (None, "mean"))
        >>> logits.shape, loss.item()
        (torch.Size([4, 3]), 2.0)
    """
    if len(chunks) == 0:
        raise MicrobatchError("merge_chunks needs the output of at least one microbatch")
    return _merge(list(chunks), spec, "output")


def _merge(values: list, spec: Any, path: str) -> Any:
    if _is_container(spec):
        if all(v is None for v in values):
            return None
        items, treespec, children = _flatten_all(values, path)
        specs = _child_specs(values[0], items, spec, path)
        merged = [_merge(ch, s, p) for (_, p, _), ch, s in zip(items, children, specs)]
        return pytree.tree_unflatten(merged, treespec)
    _check_leaf_spec(spec, path, allowed=_REDUCTIONS)
    if _is_custom(spec):
        return spec(values)
    return _merge_tree(values, spec, path)


def _flatten_all(values: list, path: str) -> tuple[list, pytree.TreeSpec, list[list]]:
    """Flatten one level of every microbatch's value, checking they share a structure."""
    items, treespec = _flatten_one(values[0], path)
    per_mb = [[c for _, _, c in items]]
    for i, v in enumerate(values[1:], start=1):
        if not _is_container(v) or _flatten_one(v, path)[1] != treespec:
            raise MicrobatchError(
                f"{path}: microbatch {i} produced a {_describe(v)}, but microbatch 0 "
                f"produced a {_describe(values[0])}"
            )
        per_mb.append([c for _, _, c in _flatten_one(v, path)[0]])
    children = [list(col) for col in zip(*per_mb)] if items else []
    return items, treespec, children


def _merge_tree(values: list, spec: Any, path: str) -> Any:
    """Merge under a leaf spec, recursing through containers."""
    first = values[0]
    if all(v is None for v in values):
        return None
    if _is_container(first):
        items, treespec, children = _flatten_all(values, path)
        merged = [_merge_tree(ch, spec, p) for (_, p, _), ch in zip(items, children)]
        return pytree.tree_unflatten(merged, treespec)
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) != isinstance(first, torch.Tensor) or _is_container(v):
            raise MicrobatchError(
                f"{path}: microbatch {i} produced a {_describe(v)}, but microbatch 0 "
                f"produced a {_describe(first)}"
            )
    if spec in _REDUCTIONS:
        return _reduce(values, spec, path)
    if spec is Replicate:
        return _same(values, path)
    if isinstance(first, torch.Tensor) and (first.dim() > 0 or spec is not None):
        dim = 0 if spec is None else spec.dim
        return _cat(values, dim, path)
    if spec is None and isinstance(first, torch.Tensor) and first.is_floating_point():
        # a per-microbatch scalar such as an HF model's own `loss`: the batch's value is the
        # mean over microbatches (the same rule the schedule's gradients follow)
        return _reduce(values, "mean", path)
    return _same(values, path)


def _cat(values: list[torch.Tensor], dim: int, path: str) -> torch.Tensor:
    ndim = values[0].dim()
    if ndim == 0 or not -ndim <= dim < ndim:
        raise MicrobatchError(
            f"{path} has shape {tuple(values[0].shape)}, cannot concatenate along dim {dim}"
        )
    try:
        return torch.cat(values, dim=dim)
    except RuntimeError as e:
        shapes = [tuple(v.shape) for v in values]
        raise MicrobatchError(f"{path}: cannot concatenate shapes {shapes} along dim {dim}: {e}") from e


def _reduce(values: list, how: str, path: str) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        total = torch.stack(values).sum(dim=0)
    elif isinstance(first, (int, float, complex)):
        total = sum(values)
    else:
        raise MicrobatchError(f"{path} is a {type(first).__name__}, cannot {how} it")
    # True division also turns integer sums into a float mean, as intended.
    return total / len(values) if how == "mean" else total


def _same(values: list, path: str) -> Any:
    """Values that cannot be concatenated must agree; return one of them."""
    first = values[0]
    for i, v in enumerate(values[1:], start=1):
        if not _equal(first, v):
            raise MicrobatchError(
                f"{path} differs between microbatches (microbatch 0: {first!r}, microbatch "
                f"{i}: {v!r}); pass merge spec \"sum\", \"mean\" or a callable for it"
                + (" (the schedule's output_merge_spec=)" if path.startswith("output") else "")
            )
    return first


def _equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # e.g. an object whose == returns an array
        return False
