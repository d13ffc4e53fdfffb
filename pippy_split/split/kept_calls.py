"""Which of the user's module calls keep their call signature through ``torch.export``
(split, while tracing: ``trace.py`` asks, ``module_calls.py`` uses what is kept).

A kept signature records which values went into a module call and which came out, so a
stage can call the user's module object there (hooks, ``fully_shard``, ``parallelize_module``
apply). Export keeps one where asked (``preserve_module_call_signature``) and fails or
changes the graph in the places below, each handled here rather than by giving up on all:

- **A value export cannot flatten** (an HF cache object), found and handled by
  ``opaque_values.py``: a call that *returns* one (Reformer's encoder) keeps its signature
  with a constant in that place; a call that *takes* one keeps none, its own submodules are
  kept instead.
- **A ``torch.no_grad()`` / autocast region inside a forward** (an MoE router). A signature
  kept for a module called *inside* the region puts export's markers in the region's
  subgraph and changes which values cross it; the modules around the region are fine. So
  the modules called inside a region (:func:`modules_in_regions`) keep none, and the
  graph must then be the one exported without any signature (:func:`same_graph`).
- **Only if that still differs**, the plain export, with a warning naming what no longer
  applies.

:func:`calls_to_keep` narrows the signatures to those the cuts need (export's cost grows
with each one kept): the outermost module calls. Where a value leaves such a call other
than through its outputs (:func:`leaky_calls`: a hook's side channel), no stage can call it
whole, so the calls inside it keep signatures too and the model is exported again.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Collection, Iterator, Sequence
from typing import Any, cast

import torch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from .calls import ROOT_PREFIX, call_tree, module_paths, user_module_path
from .module_calls import same_value_outside, signature_key
from .opaque_values import opaque_calls, outputs_hidden
from .python_effects import ForwardEffects

__all__ = ["calls_to_keep", "export_keeping_calls", "leaky_calls", "modules_in_regions", "same_graph",
           "no_stack_traces"]


class _Export:
    """One ``torch.export`` of the tracing root on the example, keeping the signatures of
    the named modules (user FQNs) and hiding the opaque outputs of those in ``hide``."""

    def __init__(self, model: torch.nn.Module, root: torch.nn.Module, args: tuple, kwargs: dict,
                 dynamic_shapes: Any, strict: bool) -> None:
        self.model, self.root, self.args, self.kwargs = model, root, args, kwargs
        self.dynamic_shapes, self.strict = dynamic_shapes, strict

    def __call__(self, names: Sequence[str], hide: Collection[str] = ()) -> ExportedProgram:
        with no_stack_traces(), outputs_hidden(self.model, [n for n in names if n in hide]):
            return torch.export.export(self.root, self.args, self.kwargs, dynamic_shapes=self.dynamic_shapes,
                                       strict=self.strict,
                                       preserve_module_call_signature=tuple(ROOT_PREFIX + n for n in names))


def export_keeping_calls(model: torch.nn.Module, root: torch.nn.Module, args: tuple, kwargs: dict, *,
                         dynamic_shapes: Any, strict: bool, effects: ForwardEffects,
                         cuts: Sequence[str] | None, keep_calls: bool = True) -> ExportedProgram:
    """Export ``root`` (the tracing wrapper around ``model``) keeping every module's call
    signature (``cuts`` None), or only those that cuts at ``cuts`` need (:func:`calls_to_keep`),
    as far as export can keep them (see the module docstring). ``effects``: what the
    forward did in Python (the modules applying a custom autograd Function keep no
    signature inside them). Where the forward did not call a module the class-based guess
    took as called (a container its parent iterates over), or where a value leaves a kept call
    other than through its outputs (:func:`leaky_calls`: no stage can call it whole), the calls
    inside are kept too and the model exported again."""
    export = _Export(model, root, args, kwargs, dynamic_shapes, strict)
    if not keep_calls:  # one plain export (keep_calls=False: the caller runs the stages as traced ops)
        return export(())
    if cuts is None:
        return _keep(export, [name for name, _ in model.named_modules() if name], effects)
    keep = calls_to_keep(model, cuts)
    ep = _keep(export, keep, effects)
    opened: set[str] = set()
    for _ in range(_MAX_OPENED):
        opened |= leaky_calls(ep)
        more = set(calls_to_keep(model, cuts, _ran_modules(ep), opened)) - set(keep)
        if not more:
            break
        keep = keep + sorted(more)
        ep = _keep(export, keep, effects)
    return ep


_MAX_OPENED = 3
"""How many more exports the trace may spend opening leaky calls (usually one does)."""


def leaky_calls(ep: ExportedProgram) -> set[str]:
    """The user's modules to look inside: each with a kept call from which a value leaves other
    than through the call's outputs (a forward hook's side channel, such as Hugging Face's
    output recorder taking an MoE router's logits), so that no stage can call it whole, and
    every module between it and the module that made the value (the block's MLP, around its
    router), so that one more export keeps the signatures of the calls inside all of them. A no-op cast of an input read
    after the call is no leak."""
    ops = [n for n in ep.graph.nodes if n.op == "call_function"]
    tree = call_tree(ops)
    sigs = {user_module_path(e.fqn): e.signature for e in ep.module_call_graph if e.signature is not None}
    by_name = {n.name: n for n in ep.graph.nodes}
    out: set[str] = set()
    for call in tree.calls.values():
        sig = sigs.get(signature_key(call, call.path))
        if sig is None:
            continue
        span = set(ops[call.first:call.last + 1])
        returned = {by_name.get(getattr(a, "name", "")) for a in sig.outputs}
        for n in span:
            if n not in returned and any(u not in span for u in n.users) and same_value_outside(n, span) is None:
                out.add(call.path)
                out.update(p for p in module_paths(n)[:-1] if p.startswith(call.path + "."))  # not its maker
    return out


def _keep(export: _Export, names: list[str], effects: ForwardEffects) -> ExportedProgram:
    """Export keeping ``names``' signatures where export can: less those taking an opaque
    value if export fails, less those called inside a no-grad / autocast region if the graph
    differs from the plain one; else the plain export, with a warning."""
    hide: list[str] = []
    try:
        ep = export(names)
    except Exception as e:  # a module taking or giving an object export cannot flatten, or the model itself
        takes, gives = opaque_calls(export.model, export.args, export.kwargs)
        fewer = [n for n in names if n not in takes and not (export.strict and n in gives)]
        hide = [n for n in fewer if n in gives]  # TorchDynamo traces hooks: strict keeps none of these
        if fewer == names and not hide:  # nothing at a module call: the plain export raises the model's reason
            return _plain(export, _reason(e))
        try:
            ep = export(fewer, hide)
        except Exception as e2:
            return _plain(export, _reason(e2))
        names = fewer
    if not _has_regions(ep.graph_module):
        return ep
    plain = export(())
    if same_graph(ep.graph_module, plain.graph_module):
        return ep
    # A Function's forward runs in no-grad mode too: keep no signature inside it.
    inside = modules_in_regions(plain.graph_module) | {
        n for n in names if any(n.startswith(f + ".") for f in effects.functions)}
    outside = [n for n in names if n not in inside]
    try:
        kept: ExportedProgram | None = export(outside, hide)
    except Exception:
        kept = None
    if kept is not None and same_graph(kept.graph_module, plain.graph_module):
        return kept
    return _plain(export, "keeping them changes the graph around a higher-order region (torch.no_grad() or "
                  "autocast inside forward)", plain)


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:300]}"


def _plain(export: _Export, reason: str, plain: ExportedProgram | None = None) -> ExportedProgram:
    """The export without any signature (raising where the model itself cannot be traced), and
    the warning that says what the stages lose."""
    ep = plain if plain is not None else export(())
    warnings.warn(f"{type(export.model).__name__}: torch.export could not keep its modules' call signatures "
                  f"({reason}); its stages run the traced ops only, so hooks, fully_shard per block, "
                  "parallelize_module and other module wrappers applied to a stage's submodules do not take effect",
                  stacklevel=7)  # the caller of pipeline()
    return ep


def calls_to_keep(model: torch.nn.Module, split_fqns: Sequence[str], called: set[str] | None = None,
                  opened: Collection[str] = ()) -> list[str]:
    """The modules whose call signatures a trace must keep so that, with cuts at the modules
    ``split_fqns``, every stage can call each user's module that lies whole in it: going down
    from the root through every module a cut enters (the split points' ancestors), that is
    not called as a whole, or that is ``opened`` (no stage can call it whole), the first module
    called whole, and nothing inside it (that runs in its own ``forward``). ``called``: the
    FQNs a forward called (None: every module whose class has a ``forward``, so a
    ``ModuleList`` is passed through). Keeping fewer signatures makes ``torch.export`` cheaper.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2)))
        >>> calls_to_keep(model, ["1.1"]), calls_to_keep(model, ["1"]), calls_to_keep(model, ["1"], called={"0", "1.1"})
        (['0', '1.0', '1.1'], ['0', '1'], ['0', '1.1'])
    """
    entered = {"", *opened}
    for fqn in split_fqns:
        parts = fqn.split(".")
        entered.update(".".join(parts[:k]) for k in range(1, len(parts)))
    keep: list[str] = []

    def descend(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            runs = fqn in called if called is not None else type(child).forward is not torch.nn.Module.forward
            if runs and fqn not in entered:
                keep.append(fqn)
            else:
                descend(fqn + ".", child)

    descend("", model)
    return keep


def _ran_modules(ep: ExportedProgram) -> set[str]:
    """The user's modules whose calls left ops in the exported graph."""
    ran: set[str] = set()
    for node in ep.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            fqn = user_module_path(path)
            if fqn:
                ran.add(fqn)
    return ran


