"""Activation checkpointing inside a stage: RNG state, and selective regions by module FQN.

Part of the stage layer. ``activation_checkpoint="full"`` (in ``stage.py``) reruns the
whole stage before its backward; a list of FQN patterns checkpoints only the calls of
the original modules whose names match (``["blocks.*"]``, :mod:`fnmatch`). On a stage
of a Pipe the regions come from each op's original module path
(``node.meta["nn_module_stack"]``): every maximal run of ops inside one call of a
matching module becomes one region. Each region call runs with autograd on, but the
tensors autograd saves inside it are dropped; the first backward that needs one reruns
the region from its inputs (same RNG and autocast state) and keeps all of them until
the microbatch's graph is gone, so B, or I followed by W, recompute each region once
(``torch.utils.checkpoint`` would recompute again for W, a second backward call).
"""

from __future__ import annotations

import difflib
import fnmatch
import operator
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch
from torch.fx import Graph, GraphModule, Node

from ..split.calls import call_stack, module_paths
from ..split.module_calls import called_module_names

__all__ = ["checkpoint_patterns", "check_patterns_match", "RegionRecorder", "CheckpointRegion",
           "checkpointed_graph_module", "checkpoint_submodules", "rng_state", "restored_rng", "unchanged",
           "graph_module_paths"]


def checkpoint_patterns(value: Any, where: str) -> str | tuple[str, ...] | None:
    """``None``, ``"full"`` or a tuple of FQN patterns; anything else is a ``ValueError``.

    Example:
        >>> checkpoint_patterns(["blocks.*"], "stage 0")
        ('blocks.*',)
    """
    if value is None or value == "full":
        return value
    if isinstance(value, str):
        raise ValueError(f"{where}: activation_checkpoint={value!r}: a string must be 'full' (recompute the whole "
                         f"stage); for selective checkpointing pass a list of module FQN patterns, e.g. [{value!r}]")
    if isinstance(value, Iterable):
        patterns = tuple(value)
        bad = [p for p in patterns if not isinstance(p, str) or not p]
        if patterns and not bad:
            return patterns
    raise ValueError(f"{where}: activation_checkpoint={value!r}: expected None, 'full', or a non-empty list of "
                     "module FQN patterns such as ['blocks.*'] or ['model.layers.*.mlp']")


def check_patterns_match(patterns: Sequence[str], fqns: Iterable[str], where: str) -> None:
    """Every pattern must name at least one module; the error lists the closest FQNs."""
    names = sorted(set(fqns))
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(n, pattern) for n in names):
            continue
        close = difflib.get_close_matches(pattern, names, n=4, cutoff=0.5)
        parents = sorted({n.rsplit(".", 1)[0] + ".*" for n in names if "." in n})
        hint = close + difflib.get_close_matches(pattern, parents, n=2, cutoff=0.5)
        raise ValueError(f"{where}: activation_checkpoint pattern {pattern!r} matches no module of the model; "
                         f"closest module names: {hint or names[:6]}")


def rng_state(device: torch.device) -> tuple:
    """The CPU (and ``device``'s CUDA) RNG state, for a recompute that must draw the same numbers."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class restored_rng:
    """Run with an RNG state from :func:`rng_state` (dropout draws the same masks), then put it back."""

    def __init__(self, device: torch.device, state: tuple) -> None:
        self.device, self.state = device, state
        self.fork = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])

    def __enter__(self) -> None:
        self.fork.__enter__()
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc: Any) -> None:
        self.fork.__exit__(*exc)


class unchanged:
    """Leave ``tensors`` holding after the block what they held before it: a recompute
    must not update BatchNorm's running statistics (or any buffer) a second time.
    (Version counters cannot tell which buffers a call writes: ``aten.batch_norm``
    updates its running statistics without bumping them, so every buffer the
    recomputed code reads is put back; they are small next to the activations.)"""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.saved: list[torch.Tensor] = []

    def __enter__(self) -> None:
        self.saved = [t.detach().clone() for t in self.tensors]

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for t, old in zip(self.tensors, self.saved):
                t.data.copy_(old)  # through .data: the recomputed graph may have saved t; keep its version


class RegionRecorder:
    """One stage's switch for its checkpointed regions, and counts of what they did.

    ``active`` is on only during a training forward; ``storages`` (when the stage tracks
    what autograd keeps, see ``PipelineStage.may_release``) receives the storages of
    region inputs, which the recompute needs.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active = False
        self.storages: set[int] | None = None
        self.region_calls = 0  # region calls run with checkpointing that saved something for backward
        self.recomputes = 0  # region reruns in backward
        # (module, its checkpointed forward): set on the instance only while the stage's forward
        # runs (``recording``), so the user's module is left as it was between stage calls
        self.wrappers: list[tuple[torch.nn.Module, Callable]] = []

    def recording(self, on: bool, storages: set[int] | None) -> "_Recording":
        return _Recording(self, on, storages)


