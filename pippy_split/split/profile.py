"""Measured cost of every graph op, once, on the model's device: forward, input-gradient
and weight-gradient time, and the bytes autograd saves for its backward.

Used by the partition step of split → Pipe for ``balance="time"`` (:func:`node_times`)
and by the planner (:func:`op_profiles`, :mod:`pippy_split.plan`). The exported graph
is run op by op on the example inputs (a warm-up pass that also records what autograd
saves, then each op's least time over two more). Each op's floating-point inputs
become fresh leaves, so its backward can be timed alone with ``torch.autograd.grad``:
once for the inputs that are activations (I) and once for the parameters (W). Nothing
of the model changes: buffers and inputs are cloned (in-place ops write to the clones)
and the random-number state is restored. Results are kept on the ``Traced`` object,
so balancing and planning over one trace profile it once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, cast

import torch
from torch.utils import _pytree as pytree

from .errors import SplitError
from .trace import Traced

__all__ = ["OpProfile", "DEFAULT_PASSES", "graph_tensors", "node_times", "op_profiles", "op_overhead"]

DEFAULT_PASSES = 5
"""Whole-graph passes of a profile: the first warms up, each op keeps its least time over
the others (four timings resist a busy machine better than two)."""


@dataclass(frozen=True)
class OpProfile:
    """One op's measured cost on the example microbatch.

    Attributes:
        forward: seconds of its forward (with autograd recording).
        input_grad: seconds of its backward to the inputs that are not parameters (I).
        weight_grad: seconds of its backward to the parameters it reads (W).
        saved: ``(storage id, bytes)`` of each tensor autograd saved for its backward,
            parameters left out; storages are shared between ops, so a stage holds the
            union (ids are only meaningful within one profile).
        output_bytes: bytes of its tensor outputs.
        reads_params: whether it reads a parameter (a split backward's W differentiates it).
    """

    forward: float
    input_grad: float
    weight_grad: float
    saved: tuple[tuple[int, int], ...] = ()
    output_bytes: int = 0
    reads_params: bool = False

    @property
    def total(self) -> float:
        return self.forward + self.input_grad + self.weight_grad


def graph_tensors(traced: Traced, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Graph placeholder name -> the model's parameter or buffer tensor."""
    state: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
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


def _forward_only(op: torch.fx.Node, args: tuple, kwargs: dict, device: torch.device) -> tuple[Any, OpProfile]:
    target = cast(Callable[..., Any], op.target)  # a call_function node
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        out = target(*args, **kwargs)
        _sync(device)
    return out, OpProfile(time.perf_counter() - t0, 0.0, 0.0, (), _out_bytes(out))


def _out_bytes(out: Any) -> int:
    return sum(o.nbytes for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor))


