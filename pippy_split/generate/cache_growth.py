"""A KV cache that grows in place (generate: the decode program's cache update, per step).

A model's cache update appends the step's keys and values to the past with a
``torch.cat`` (Hugging Face's ``DynamicCache``), which copies the whole past every
step: a generation of ``n`` tokens copies ``O(n^2)`` cache, and on a CPU each copy is a fresh
allocation the size of the cache. :func:`grow_cache` replaces that ``cat`` in the decode
program's stage graphs (:func:`grow_in_place`): where the past is the filled prefix of a
buffer with room after it (:func:`with_room`, made by the stage decoder at the prefill,
sized for the prompt and the call's new tokens), the step's keys and values are written into
the room and the result is a longer view of the same buffer. A lane that outgrows its buffer
(continuous batching: a refilled lane's cache keeps growing) moves to one with as much room
again, one copy per buffer's worth of tokens. Anywhere else it is the ``cat`` it replaces.
Values are those of the ``cat``; only where they live changes.

A buffer records how much of it is filled. Only a view that ends there grows in place, so a
second view of the same past (a branch) never overwrites what a longer one holds: it is
concatenated instead.
"""

from __future__ import annotations

import torch

__all__ = ["grow_cache", "grow_in_place", "with_room"]

_FILLED = "_pippy_split_filled"
"""The attribute of a buffer made by :func:`with_room`: how much of its growth dim is filled."""
_ROOM = "_pippy_split_room"
"""... and the room it was made with: what a buffer that replaces it adds."""


def with_room(empty: torch.Tensor, dim: int, room: int) -> torch.Tensor:
    """``empty`` (a cache tensor with nothing along ``dim``) as a view of a buffer with room for
    ``room`` entries along ``dim``, which :func:`grow_cache` fills in place.

    Example:
        >>> past = with_room(torch.zeros(2, 4, 0, 8), 2, 16)
        >>> grown = grow_cache(past, torch.ones(2, 4, 3, 8), 2)
        >>> grown.shape, grown._base is past._base
        (torch.Size([2, 4, 3, 8]), True)
    """
    if empty.shape[dim] != 0 or room <= 0:
        return empty
    return _buffer(empty, dim, room).narrow(dim, 0, 0)


def _buffer(filled: torch.Tensor, dim: int, room: int) -> torch.Tensor:
    """A buffer holding ``filled`` with ``room`` more entries along ``dim``."""
    n = filled.shape[dim]
    shape = list(filled.shape)
    shape[dim] = n + room
    buffer = filled.new_empty(shape)
    buffer.narrow(dim, 0, n).copy_(filled)
    setattr(buffer, _FILLED, n)
    setattr(buffer, _ROOM, room)
    return buffer


def grow_cache(past: torch.Tensor, new: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.cat([past, new], dim)``, written into the room of ``past``'s buffer where it has
    room and ``past`` is its filled prefix (see the module docstring)."""
    dim = dim % past.dim()
    buffer = past._base
    n, t = past.shape[dim], new.shape[dim]
    if (buffer is None or getattr(buffer, _FILLED, None) != n
            or past.storage_offset() != buffer.storage_offset() or past.stride() != buffer.stride()
            or torch.promote_types(buffer.dtype, new.dtype) != buffer.dtype or new.device != buffer.device
            or not new.shape[:dim] + new.shape[dim + 1:] == past.shape[:dim] + past.shape[dim + 1:]
            == buffer.shape[:dim] + buffer.shape[dim + 1:]
            or (torch.is_grad_enabled() and (past.requires_grad or new.requires_grad))):
        return torch.cat([past, new], dim)
    if n + t > buffer.shape[dim]:  # outgrown: a buffer with as much room again
        buffer = _buffer(past, dim, t + getattr(buffer, _ROOM))
    buffer.narrow(dim, n, t).copy_(new)
    setattr(buffer, _FILLED, n + t)
    return buffer.narrow(dim, 0, n + t)


def grow_in_place(graph_module: torch.fx.GraphModule, past_inputs: set[int]) -> int:
    """Make each ``cat`` in ``graph_module`` that appends to one of the placeholders at
    positions ``past_inputs`` (a cache's past) a :func:`grow_cache`. Returns how many."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    pasts = {placeholders[i] for i in past_inputs}
    count = 0
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
            continue
        tensors = node.args[0]
        if len(tensors) != 2 or tensors[0] not in pasts:
            continue
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        node.target, node.args, node.kwargs = grow_cache, (tensors[0], tensors[1], dim), {}
        count += 1
    if count:
        graph_module.recompile()
    return count
