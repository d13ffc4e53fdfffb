"""What a call's inputs must match of the traced example, and the error when they do not.

Part of tracing (:mod:`.trace`): ``Traced.input_checks`` holds one check per input
(a tensor's fixed dims and dtype, a value export baked in, or anything for a dynamic
scalar); ``Traced.flatten_inputs`` runs them on every call, and a mismatch says what
was traced, what came, and what to do (trace one microbatch, or ``dynamic_shapes=``).

Example:
    >>> import torch
    >>> check_input("x", torch.zeros(8, 4), input_check(torch.zeros(2, 4), None))
    Traceback (most recent call last):
    ...
    ValueError: input 'x' has shape (8, 4) torch.float32, but the pipeline was traced for shape (2, 4) ...
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["input_check", "check_input", "shape_hint"]


def input_check(val: Any, example: Any) -> Any:
    """What later calls must match for one input (see ``Traced.input_checks``)."""
    if isinstance(val, torch.Tensor):
        dims = tuple(d if isinstance(d, int) else None for d in val.shape)
        return ("tensor", dims, val.dtype)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("any",)  # a dynamic scalar input: any value goes
    return ("value", example)


def check_input(name: str, x: Any, check: Any) -> None:
    """Raise when a call's input differs from the traced example in what the graph baked in."""
    if check[0] == "any":
        return
    if check[0] == "value":
        if isinstance(x, torch.Tensor) or x != check[1]:
            raise ValueError(
                f"input {name!r} is {x!r}, but the pipeline was traced with {check[1]!r} and torch.export "
                "baked that value into the graph; trace again with the value you want"
            )
        return
    _, dims, dtype = check
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"input {name!r} must be a tensor (as when traced), got {type(x).__name__}")
    if x.dtype != dtype or x.dim() != len(dims) or any(d is not None and d != s for d, s in zip(dims, x.shape)):
        want = "(" + ", ".join("*" if d is None else str(d) for d in dims) + ")"
        legend = " (* = dynamic)" if None in dims else ""
        raise ValueError(
            f"input {name!r} has shape {tuple(x.shape)} {x.dtype}, but the pipeline was traced for shape {want} "
            f"{dtype}{legend}; {shape_hint(x, dims, dtype)}"
        )


def shape_hint(x: torch.Tensor, dims: list, dtype: torch.dtype) -> str:
    """What to do about a call whose shape differs from the trace's."""
    if x.dtype != dtype or x.dim() != len(dims):
        return "call it with inputs like the traced example"
    traced0, got0 = dims[0], x.shape[0] if x.dim() else None
    same_rest = all(d is None or d == s for d, s in zip(dims[1:], x.shape[1:]))
    if same_rest and traced0 is not None and got0 is not None and got0 != traced0:
        if got0 % traced0 == 0:
            return (f"it looks like a batch of {got0 // traced0} microbatches: trace on ONE microbatch (the schedule "
                    "splits the batch) or pass dynamic_shapes= to pipeline() for the batch dim")
        if traced0 % got0 == 0:
            return ("it looks like a microbatch of a pipe traced on a whole batch: trace on one microbatch "
                    f"(here {got0} rows) or pass dynamic_shapes= to pipeline() for the batch dim")
    return "pass dynamic_shapes= to pipeline() for dims that vary"
