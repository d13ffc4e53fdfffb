"""Per-node cost estimates (FLOPs from the traced shapes) for balancing and summaries.

Shapes come from the fake tensors export already attached to every node
(``node.meta["val"]``); dynamic dims use the example's values (their hints).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

__all__ = ["node_flops", "hint_int"]

aten = torch.ops.aten


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


def node_flops(node: torch.fx.Node) -> int:
    """Estimated forward FLOPs of one call_function node."""
    val = node.meta.get("val")
    target = node.target
    if target is aten.linear.default:
        x, w = _shape(node.args[0]), _shape(node.args[1])
        return 2 * math.prod(x) * w[0]
    if target is aten.matmul.default:
        a = _shape(node.args[0])
        return 2 * _numel(val) * (a[-1] if len(a) else 1)
    if target is aten.scaled_dot_product_attention.default:
        q, k = _shape(node.args[0]), _shape(node.args[1])
        # QK^T and PV: 2 matmuls of (.., T, D) x (.., D, S)
        return 4 * math.prod(q[:-1]) * k[-2] * q[-1]
    packet = getattr(target, "overloadpacket", None)
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
