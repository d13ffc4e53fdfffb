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
import warnings
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

import torch

from .balance import BalanceReport, balance_warning, cut_positions
from .calls import all_module_paths as _all_module_paths
from .calls import call_tree, module_paths
from .cost import BALANCE_METRICS, node_costs
from .errors import SplitError
from .functions import check_cuts, sealed_calls
from .grad import infer_requires_grad
from .markers import SplitPoint, is_split_marker
from .profile import graph_tensors, node_times
from .trace import Traced

__all__ = ["Cut", "Partition", "plan_stages", "plan_from_cuts", "module_paths", "check_balance", "op_costs"]


@dataclass(frozen=True)
class Cut:
    """A stage boundary before ``ops[index]``; ``label`` says which split point made it."""

    index: int
    label: str


@dataclass
class Partition:
    """Every call node's stage, in graph order."""

    ops: list[torch.fx.Node]
    cuts: list[Cut]
    stage_of: dict[torch.fx.Node, int]
    balance: BalanceReport | None = None  # each stage's cost under the balance metric

    @property
    def num_stages(self) -> int:
        return len(self.cuts) + 1


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


def split_fqns(split_spec: Any) -> list[str] | None:
    """The module FQNs a checked ``split_spec`` cuts at, or None where the cuts are not known
    before tracing (an int balances by measured cost, None follows ``pipe_split()`` marks).

    Example:
        >>> split_fqns({"layers.4": SplitPoint.BEGINNING}), split_fqns(["a", "b"]), split_fqns(4)
        (['layers.4'], ['a', 'b'], None)
    """
    if split_spec is None or isinstance(split_spec, int):
        return None
    return [fqn for fqn, _ in _normalize_spec(split_spec)]


def _normalize_spec(split_spec: Any) -> list[tuple[str, SplitPoint]]:
    if isinstance(split_spec, Mapping):
        items = []
        for fqn, point in split_spec.items():
            if isinstance(point, str):
                try:
                    point = SplitPoint[point.upper()]
                except KeyError:
                    raise SplitError(f"split point for {fqn!r} must be SplitPoint.BEGINNING or END, got {point!r}") from None
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


def check_balance(balance: Any) -> None:
    """Refuse an unknown ``balance=`` before anything is traced.

    Example:
        >>> check_balance("time")
        >>> check_balance("speed")
        Traceback (most recent call last):
        ...
        ValueError: balance must be one of 'flops', 'params', 'time', 'memory'; got 'speed'
    """
    if balance not in BALANCE_METRICS:
        raise ValueError(f"balance must be one of {', '.join(map(repr, BALANCE_METRICS))}; got {balance!r}")


def op_costs(ops: list[torch.fx.Node], balance: str, model: torch.nn.Module, traced: Traced | None = None,
             flat_inputs: Sequence[Any] | None = None) -> list[float]:
    """One cost per op of ``ops`` under ``balance`` (see :func:`pippy_split.pipeline`).

    "flops" needs only the graph; "params" and "memory" need ``traced`` (which graph
    input is which tensor); "time" also needs the example's ``flat_inputs`` and runs
    the graph once on the model's device.

    Example:
        >>> from pippy_split.split.trace import trace_model
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> traced = trace_model(model, (torch.randn(2, 4),))
        >>> ops = [n for n in traced.graph.nodes if n.op == "call_function"]  # linear, relu, linear
        >>> op_costs(ops, "flops", model), op_costs(ops, "params", model, traced)  # params: weight + bias bytes
        ([64.0, 8.0, 64.0], [80.0, 0.0, 80.0])
    """
    check_balance(balance)
    if balance == "flops":
        return node_costs(ops, "flops", {})
    if traced is None:
        raise ValueError(f"balance={balance!r} needs the traced model (traced=)")

    if balance == "time":
        if flat_inputs is None:
            raise ValueError("balance='time' needs the example inputs (flat_inputs=)")
        times = node_times(traced, model, flat_inputs)
        return [t if not _is_free(op) else 0.0 for op, t in zip(ops, times)]
    tensors = graph_tensors(traced, model)
    rg = None
    if balance == "memory":
        seed = {name: t.requires_grad for name, t in tensors.items()}
        seed.update(traced.requires_grad_inputs)
        rg = infer_requires_grad(traced.graph, seed, traced.functions)
    return node_costs(ops, balance, tensors, rg)


