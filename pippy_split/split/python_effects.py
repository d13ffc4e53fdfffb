"""What a model's ``forward`` does that its traced graph does not hold (split, while tracing).

Two things run in Python, not in ops, and a stage that runs traced ops (the glue) loses them:

- **State written on a module.** ``self.rg_lru.recurrent_states = None`` is no op: the
  trace bakes in what the code read at trace time. That is exact for glue, but not for a
  module swapped back in as the user's object (``split/module_calls.py``): it runs its own
  ``forward`` and reads the attribute as its last call left it, because the glue that
  would have reset it no longer runs. In a pipeline that last call is the previous
  microbatch's, and autograd links the two. :func:`modules_kept_traced` names the modules
  a stage must therefore not call: those whose subtree is written from outside it. A
  module whose own forward writes all the state it reads (HF RecurrentGemma's recurrent
  block, resetting and then updating its ``rg_lru``) is still called whole where the cut
  leaves it whole.
- **A custom ``torch.autograd.Function``.** Export traces its ``forward`` only; its
  ``backward`` (a reversible layer's recomputation, a clipped derivative, a fused
  kernel's) exists only where the user's module that applies it runs as itself. Those
  modules are recorded so that the split keeps them whole and calls them, or refuses.

:func:`watch_forward` records both while the model is traced, with the module whose
``forward`` was running, and puts every tensor attribute it saw written back as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["StateWrite", "ForwardEffects", "watch_forward", "modules_kept_traced"]

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


@dataclass
class ForwardEffects:
    """What :func:`watch_forward` saw."""

    writes: list[StateWrite] = field(default_factory=list)
    """Every attribute assigned on a module of the model while one of its forwards ran."""
    functions: dict[str, list[str]] = field(default_factory=dict)
    """``{module FQN: [custom autograd Function, ...]}``: the innermost module whose
    ``forward`` applied each Function (``""``: the model's own forward)."""


@contextlib.contextmanager
def watch_forward(model: torch.nn.Module, *, functions: bool = True) -> Iterator[ForwardEffects]:
    """Record what ``model``'s forwards do in Python (see :class:`ForwardEffects`) while the
    block runs. An attribute set outside any forward (by the tracer) is not the model's; on
    exit every recorded attribute that holds a tensor is put back as it was, so a trace
    leaves no traced value on the user's modules.

    ``functions``: also watch ``torch.autograd.Function.apply``, and after each call set
    the grad mode it found again (autograd restores it in C++, which a tracer does not
    see: without this, export traces everything after a Function whose ``forward`` holds a
    ``torch.no_grad()`` block as if in that block). Only for eager tracing: TorchDynamo
    traces ``apply`` itself.
    """
    watch = _Watch(model)
    handles = [h for m in {id(m): m for m in model.modules()}.values()
               for h in (m.register_forward_pre_hook(watch.enter),
                         m.register_forward_hook(watch.leave, always_call=True))]
    torch.nn.Module.__setattr__ = watch.setattr  # type: ignore[method-assign, assignment]
    if functions:
        torch.autograd.Function.apply = classmethod(watch.apply)  # type: ignore[assignment, method-assign]
    try:
        yield watch.effects
    finally:
        torch.nn.Module.__setattr__ = watch.original_setattr  # type: ignore[method-assign]
        torch.autograd.Function.apply = watch.original_apply  # type: ignore[method-assign]
        for h in handles:
            h.remove()
        watch.put_back()


class _Watch:
    """The state of one :func:`watch_forward`: the stack of running forwards, what they did,
    and each written attribute's value before its first write."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.effects = ForwardEffects()
        self.saved: dict[tuple[int, str], tuple[torch.nn.Module, Any]] = {}
        self.original_setattr = torch.nn.Module.__setattr__
        # a Python classmethod up to torch 2.13, a C classmethod descriptor from 2.14: kept as found
        self.original_apply = torch.autograd.Function.__dict__["apply"]

    def enter(self, module: torch.nn.Module, *_: Any) -> None:
        # a module the tracer made from one of the model's (an alias's copy) counts as its caller
        self.stack.append(self.names.get(id(module), self.stack[-1] if self.stack else ""))

    def leave(self, module: torch.nn.Module, *_: Any) -> None:
        if self.stack:
            self.stack.pop()

    @property
    def setattr(self) -> Any:
        """``nn.Module.__setattr__`` that records a write made inside a forward."""

        def setattr_watched(module: torch.nn.Module, name: str, value: Any) -> None:
            fqn = self.names.get(id(module))
            if self.stack and fqn is not None:
                self.effects.writes.append(StateWrite(self.stack[-1], fqn, name))
                if (id(module), name) not in self.saved:
                    self.saved[(id(module), name)] = (module, getattr(module, name, _UNSET))
            self.original_setattr(module, name, value)

        return setattr_watched

    def apply(self, cls: Any, *args: Any, **kwargs: Any) -> Any:
        """``Function.apply`` that records the Function and sets the grad mode it found again."""
        grad_mode = torch.is_grad_enabled()
        if self.stack:
            found = self.effects.functions.setdefault(self.stack[-1], [])
            if cls.__qualname__ not in found:
                found.append(cls.__qualname__)
        try:
            return self.original_apply.__get__(None, cls)(*args, **kwargs)
        finally:
            torch.set_grad_enabled(grad_mode)

    def put_back(self) -> None:
        """Every written attribute that now holds a tensor (a traced value) as it was before."""
        for (_, name), (module, value) in self.saved.items():
            if not isinstance(getattr(module, name, None), torch.Tensor):
                continue  # a flag may go with work done once (HF installs its output hooks): left as set
            if value is not _UNSET:
                self.original_setattr(module, name, value)
            else:
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