class _Recording:
    def __init__(self, recorder: RegionRecorder, on: bool, storages: set[int] | None) -> None:
        self.recorder, self.on, self.storages = recorder, on, storages

    def __enter__(self) -> None:
        self.recorder.active, self.recorder.storages = self.on, self.storages
        self.before = [(sub, sub.__dict__.get("forward")) for sub, _ in self.recorder.wrappers]
        for sub, forward in self.recorder.wrappers:
            sub.forward = forward

    def __exit__(self, *exc: Any) -> None:
        self.recorder.active, self.recorder.storages = False, None
        for sub, forward in reversed(self.before):
            if forward is None:
                del sub.forward
            else:
                sub.forward = forward


class _RegionCall:
    """One call of one region on one microbatch: its inputs and the state to rerun it."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, recorder: RegionRecorder,
                 state: Sequence[torch.Tensor]) -> None:
        device_type = recorder.device.type
        self.fn, self.args, self.kwargs, self.recorder = fn, args, kwargs, recorder
        self.state = list(state)  # buffers the region may write in place; recompute puts them back
        self.rng = rng_state(recorder.device)
        self.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        self.saved: list[torch.Tensor] | None = None
        self.packed = 0

    def pack(self, _t: torch.Tensor) -> tuple["_RegionCall", int]:
        self.packed += 1
        return self, self.packed - 1

    def run(self) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack):
            return self.fn(*self.args, **self.kwargs)

    def recompute(self) -> None:
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> int:
            saved.append(t.detach() if t.requires_grad else t)
            return len(saved) - 1

        enabled, dtype = self.autocast
        with restored_rng(self.recorder.device, self.rng), unchanged(self.state), torch.enable_grad(), \
                torch.autocast(self.recorder.device.type, dtype=dtype, enabled=enabled), \
                torch.autograd.graph.saved_tensors_hooks(keep, saved.__getitem__):
            self.fn(*self.args, **self.kwargs)
        if len(saved) != self.packed:
            raise RuntimeError(f"activation checkpointing: recomputing a region saved {len(saved)} tensors, its "
                               f"forward saved {self.packed}; the region is not deterministic in what it computes")
        self.saved = saved
        self.recorder.recomputes += 1


def _unpack(handle: tuple[_RegionCall, int]) -> torch.Tensor:
    call, index = handle
    if call.saved is None:
        call.recompute()
    assert call.saved is not None
    return call.saved[index]


def _run_region(fn: Callable, recorder: RegionRecorder, args: tuple, kwargs: dict,
                state: Sequence[torch.Tensor]) -> Any:
    if not recorder.active or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if recorder.storages is not None:
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                recorder.storages.add(a.untyped_storage().data_ptr())
    call = _RegionCall(fn, args, kwargs, recorder, state)
    out = call.run()
    if call.packed:  # a region that saved nothing for backward has nothing to recompute
        recorder.region_calls += 1
    return out


class CheckpointRegion(torch.nn.Module):
    """A region of a stage graph (a :class:`GraphModule` of its ops) run checkpointed."""

    def __init__(self, region: GraphModule, recorder: RegionRecorder, name: str, state_args: Sequence[int]) -> None:
        super().__init__()
        self.region = region
        self.recorder = recorder
        self.name = name  # the module call it came from, for messages
        self.state_args = tuple(state_args)  # positions of the buffers it reads

    def forward(self, *args: Any) -> Any:
        state = [args[i] for i in self.state_args if isinstance(args[i], torch.Tensor)]
        return _run_region(self.region, self.recorder, args, {}, state)


def _matched_call(node: Node, patterns: Sequence[str]) -> tuple[str, str] | None:
    """(call key, FQN) of the outermost module call around ``node`` whose FQN matches."""
    for key, path in zip(call_stack(node), module_paths(node)):
        if any(fnmatch.fnmatchcase(path, p) for p in patterns):
            return key, path
    return None


def _segments(nodes: list[Node], patterns: Sequence[str]) -> list[tuple[str, list[Node]]]:
    """Maximal runs of call nodes inside one call of a matching module; an op export
    or the stage added without a module stack (``capture``, ``sym_size``) joins the
    region of the op just before it when it reads a value of that region."""
    out: list[tuple[str, list[Node]]] = []
    current: tuple[str, str] | None = None
    members: set[Node] = set()
    for n in nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        call = _matched_call(n, patterns)
        if call is None and current is not None and n.op == "call_function" and not n.meta.get("nn_module_stack") and \
                any(a in members for a in n.all_input_nodes):
            call = current
        if call is not None and call == current:
            out[-1][1].append(n)
            members.add(n)
            continue
        current = call
        members = {n} if call is not None else set()
        if call is not None:
            out.append((call[1], [n]))
    return out


def _region_module(ops: list[Node]) -> tuple[GraphModule, list[Node], list[Node]]:
    """A GraphModule of ``ops`` alone: (module, the outside nodes it reads, the nodes read outside)."""
    inside = set(ops)
    inputs = list(dict.fromkeys(a for n in ops for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in ops if any(u not in inside for u in n.users)]
    graph = Graph()
    env = {a: graph.placeholder(f"in_{i}") for i, a in enumerate(inputs)}
    for n in ops:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[n] for n in outputs))
    return GraphModule(torch.nn.Module(), graph), inputs, outputs


def checkpointed_graph_module(gm: GraphModule, patterns: Sequence[str], recorder: RegionRecorder) -> GraphModule:
    """A module computing what ``gm`` computes, with each region matching ``patterns`` run
    as a :class:`CheckpointRegion`. It shares ``gm``'s parameters and buffers (the same
    objects); ``gm`` itself is left as it is. Returns ``gm`` when no op matches."""
    nodes = list(gm.graph.nodes)
    segments = _segments(nodes, patterns)
    if not segments:
        return gm
    first_of = {ops[0]: k for k, (_, ops) in enumerate(segments)}
    in_region = {n for _, ops in segments for n in ops}
    graph = Graph()
    graph._codegen = gm.graph._codegen
    env: dict[Node, Node] = {}
    attrs: dict[str, Any] = {}
    # placeholders, then every attribute (they read nothing, so they may move up)
    for n in [n for n in nodes if n.op == "placeholder"] + [n for n in nodes if n.op == "get_attr"]:
        env[n] = graph.node_copy(n, env.__getitem__)
        if n.op == "get_attr":
            attrs[n.target] = operator.attrgetter(n.target)(gm)
    for n in nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        if n in first_of:
            k = first_of[n]
            name, ops = segments[k]
            region, inputs, outputs = _region_module(ops)
            target = f"_checkpointed_region_{k}"
            buffers = {str(a.target) for a in inputs if a.op == "get_attr" and isinstance(attrs.get(str(a.target)), torch.Tensor)
                       and not isinstance(attrs[str(a.target)], torch.nn.Parameter)}
            state_args = [i for i, a in enumerate(inputs) if a.op == "get_attr" and str(a.target) in buffers]
            attrs[target] = CheckpointRegion(region, recorder, name, state_args)
            call = graph.call_module(target, tuple(env[a] for a in inputs))
            for j, o in enumerate(outputs):
                env[o] = graph.call_function(operator.getitem, (call, j))
                env[o].meta = dict(o.meta)
        elif n not in in_region:
            env[n] = graph.node_copy(n, env.__getitem__)
            if n.op == "call_module":  # a user's module the stage calls: the same object
                attrs[str(n.target)] = gm.get_submodule(str(n.target))
    out = GraphModule(attrs, graph, class_name=type(gm).__name__)
    return out


def _wrap(sub: torch.nn.Module, recorder: RegionRecorder) -> None:
    """Run ``sub`` as a checkpointed region: its ``forward`` is wrapped on the instance while
    the stage's forward runs (:meth:`RegionRecorder.recording`)."""
    inner, state = getattr(sub.forward, "_pippy_split_unwrapped", sub.forward), list(sub.buffers())

    def forward(*a: Any, _f: Callable = inner, _s: list = state, **kw: Any) -> Any:
        return _run_region(_f, recorder, a, kw, _s)

    forward._pippy_split_unwrapped = inner  # type: ignore[attr-defined]  # a second stage rewraps, not nests
    recorder.wrappers.append((sub, forward))


