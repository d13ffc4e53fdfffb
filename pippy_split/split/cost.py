"""Per-node cost estimates for balancing and summaries (part of the partition step).

FLOPs, parameter bytes and training-memory bytes come from the fake tensors export
already attached to every node (``node.meta["val"]``); dynamic dims use the
example's values (their hints). Measured time lives in ``profile.py``.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from .calls import region_nodes

__all__ = ["node_flops", "hint_int", "is_view", "mutated_args", "value_bytes", "BALANCE_METRICS", "node_costs"]

_aten = torch.ops.aten
# Export's training IR keeps these composite ops; torch's flop formulas cover only aten.convolution.
_CONVS = {_aten.conv1d, _aten.conv2d, _aten.conv3d}
_CONV_TRANSPOSES = {_aten.conv_transpose1d, _aten.conv_transpose2d, _aten.conv_transpose3d}


def mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Input nodes an in-place op writes to (from its schema's write aliases)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                out.append(value)
    return out


def hint_int(d: Any) -> int:
    """A concrete int for a possibly symbolic dim (the example's value)."""
    if isinstance(d, torch.SymInt):
        hint = d.node.hint
        return int(hint) if hint is not None else 1
    return int(d)


def _numel(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return math.prod(hint_int(d) for d in val.shape)
    if isinstance(val, (tuple, list)):
        return sum(_numel(v) for v in val)
    return 0


def _shape(x: Any) -> Any:
    if isinstance(x, torch.fx.Node):
        x = x.meta.get("val")
    if isinstance(x, torch.Tensor):
        return torch.Size([hint_int(d) for d in x.shape])
    return x


def is_view(node: torch.fx.Node) -> bool:
    """True for an op that only re-describes its input (view, permute, slice, getitem):
    it computes nothing and allocates nothing."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or schema.is_mutable or not schema.returns:
        return False
    return all(r.alias_info is not None for r in schema.returns)


def value_bytes(val: Any) -> int:
    """Bytes of a traced value (a tensor, or a tuple/list of them); 0 for anything else."""
    if isinstance(val, torch.Tensor):
        return _numel(val) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(value_bytes(v) for v in val)
    return 0


def node_flops(node: torch.fx.Node) -> int:
    """Estimated forward FLOPs of one call_function node (0 for views; the ops inside
    a higher-order op's region, e.g. a ``torch.no_grad()`` block, summed).

    Example:
        >>> from pippy_split.split.trace import trace_model
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> graph = trace_model(model, (torch.randn(2, 4),)).graph
        >>> [node_flops(n) for n in graph.nodes if n.op == "call_function"]  # linear: 2 x 2 x 4 x 4; relu: 1 per element
        [64, 8, 64]
    """
    if is_view(node):
        return 0
    val = node.meta.get("val")
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return sum(node_flops(n) for n in region_nodes(node))
    if target is _aten.linear.default:
        x, w = _shape(node.args[0]), _shape(node.args[1])
        return 2 * math.prod(x) * w[0]
    if target is _aten.matmul.default:
        a = _shape(node.args[0])
        return 2 * _numel(val) * (a[-1] if len(a) else 1)
    packet = getattr(target, "overloadpacket", None)
    if packet in _CONVS:
        # weight (C_out, C_in / groups, *kernel): each output element is a dot product of that size
        w = _shape(node.args[1])
        return 2 * _numel(val) * math.prod(w[1:])
    if packet in _CONV_TRANSPOSES:
        # weight (C_in, C_out / groups, *kernel): each input element is spread over that many outputs
        x, w = _shape(node.args[0]), _shape(node.args[1])
        return 2 * math.prod(x) * math.prod(w[1:])
    if target is _aten.scaled_dot_product_attention.default:
        q, k = _shape(node.args[0]), _shape(node.args[1])
        # QK^T and PV: 2 matmuls of (.., T, D) x (.., D, S)
        return 4 * math.prod(q[:-1]) * k[-2] * q[-1]
    if packet in flop_registry:
        try:
            args = [_shape(a) for a in node.args]
            kwargs = {k: _shape(v) for k, v in node.kwargs.items()}
            # The registered formula (unwrapped) takes shapes, not tensors.
            inner = getattr(flop_registry[packet], "__wrapped__", flop_registry[packet])
            out = _shape(val) if isinstance(val, torch.Tensor) else None
            return int(inner(*args, out_shape=out, **kwargs))
        except Exception:  # a formula that does not fit this overload: fall back
            pass
    return _numel(val)  # elementwise-ish: one op per output element


BALANCE_METRICS = ("flops", "params", "time", "memory")

# Training state per parameter byte: the weight, its gradient, and Adam's two moments.
PARAM_STATE_FACTOR = 4


def node_costs(ops: list[torch.fx.Node], metric: str, param_tensors: dict[str, torch.Tensor],
               requires_grad: dict[torch.fx.Node, bool] | None = None) -> list[float]:
    """The cost of each op in ``ops`` under ``metric`` ("flops", "params" or "memory";
    measured "time" comes from ``profile.node_times``).

    Args:
        ops: the graph's call nodes, in order.
        metric: "flops": forward FLOPs; "params": bytes of the parameters and buffers an op
            is the first to read (a tensor read by several ops, like a tied embedding or a
            layer called many times, counts once); "memory": training bytes, i.e. the
            activation an op keeps for backward (its output, if it needs a gradient and is
            not a view) plus 4x the bytes of the parameters it first reads (weight,
            gradient, two Adam moments) and 1x its buffers.
        param_tensors: graph placeholder name -> the model's tensor, for parameters and buffers.
        requires_grad: which nodes carry a gradient (``grad.infer_requires_grad``); for "memory".

    Returns:
        One float per op.

    Example:
        >>> from pippy_split.split.profile import graph_tensors
        >>> from pippy_split.split.trace import trace_model
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> traced = trace_model(model, (torch.randn(2, 4),))
        >>> ops = [n for n in traced.graph.nodes if n.op == "call_function"]  # linear, relu, linear
        >>> node_costs(ops, "params", graph_tensors(traced, model))  # a Linear(4, 4): 16 + 4 floats
        [80.0, 0.0, 80.0]
    """
    if metric == "flops":
        return [float(node_flops(op)) for op in ops]
    if metric not in ("params", "memory"):
        raise ValueError(f"no static cost for balance={metric!r}; choose one of {BALANCE_METRICS}")
    seen: set[int] = set()
    out = []
    for op in ops:
        cost = 0.0
        for a in op.all_input_nodes:
            t = param_tensors.get(a.name) if a.op == "placeholder" else None
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            size = t.numel() * t.element_size()
            if metric == "memory":
                size *= PARAM_STATE_FACTOR if isinstance(t, torch.nn.Parameter) and t.requires_grad else 1
            cost += size
        if metric == "memory" and not is_view(op) and (requires_grad or {}).get(op, False):
            cost += value_bytes(op.meta.get("val"))
        out.append(cost)
    return out
