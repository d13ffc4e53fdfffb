"""What the shapes of values crossing a cut are made of: each value's :class:`TensorSpec`
(sizes as numbers or the model inputs' symbols) and where each dynamic symbol is read.

Part of split → Pipe, used by :mod:`.stage_graph` while it builds the stages: export's
symbols (``s75``) take the user's ``Dim`` names (``T``), a value whose size depends on
data (not on input shapes) cannot cross a cut, and each symbol's traced range is kept
so a later input outside it is refused before any message.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch

from .errors import SplitError
from .spec import SymbolSource, TensorSpec
from .trace import Traced

__all__ = ["user_symbol_names", "spec_of", "symbol_sources", "traced_range"]


def user_symbol_names(placeholders: dict[str, torch.fx.Node]) -> dict[sympy.Symbol, sympy.Symbol]:
    """Export's symbols (``s75``) renamed after the user's ``Dim`` names (``T``) where unambiguous."""
    raw_to_name: dict[sympy.Symbol, str] = {}
    for node in placeholders.values():
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d in val.shape:
            if not isinstance(d, torch.SymInt) or not isinstance(d.node.expr, sympy.Symbol):
                continue
            env = d.node.shape_env
            debug = getattr(env, "source_name_to_debug_name", {}) or {}
            for source in env.var_to_sources.get(d.node.expr, []):
                name = debug.get(source.name() if callable(source.name) else source.name)
                if name:
                    raw_to_name[d.node.expr] = name
                    break
    names = list(raw_to_name.values())
    return {raw: sympy.Symbol(name, integer=True, positive=True) for raw, name in raw_to_name.items()
            if names.count(name) == 1}


def spec_of(node: torch.fx.Node, requires_grad: bool, known: set, rename: dict | None = None) -> TensorSpec:
    val: Any = node.meta.get("val")
    dims = []
    for d in val.shape:
        if isinstance(d, torch.SymInt):
            expr = sympy.sympify(d.node.expr)
            if expr.is_number:
                dims.append(int(expr))
                continue
            unknown = expr.free_symbols - known
            if unknown:
                raise SplitError(
                    f"value {node.name!r} of shape {tuple(val.shape)} crosses a stage boundary but its size "
                    f"depends on data ({sorted(map(str, unknown))}), not on input shapes; move the split point "
                    "so that this value stays inside one stage"
                )
            dims.append(expr.xreplace(rename) if rename else expr)
        else:
            dims.append(int(d))
    return TensorSpec(tuple(dims), val.dtype, requires_grad, dim_order_of(val))


def dim_order_of(value: torch.Tensor) -> tuple[int, ...] | None:
    """``value``'s dims in memory order where that is not row-major (None where it is, or where
    its strides do not say: symbolic, or not one dense block).

    Example:
        >>> dim_order_of(torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last)), dim_order_of(torch.zeros(2, 3))
        ((0, 2, 3, 1), None)
    """
    try:
        order = tuple(int(d) for d in value.dim_order())
    except Exception:  # symbolic strides, or an overlapping / gapped layout: sent row-major
        return None
    return None if order == tuple(range(value.dim())) else order


def symbol_sources(traced: Traced, placeholders: dict[str, torch.fx.Node]) -> list[SymbolSource]:
    out: list[SymbolSource] = []
    seen: set[sympy.Symbol] = set()
    for idx, name in enumerate(traced.user_inputs):
        val = placeholders[name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for dim, d in enumerate(val.shape):
            if isinstance(d, torch.SymInt):
                expr = d.node.expr
                if isinstance(expr, sympy.Symbol) and expr not in seen:
                    seen.add(expr)
                    out.append(SymbolSource(expr, idx, dim, *traced_range(traced, expr)))
    return out


def traced_range(traced: Traced, symbol: sympy.Symbol) -> tuple[int, int | None]:
    """The range export traced ``symbol`` for: its ``Dim(min=, max=)`` (bounds export refined included)."""
    vr = traced.ep.range_constraints.get(symbol)
    if vr is None:
        return 0, None
    lower, upper = _bound(vr.lower), _bound(vr.upper)
    return (0 if lower is None else lower), upper


def _bound(value: sympy.Expr) -> int | None:
    """A range bound as an int, None for an infinite one (sympy's ``oo`` or torch's ``int_oo``,
    whose ``is_finite`` is True: ``Dim.DYNAMIC`` dims are traced for ``[2, int_oo]``)."""
    try:
        return int(value) if value.is_finite else None
    except (OverflowError, AttributeError, TypeError):
        return None