def checkpoint_submodules(module: torch.nn.Module, patterns: Sequence[str], recorder: RegionRecorder,
                          prefix: str = "") -> int:
    """For a hand-built stage (not a traced graph): run each outermost submodule whose FQN
    (``prefix`` + its name) matches ``patterns`` as a checkpointed region (its ``forward``
    is wrapped on the instance). Returns how many submodules were wrapped."""
    wrapped: list[str] = []
    for name, sub in module.named_modules():
        full = f"{prefix}{name}" if name else prefix.rstrip(".")
        if not full or any(full.startswith(w + ".") for w in wrapped):
            continue
        if any(fnmatch.fnmatchcase(full, p) for p in patterns):
            _wrap(sub, recorder)
            wrapped.append(full)
    return len(wrapped)


def checkpoint_called_modules(gm: GraphModule, patterns: Sequence[str], recorder: RegionRecorder) -> int:
    """The user's modules a traced stage calls (``call_module`` nodes): each runs as a
    checkpointed region where its FQN or an enclosing module's matches ``patterns``, else
    its outermost matching submodules do. Returns how many modules were wrapped."""
    count = 0
    for target in dict.fromkeys(str(n.target) for n in gm.graph.nodes if n.op == "call_module"):
        parts = target.split(".")
        enclosing = [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatchcase(path, p) for path in enclosing for p in patterns):
            _wrap(gm.get_submodule(target), recorder)
            count += 1
        else:
            count += checkpoint_submodules(gm.get_submodule(target), patterns, recorder, prefix=target + ".")
    return count


def graph_module_paths(gm: GraphModule) -> set[str]:
    """Every original module FQN the ops of a stage graph ran inside, and every module (and
    submodule) of the user's that it calls."""
    paths = {p for n in gm.graph.nodes if n.op == "call_function" for p in module_paths(n)}
    called = called_module_names(gm)
    for name in called:  # and the modules enclosing a called one
        parts = name.split(".")
        paths.update(".".join(parts[:k]) for k in range(1, len(parts)))
    return paths | called
