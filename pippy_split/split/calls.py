"""Module calls in the exported graph: which module call every op runs inside.

Part of the partition step of split → Pipe. ``torch.export`` records on each op the
stack of module calls it was traced inside (``node.meta["nn_module_stack"]``); a
module called twice (ALBERT's one shared layer) gets a new key per call
(``...albert_layers.0@1``). From these stacks this module derives each call's span
of ops, the call tree, the runs of repeated blocks (consecutive sibling calls of one
class, such as ``layers.0 … layers.7`` or eight calls of one shared layer), and a
penalty for cutting before each op: 0 at a repeated block's boundary, otherwise one
per module call the cut would split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Call", "CallTree", "ROOT_PREFIX", "user_module_path", "module_paths", "all_module_paths", "region_nodes",
           "call_stack", "call_tree"]

ROOT_PREFIX = "mod."
"""The tracing wrapper's name for the user's model (``split/trace.py``): export's module
paths read ``mod.blocks.0`` for the user's ``blocks.0``."""

# Export's placeholder stack for nodes it made outside any module (e.g. sym_size).
_NO_STACK = "_empty_nn_module_stack"


def user_module_path(path: str) -> str | None:
    """The user's FQN for a module path of export's ``nn_module_stack`` (``"mod.blocks.0"``
    -> ``"blocks.0"``), or ``None`` for the model itself and the tracing wrapper.

    Example:
        >>> user_module_path("mod.blocks.0"), user_module_path("mod")
        ('blocks.0', None)
    """
    if path.startswith(ROOT_PREFIX):
        return path[len(ROOT_PREFIX):]
    return None if path in ("", ROOT_PREFIX.rstrip(".")) else path


def _stack_entries(node: torch.fx.Node) -> list[tuple[str, str, str]]:
    """``(call key, user FQN, class name)`` of each module call around ``node``, outermost
    first; the model itself and the tracing wrapper are left out."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for key, (path, cls) in stack.items():
        path = user_module_path(path.split("@")[0])
        if path is None or path.startswith(_NO_STACK):
            continue
        name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
        out.append((key, path, name))
    return out


def region_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The ops inside a higher-order op's subgraph (e.g. a ``torch.no_grad()`` region,
    which export wraps in ``wrap_with_set_grad_enabled``); [] for an ordinary op."""
    owner = node.graph.owning_module
    if owner is None:
        return []
    out: list[torch.fx.Node] = []
    for a in node.args:
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            sub = getattr(owner, str(a.target), None)
            if isinstance(sub, torch.fx.GraphModule):
                out.extend(n for n in sub.graph.nodes if n.op == "call_function")
    return out


def _entries(node: torch.fx.Node) -> list[tuple[str, str, str]]:
    """A higher-order op carries no module stack of its own; it takes the stack of
    the first op inside its region."""
    out = _stack_entries(node)
    if not out:
        for inner in region_nodes(node):
            out = _stack_entries(inner)
            if out:
                break
    return out


def module_paths(node: torch.fx.Node) -> list[str]:
    """User FQNs of the modules a node was traced inside, outermost first ('' excluded).

    Example:
        >>> from pippy_split import zoo
        >>> from pippy_split.split.trace import trace_model
        >>> model = zoo.get("mlp_stack", d=8).model  # layers.K: linear (its fc), tanh, add
        >>> ops = [n for n in trace_model(model, (torch.randn(2, 8),)).graph.nodes if n.op == "call_function"]
        >>> module_paths(ops[3]), module_paths(ops[4])  # layers.1's linear, then its tanh
        (['layers.1', 'layers.1.fc'], ['layers.1'])
    """
    return [path for _, path, _ in _entries(node)]


def all_module_paths(node: torch.fx.Node) -> list[str]:
    """Every module a node runs code of: its own stack, plus, for a higher-order op,
    the stacks of all the ops inside its region."""
    out = dict.fromkeys(p for _, p, _ in _stack_entries(node))
    for inner in region_nodes(node):
        out.update(dict.fromkeys(p for _, p, _ in _stack_entries(inner)))
    return list(out)


def call_stack(node: torch.fx.Node) -> tuple[str, ...]:
    """Keys of the module calls around ``node``, outermost first; repeated calls of one
    module have different keys."""
    return tuple(key for key, _, _ in _entries(node))


