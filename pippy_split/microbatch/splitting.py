"""Splitting one step's inputs into microbatches (the start of a pipeline step).

Part of :mod:`pippy_split.microbatch` (the public home of :func:`split_args_kwargs`):
the schedule calls it on the arguments of ``schedule.step(...)`` before the first
stage runs. Chunk specs and the helpers shared with merging are in
:mod:`pippy_split.microbatch.chunking`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .chunking import (
    MicrobatchError,
    Microbatches,
    Replicate,
    TensorChunkSpec,
    check_leaf_spec,
    child_specs,
    flatten_one,
    is_container,
    is_custom,
    show_path,
)

__all__ = ["split_args_kwargs"]


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
            An argument given as :class:`Microbatches` is already split: entry ``k``
            is microbatch ``k``'s value, whatever its shape.

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
    check_leaf_spec(spec, "args")
    return [spec] * len(args)  # one leaf spec (or None) for every argument


def _kwarg_spec(spec: Any, key: str) -> Any:
    if isinstance(spec, Mapping):
        return spec.get(key)
    check_leaf_spec(spec, "kwargs")
    return spec


def _split(value: Any, spec: Any, path: str, st: _SplitState) -> list:
    """Split one value (and everything inside it) under ``spec`` into ``st.n`` parts."""
    if isinstance(value, Microbatches):
        if len(value) != st.n:
            raise MicrobatchError(f"argument {show_path(path)} is Microbatches of {len(value)} entries, but the step "
                                  f"has {st.n} microbatches: give one entry per microbatch")
        return list(value)
    if is_container(spec):
        if value is None:
            return [None] * st.n  # an optional argument left out: nothing to split
        items, treespec = flatten_one(value, path) if is_container(value) else ([], None)
        specs = child_specs(value, items, spec, path)
        parts = [_split(c, s, p, st) for (_, p, c), s in zip(items, specs)]
        return [pytree.tree_unflatten([part[i] for part in parts], treespec) for i in range(st.n)]  # type: ignore[arg-type]
    check_leaf_spec(spec, path)
    if spec is Replicate:
        return [value] * st.n
    if is_custom(spec):
        return _split_custom(value, spec, path, st.n)
    return _split_tree(value, spec, path, st)


def _split_custom(value: Any, fn: Callable, path: str, n: int) -> list:
    parts = fn(value, n)
    if not isinstance(parts, Sequence) or len(parts) != n:
        got = f"{len(parts)} values" if isinstance(parts, Sequence) else type(parts).__name__
        raise MicrobatchError(
            f"custom chunk spec {fn!r} for argument {show_path(path)} returned {got}, expected a "
            f"list of {n}"
        )
    return list(parts)


def _split_tree(value: Any, spec: TensorChunkSpec | None, path: str, st: _SplitState) -> list:
    """Default/TensorChunkSpec split: chunk tensors, replicate other leaves."""
    if isinstance(value, torch.Tensor):
        if spec is None and value.dim() == 0:
            return [value] * st.n  # a scalar has no batch dimension to chunk
        return _chunk_tensor(value, 0 if spec is None else spec.dim, path, st)
    if not is_container(value):
        return [value] * st.n
    items, treespec = flatten_one(value, path)
    parts = [_split_tree(c, spec, p, st) for _, p, c in items]
    return [pytree.tree_unflatten([part[i] for part in parts], treespec) for i in range(st.n)]


def _chunk_tensor(t: torch.Tensor, dim: int, path: str, st: _SplitState) -> list[torch.Tensor]:
    if t.dim() == 0 or not -t.dim() <= dim < t.dim():
        raise MicrobatchError(
            f"argument {show_path(path)} has shape {tuple(t.shape)}, cannot chunk along dim {dim}"
        )
    dim = dim % t.dim()
    size = t.shape[dim]
    if st.first is None:
        st.first = (path, size, dim)
        _check_batch_size(path, size, dim, st)
    elif size != st.first[1]:
        other, other_size, other_dim = st.first
        raise MicrobatchError(
            f"argument {show_path(path)} has batch size {size} along dim {dim}, but argument "
            f"{show_path(other)} has batch size {other_size} along dim {other_dim}; chunked "
            "arguments must agree"
        )
    return list(torch.tensor_split(t, st.n, dim=dim))


def _check_batch_size(path: str, size: int, dim: int, st: _SplitState) -> None:
    if size < st.n:
        raise MicrobatchError(
            f"argument {show_path(path)} has batch size {size} along dim {dim}, smaller than "
            f"{st.n} microbatches"
        )
    if size % st.n and not st.allow_uneven:
        raise MicrobatchError(
            f"argument {show_path(path)} has batch size {size} along dim {dim}, not divisible "
            f"into {st.n} microbatches (pass allow_uneven=True to allow unequal chunks)"
        )
