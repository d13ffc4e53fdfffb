"""Measured cost of every graph op: forward plus backward time, once, on the model's device.

Used by the partition step of split → Pipe for ``balance="time"``. The exported graph
is run op by op on the example inputs (a warm-up pass, then each op's least time
over two more). Each op's
floating-point inputs become fresh leaves, so its backward can be timed alone with
``torch.autograd.grad``. Nothing of the model changes: buffers and inputs are
cloned (in-place ops write to the clones) and the random-number state is restored.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from .errors import SplitError
from .trace import Traced

__all__ = ["graph_tensors", "node_times"]


def graph_tensors(traced: Traced, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Graph placeholder name -> the model's parameter or buffer tensor."""
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    return {name: state[fqn] for name, fqn in {**traced.params, **traced.buffers}.items() if fqn in state}


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _is_grad_dtype(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _mutates(op: torch.fx.Node) -> bool:
    schema = getattr(op.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _forward_only(op: torch.fx.Node, args: tuple, kwargs: dict, device: torch.device) -> tuple[Any, float]:
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        out = op.target(*args, **kwargs)
        _sync(device)
    return out, time.perf_counter() - t0


def _time_op(op: torch.fx.Node, args: tuple, kwargs: dict, device: torch.device) -> tuple[Any, float]:
    """Run one op; returns (its output, detached) and its forward + backward seconds."""
    if _mutates(op):  # writes to its input: run it as is, forward only
        return _forward_only(op, args, kwargs, device)
    leaves: list[torch.Tensor] = []

    def leaf(x: Any) -> Any:
        if _is_grad_dtype(x):
            x = x.detach().requires_grad_(True)
            leaves.append(x)
        return x

    grad_args, grad_kwargs = pytree.tree_map(leaf, (args, kwargs))
    with torch.enable_grad():
        try:
            _sync(device)
            t0 = time.perf_counter()
            out = op.target(*grad_args, **grad_kwargs)
            _sync(device)
        except RuntimeError:  # e.g. an integer result from float inputs: no backward to time
            return _forward_only(op, args, kwargs, device)
        seconds = time.perf_counter() - t0
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.grad_fn is not None]
        if outs and leaves:
            grads = [torch.ones_like(o) for o in outs]
            try:
                _sync(device)
                t0 = time.perf_counter()
                torch.autograd.grad(outs, leaves, grads, allow_unused=True)
                _sync(device)
                seconds += time.perf_counter() - t0
            except RuntimeError:  # an op autograd cannot differentiate alone: forward time only
                pass
    return pytree.tree_map(lambda o: o.detach() if isinstance(o, torch.Tensor) else o, out), seconds


def node_times(traced: Traced, model: torch.nn.Module, flat_inputs: Sequence[Any], passes: int = 3) -> list[float]:
    """Forward + backward seconds of each call node of ``traced.graph``, in graph order.

    Args:
        traced: the exported model (``trace.trace_model``).
        model: the model it came from (its tensors are read, never written).
        flat_inputs: the example inputs, flattened as ``traced.flatten_inputs`` does.
        passes: runs of the whole graph; the first warms up, and each op keeps its least
            time over the others (robust to a pause of the process).

    Returns:
        One float per call_function node.

    Example:
        >>> traced = trace_model(model, (x,))  # doctest: +SKIP
        >>> times = node_times(traced, model, traced.flatten_inputs((x,), {}))  # doctest: +SKIP
        >>> len(times) == sum(1 for n in traced.graph.nodes if n.op == "call_function")  # doctest: +SKIP
        True
    """
    tensors = graph_tensors(traced, model)
    if any(t.is_meta for t in tensors.values()):
        raise SplitError("balance='time' runs the model once to time it, but its tensors are on the meta device; "
                         "use balance='flops' (or 'params' / 'memory'), which need no real tensors")
    devices = [t.device for t in tensors.values()] + [x.device for x in flat_inputs if isinstance(x, torch.Tensor)]
    device = devices[0] if devices else torch.device("cpu")
    inputs = dict(zip(traced.user_inputs, flat_inputs))
    graph_module = traced.ep.graph_module
    best: list[float] | None = None
    with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type):
        for k in range(max(passes, 2)):
            env: dict[torch.fx.Node, Any] = {}
            times: list[float] = []
            for node in traced.graph.nodes:
                if node.op == "placeholder":
                    if node.name in traced.params:
                        env[node] = tensors[node.name].detach()
                    elif node.name in traced.buffers:
                        env[node] = tensors[node.name].detach().clone()
                    elif node.name in traced.constants:
                        env[node] = traced.ep.constants[traced.constants[node.name]]
                    else:
                        x = inputs[node.name]
                        env[node] = x.detach().clone() if isinstance(x, torch.Tensor) else x
                elif node.op == "get_attr":
                    env[node] = getattr(graph_module, node.target)
                elif node.op == "call_function":
                    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                    try:
                        env[node], seconds = _time_op(node, args, kwargs, device)
                    except Exception as e:
                        raise SplitError(f"balance='time': op {node.name} ({node.target}) failed when run alone: "
                                         f"{type(e).__name__}: {e}") from e
                    times.append(seconds)
            if k > 0:
                best = times if best is None else [min(a, b) for a, b in zip(best, times)]
    return best
