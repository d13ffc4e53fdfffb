"""The same split traced again under ``torch.autocast`` (split → Pipe, for mixed precision).

A model's Python code sees dtypes while it is traced: ``torch.finfo(scores.dtype).min``
becomes a constant, and ``hidden.to(torch.float32)`` is a no-op on an fp32 tensor that
leaves nothing in the graph. A graph traced in fp32 and then run under autocast is
therefore not the model run under autocast. ``Pipe.under_autocast`` traces the model
again inside ``torch.autocast`` (export records the ops before autocast casts them, so
the graph still runs under autocast, now with the model's own casts and constants) and
cuts it where the fp32 pipe was cut; :func:`translate_cuts` finds those places.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import torch

from .calls import call_stack, call_tree
from .errors import SplitError
from .markers import is_split_marker
from .partition import Cut

__all__ = ["TraceRecipe", "translate_cuts", "trace_device_type"]


@dataclass(frozen=True)
class TraceRecipe:
    """What ``pipeline()`` traced, kept so the same split can be traced again."""

    example_args: tuple
    """The example microbatch's positional inputs."""
    example_kwargs: dict
    """Its keyword inputs."""
    dynamic_shapes: Any
    """``torch.export``'s ``dynamic_shapes``, as given."""
    strict: bool
    """Export's strict (TorchDynamo) mode."""
    cuts: tuple[str, ...] | None = None
    """The module FQNs the split cut at, where known before tracing (the trace kept only the
    call signatures they need; None: every module's)."""


def trace_device_type(model: torch.nn.Module, device_type: str) -> str:
    """The autocast device type to trace under: where the model's tensors are (autocast only
    casts tensors of its own device type), else ``device_type``. A model traced on the CPU
    for a CUDA run sees CPU autocast's dtypes, which agree with CUDA's for matmuls,
    linears and convolutions; the runtime casts under the stage's own device type."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point() and t.device.type != "meta":
            return t.device.type
    return device_type


def _signature(op: torch.fx.Node) -> tuple[str, tuple[str, ...]]:
    return str(op.target), call_stack(op)


def translate_cuts(old_ops: list[torch.fx.Node], cuts: list[Cut], new_ops: list[torch.fx.Node]) -> list[Cut]:
    """The cuts of ``old_ops`` placed among ``new_ops`` (the same model traced again, where
    dtype-dependent code may have added or dropped a few ops).

    A cut at the beginning of a module call stays at the beginning of that call, one at
    its end at its end, a ``pipe_split()`` at the same marker; any other cut stays before
    the op it was before, matched by op and module calls. A cut with no such place is a
    ``SplitError`` naming it.

    Example:
        >>> from pippy_split.split.partition import plan_stages
        >>> from pippy_split.split.trace import trace_model
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)); x = torch.randn(2, 4)
        >>> fp32 = trace_model(model, (x,))
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     bf16 = trace_model(model, (x,))
        >>> ops = lambda traced: [n for n in traced.graph.nodes if n.op == "call_function"]
        >>> translate_cuts(ops(fp32), plan_stages(fp32.graph, ["2"], model).cuts, ops(bf16))
        [Cut(index=2, label='2 (BEGINNING)')]
    """
    old_tree, new_tree = call_tree(old_ops), call_tree(new_ops)
    old_markers = [i for i, op in enumerate(old_ops) if is_split_marker(op.target)]
    new_markers = [i for i, op in enumerate(new_ops) if is_split_marker(op.target)]
    aligned: dict[int, int] | None = None
    out = []
    for cut in cuts:
        i = cut.index
        index = None
        if i < len(old_ops) and i in old_markers and len(old_markers) == len(new_markers):
            index = new_markers[old_markers.index(i)]
        if index is None and i < len(old_ops):
            starting = [k for k in old_tree.stacks[i] if old_tree.calls[k].first == i and k in new_tree.calls]
            if starting:
                index = new_tree.calls[starting[0]].first
        if index is None and i > 0:
            ending = [k for k in old_tree.stacks[i - 1] if old_tree.calls[k].last == i - 1 and k in new_tree.calls]
            if ending:
                index = new_tree.calls[ending[0]].last + 1
        if index is None:
            if aligned is None:
                aligned = _align(old_ops, new_ops)
            index = aligned.get(i)
        if index is None:
            raise SplitError(f"the cut {cut.label} (before op {i}) has no counterpart in the model traced under "
                             "torch.autocast (its code takes another path there); mark the stage boundaries with "
                             "module FQNs or pippy_split.pipe_split(), or use mixed_precision=None")
        out.append(Cut(index, cut.label))
    return out


def _align(old_ops: list[torch.fx.Node], new_ops: list[torch.fx.Node]) -> dict[int, int]:
    """Old op index -> new op index for ops matched in order by target and module calls
    (the position after the last op maps to the position after the last op)."""
    matcher = difflib.SequenceMatcher(None, [_signature(o) for o in old_ops], [_signature(o) for o in new_ops],
                                      autojunk=False)
    out = {len(old_ops): len(new_ops)}
    for a, b, size in matcher.get_matching_blocks():
        for k in range(size):
            out[a + k] = b + k
    return out
