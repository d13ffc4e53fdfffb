"""Values ``torch.export`` cannot flatten at the user's module calls: cache objects (split,
while tracing; ``kept_calls.py`` asks).

Export's module call signatures take tensors and scalars only. An HF cache object
(``DynamicCache``, Reformer's ``ReformerDynamicCache``) passed into or returned from a module
call makes the signature fail. :func:`opaque_calls` finds those calls by one forward on fake
tensors. A call that *returns* one keeps its signature: :func:`outputs_hidden` shows export's
signature hook a constant in the object's place while the caller still gets the object, as
the model's own outputs are treated (``trace.py`` drops them); a stage calling the module
leaves that output unread. A call that *takes* one cannot (the stage would have to pass an
object the trace never saw), so it keeps none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

__all__ = ["opaque_calls", "outputs_hidden", "fake_forward"]

_FLAT = (torch.Tensor, int, float, bool, str, type(None))  # what export's signature hooks accept


def _flattens(leaf: Any) -> bool:
    return isinstance(leaf, _FLAT)


def opaque_calls(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[set[str], set[str]]:
    """``(modules taking, modules returning)`` a value export cannot flatten into tensors and
    scalars (an HF cache), found by one forward on fake tensors (no compute, no memory). A
    module whose output cannot show a constant in the value's place (:func:`outputs_hidden`)
    counts as taking one: its call keeps no signature."""
    takes: set[str] = set()
    gives: set[str] = set()
    handles = []
    for name, mod in model.named_modules():
        if not name:
            continue

        def pre(m: Any, a: Any, kw: Any, _n: str = name) -> None:
            if not all(_flattens(leaf) for leaf in pytree.tree_leaves((a, kw))):
                takes.add(_n)

        def post(m: Any, a: Any, kw: Any, out: Any, _n: str = name) -> None:
            if not all(_flattens(leaf) for leaf in pytree.tree_leaves(out)):
                (gives if _shown(out) is not None else takes).add(_n)

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    try:
        fake_forward(model, args, kwargs)
    finally:
        for h in handles:
            h.remove()
    return takes, gives


@contextlib.contextmanager
def outputs_hidden(model: torch.nn.Module, names: Collection[str]) -> Iterator[None]:
    """While the block runs, each call of a module in ``names`` shows a constant (``0``) in
    place of every output leaf export cannot flatten to the forward hooks registered after
    this one (export's signature hook), and its caller gets the outputs as returned: the
    call's signature records a constant there, no value (as the model's own outputs are
    treated), and a stage calling the module leaves that output unread.

    Example:
        >>> class Cached(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x + 1, object()
        >>> m = torch.nn.Sequential(Cached())
        >>> with outputs_hidden(m, ["0"]):
        ...     h = m[0].register_forward_hook(lambda mod, a, out: print(out[1]))  # as export's, registered after
        ...     out = m(torch.zeros(1))
        0
        >>> h.remove()
        >>> type(out[1]).__name__
        'object'
    """
    hiders = [_Hider(model.get_submodule(n)) for n in names]
    try:
        yield
    finally:
        for h in hiders:
            h.remove()


_SHOWN = 0
"""What export's signature records in place of an opaque output: a constant no stage reads (an
int: export's signatures take no string, and a container such as an HF ModelOutput drops None)."""


def _shown(out: Any) -> tuple[Any, list[Any], Any, set[int]] | None:
    """``(out with _SHOWN in place of each opaque leaf, out's leaves, its spec, their indices)``,
    or None where that changes its structure (a container that drops some values)."""
    leaves, spec = pytree.tree_flatten(out)
    opaque = {i for i, leaf in enumerate(leaves) if not _flattens(leaf)}
    shown = pytree.tree_unflatten([_SHOWN if i in opaque else x for i, x in enumerate(leaves)], spec)
    return (shown, leaves, spec, opaque) if len(pytree.tree_leaves(shown)) == len(leaves) else None


class _Hider:
    """One module's opaque outputs hidden from the hooks after its first forward hook: at
    each call its pre-hook appends a hook that puts them back after every other hook."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.saved: list[tuple[list[Any], Any, set[int]]] = []
        self.handles = [module.register_forward_pre_hook(self.arm), module.register_forward_hook(self.hide)]
        self.restores: list[Any] = []

    def arm(self, module: torch.nn.Module, _args: Any) -> None:
        # registered now, it runs after the hooks export registered when it started
        self.restores.append(module.register_forward_hook(self.restore))

    def hide(self, _module: torch.nn.Module, _args: Any, out: Any) -> Any:
        hidden = _shown(out)
        if hidden is None:  # opaque_calls keeps no signature for such a call: not reached
            raise TypeError(f"{type(out).__name__} changes its structure with a constant in place of an opaque output")
        shown, leaves, spec, opaque = hidden
        self.saved.append((leaves, spec, opaque))
        return shown

    def restore(self, _module: torch.nn.Module, _args: Any, out: Any) -> Any:
        self.restores.pop().remove()
        leaves, spec, opaque = self.saved.pop()
        now = pytree.tree_leaves(out)  # export's: the same leaves, tensors through its markers
        return pytree.tree_unflatten([leaves[i] if i in opaque else x for i, x in enumerate(now)], spec)

    def remove(self) -> None:
        for h in self.handles + self.restores:
            h.remove()


def fake_forward(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """One forward of ``model`` on fake tensors (no compute, no memory), for the probes that
    watch it; an exception ends it quietly (a probe only narrows what is kept)."""
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            fake = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
            model(*fake[0], **fake[1])
    except Exception:
        pass
