"""Custom ``torch.autograd.Function``s in a split (split → Pipe).

Export traces a Function's ``forward`` only. Its ``backward`` (a reversible layer's
recomputation, a clipped derivative, a fused kernel's) runs only where the module that
applies it (recorded while tracing: ``Traced.functions``, see ``python_effects.py``) runs in
a stage as the user's own module. So:

- no cut enters such a module: the balancer leaves it whole, and a split spec that cuts
  inside one is a ``SplitError`` naming the cuts around it (:func:`sealed_calls`,
  :func:`check_cuts`);
- what it returns carries a gradient even where its forward is traced in no-grad mode,
  as autograd runs a Function's forward (:func:`in_function`, read by
  ``grad.infer_requires_grad``);
- once the stages are built, :func:`check_functions_called` refuses a split in which such
  a module runs as traced ops while its Function's forward runs without autograd (its
  parameters would get no gradient), and warns where autograd would differentiate the
  traced forward instead of the Function's own backward.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Sequence
from typing import Any

import torch

from .calls import Call, CallTree, module_paths
from .errors import SplitError

__all__ = ["in_function", "sealed_calls", "check_cuts", "check_functions_called"]


def in_function(node: torch.fx.Node, functions: Collection[str]) -> bool:
    """Whether ``node`` was traced inside a module that applies a custom autograd Function."""
    return bool(functions) and any(p in functions for p in module_paths(node))


def sealed_calls(tree: CallTree, functions: Collection[str]) -> list[Call]:
    """The calls no cut may enter: those of modules that apply a custom autograd Function
    (the model's own forward excepted: a stage never calls the whole model)."""
    return [c for c in tree.calls.values() if c.path in functions and c.last > c.first]


def _names(functions: dict[str, list[str]], path: str) -> str:
    return ", ".join(functions[path])


def check_cuts(cuts: Sequence[Any], sealed: list[Call], functions: dict[str, list[str]]) -> None:
    """Refuse a cut (``Cut``: ``index`` before that op, ``label``) that falls inside a sealed call."""
    for cut in cuts:
        for c in sealed:
            if c.first < cut.index <= c.last:
                raise SplitError(
                    f"the cut {cut.label} falls inside {c.path!r}, which applies the custom autograd Function "
                    f"{_names(functions, c.path)}: torch.export traces a Function's forward only, so its own "
                    f"backward runs only where a stage calls {c.path!r} whole. What works: cut around it, "
                    f"{{{c.path!r}: SplitPoint.BEGINNING}} or {{{c.path!r}: SplitPoint.END}}, or an int split_spec "
                    f"(the balancer never cuts inside it)")


def _grad_disabled(op: torch.fx.Node) -> bool:
    """A ``torch.no_grad()`` region (export's higher-order op) or a switch to no-grad mode."""
    if op.target is torch._C._set_grad_enabled:
        return not op.args[0]
    return getattr(op.target, "__name__", str(op.target)) == "wrap_with_set_grad_enabled" and not op.args[0]


def _why_traced(path: str, kept_traced: dict[str, Any], signatures: dict[str, Any]) -> str:
    if path in kept_traced:
        return f"it must stay traced because {kept_traced[path]} (Python state no op records)"
    if not any(key.split("@", 1)[0] == path for key in signatures):
        return "torch.export kept no call signature for it"
    return "its traced ops could not be swapped for a call of it"


def check_functions_called(ops: list[torch.fx.Node], tree: CallTree, functions: dict[str, list[str]],
                           called: set[str], kept_traced: dict[str, Any], signatures: dict[str, Any],
                           params: dict[str, str], trainable: set[str]) -> None:
    """After the stages are built (``called``: every module FQN a stage calls as the user's
    object, with everything inside): refuse a module applying a Function that runs as traced
    ops with its forward in no-grad mode, naming its trainable parameters left without a
    gradient; warn where autograd differentiates the traced forward instead."""
    spans = [(c.path, ops[c.first:c.last + 1]) for c in sorted(tree.calls.values(), key=lambda c: c.first)
             if c.path in functions and c.path not in called]
    if "" in functions:  # the model's own forward: where its Function's ops are is not known, so all glue
        spans.insert(0, ("", [op for op in ops if not called.intersection(module_paths(op))]))
    for path, span in spans:
        names = _names(functions, path)
        where = repr(path) if path else "the model's own forward"
        why = _why_traced(path, kept_traced, signatures) if path else "a stage never calls the whole model"
        if any(_grad_disabled(op) for op in span):
            lost = sorted({params[a.name] for op in span if _grad_disabled(op) for a in op.all_input_nodes
                           if a.op == "placeholder" and params.get(a.name) in trainable})
            raise SplitError(
                f"{where} applies the custom autograd Function {names}, whose forward runs without autograd: "
                f"a stage runs it as traced ops ({why}), where its backward does not exist and "
                f"{len(lost)} trainable parameter(s) would get no gradient ({', '.join(lost[:4])}"
                f"{', ...' if len(lost) > 4 else ''}). What works: apply it in a module's forward and let a stage "
                f"call that module whole (cut around it), or build that stage by hand with "
                f"pippy_split.PipelineStage")
        warnings.warn(f"{where} applies the custom autograd Function {names} and runs as traced ops ({why}): "
                      f"autograd differentiates its traced forward there, not {names.split(', ')[0]}.backward",
                      stacklevel=4)
