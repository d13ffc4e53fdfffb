"""What a stage's forward is given at run time, made once from its inputs: :class:`StageArgs`
(its positional arguments from the model inputs, the values other stages produced and the
step's sizes) and :func:`concrete_shape` (a crossing value's shape for a microbatch's sizes).

The runtime builds a ``StageArgs`` per stage when it wires the stage and reads edge shapes
through ``concrete_shape``, so a step runs no code of ``split/``. The one home of both: the
split's ``gather_inputs`` and ``TensorSpec.concrete_shape`` (one process, ``pipe(x)``) call
here. It imports nothing of the package (``split/`` reaches it with a function-local import);
a stage input is read by its fields (``StageInput``: ``edge``, ``kind``, ``model_input``, ``expr``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import sympy

__all__ = ["StageArgs", "concrete_shape"]

_MODEL, _EDGE, _SYMBOL = 0, 1, 2
_ABSENT = object()


def concrete_shape(shape: Sequence[Any], bindings: Mapping[sympy.Symbol, int]) -> tuple[int, ...]:
    """``shape`` with every symbolic dim replaced by its value under ``bindings``.

    Example:
        >>> T = sympy.Symbol("T")
        >>> concrete_shape((2, T, 2 * T), {T: 8})
        (2, 8, 16)
    """
    return tuple(d if isinstance(d, int) else int(d.xreplace(bindings)) for d in shape)


class StageArgs:
    """One stage's positional arguments from its inputs (``StageInput`` s, in order): model
    inputs from the flat inputs, edge values from the produced values (keyed by
    ``(src_stage, src_output)``, a forwarded model input under ``(MODEL_INPUT, index)``),
    sizes from the bindings.

    ``on_missing(slot)`` raises the caller's error for an edge value not produced (default:
    a ``KeyError``).

    Example:
        >>> from pippy_split.split.spec import Edge, InputKind, StageInput, TensorSpec
        >>> import torch
        >>> spec = TensorSpec((1,), torch.float32, True)
        >>> args = StageArgs([StageInput(0, InputKind.MODEL, model_input=1),
        ...                   StageInput(1, InputKind.EDGE, edge=Edge(0, 0, 1, 1, spec))])
        >>> args(["x", "y"], {(0, 0): "h"}, {})
        ['y', 'h']
    """

    __slots__ = ("slots", "_plan")

    def __init__(self, slots: Sequence[Any]) -> None:
        self.slots = list(slots)
        plan: list[tuple[int, Any]] = []
        for slot in self.slots:
            if slot.edge is not None:  # exactly the edge inputs carry one (StageInput checks it)
                plan.append((_EDGE, (slot.edge.src_stage, slot.edge.src_output)))
            elif slot.kind == "symbol":  # InputKind is a str enum
                plan.append((_SYMBOL, slot.expr))
            else:
                plan.append((_MODEL, slot.model_input))
        self._plan = plan

    def __call__(self, flat_inputs: Sequence[Any] | None, produced: Mapping[tuple[int, int], Any],
                 bindings: Mapping[sympy.Symbol, int], on_missing: Callable[[Any], None] | None = None) -> list[Any]:
        out = []
        for slot, (kind, what) in zip(self.slots, self._plan):
            if kind == _EDGE:
                value = produced.get(what, _ABSENT)
                if value is _ABSENT:
                    if on_missing is not None:
                        on_missing(slot)
                    raise KeyError(f"input {slot.index}: value {what} (stage, output) was not produced")
                out.append(value)
            elif kind == _MODEL:
                if flat_inputs is None:
                    raise ValueError(f"input {slot.index} is model input {what}, but no model inputs were given")
                out.append(flat_inputs[what])
            else:
                out.append(int(what.xreplace(bindings)))
        return out