def _storage(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _grad_seconds(outs: list, leaves: list, grads: list, device: torch.device, retain: bool) -> float:
    if not leaves:
        return 0.0
    try:
        _sync(device)
        t0 = time.perf_counter()
        torch.autograd.grad(outs, leaves, grads, allow_unused=True, retain_graph=retain)
        _sync(device)
        return time.perf_counter() - t0
    except RuntimeError:  # an op autograd cannot differentiate alone: no backward time
        return 0.0


def _time_op(op: torch.fx.Node, args: tuple, kwargs: dict, device: torch.device, params: set[int],
             record: bool = False) -> tuple[Any, OpProfile]:
    """Run one op; returns (its output, detached) and its profile. ``params`` holds the
    ids of the tensors that are parameters; ``record`` collects what autograd saves."""
    if _mutates(op):  # writes to its input: run it as is, forward only
        return _forward_only(op, args, kwargs, device)
    acts: list[torch.Tensor] = []
    weights: list[torch.Tensor] = []

    def leaf(x: Any) -> Any:
        if _is_grad_dtype(x):
            is_param = id(x) in params
            x = x.detach().requires_grad_(True)
            (weights if is_param else acts).append(x)
        return x

    grad_args, grad_kwargs = pytree.tree_map(leaf, (args, kwargs))
    param_storages = {w.untyped_storage().data_ptr() for w in weights}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage(t)
        if ptr not in param_storages:
            saved[ptr] = nbytes
        return t

    target = cast(Callable[..., Any], op.target)  # a call_function node
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if record else _null()
    with torch.enable_grad():
        try:
            with hooks:
                _sync(device)
                t0 = time.perf_counter()
                out = target(*grad_args, **grad_kwargs)
                _sync(device)
        except RuntimeError:  # e.g. an integer result from float inputs: no backward to time
            return _forward_only(op, args, kwargs, device)
        fwd = time.perf_counter() - t0
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.grad_fn is not None]
        i_s = w_s = 0.0
        if outs and (acts or weights):
            grads = [torch.ones_like(o) for o in outs]
            i_s = _grad_seconds(outs, acts, grads, device, retain=bool(weights))
            w_s = _grad_seconds(outs, weights, grads, device, retain=False)
    detached = pytree.tree_map(lambda o: o.detach() if isinstance(o, torch.Tensor) else o, out)
    return detached, OpProfile(fwd, i_s, w_s, tuple(saved.items()), _out_bytes(out), bool(weights))


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def node_times(traced: Traced, model: torch.nn.Module, flat_inputs: Sequence[Any],
               passes: int = DEFAULT_PASSES) -> list[float]:
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
        >>> from pippy_split.split.trace import trace_model
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)); x = torch.randn(2, 4)
        >>> traced = trace_model(model, (x,))
        >>> times = node_times(traced, model, traced.flatten_inputs((x,), {}))  # seconds: linear, relu, linear
        >>> len(times) == sum(1 for n in traced.graph.nodes if n.op == "call_function"), all(t > 0 for t in times)
        (True, True)
    """
    return [p.total for p in op_profiles(traced, model, flat_inputs, passes)]


def op_profiles(traced: Traced, model: torch.nn.Module, flat_inputs: Sequence[Any],
                passes: int = DEFAULT_PASSES) -> list[OpProfile]:
    """:class:`OpProfile` of each call node of ``traced.graph``, in graph order; measured
    once per ``traced`` (kept on it), see :func:`node_times` for the arguments.

    Example:
        >>> from pippy_split.split.trace import trace_model
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)); x = torch.randn(2, 4)
        >>> traced = trace_model(model, (x,))
        >>> profs = op_profiles(traced, model, traced.flatten_inputs((x,), {}))  # linear, relu, linear
        >>> sum(p.forward for p in profs) > 0, [p.reads_params for p in profs], [p.output_bytes for p in profs]
        (True, [True, False, True], [32, 32, 32])
    """
    cache = traced.__dict__.setdefault("_op_profiles", {})
    if passes not in cache:
        cache[passes] = _measure(traced, model, flat_inputs, passes)
    return cache[passes]


def _measure(traced: Traced, model: torch.nn.Module, flat_inputs: Sequence[Any], passes: int) -> list[OpProfile]:
    tensors = graph_tensors(traced, model)
    if any(t.is_meta for t in tensors.values()):
        raise SplitError("balance='time' runs the model once to time it, but its tensors are on the meta device; "
                         "use balance='flops' (or 'params' / 'memory'), which need no real tensors")
    devices = [t.device for t in tensors.values()] + [x.device for x in flat_inputs if isinstance(x, torch.Tensor)]
    device = devices[0] if devices else torch.device("cpu")
    best: list[OpProfile] | None = None
    with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type):
        for k in range(max(passes, 2)):
            profs = _one_pass(traced, tensors, flat_inputs, device, record=k == 0)
            if k == 0:
                saved = [(p.saved, p.output_bytes, p.reads_params) for p in profs]
            else:
                best = profs if best is None else [_least(a, b) for a, b in zip(best, profs)]
    assert best is not None
    return [OpProfile(p.forward, p.input_grad, p.weight_grad, *rest) for p, rest in zip(best, saved)]


def _least(a: OpProfile, b: OpProfile) -> OpProfile:
    return OpProfile(min(a.forward, b.forward), min(a.input_grad, b.input_grad), min(a.weight_grad, b.weight_grad))


def _one_pass(traced: Traced, tensors: dict[str, torch.Tensor], flat_inputs: Sequence[Any], device: torch.device,
              record: bool) -> list[OpProfile]:
    inputs = dict(zip(traced.user_inputs, flat_inputs))
    graph_module = traced.ep.graph_module
    env: dict[torch.fx.Node, Any] = {}
    params: set[int] = set()
    profs: list[OpProfile] = []
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            if node.name in traced.params:
                env[node] = tensors[node.name].detach()
                params.add(id(env[node]))
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
                env[node], prof = _time_op(node, args, kwargs, device, params, record)
            except Exception as e:
                raise SplitError(f"balance='time': op {node.name} ({node.target}) failed when run alone: "
                                 f"{type(e).__name__}: {e}") from e
            profs.append(prof)
    return profs


def op_overhead(device: torch.device | None = None) -> tuple[float, float, float]:
    """Seconds the profiler measures for a one-element op: ``(forward, input grad, weight grad)``,
    the part of every op's time that does not scale with the microbatch."""
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    node = g.call_function(torch.ops.aten.mul.Tensor, (a, b))
    x = torch.ones(1, device=device)
    w = torch.ones(1, device=device)
    best = [float("inf")] * 3
    for _ in range(20):
        _, p = _time_op(node, (x, w), {}, x.device, {id(w)})
        best = [min(v, n) for v, n in zip(best, (p.forward, p.input_grad, p.weight_grad))]
    return best[0], best[1], best[2]