# ---- no-grad / autocast regions ------------------------------------------------------------

def _subgraphs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[torch.fx.GraphModule]:
    """The graphs a higher-order op runs (a ``torch.no_grad()`` or autocast region's body)."""
    subs = [getattr(gm, str(a.target), None) for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
    return [s for s in subs if isinstance(s, torch.fx.GraphModule)]


def _has_regions(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator) for n in gm.graph.nodes)


def _paths(node: torch.fx.Node) -> set[str]:
    out = set()
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        fqn = user_module_path(str(path).split("@")[0])
        if fqn:
            out.add(fqn)
    return out


def modules_in_regions(gm: torch.fx.GraphModule) -> set[str]:
    """The user's modules called inside a higher-order region of ``gm`` (a ``torch.no_grad()``
    or autocast block in some forward; nested regions included): every module on the stack of
    an op in the region's body but not on the stack of the region itself.

    Example:
        >>> class Router(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.gate, self.count = torch.nn.Linear(4, 2), torch.nn.Linear(2, 2)
        ...     def forward(self, x):
        ...         with torch.no_grad():
        ...             self.count(self.gate(x))
        ...         return self.gate(x)
        >>> ep = torch.export.export(torch.nn.Sequential(Router()), (torch.randn(1, 4),))
        >>> sorted(modules_in_regions(ep.graph_module))  # "0" holds the region: only what it calls inside
        ['0.count', '0.gate']
    """
    out: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        around = _paths(node)
        for sub in _subgraphs(gm, node):
            out |= {p for op in sub.graph.nodes if op.op == "call_function" for p in _paths(op)} - around
            out |= modules_in_regions(sub)
    return out


