"""Which graph values need a gradient at run time.

``torch.export`` traces without autograd, so its fake values all say
``requires_grad=False``. We derive it the way autograd would: a float/complex
result of a differentiable op on something that needs grad needs grad too,
except inside ``no_grad`` regions and for ops with no derivative (``detach``,
``*_like`` factories). A custom autograd Function's forward is traced in no-grad mode,
but its results carry the Function's gradient: inside a module that applies one, a no-grad
region counts as differentiable (``functions.py``). The stage layer double-checks this at
run time.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from .functions import in_function

__all__ = ["infer_requires_grad"]

_aten = torch.ops.aten
_NO_GRAD_PACKETS = {
    _aten.detach, _aten.detach_, _aten.zeros_like, _aten.ones_like, _aten.empty_like, _aten.full_like,
    _aten.rand_like, _aten.randn_like, _aten.randint_like, _aten.new_zeros, _aten.new_ones, _aten.new_empty,
    _aten.new_full, _aten.lift_fresh_copy, _aten.bernoulli, _aten.randperm, _aten.argmax, _aten.argmin,
    _aten.sym_size, _aten.sym_numel, _aten.sym_stride, _aten._assert_tensor_metadata,
}


def _differentiable_dtype(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return val.dtype.is_floating_point or val.dtype.is_complex
    if isinstance(val, (tuple, list)):
        return any(_differentiable_dtype(v) for v in val)
    return False


def _is_grad_mode_hop(target: Any) -> bool:
    return getattr(target, "__name__", "") == "wrap_with_set_grad_enabled" or str(target) == "wrap_with_set_grad_enabled"


def infer_requires_grad(graph: torch.fx.Graph, placeholder_grad: dict[str, bool],
                        functions: Collection[str] = ()) -> dict[torch.fx.Node, bool]:
    """``{node: needs grad}`` for every node; ``placeholder_grad`` seeds the graph inputs by name,
    ``functions`` names the modules that apply a custom autograd Function (``Traced.functions``)."""
    rg: dict[torch.fx.Node, bool] = {}
    grad_enabled = True
    for node in graph.nodes:
        if node.op == "placeholder":
            rg[node] = placeholder_grad.get(node.name, False)
            continue
        if node.op != "call_function":
            rg[node] = False
            continue
        target = node.target
        if target is torch._C._set_grad_enabled:
            grad_enabled = bool(node.args[0]) or in_function(node, functions)
            rg[node] = False
            continue
        any_in = any(rg.get(a, False) for a in node.all_input_nodes)
        if _is_grad_mode_hop(target):
            any_in = any_in and (bool(node.args[0]) or in_function(node, functions))
        elif getattr(target, "overloadpacket", None) in _NO_GRAD_PACKETS:
            any_in = False
        val = node.meta.get("val")
        if target is __import__("operator").getitem:
            rg[node] = any_in and _differentiable_dtype(val)
        else:
            rg[node] = grad_enabled and any_in and _differentiable_dtype(val)
    return rg
