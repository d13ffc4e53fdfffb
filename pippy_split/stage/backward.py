"""The zero-bubble backward split: what W must differentiate, found on the stage graph.

For every op that combines a parameter (possibly through views like ``t()``)
with an activation, and every call of a parameter-owning leaf module (a Linear, a
norm) inside a user's module the stage calls, the output is *captured* (a no-op graph call that hands
it to the stage only while the stage asks for it, so the stage module, its
outputs and its hooks stay the same): the input-grad pass (I)
computes the gradient flowing into it on its way to the stage inputs, and the
weight-grad pass (W) differentiates just that op with respect to its
parameters. A parameter used by several such ops in one stage would be counted
once per use through the activation path, so it is differentiated whole in I
instead — exact, like ``loss.backward()``; so is a parameter that reaches a
stage output with no activation in between (sent on as it is, or a view of it),
whose gradient comes from the receiving stage.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule

__all__ = ["WeightGradPlan", "CaptureSink", "Captured", "LeafCaptureHook", "plan_weight_grads", "capturing", "weight_captures"]


class Captured(dict):
    """What one forward handed over: op outputs by capture index, and (``modules``) each call
    of a parameter-owning leaf module inside a called user module, in call order, as
    ``(module, output or None, its parameters)``."""

    def __init__(self) -> None:
        super().__init__()
        self.modules: list[tuple[torch.nn.Module, torch.Tensor | None, list[torch.nn.Parameter]]] = []


class CaptureSink:
    """Where one instrumented stage module hands over the outputs W needs: its graph calls
    :meth:`capture`, and forward hooks on the leaf modules inside the user's modules it
    calls call :meth:`capture_module`; both keep them only while :func:`capturing`
    collects (no module-level state: each instrumented module has its own sink)."""

    def __init__(self) -> None:
        self.active: Captured | None = None

    @torch.compiler.disable  # a graph break under torch.compile: the hand-over runs eagerly, every call
    def capture(self, index: int, value: torch.Tensor) -> None:
        """Graph hook: hand ``value`` to the running forward when it collects (else a no-op)."""
        if self.active is not None:
            self.active[index] = value

    @torch.compiler.disable
    def capture_module(self, module: torch.nn.Module, _args: Any, output: Any) -> None:
        """Forward hook: hand a leaf module's output and its parameters (as they are now:
        after ``parallelize_module`` too) to the running forward when it collects."""
        if self.active is None:
            return
        params = [p for p in module._parameters.values() if p is not None and p.requires_grad]
        if params:
            out = output if isinstance(output, torch.Tensor) and output.requires_grad else None
            self.active.modules.append((module, out, params))


@dataclass
class WeightGradPlan:
    params: list[list[torch.nn.Parameter]]  # per capture index: the parameters W differentiates
    whole_params: list[torch.nn.Parameter]  # parameters whose gradient I computes in full
    sink: CaptureSink = field(default_factory=CaptureSink)  # what the instrumented graph calls
    names: dict[int, str] = field(default_factory=dict)  # id of each planned parameter -> its FQN in the module
    # the capture sets (per microbatch: which captures, for which parameters) proven to cover
    # every parameter exactly (``coverage.uncovered_parameters``); checked once each
    proven: set[tuple] = field(default_factory=set)

    @property
    def num_captures(self) -> int:
        return len(self.params)


def _param_of(gm: GraphModule, node: torch.fx.Node) -> torch.nn.Parameter | None:
    if node.op != "get_attr":
        return None
    try:
        obj = gm.get_parameter(str(node.target))
    except AttributeError:
        return None
    return obj if obj.requires_grad else None


def _called_modules(gm: GraphModule) -> list[torch.nn.Module]:
    return [gm.get_submodule(str(n.target)) for n in gm.graph.nodes if n.op == "call_module"]


def _owned_by_inner_modules(gm: GraphModule, params_by_id: dict[int, torch.nn.Parameter]) -> set[int]:
    """Ids of parameters that a called user module, or a module inside it with submodules of
    its own, holds directly (used in its Python ``forward``, e.g. Mamba's ``D``): no leaf
    module's output isolates them, so I computes them in full."""
    out: set[int] = set()
    for called in _called_modules(gm):
        for owner in called.modules():
            if next(owner.children(), None) is None:
                continue
            for p in owner._parameters.values():
                if p is not None and p.requires_grad:
                    out.add(id(p))
                    params_by_id[id(p)] = p
    return out


class LeafCaptureHook:
    """The one forward hook a leaf module of the user's carries, however many stages capture
    from it (several pipes, schedules built again): it hands the module's output to every
    live :class:`CaptureSink` (each a no-op unless its forward is collecting), and removes
    itself when the last of them is gone, leaving the module as the user made it."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.sinks: weakref.WeakSet[CaptureSink] = weakref.WeakSet()
        self.handle = module.register_forward_hook(self)

    @classmethod
    def on(cls, module: torch.nn.Module) -> "LeafCaptureHook":
        """The module's hook, registered on first use."""
        for hook in module._forward_hooks.values():
            if isinstance(hook, cls):
                return hook
        return cls(module)

    def add(self, sink: CaptureSink) -> None:
        if sink not in self.sinks:
            self.sinks.add(sink)
            weakref.finalize(sink, self._release_if_unused)

    def _release_if_unused(self) -> None:
        if next(iter(self.sinks), None) is None:  # iteration skips a sink whose removal is pending
            self.handle.remove()

    @torch.compiler.disable
    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        for sink in list(self.sinks):
            sink.capture_module(module, args, output)


def _hook_leaf_modules(gm: GraphModule, sink: CaptureSink) -> None:
    """Let every parameter-owning leaf module (``nn.Linear``, a norm, an embedding) inside the
    user's modules the stage calls hand its output to ``sink``: W differentiates just that
    module for its own parameters, as it does an op of the traced graph."""
    seen: set[int] = set()
    for called in _called_modules(gm):
        for owner in called.modules():
            if id(owner) in seen or next(owner.children(), None) is not None or not any(
                    p is not None and p.requires_grad for p in owner._parameters.values()):
                continue
            seen.add(id(owner))
            LeafCaptureHook.on(owner).add(sink)


def _params_reaching_outputs(graph: torch.fx.Graph, param_only: dict[torch.fx.Node, set[int]]) -> set[int]:
    """Ids of parameters a stage output is computed from with no activation in between (the
    parameter itself, a view, ``D.float()``, ``2 * D``): their gradient arrives from the
    receiving stage, through no op W differentiates, so I computes it in full."""
    found: set[int] = set()
    for node in graph.nodes:
        if node.op == "output":
            for arg in node.all_input_nodes:
                found |= param_only.get(arg, set())
    return found


def weight_captures(plan: WeightGradPlan, found: Captured) -> tuple[list[Any], list[list[torch.nn.Parameter]],
                                                                  list[torch.nn.Parameter]]:
    """One microbatch's W work from what its forward handed over: ``(captured outputs, the
    parameters W differentiates each for, parameters I computes in full this time)``. A
    leaf module called twice (its second output depends on its first through the same
    parameters), one whose output is not a tensor, or a parameter also held elsewhere in
    the stage is computed in full by I, exact like ``loss.backward()``."""
    caps: list[Any] = [found.get(k) for k in range(plan.num_captures)]
    params = [list(group) for group in plan.params]
    calls: dict[int, int] = {}
    owners: dict[int, set[int]] = {}
    for module, _, ps in found.modules:
        calls[id(module)] = calls.get(id(module), 0) + 1
        for p in ps:
            owners.setdefault(id(p), set()).add(id(module))
    planned_whole = {id(p) for p in plan.whole_params}  # I computes these in full already
    whole: dict[int, torch.nn.Parameter] = {}
    for module, out, ps in found.modules:
        rest = [p for p in ps if id(p) not in planned_whole]
        if not rest:
            continue
        shared = len(rest) != len(ps) or any(len(owners[id(p)]) > 1 for p in rest)
        if out is None or calls[id(module)] > 1 or shared:
            whole.update((id(p), p) for p in rest)
        else:
            caps.append(out)
            params.append(rest)
    return caps, params, list(whole.values())


@contextlib.contextmanager
def capturing(plan: WeightGradPlan | None) -> Iterator[Captured]:
    """Collect the captured outputs of a forward of ``plan``'s module run inside this
    block (``None``: a stage without the I/W split; nothing is collected)."""
    found = Captured()
    if plan is None:
        yield found
        return
    outer, plan.sink.active = plan.sink.active, found
    try:
        yield found
    finally:
        plan.sink.active = outer


def plan_weight_grads(gm: GraphModule) -> WeightGradPlan:
    """Instrument ``gm`` in place so a forward run under ``capturing(plan)`` reports the
    op outputs W needs (outputs, hooks and behaviour are otherwise unchanged), and
    return the plan for W. Idempotent: a module is instrumented once."""
    existing = getattr(gm, "_pippy_split_weight_grad_plan", None)
    if existing is not None:
        return existing
    graph = gm.graph
    param_only: dict[torch.fx.Node, set[int]] = {}  # node -> ids of params it derives from
    params_by_id: dict[int, torch.nn.Parameter] = {}
    for node in graph.nodes:
        p = _param_of(gm, node)
        if p is not None:
            param_only[node] = {id(p)}
            params_by_id[id(p)] = p
        elif node.op == "call_function" and node.all_input_nodes and all(a in param_only for a in node.all_input_nodes):
            param_only[node] = set().union(*(param_only[a] for a in node.all_input_nodes))
    captures: list[tuple[torch.fx.Node, set[int]]] = []
    passed_to_modules: set[int] = set()  # a parameter handed to a called module as an argument
    for node in graph.nodes:
        if node.op not in ("call_function", "call_module") or node in param_only:
            continue
        ids = set().union(*(param_only[a] for a in node.all_input_nodes if a in param_only)) if any(
            a in param_only for a in node.all_input_nodes) else set()
        if ids and node.op == "call_module":
            passed_to_modules |= ids  # the module's leaf captures would overlap its output's: I computes it whole
        elif ids:
            captures.append((node, ids))
    uses: dict[int, int] = {}
    for _, ids in captures:
        for i in ids:
            uses[i] = uses.get(i, 0) + 1
    whole = {i for i, n in uses.items() if n > 1}
    for node, ids in captures:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            whole |= ids  # tuple-valued op: cannot capture one tensor, differentiate whole
    whole |= _params_reaching_outputs(graph, param_only)
    whole |= _owned_by_inner_modules(gm, params_by_id) | passed_to_modules
    # a parameter both an op of the graph and a called module read (tied): I computes it in full
    in_modules = {id(p) for called in _called_modules(gm) for p in called.parameters()}
    for i in [i for i in uses if i in in_modules]:
        whole.add(i)
    kept = [(node, ids - whole) for node, ids in captures if ids - whole]
    plan = WeightGradPlan([[params_by_id[i] for i in sorted(ids)] for _, ids in kept],
                          [params_by_id[i] for i in sorted(whole)],
                          names={id(p): n for n, p in gm.named_parameters(remove_duplicate=False)})
    for k, (node, _) in enumerate(kept):
        with graph.inserting_after(node):
            graph.call_function(plan.sink.capture, (k, node))
    _hook_leaf_modules(gm, plan.sink)
    gm.recompile()
    gm._pippy_split_weight_grad_plan = plan  # type: ignore[assignment]  # a plain attribute on the module
    return plan