def same_graph(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> bool:
    """Whether two graphs run the same ops on the same values (names aside), subgraphs of
    higher-order ops included."""
    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    if len(na) != len(nb):
        return False
    index_a = {n: i for i, n in enumerate(na)}
    index_b = {n: i for i, n in enumerate(nb)}
    for x, y in zip(na, nb):
        if x.op != y.op:
            return False
        if x.op == "get_attr":
            sx, sy = getattr(a, str(x.target), None), getattr(b, str(y.target), None)
            if isinstance(sx, torch.fx.GraphModule) != isinstance(sy, torch.fx.GraphModule):
                return False
            if isinstance(sx, torch.fx.GraphModule) and not same_graph(sx, cast(torch.fx.GraphModule, sy)):
                return False
        elif x.op != "placeholder" and x.target != y.target:
            return False
        ax = pytree.tree_map_only(torch.fx.Node, lambda n: ("node", index_a[n]), (x.args, x.kwargs))
        ay = pytree.tree_map_only(torch.fx.Node, lambda n: ("node", index_b[n]), (y.args, y.kwargs))
        if str(ax) != str(ay):
            return False
    return True


@contextlib.contextmanager
def no_stack_traces() -> Iterator[None]:
    """``torch.fx.config.do_not_emit_stack_traces`` on, then back as it was: recording a
    source line per node is about a third of export's time and nothing downstream reads it."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before

