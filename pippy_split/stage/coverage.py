"""Proof that a split backward (I then W) gives every parameter exactly B's gradient.

Part of the stage layer, used by ``stage_backward.py`` when the input-grad pass (I)
of a microbatch starts. The capture plan (:mod:`.backward`) says, per captured op
output, which parameters W differentiates it for, and which parameters I computes
whole. Whether that covers the stage is a fact of the autograd graph the forward
built (a parent module may read a child's weight without calling the child, an op
that is not a module call may read a parameter a hooked module also uses), so it is
checked there:

* a parameter I computes whole is exact by construction;
* any other parameter ``p`` with captures ``C_p`` (those W differentiates for ``p``)
  gets B's gradient iff every path from the stage's roots to ``p`` passes through
  exactly one capture of ``C_p``: none (a path around them) leaves W short, two (one
  capture below another) count a path twice.

A parameter that fails either is computed whole by I from then on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["uncovered_parameters"]

_Edge = tuple[Any, int]  # (autograd node, output index)


def _edge(value: torch.Tensor | GradientEdge) -> _Edge | None:
    if isinstance(value, GradientEdge):
        return value.node, value.output_nr
    if not value.requires_grad:
        return None
    e = get_gradient_edge(value)
    return e.node, e.output_nr


def _reached(starts: Iterable[Any], blocked: set[_Edge]) -> tuple[set[int], bool]:
    """From the autograd nodes ``starts``, walk every edge not in ``blocked``: the ids of the
    leaf tensors reached (their ``AccumulateGrad``'s variable), and whether a blocked edge
    was met on the way."""
    seen: set[int] = set()
    leaves: set[int] = set()
    met = False
    stack = [n for n in starts if n is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
            continue
        for nxt, nr in node.next_functions:
            if nxt is None:
                continue
            if (nxt, nr) in blocked:
                met = True
                continue
            stack.append(nxt)
    return leaves, met


def uncovered_parameters(roots: Sequence[torch.Tensor], captures: Sequence[tuple[Any, Sequence[torch.nn.Parameter]]],
                         whole: Iterable[torch.nn.Parameter],
                         params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters of ``params`` that I (from ``roots``) and W (each capture for its
    parameters) would leave without B's gradient: reached on a path through none of
    their captures, or through two of them.

    Args:
        roots: the tensors the backward starts from (stage outputs, or the loss).
        captures: ``(captured op output or its GradientEdge, parameters W differentiates it for)``.
        whole: parameters I differentiates in full (always exact).
        params: the stage's trainable parameters.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> h = lin(torch.randn(3, 2))                    # captured: W covers lin's parameters ...
        >>> out = h + torch.nn.functional.linear(h, lin.weight)   # ... but lin.weight is read again
        >>> [p is lin.weight for p in uncovered_parameters([out], [(h, [lin.weight, lin.bias])], [], lin.parameters())]
        [True]
    """
    whole_ids = {id(p) for p in whole}
    root_nodes: list[Any] = []
    for r in roots:
        e = _edge(r)
        if e is not None:
            root_nodes.append(e[0])
    cap_edges: list[_Edge | None] = [_edge(c) for c, _ in captures]
    owned: dict[int, set[int]] = {}  # parameter id -> indices of the captures W differentiates for it
    for k, (_, ps) in enumerate(captures):
        for p in ps:
            owned.setdefault(id(p), set()).add(k)
    by_captures: dict[frozenset[int], list[torch.nn.Parameter]] = {}
    for p in params:
        if p.requires_grad and id(p) not in whole_ids:
            by_captures.setdefault(frozenset(owned.get(id(p), ())), []).append(p)
    bad: list[torch.nn.Parameter] = []
    for ks, group in by_captures.items():
        blocked = {e for k in ks if (e := cap_edges[k]) is not None}
        around, _ = _reached(root_nodes, blocked)
        _, nested = _reached([e[0] for e in blocked], blocked) if blocked else (set(), False)
        bad.extend(p for p in group if nested or id(p) in around)
    return bad
