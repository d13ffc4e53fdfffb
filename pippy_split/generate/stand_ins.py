"""Zero-memory stand-ins for tensors a trace needs only the shape of (generate, tracing).

The decode program is traced on the user's model. Where that model's tensors cannot be
traced as they are (a pipe built on ``meta`` and filled stage by stage on each rank, or
FSDP2 / TP DTensors), each is lent a stand-in of its shape and dtype holding one element,
for the trace only. The decode program keeps what it traced on, so before a stage decodes,
every stand-in it holds must have been bound to a live tensor of this rank's stage:
:func:`is_stand_in` tells them apart.

Example:
    >>> p = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
    >>> s = stand_in(p, torch.device("cpu"))
    >>> tuple(s.shape), s.device.type, is_stand_in(s), is_stand_in(p)
    ((4, 3), 'cpu', True, False)
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, Iterator

import torch

from ..split.module_calls import parent_of

__all__ = ["stand_in", "is_stand_in", "meta_stood_in", "lend"]

_MADE: dict[int, weakref.ref] = {}  # id -> the stand-in (tensors compare elementwise: no WeakSet)


def stand_in(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype on ``device`` (``t``'s own by default) that holds one
    element; a Parameter (not requiring grad) where ``t`` is one."""
    flat = torch.empty((), dtype=t.dtype, device=t.device if device is None else device).expand(t.shape)
    new = torch.nn.Parameter(flat, requires_grad=False) if isinstance(t, torch.nn.Parameter) else flat
    key = id(new)
    _MADE[key] = weakref.ref(new, lambda _, key=key: _MADE.pop(key, None))  # type: ignore[misc]
    return new


def is_stand_in(t: torch.Tensor) -> bool:
    """Whether ``t`` was made by :func:`stand_in`."""
    ref = _MADE.get(id(t))
    return ref is not None and ref() is t


def lend(root: torch.nn.Module, name: str, old: torch.Tensor, new: torch.Tensor,
         undo: list[Callable[[], None]]) -> bool:
    """Put ``new`` where ``old`` is registered as ``name`` under ``root`` (a parameter or a
    buffer); ``undo`` puts ``old`` back. False (nothing done) where ``name`` no longer holds
    ``old`` (lent already through another name of the same module)."""
    parent, leaf = parent_of(root, name)
    store: dict = parent._parameters if leaf in parent._parameters else parent._buffers
    if store.get(leaf) is not old:
        return False
    store[leaf] = new
    undo.append(functools.partial(store.__setitem__, leaf, old))
    return True


@contextlib.contextmanager
def meta_stood_in(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """For the ``with``: each ``meta`` parameter and buffer of ``model`` is a stand-in on
    ``device`` (its tied names share one)."""
    undo: list[Callable[[], None]] = []
    made: dict[int, torch.Tensor] = {}
    try:
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        for name, t in named:
            if t.device.type == "meta":
                new = made.get(id(t))
                if new is None:
                    new = made[id(t)] = stand_in(t, device)
                lend(model, name, t, new, undo)
        yield
    finally:
        while undo:
            undo.pop()()
