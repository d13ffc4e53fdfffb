"""Chunk specs: how one value is split into microbatches (or merged back), and the
helpers splitting and merging share (spec classification, one-level flattening,
error paths).

Part of :mod:`pippy_split.microbatch` (the public home of the spec names), which sits
at the two ends of a pipeline step; ``splitting`` and ``merging`` beside it hold the
two halves. The shared helpers below are package-internal names: public to
``splitting`` and ``merging``, not re-exported.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["MicrobatchError", "TensorChunkSpec", "Replicate", "Microbatches"]


class MicrobatchError(ValueError):
    """An input cannot be split into, or an output merged from, microbatches."""


@dataclass(frozen=True)
class TensorChunkSpec:
    """Chunk tensors along dimension ``dim`` (negative counts from the end).

    Example:
        >>> from pippy_split.microbatch import split_args_kwargs
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

REDUCTIONS = ("sum", "mean")


class Microbatches(list):
    """A value already split into microbatches: entry ``k`` goes to microbatch ``k``
    as it is, so microbatches may differ in a dim declared dynamic (a sequence length).

    Pass it to ``step()`` / ``eval()`` in place of a batched argument (and as ``target=``);
    its length must be the schedule's ``n_microbatches``. A step given any ``Microbatches``
    returns the last stage's outputs as ``Microbatches`` too (unequal shapes do not
    concatenate).

    Example:
        >>> from pippy_split.microbatch import split_args_kwargs
        >>> x = Microbatches([torch.zeros(2, 16), torch.zeros(2, 8)])
        >>> [a[0].shape[1] for a, _ in split_args_kwargs((x,), {}, 2)]
        [16, 8]
    """

    def __repr__(self) -> str:
        return f"Microbatches({super().__repr__()})"


def any_per_microbatch(*values: Any) -> bool:
    """Whether any of these values (or a top-level argument inside a tuple/dict) is :class:`Microbatches`."""
    for v in values:
        inner = v.values() if isinstance(v, Mapping) else v if isinstance(v, tuple) else (v,)
        if any(isinstance(x, Microbatches) for x in inner):
            return True
    return False


# --------------------------------------------------------------------------- #
# Shared with splitting and merging: spec classification, one-level flattening,
# error paths.
# --------------------------------------------------------------------------- #


def show_path(path: str) -> str:
    """Render an argument path for a message: ``'x'``, ``'args[0]'``, ``kwargs['m']``."""
    return path if "'" in path else f"'{path}'"


def is_container(value: Any) -> bool:
    # torch.Size is a pytree node, but it unflattens to a plain tuple: keep it whole.
    return not isinstance(value, (torch.Tensor, torch.Size)) and not pytree.tree_is_leaf(value)


def is_custom(spec: Any) -> bool:
    return callable(spec) and not isinstance(spec, (TensorChunkSpec, _ReplicateType, type))


def _raw_key(entry: Any) -> Any:
    """The plain key behind a pytree KeyEntry (dict key, attribute name or index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def flatten_one(value: Any, path: str) -> tuple[list[tuple[Any, str, Any]], pytree.TreeSpec]:
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


def describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor of shape {tuple(value.shape)}"
    if is_container(value):
        items, _ = flatten_one(value, "")
        return f"{type(value).__name__} with keys {[k for k, _, _ in items]}"
    return type(value).__name__


def child_specs(value: Any, items: list, spec: Any, path: str) -> list:
    """Align a container spec with the children of ``value`` (pytree prefix match)."""
    if not is_container(value):
        raise MicrobatchError(
            f"chunk spec for argument {show_path(path)} is a {type(spec).__name__}, "
            f"but the argument is a {describe_value(value)}"
        )
    if isinstance(spec, Mapping):
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            raise MicrobatchError(
                f"chunk spec for argument {show_path(path)} is a dict, but the argument is a "
                f"{type(value).__name__}; give a list/tuple spec"
            )
        # Keys the value lacks are ignored: an optional entry may be absent.
        return [spec.get(key) for key, _, _ in items]
    if isinstance(spec, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            raise MicrobatchError(
                f"chunk spec for argument {show_path(path)} is a {type(spec).__name__}, "
                f"but the argument is a {describe_value(value)}"
            )
        if len(spec) != len(items):
            raise MicrobatchError(
                f"chunk spec for argument {show_path(path)} has {len(spec)} entries, "
                f"but the argument has {len(items)}"
            )
        return list(spec)
    # Any other registered container used as a spec must mirror the value's type.
    spec_items, _ = flatten_one(spec, path)
    if type(spec) is not type(value) or len(spec_items) != len(items):
        raise MicrobatchError(
            f"chunk spec for argument {show_path(path)} is a {describe_value(spec)}, "
            f"but the argument is a {describe_value(value)}"
        )
    return [s for _, _, s in spec_items]


def check_leaf_spec(spec: Any, path: str, allowed: tuple[str, ...] = ()) -> None:
    if spec is None or spec is Replicate or isinstance(spec, TensorChunkSpec):
        return
    if spec in allowed or is_custom(spec):
        return
    raise MicrobatchError(f"invalid chunk spec {spec!r} for argument {show_path(path)}")