@dataclass
class Call:
    """One call of one module: the ops ``first .. last`` (indices into the op list) ran in it."""

    key: str
    path: str
    cls: str
    first: int
    last: int
    parent: str | None
    children: list[str] = field(default_factory=list)


@dataclass
class CallTree:
    """Every module call of a graph, each op's stack of calls, and the repeated blocks."""

    calls: dict[str, Call]
    stacks: list[tuple[str, ...]]
    runs: list[list[Call]]  # consecutive sibling calls of one class, each with calls inside it

    def num_blocks(self, costs: list[float] | None = None) -> int:
        """How many repeated blocks the model runs, counted at the class of block whose
        runs hold the most cost (op count without ``costs``), the finest such level if
        several hold about as much: ``layers.*`` of a transformer, encoder and decoder
        blocks together for T5, the BasicBlocks (not layer1..4) of a ResNet."""
        weight: dict[str, float] = {}
        count: dict[str, int] = {}
        for run in self.runs:
            cls = run[0].cls
            count[cls] = count.get(cls, 0) + len(run)
            weight[cls] = weight.get(cls, 0.0) + sum(
                sum(costs[c.first:c.last + 1]) if costs is not None else c.last + 1 - c.first for c in run)
        if not weight:
            return 0
        heaviest = max(weight.values())
        # Nested levels hold about the same cost (ResNet's layer1..4 and their BasicBlocks):
        # count the finer one.
        return max(count[cls] for cls, w in weight.items() if w >= 0.9 * heaviest)

    def cut_penalties(self) -> list[float]:
        """For each cut position 0..n (before op i): 0 where the cut falls on a repeated
        block's boundary and splits nothing but the block's enclosing calls; otherwise
        the number of module calls it splits."""
        n = len(self.stacks)
        opened = [0] * (n + 2)
        for c in self.calls.values():
            if c.last > c.first:  # open at positions first+1 .. last
                opened[c.first + 1] += 1
                opened[c.last + 1] -= 1
        pen, depth = [0.0] * (n + 1), 0
        for i in range(n + 1):
            depth += opened[i]
            pen[i] = float(depth)
        for run in self.runs:
            ancestors = []
            key = run[0].parent
            while key is not None:
                ancestors.append(self.calls[key])
                key = self.calls[key].parent
            for i in range(run[0].first, run[-1].last + 2):
                around = sum(1 for a in ancestors if a.first < i <= a.last)
                if pen[i] == around:  # nothing but the run's ancestors is split here
                    pen[i] = 0.0
        return pen


def call_tree(ops: list[torch.fx.Node]) -> CallTree:
    """The module calls of ``ops`` (a graph's call nodes in order).

    Example:
        >>> from pippy_split import zoo
        >>> from pippy_split.split.trace import trace_model
        >>> model = zoo.get("mlp_stack", d=8).model  # 8 residual layers
        >>> tree = call_tree([n for n in trace_model(model, (torch.randn(2, 8),)).graph.nodes if n.op == "call_function"])
        >>> [c.path for c in tree.runs[0]][:2], tree.num_blocks()
        (['layers.0', 'layers.1'], 8)
    """
    calls: dict[str, Call] = {}
    stacks = []
    for i, op in enumerate(ops):
        entries = _entries(op)
        stacks.append(tuple(k for k, _, _ in entries))
        parent = None
        for key, path, cls in entries:
            call = calls.get(key)
            if call is None:
                call = calls[key] = Call(key, path, cls, i, i, parent)
                if parent is not None:
                    calls[parent].children.append(key)
            call.last = i
            parent = key
    roots = [c.key for c in calls.values() if c.parent is None]
    runs: list[list[Call]] = []
    for siblings in [roots] + [c.children for c in calls.values()]:
        ordered = sorted((calls[k] for k in siblings), key=lambda c: c.first)
        run: list[Call] = []
        for c in ordered + [None]:
            if c is not None and c.children and run and c.cls == run[-1].cls and c.first > run[-1].last:
                run.append(c)
                continue
            if len(run) >= 2:
                runs.append(run)
            run = [c] if c is not None and c.children else []
    return CallTree(calls, stacks, runs)