def _is_free(op: torch.fx.Node) -> bool:
    return op.target is operator.getitem or is_split_marker(op.target)


def _balanced_cuts(ops: list[torch.fx.Node], n: int, costs: list[float], metric: str,
                   functions: Collection[str] = ()) -> tuple[list[Cut], BalanceReport]:
    if n == 1:
        return [], BalanceReport(metric, (float(sum(costs)),), 1.0)
    tree = call_tree(ops)
    sealed = [(c.first, c.last) for c in sealed_calls(tree, functions)]
    positions, report = cut_positions(ops, n, costs, [_is_real(op) for op in ops], tree, metric, sealed)
    warning = balance_warning(report, n, tree.num_blocks(costs))
    if warning:
        warnings.warn(warning, stacklevel=4)
    return [Cut(p, f"balanced cut {k + 1}") for k, p in enumerate(positions)], report


def _stage_costs(plan: Partition, costs: list[float]) -> tuple[float, ...]:
    out = [0.0] * plan.num_stages
    for op, c in zip(plan.ops, costs):
        out[plan.stage_of[op]] += c
    return tuple(out)


def plan_stages(graph: torch.fx.Graph, split_spec: Any, model: torch.nn.Module, *, balance: str = "flops",
                traced: Traced | None = None, flat_inputs: Sequence[Any] | None = None) -> Partition:
    """Assign every call node of ``graph`` to a stage according to ``split_spec``.

    An int ``split_spec`` is balanced by the ``balance`` cost model (see :func:`op_costs`);
    every plan carries each stage's cost under that model (``plan.balance``).
    """
    ops = [n for n in graph.nodes if n.op == "call_function"]
    functions = traced.functions if traced is not None else {}
    int_spec = isinstance(split_spec, int) and not isinstance(split_spec, bool)
    if int_spec and split_spec < 1:
        raise SplitError(f"split_spec as an int must be >= 1, got {split_spec}")
    costs = None
    if int_spec or balance == "flops" or traced is not None:
        costs = op_costs(ops, balance, model, traced, flat_inputs)
    report = None
    if split_spec is None:
        cuts = [Cut(i, f"pipe_split() #{k}") for k, i in enumerate(i for i, op in enumerate(ops) if is_split_marker(op.target))]
    elif isinstance(split_spec, bool):
        raise SplitError("split_spec must be a dict, a list of FQNs, an int or None, not a bool")
    elif isinstance(split_spec, int):
        assert costs is not None  # worked out above for an int split_spec
        cuts, report = _balanced_cuts(ops, split_spec, costs, balance, functions)
    else:
        cuts = _fqn_cuts(ops, _normalize_spec(split_spec), model)
    check_cuts(cuts, sealed_calls(call_tree(ops), functions), functions)
    plan = plan_from_cuts(ops, cuts)
    if costs is not None:  # what the stages hold (getitems moved), with the search's findings
        plan.balance = BalanceReport(balance, _stage_costs(plan, costs), report.best_ratio if report else None,
                                     report.indivisible if report else None)
    return plan


def plan_from_cuts(ops: list[torch.fx.Node], cuts: list[Cut]) -> Partition:
    """The plan that cuts ``ops`` (a graph's call nodes, in order) before each cut's op;
    an empty stage is a ``SplitError``."""
    positions = [c.index for c in cuts]
    stage_of = {op: bisect.bisect_right(positions, i) for i, op in enumerate(ops)}
    for op in ops:
        # A getitem on a multi-output op stays with the op: tuples never cross a cut.
        if op.target is operator.getitem and isinstance(op.args[0], torch.fx.Node) and op.args[0] in stage_of:
            stage_of[op] = stage_of[op.args[0]]
    plan = Partition(ops=ops, cuts=cuts, stage_of=stage_of)
    _check_no_empty_stage(plan)
    return plan


def _is_real(op: torch.fx.Node) -> bool:
    return not is_split_marker(op.target) and isinstance(op.meta.get("val"), (torch.Tensor, tuple, list))


def _check_no_empty_stage(plan: Partition) -> None:
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
