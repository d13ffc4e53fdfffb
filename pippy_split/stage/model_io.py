"""The traced model's call at run time, made once: a call's inputs laid out, flattened and
checked as the trace took them (:class:`ModelInputs`), and the last stage's outputs rebuilt into
what the model returns (:class:`ModelOutputs`).

The split makes both when it traces (``Traced.model_inputs``, ``Pipe.model_outputs``); a
schedule and its stages keep them, so a step runs no code of ``split/``. Each input's check
is made from the traced example (:func:`input_check`) and a mismatch says what was traced,
what came, and what to do (trace one microbatch, or ``dynamic_shapes=``). This module imports
nothing of the package: ``split/``, which never imports ``stage/`` at module level, reaches it
with a function-local import.

Example:
    >>> import torch
    >>> check_input("x", torch.zeros(8, 4), input_check(torch.zeros(2, 4), None))
    Traceback (most recent call last):
    ...
    ValueError: input 'x' has shape (8, 4) torch.float32, but the pipeline was traced for shape (2, 4) ...
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

__all__ = ["ModelInputs", "ModelOutputs", "input_check", "check_input", "shape_hint"]


class ModelInputs:
    """How a call of the traced model becomes the flat inputs stages index into.

    Args:
        signature: the model's ``forward`` signature (None where it has none to read).
        arg_names / kwarg_names: what the example passed positionally / by keyword.
        n_varargs: values the example passed to the model's ``*args``.
        in_spec: the pytree structure of the example's ``(args, kwargs)``.
        names: each flat input's name, in flat order.
        checks: each flat input's :func:`input_check`.

    Example:
        >>> import torch
        >>> sig = inspect.signature(lambda x, scale=1.0: x)
        >>> spec = pytree.tree_flatten(((torch.zeros(2, 4),), {}))[1]
        >>> inputs = ModelInputs(sig, ["x"], [], 0, spec, ["x"], [input_check(torch.zeros(2, 4), None)])
        >>> [t.shape for t in inputs.flatten((), {"x": torch.ones(2, 4)})]
        [torch.Size([2, 4])]
    """

    def __init__(self, signature: inspect.Signature | None, arg_names: Sequence[str], kwarg_names: Sequence[str],
                 n_varargs: int, in_spec: pytree.TreeSpec, names: Sequence[str], checks: Sequence[Any]) -> None:
        self.signature = signature
        self.arg_names, self.kwarg_names = list(arg_names), list(kwarg_names)
        self.n_varargs = n_varargs
        self.in_spec = in_spec
        self.names, self.checks = list(names), list(checks)
        kinds = {p.name: p.kind for p in signature.parameters.values()} if signature is not None else {}
        self._var_pos = next((n for n, k in kinds.items() if k is inspect.Parameter.VAR_POSITIONAL), None)
        self._var_kw = next((n for n, k in kinds.items() if k is inspect.Parameter.VAR_KEYWORD), None)
        self._expected = self.arg_names + self.kwarg_names
        # The example passed positional arguments only: a call with as many and no keywords binds
        # to exactly the example's names, as normalize() would find.
        self._positional = signature is None or (not self.kwarg_names and n_varargs == 0)
        self._named_checks = list(zip(self.names, self.checks))

    def normalize(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Rearrange a call's arguments into the (args, kwargs) shape of the example.

        Inputs the example did not pass were baked into the graph as their defaults,
        so passing them now is an error rather than silently ignored.
        """
        if self.signature is None:
            return tuple(args), dict(kwargs)
        if self._positional and not kwargs and len(args) == len(self.arg_names):
            return tuple(args), {}
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"pipeline called with arguments that do not fit the model's forward: {e}") from None
        arguments = dict(bound.arguments)
        var_pos, var_kw = self._var_pos, self._var_kw
        extra_args = tuple(arguments.pop(var_pos, ())) if var_pos else ()
        arguments.update(arguments.pop(var_kw, {}) if var_kw else {})  # **kwargs by their own names
        expected = self._expected
        missing = [n for n in expected if n not in arguments]
        if missing:
            raise TypeError(
                f"missing model input(s) {missing}: the pipeline was traced with them, pass them on every call"
            )
        unexpected = [n for n in arguments if n not in expected]
        if len(extra_args) != self.n_varargs:
            unexpected.append(f"*{var_pos} ({len(extra_args)} values, traced with {self.n_varargs})")
        if unexpected:
            raise TypeError(
                f"model input(s) {unexpected} differ from the example the pipeline was traced with, which "
                f"passed {expected}" + (f" and {self.n_varargs} *{var_pos}" if var_pos else "")
                + "; inputs not traced were baked in as their defaults, so trace with the inputs you will pass"
            )
        new_args = tuple(arguments[n] for n in self.arg_names) + extra_args
        new_kwargs = {n: arguments[n] for n in self.kwarg_names}
        return new_args, new_kwargs

    def flatten(self, args: tuple, kwargs: dict) -> list[Any]:
        """The call's inputs as the flat list stages index into, each checked against the trace."""
        args, kwargs = self.normalize(args, kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise TypeError(
                f"inputs have a different structure than the example the pipeline was traced with:\n"
                f"  expected {self.in_spec}\n  got      {spec}"
            )
        for (name, check), x in zip(self._named_checks, flat):
            check_input(name, x, check)
        return flat


class ModelOutputs:
    """How the last stage's outputs become what the model returns (tuples, dicts, ``ModelOutput``).

    Args:
        leaves: per leaf of the model's output, ``("stage", i)`` for the last stage's output
            ``i``, or ``("const", value)`` for a value the trace fixed (a constant, a dropped cache).
        out_spec: the pytree structure of the model's output.

    Example:
        >>> spec = pytree.tree_flatten({"logits": 0, "aux": None})[1]
        >>> ModelOutputs([("stage", 1), ("const", None)], spec)(["h", "logits"])
        {'logits': 'logits', 'aux': None}
    """

    def __init__(self, leaves: Sequence[tuple[str, Any]], out_spec: pytree.TreeSpec) -> None:
        self.leaves = list(leaves)
        self.out_spec = out_spec
        # the common case, one tensor returned: no tree to rebuild
        self._only = leaves[0][1] if out_spec.is_leaf() and leaves[0][0] == "stage" else None

    def __call__(self, last_stage_outputs: Sequence[Any]) -> Any:
        if self._only is not None:
            return last_stage_outputs[self._only]
        leaves = [last_stage_outputs[v] if kind == "stage" else v for kind, v in self.leaves]
        return pytree.tree_unflatten(leaves, self.out_spec)


def input_check(val: Any, example: Any) -> Any:
    """What later calls must match for one input, from its traced value ``val`` (a placeholder's
    fake tensor or symbolic scalar) and the example's ``example``: a tensor's ``(dims, dtype)``,
    where a dim is None if dynamic, or a non-tensor's value (export baked it into the graph)."""
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


def shape_hint(x: torch.Tensor, dims: Sequence[int | None], dtype: torch.dtype) -> str:
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
