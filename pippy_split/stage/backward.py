"""The zero-bubble backward split: what W must differentiate, found on the stage graph.

For every op that combines a parameter (possibly through views like ``t()``)
with an activation, and every call of a user's module holding parameters, the
output is *captured* (a no-op graph call that hands
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
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule

__all__ = ["WeightGradPlan", "CaptureSink", "plan_weight_grads", "capturing"]


class CaptureSink:
    """Where one instrumented stage module hands over the op outputs W needs: its graph
    calls :meth:`capture`, which keeps them only while :func:`capturing` collects (no
    module-level state: each instrumented module has its own sink)."""

    def __init__(self) -> None:
        self.active: dict[int, torch.Tensor] | None = None

    @torch.compiler.disable  # a graph break under torch.compile: the hand-over runs eagerly, every call
    def capture(self, index: int, value: torch.Tensor) -> None:
        """Graph hook: hand ``value`` to the running forward when it collects (else a no-op)."""
        if self.active is not None:
            self.active[index] = value


@dataclass
class WeightGradPlan:
    params: list[list[torch.nn.Parameter]]  # per capture index: the parameters W differentiates
    whole_params: list[torch.nn.Parameter]  # parameters whose gradient I computes in full
    sink: CaptureSink = field(default_factory=CaptureSink)  # what the instrumented graph calls
    names: dict[int, str] = field(default_factory=dict)  # id of each planned parameter -> its FQN in the module

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


@contextlib.contextmanager
def capturing(plan: WeightGradPlan | None) -> Iterator[dict[int, torch.Tensor]]:
    """Collect the captured op outputs of a forward of ``plan``'s module run inside this
    block (``None``: a stage without the I/W split; nothing is collected)."""
    found: dict[int, torch.Tensor] = {}
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
    for node in graph.nodes:
        if node.op not in ("call_function", "call_module") or node in param_only:
            continue
        ids = set().union(*(param_only[a] for a in node.all_input_nodes if a in param_only)) if any(
            a in param_only for a in node.all_input_nodes) else set()
        if node.op == "call_module":  # a user's module: W differentiates its output for all its parameters
            for p in gm.get_submodule(str(node.target)).parameters():
                if p.requires_grad:
                    ids.add(id(p))
                    params_by_id[id(p)] = p
        if ids:
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
    kept = [(node, ids - whole) for node, ids in captures if ids - whole]
    plan = WeightGradPlan([[params_by_id[i] for i in sorted(ids)] for _, ids in kept],
                          [params_by_id[i] for i in sorted(whole)],
                          names={id(p): n for n, p in gm.named_parameters(remove_duplicate=False)})
    for k, (node, _) in enumerate(kept):
        with graph.inserting_after(node):
            graph.call_function(plan.sink.capture, (k, node))
    gm.recompile()
    gm._pippy_split_weight_grad_plan = plan  # type: ignore[assignment]  # a plain attribute on the module
    return plan
