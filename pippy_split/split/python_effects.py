"""Python state a model's ``forward`` writes on its modules (split, while tracing).

``self.rg_lru.recurrent_states = None`` in a forward is no op of the traced graph: the
trace bakes in what the code read at trace time and drops the assignment. That is exact
for traced ops (the glue), but not for a module swapped back in as the user's object
(``split/module_calls.py``): it runs its own ``forward`` and reads the attribute as the
last call left it, because the glue that would have reset it no longer runs. In a
pipeline that last call is the previous microbatch's, and autograd links the two.

So while the model is traced, every ``setattr`` on one of its modules is recorded with
the module whose ``forward`` made it (:func:`watch_state_writes`), and
:func:`modules_kept_traced` names the modules a stage must not call as the user's object:
those whose subtree is written from outside it. A module whose own forward writes all the
state it reads (HF RecurrentGemma's recurrent block, resetting and then updating its
``rg_lru``) is still called whole where the cut leaves it whole; only where the cut
enters it do its written children stay traced ops with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StateWrite", "watch_state_writes", "modules_kept_traced"]

_UNSET = object()


@dataclass(frozen=True)
class StateWrite:
    """One attribute a module's ``forward`` assigned on a module of the model."""

    writer: str
    """FQN of the module whose ``forward`` was running (``""``: the model's own)."""
    target: str
    """FQN of the module assigned to."""
    attr: str
    """The attribute's name."""

    def __str__(self) -> str:
        where = f"{self.writer!r}" if self.writer else "the model's own forward"
        return f"{where} sets {self.target + '.' if self.target else ''}{self.attr}"


@contextlib.contextmanager
def watch_state_writes(model: torch.nn.Module) -> Iterator[list[StateWrite]]:
    """Record, into the yielded list, every attribute assigned on a module of ``model``
    while one of its modules' ``forward`` runs (an attribute set outside any forward, by
    the tracer, is not the model's); on exit every such attribute is put back as it was,
    so a trace leaves no traced value on the user's modules."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []
    writes: list[StateWrite] = []
    saved: dict[tuple[int, str], tuple[torch.nn.Module, Any]] = {}
    original = torch.nn.Module.__setattr__

    def setattr_watched(self: torch.nn.Module, name: str, value: Any) -> None:
        fqn = names.get(id(self))
        if stack and fqn is not None:
            writes.append(StateWrite(stack[-1], fqn, name))
            if (id(self), name) not in saved:
                saved[(id(self), name)] = (self, getattr(self, name, _UNSET))
        original(self, name, value)

    def enter(module: torch.nn.Module, *_: Any) -> None:
        stack.append(names[id(module)])

    def leave(module: torch.nn.Module, *_: Any) -> None:
        if stack:
            stack.pop()

    handles = [h for m in {id(m): m for m in model.modules()}.values()
               for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave, always_call=True))]
    torch.nn.Module.__setattr__ = setattr_watched  # type: ignore[method-assign]
    try:
        yield writes
    finally:
        torch.nn.Module.__setattr__ = original  # type: ignore[method-assign]
        for h in handles:
            h.remove()
        for (_, name), (module, value) in saved.items():
            if value is not _UNSET:
                original(module, name, value)
            elif hasattr(module, name):
                delattr(module, name)


def _contains(outer: str, inner: str) -> bool:
    return outer == "" or inner == outer or inner.startswith(outer + ".")


def modules_kept_traced(writes: list[StateWrite]) -> dict[str, StateWrite]:
    """``{fqn: a write that keeps it traced}``: every module whose subtree is written by a
    forward outside that subtree. Called as the user's object, such a module would read
    what its previous call left where the model's code sets it first.

    Example:
        >>> modules_kept_traced([StateWrite("layers.0.block", "layers.0.block.lru", "state"),
        ...                      StateWrite("layers.0.block.lru", "layers.0.block.lru", "state")])
        {'layers.0.block.lru': StateWrite(writer='layers.0.block', target='layers.0.block.lru', attr='state')}
    """
    out: dict[str, StateWrite] = {}
    for w in writes:
        parts = w.target.split(".") if w.target else []
        for k in range(len(parts), 0, -1):
            fqn = ".".join(parts[:k])
            if _contains(fqn, w.writer):
                break
            out.setdefault(fqn, w)
    return out
