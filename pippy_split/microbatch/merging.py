"""Merging per-microbatch outputs back into one value (the end of a pipeline step).

Part of :mod:`pippy_split.microbatch` (the public home of :func:`merge_chunks`): the
runtime calls it on the last stage's outputs once every microbatch has come
through. Chunk specs and the shared helpers are in :mod:`pippy_split.microbatch.chunking`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .chunking import (
    REDUCTIONS,
    MicrobatchError,
    Replicate,
    check_leaf_spec,
    child_specs,
    describe_value,
    flatten_one,
    is_container,
    is_custom,
)

__all__ = ["merge_chunks"]


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
    if is_container(spec):
        if all(v is None for v in values):
            return None
        items, treespec, children = _flatten_all(values, path)
        specs = child_specs(values[0], items, spec, path)
        merged = [_merge(ch, s, p) for (_, p, _), ch, s in zip(items, children, specs)]
        return pytree.tree_unflatten(merged, treespec)
    check_leaf_spec(spec, path, allowed=REDUCTIONS)
    if is_custom(spec):
        return spec(values)
    return _merge_tree(values, spec, path)


def _flatten_all(values: list, path: str) -> tuple[list, pytree.TreeSpec, list[list]]:
    """Flatten one level of every microbatch's value, checking they share a structure."""
    items, treespec = flatten_one(values[0], path)
    per_mb = [[c for _, _, c in items]]
    for i, v in enumerate(values[1:], start=1):
        if not is_container(v) or flatten_one(v, path)[1] != treespec:
            raise MicrobatchError(
                f"{path}: microbatch {i} produced a {describe_value(v)}, but microbatch 0 "
                f"produced a {describe_value(values[0])}"
            )
        per_mb.append([c for _, _, c in flatten_one(v, path)[0]])
    children = [list(col) for col in zip(*per_mb)] if items else []
    return items, treespec, children


def _merge_tree(values: list, spec: Any, path: str) -> Any:
    """Merge under a leaf spec, recursing through containers."""
    first = values[0]
    if all(v is None for v in values):
        return None
    if is_container(first):
        items, treespec, children = _flatten_all(values, path)
        merged = [_merge_tree(ch, spec, p) for (_, p, _), ch in zip(items, children)]
        return pytree.tree_unflatten(merged, treespec)
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) != isinstance(first, torch.Tensor) or is_container(v):
            raise MicrobatchError(
                f"{path}: microbatch {i} produced a {describe_value(v)}, but microbatch 0 "
                f"produced a {describe_value(first)}"
            )
    if spec in REDUCTIONS:
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
