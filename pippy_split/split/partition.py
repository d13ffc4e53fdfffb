"""Decide which stage every graph node belongs to (split → Pipe, second step).

Input: the exported graph and a split spec. Output: the cut positions among
the graph's call nodes, in execution order, and each node's stage index.
Nothing here builds modules; ``stage_graph.py`` does that from this plan.
"""

from __future__ import annotations

import bisect
import difflib
import enum
import operator
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .cost import node_flops
from .errors import SplitError
from .markers import PIPE_SPLIT_OP, SplitPoint
from .trace import ROOT_PREFIX

__all__ = ["Cut", "Plan", "plan_stages", "module_paths"]


@dataclass(frozen=True)
class Cut:
    """A stage boundary before ``ops[index]``; ``label`` says which split point made it."""

    index: int
    label: str


@dataclass
class Plan:
    """Every call node's stage, in graph order."""

    ops: list[torch.fx.Node]
    cuts: list[Cut]
    stage_of: dict[torch.fx.Node, int]

    @property
    def num_stages(self) -> int:
        return len(self.cuts) + 1


# Export's placeholder stack for nodes it made outside any module (e.g. sym_size).
_NO_STACK = "_empty_nn_module_stack"


def _stack_paths(node: torch.fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for path, _cls in stack.values():
        path = path.split("@")[0]
        if path.startswith(ROOT_PREFIX):
            out.append(path[len(ROOT_PREFIX):])
        elif path not in ("", "mod") and not path.startswith(_NO_STACK):
            out.append(path)
    return out


def _region_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The ops inside a higher-order op's subgraph (e.g. a ``torch.no_grad()`` region,
    which export wraps in ``wrap_with_set_grad_enabled``); [] for an ordinary op."""
    owner = node.graph.owning_module
    if owner is None:
        return []
    out = []
    for a in node.args:
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            sub = getattr(owner, a.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                out.extend(n for n in sub.graph.nodes if n.op == "call_function")
    return out


def module_paths(node: torch.fx.Node) -> list[str]:
    """User FQNs of the modules a node was traced inside, outermost first ('' excluded).

    A higher-order op carries no module stack of its own; it takes the stack of
    the first op inside its region.
    """
    out = _stack_paths(node)
    if not out:
        for inner in _region_nodes(node):
            out = _stack_paths(inner)
            if out:
                break
    return out


def _all_module_paths(node: torch.fx.Node) -> list[str]:
    """Every module a node runs code of: its own stack, plus, for a higher-order op,
    the stacks of all the ops inside its region."""
    out = dict.fromkeys(_stack_paths(node))
    for inner in _region_nodes(node):
        out.update(dict.fromkeys(_stack_paths(inner)))
    return list(out)


def check_split_spec(split_spec: Any) -> None:
    """Refuse a malformed ``split_spec`` before anything is traced (see :func:`plan_stages`).

    Example:
        >>> check_split_spec(["layers.4"]); check_split_spec(4); check_split_spec(None)
        >>> check_split_spec((torch.ones(2),))
        Traceback (most recent call last):
        ...
        pippy_split.split.errors.SplitError: split_spec entry 0 is a Tensor, not a module FQN ...
    """
    if split_spec is None or (isinstance(split_spec, int) and not isinstance(split_spec, bool)):
        return
    _normalize_spec(split_spec)


def _normalize_spec(split_spec: Any) -> list[tuple[str, SplitPoint]]:
    if isinstance(split_spec, Mapping):
        items = []
        for fqn, point in split_spec.items():
            if isinstance(point, str):
                try:
                    point = SplitPoint[point.upper()]
                except KeyError:
                    raise SplitError(f"split point for {fqn!r} must be SplitPoint.BEGINNING or END, got {point!r}")
            elif isinstance(point, enum.Enum) and point.name in SplitPoint.__members__:
                point = SplitPoint[point.name]  # torch.distributed.pipelining's SplitPoint works too
            if not isinstance(point, SplitPoint):
                raise SplitError(f"split point for {fqn!r} must be a SplitPoint, got {point!r}")
            if not isinstance(fqn, str):
                raise SplitError(f"split_spec key {fqn!r} must be a module FQN string, e.g. 'layers.4'")
            items.append((fqn, point))
        return items
    if isinstance(split_spec, (list, tuple)):
        for i, fqn in enumerate(split_spec):
            if not isinstance(fqn, str):
                hint = (" — it looks like example inputs: the order is pipeline(model, split_spec, example_args)"
                        if isinstance(fqn, torch.Tensor) else "")
                raise SplitError(f"split_spec entry {i} is a {type(fqn).__name__}, not a module FQN string such as "
                                 f"'layers.4'{hint}")
        return [(fqn, SplitPoint.BEGINNING) for fqn in split_spec]
    raise SplitError(
        f"split_spec must be a dict {{fqn: SplitPoint}}, a list of FQNs, an int or None; got {type(split_spec).__name__}"
    )


def _fqn_cuts(ops: list[torch.fx.Node], spec: list[tuple[str, SplitPoint]], model: torch.nn.Module) -> list[Cut]:
    known = {name for name, _ in model.named_modules() if name}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, op in enumerate(ops):
        for path in _all_module_paths(op):
            first.setdefault(path, i)
            last[path] = i
    cuts = []
    for fqn, point in spec:
        if fqn not in known:
            close = difflib.get_close_matches(fqn, sorted(known), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise SplitError(f"split_spec names {fqn!r}, which is not a submodule of {type(model).__name__}{hint}")
        if fqn not in first:
            raise SplitError(
                f"split_spec names {fqn!r}, but it is never called in forward on the example inputs, "
                "so there is no place to cut"
            )
        index = first[fqn] if point is SplitPoint.BEGINNING else last[fqn] + 1
        cuts.append(Cut(index, f"{fqn} ({point.name})"))
    return sorted(cuts, key=lambda c: c.index)


def _cost_groups(ops: list[torch.fx.Node], n: int) -> list[tuple[int, float]]:
    """Runs of ops inside the same module at the shallowest depth giving enough runs.

    Returns ``[(start_index, cost), ...]``; a cut may only fall on a run boundary.
    """
    flops = [node_flops(op) if op.op == "call_function" else 0 for op in ops]
    param_bytes = [0.0] * len(ops)
    for i, op in enumerate(ops):
        for a in op.all_input_nodes:
            if a.op == "placeholder" and a.name.startswith(("p_", "b_")):
                val = a.meta.get("val")
                if isinstance(val, torch.Tensor):
                    param_bytes[i] += val.numel() * val.element_size()
    total_f = sum(flops) or 1
    total_p = sum(param_bytes) or 1
    # Half time, half memory: both normalised so neither dominates by units.
    cost = [f / total_f + p / total_p for f, p in zip(flops, param_bytes)]
    paths = [module_paths(op) for op in ops]
    max_depth = max((len(p) for p in paths), default=0)
    groups: list[tuple[int, float]] = []
    for depth in range(1, max_depth + 1):
        groups = []
        prev = object()
        for i, p in enumerate(paths):
            key = p[depth - 1] if len(p) >= depth else (p[-1] if p else "")
            if key != prev:
                groups.append((i, 0.0))
                prev = key
            start, c = groups[-1]
            groups[-1] = (start, c + cost[i])
        if len([g for g in groups if g[1] > 0]) >= 2 * n:
            break
    return groups


def _balanced_cuts(ops: list[torch.fx.Node], n: int) -> list[Cut]:
    if n < 1:
        raise SplitError(f"split_spec as an int must be >= 1, got {n}")
    if n == 1:
        return []
    groups = _cost_groups(ops, n)
    if len(groups) < n:
        raise SplitError(f"cannot balance into {n} stages: the graph has only {len(groups)} module-level pieces")
    costs = [c for _, c in groups]
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    g = len(groups)
    INF = float("inf")
    # best[k][j]: least max-stage cost splitting groups[:j] into k stages.
    best = [[INF] * (g + 1) for _ in range(n + 1)]
    back = [[0] * (g + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for j in range(k, g - (n - k) + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j]:
                    best[k][j], back[k][j] = v, i
    bounds = []
    j = g
    for k in range(n, 0, -1):
        i = back[k][j]
        bounds.append(i)
        j = i
    starts = sorted(b for b in bounds if b > 0)
    return [Cut(groups[b][0], f"balanced cut {k + 1}") for k, b in enumerate(starts)]


def plan_stages(graph: torch.fx.Graph, split_spec: Any, model: torch.nn.Module) -> Plan:
    """Assign every call node of ``graph`` to a stage according to ``split_spec``."""
    ops = [n for n in graph.nodes if n.op == "call_function"]
    if split_spec is None:
        cuts = [Cut(i, f"pipe_split() #{k}") for k, i in enumerate(i for i, op in enumerate(ops) if op.target is PIPE_SPLIT_OP)]
    elif isinstance(split_spec, bool):
        raise SplitError("split_spec must be a dict, a list of FQNs, an int or None, not a bool")
    elif isinstance(split_spec, int):
        cuts = _balanced_cuts(ops, split_spec)
    else:
        cuts = _fqn_cuts(ops, _normalize_spec(split_spec), model)
    positions = [c.index for c in cuts]
    stage_of = {op: bisect.bisect_right(positions, i) for i, op in enumerate(ops)}
    for op in ops:
        # A getitem on a multi-output op stays with the op: tuples never cross a cut.
        if op.target is operator.getitem and isinstance(op.args[0], torch.fx.Node) and op.args[0] in stage_of:
            stage_of[op] = stage_of[op.args[0]]
    plan = Plan(ops=ops, cuts=cuts, stage_of=stage_of)
    _check_no_empty_stage(plan)
    return plan


def _is_real(op: torch.fx.Node) -> bool:
    return op.target is not PIPE_SPLIT_OP and isinstance(op.meta.get("val"), (torch.Tensor, tuple, list))


def _check_no_empty_stage(plan: Plan) -> None:
    counts = [0] * plan.num_stages
    for op, s in plan.stage_of.items():
        if _is_real(op):
            counts[s] += 1
    for s, c in enumerate(counts):
        if c == 0:
            before = plan.cuts[s - 1].label if s > 0 else "the start of forward"
            after = plan.cuts[s].label if s < len(plan.cuts) else "the end of forward"
            raise SplitError(
                f"stage {s} would be empty: nothing is computed between {before} and {after}. "
                f"Remove one of these split points (the model gives at most "
                f"{sum(1 for x in counts if x) } non-empty stages with this spec)"
            )
