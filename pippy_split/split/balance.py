"""Balance an int-N split: choose N-1 cut positions among the graph's ops.

Part of the partition step of split → Pipe (``partition.py`` calls it for an int
``split_spec``). Input: the graph's call nodes in order, one cost per op (FLOPs,
parameter bytes, memory bytes or measured time, see ``cost.py``/``profile.py``), and
the module calls around each op (``calls.py``). Output: cut positions and a
:class:`BalanceReport`.

A cut may fall before any op, at any module depth, as long as every value crossing
it can travel between stages (a tensor or a size that does not depend on data, not
a tuple waiting for its ``getitem``, not a value a later op writes in place). The
search minimises the costliest stage; then, allowing that stage to cost up to
``CUT_SLACK`` of an ideal stage more, it picks the cuts that split the fewest module
calls (a repeated block's boundary splits none) and send the fewest bytes. Where the
model runs one to two repeated blocks a stage, cuts at block boundaries only are taken
if their costliest stage is within ``BLOCK_SLACK`` of a block of that best (a cut inside a
block would only move part of one block).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import sympy
import torch

from .calls import CallTree
from .cost import mutated_args, value_bytes
from .errors import SplitError

__all__ = ["BalanceReport", "TARGET_RATIO", "CUT_SLACK", "BLOCK_SLACK", "cut_positions", "legal_cuts",
           "balance_warning"]

TARGET_RATIO = 1.15
"""The costliest stage may cost this much times the ideal (total / N) without a warning."""

CUT_SLACK = 0.05
"""How much costlier than the best-balanced split (as a fraction of an ideal stage) the
chosen split may be to cut at block boundaries instead of inside modules."""

BLOCK_SLACK = 0.5
"""Where the model runs at least one repeated block a stage and fewer than two, a split at
block boundaries only is taken if its costliest stage costs at most this fraction of a block
(the median block of the model's repeated blocks) more than the best any cuts reach (with fewer
blocks than stages, some stage would hold no block at all). With about a block a stage, a cut
inside a block can only move part of one block to a neighbour, and it splits the block's module
call (per-block FSDP2, hooks, activation checkpointing, a stage module calling the user's block),
so it is worth it only where whole blocks are off by more than that: torchtitan's DeepSeek-V3 (4
blocks, its dense first layer costlier than a MoE layer) into 4 stages cuts between blocks, and
the imbalance warning names the best ratio. With two blocks a stage or more the costliest stage
stays within ``TARGET_RATIO`` where cuts can reach it (9 equal blocks into 4 stages cut inside a
block: 3 blocks against 2.25)."""

_UNITS = {"flops": "FLOPs", "params": "bytes", "memory": "bytes", "time": "s"}


@dataclass(frozen=True)
class BalanceReport:
    """Each stage's cost under the balance metric, and how far the split is from even.

    Attributes:
        metric: "flops" | "params" | "time" | "memory".
        stage_costs: cost of each stage (FLOPs, bytes or seconds; see ``unit``).
        best_ratio: the lowest ``ratio`` any cuts could reach (set for an int split).
        indivisible: the costliest piece no cut can enter, as ``(where, cost)``.
    """

    metric: str
    stage_costs: tuple[float, ...]
    best_ratio: float | None = None
    indivisible: tuple[str, float] | None = None

    @property
    def unit(self) -> str:
        return _UNITS[self.metric]

    @property
    def total(self) -> float:
        return sum(self.stage_costs)

    @property
    def ideal(self) -> float:
        """An even stage: total / N."""
        return self.total / max(len(self.stage_costs), 1)

    @property
    def shares(self) -> tuple[float, ...]:
        """Each stage's fraction of the total (0.25 = 25%)."""
        total = self.total
        return tuple(c / total if total > 0 else 0.0 for c in self.stage_costs)

    @property
    def ratio(self) -> float:
        """The costliest stage over the ideal: 1.0 is perfectly even."""
        return max(self.stage_costs) / self.ideal if self.ideal > 0 else 1.0


def _bad_value(val: object, known: set) -> bool:
    """True for a value that cannot cross a stage boundary."""
    dims: tuple[int | torch.SymInt, ...]
    if isinstance(val, torch.Tensor):
        dims = val.shape
    elif isinstance(val, torch.SymInt):
        dims = (val,)
    else:
        return True  # a tuple (its getitems must stay with it), None, a Python value
    for d in dims:
        if isinstance(d, torch.SymInt) and not sympy.sympify(d.node.expr).free_symbols <= known:
            return True  # its size depends on data
    return False


def legal_cuts(ops: list[torch.fx.Node]) -> tuple[list[bool], list[float]]:
    """For each position 0..n (a cut before ``ops[i]``): may a cut fall there, and how
    many bytes would cross it.

    Example:
        >>> from pippy_split.split.trace import trace_model
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> ops = [n for n in trace_model(model, (torch.randn(2, 4),)).graph.nodes if n.op == "call_function"]
        >>> legal_cuts(ops)  # positions 0..3: before linear, relu, linear, and after; a (2, 4) fp32 tensor crosses
        ([True, True, True, True], [0.0, 32.0, 32.0, 0.0])
    """
    n = len(ops)
    index = {op: i for i, op in enumerate(ops)}
    known: set = set()
    graph = ops[0].graph if ops else None
    for node in graph.nodes if graph is not None else ():
        val = node.meta.get("val") if node.op == "placeholder" else None
        dims = val.shape if isinstance(val, torch.Tensor) else (val,) if isinstance(val, torch.SymInt) else ()
        for d in dims:
            if isinstance(d, torch.SymInt):
                known |= sympy.sympify(d.node.expr).free_symbols
    bad = [0] * (n + 2)
    crossing = [0.0] * (n + 2)

    def mark(lo: int, hi: int, diff: list, amount: float) -> None:  # positions lo..hi inclusive
        if lo <= hi:
            diff[lo] += amount
            diff[hi + 1] -= amount

    for a, op in enumerate(ops):
        users = [index.get(u, n) for u in op.users]  # the output node: read by the last stage
        if not users:
            continue
        last = min(max(users), n - 1)
        val = op.meta.get("val")
        if _bad_value(val, known):
            mark(a + 1, last, bad, 1)
        else:
            mark(a + 1, last, crossing, float(value_bytes(val)))
    for i, op in enumerate(ops):
        for written in mutated_args(op):
            if written in index:  # an in-place write stays with the value's producer
                mark(index[written] + 1, i, bad, 1)
    legal, size = [], []
    b = c = 0.0
    for i in range(n + 1):
        b += bad[i]
        c += crossing[i]
        legal.append(b == 0)
        size.append(c)
    return legal, size


def _groups(n: int, legal: list[bool], real: list[bool], pen: list[float]) -> list[int]:
    """Start positions of the pieces between usable cuts (each holding a real op);
    where two usable cuts have only non-real ops between them, the cheaper one is kept."""
    starts = [0]
    has_real = False
    for i in range(n):
        if i > 0 and legal[i]:
            if has_real:
                starts.append(i)
                has_real = False
            elif len(starts) > 1 and pen[i] < pen[starts[-1]]:
                starts[-1] = i
        has_real = has_real or real[i]
    if not has_real and len(starts) > 1:
        starts.pop()
    return starts


def _min_stages(costs: list[float], bound: float) -> int:
    parts, acc = 1, 0.0
    for c in costs:
        if c > bound:
            return len(costs) + 1
        if acc + c > bound:
            parts, acc = parts + 1, c
        else:
            acc += c
    return parts


def _best_bound(costs: list[float], n: int) -> float:
    """The least possible cost of the costliest of ``n`` contiguous stages."""
    total = sum(costs)
    lo, hi = max(max(costs), total / n), total
    for _ in range(100):
        if hi - lo <= 1e-9 * max(hi, 1e-30):
            break
        mid = (lo + hi) / 2
        if _min_stages(costs, mid) <= n:
            hi = mid
        else:
            lo = mid
    return hi


def _cheapest(costs: list[float], pens: list[float], n: int, bound: float) -> tuple[float, list[int]]:
    """Least total cut penalty splitting ``costs`` into ``n`` stages of at most ``bound``;
    ``pens[j]`` is the penalty of a cut before group j. Returns (penalty, cut groups)."""
    m = len(costs)
    bound *= 1 + 1e-9
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    prev = [0.0] + [inf] * m  # prev[i]: best penalty covering groups[:i] with k-1 stages
    back: list[list[int]] = []
    for k in range(1, n + 1):
        cur, arg = [inf] * (m + 1), [-1] * (m + 1)
        window: deque[int] = deque()
        lo = 0
        for j in range(1, m + 1):
            i = j - 1
            if prev[i] < inf:
                while window and prev[window[-1]] >= prev[i]:
                    window.pop()
                window.append(i)
            while prefix[j] - prefix[lo] > bound:
                lo += 1
            while window and window[0] < lo:
                window.popleft()
            if window and (j == m) == (k == n):
                best = window[0]
                cur[j] = prev[best] + (pens[j] if j < m else 0.0)
                arg[j] = best
        back.append(arg)
        prev = cur
    if prev[m] == inf:
        return inf, []
    cuts, j = [], m
    for k in range(n, 0, -1):
        j = back[k - 1][j]
        if j > 0:
            cuts.append(j)
    return prev[m], sorted(cuts)


def _most_even(costs: list[float], pens: list[float], n: int, best: float, allowed: float,
               ideal: float) -> list[int]:
    """The most even split among those with the cleanest cuts: the least penalty of
    :func:`_cheapest` with stages of at most ``allowed``, then the bound bisected down
    towards ``best`` (to a thousandth of ``ideal``) while that penalty holds. Returns the
    cut groups."""
    penalty, groups = _cheapest(costs, pens, n, allowed)
    lo, hi = best, allowed
    for _ in range(12):
        if hi - lo <= 1e-3 * max(ideal, 1e-30):
            break
        mid = (lo + hi) / 2
        p, g = _cheapest(costs, pens, n, mid)
        if p <= penalty + 1e-9:
            hi, groups = mid, g
        else:
            lo = mid
    return groups


def cut_positions(ops: list[torch.fx.Node], n: int, costs: list[float], real: list[bool], tree: CallTree,
                  metric: str = "flops", sealed: Sequence[tuple[int, int]] = ()) -> tuple[list[int], BalanceReport]:
    """Cut ``ops`` into ``n`` stages: positions (cut before ``ops[p]``) and the report.

    Args:
        ops: the graph's call nodes in order.
        n: number of stages (>= 2).
        costs: one cost per op (any unit).
        real: per op, whether it counts towards a stage being non-empty.
        tree: the module calls of ``ops`` (``calls.call_tree``).
        metric: the name of the cost model, for the report.
        sealed: ``(first, last)`` op spans no cut may enter (modules that apply a custom
            autograd Function).

    Example:
        >>> from pippy_split import zoo
        >>> from pippy_split.split.calls import call_tree
        >>> from pippy_split.split.trace import trace_model
        >>> model = zoo.get("mlp_stack", d=8).model  # 8 residual layers: linear, tanh, add each
        >>> ops = [n for n in trace_model(model, (torch.randn(2, 8),)).graph.nodes if n.op == "call_function"]
        >>> positions, report = cut_positions(ops, 4, [1.0] * len(ops), [True] * len(ops), call_tree(ops))
        >>> positions, report.ratio <= TARGET_RATIO
        ([6, 12, 18], True)
    """
    legal, crossing = legal_cuts(ops)
    for first, last in sealed:
        legal[first + 1:last + 1] = [False] * (last - first)
    calls_split = tree.cut_penalties()
    usable = [crossing[i] for i in range(1, len(ops)) if legal[i]]
    scale = max(usable, default=0.0) or 1.0
    # Module calls split first; bytes sent decide between equally clean cuts.
    pen = [calls_split[i] + crossing[i] / scale for i in range(len(ops) + 1)]
    starts = _groups(len(ops), legal, real, pen)
    if len(starts) < n:
        raise SplitError(
            f"cannot balance into {n} stages: the graph has only {len(starts)} pieces that a cut can separate "
            f"(a cut never separates a value from an in-place write to it, a tuple from its getitem, or a "
            f"value whose size depends on data, nor enters a module that applies a custom autograd Function)"
        )
    bounds = starts + [len(ops)]
    group_costs = [sum(costs[bounds[g]:bounds[g + 1]]) for g in range(len(starts))]
    group_pens = [pen[s] for s in starts]
    total = sum(group_costs)
    ideal = total / n
    best = _best_bound(group_costs, n) if total > 0 else 0.0
    allowed = best + CUT_SLACK * ideal
    if best <= TARGET_RATIO * ideal:
        allowed = min(allowed, TARGET_RATIO * ideal)
    groups = _most_even(group_costs, group_pens, n, best, allowed, ideal)
    if n <= tree.num_blocks(costs) < 2 * n:  # one to two blocks a stage: whole blocks, unless BLOCK_SLACK off
        whole = _whole_blocks(group_costs, group_pens, [calls_split[s] == 0 for s in starts], n,
                              best + BLOCK_SLACK * _block_cost(tree, costs), ideal)
        groups = whole if whole is not None else groups
    positions = [starts[g] for g in groups]
    edges = [0] + positions + [len(ops)]
    stage_costs = tuple(sum(costs[edges[s]:edges[s + 1]]) for s in range(n))
    worst = max(range(len(group_costs)), key=group_costs.__getitem__)
    where = _describe(tree, bounds[worst], bounds[worst + 1], ops)
    report = BalanceReport(metric, stage_costs, best / ideal if ideal > 0 else 1.0, (where, group_costs[worst]))
    return positions, report


def _block_cost(tree: CallTree, costs: list[float]) -> float:
    """The median cost of one of the model's repeated blocks (the class of block whose runs hold
    the most cost, as :meth:`CallTree.num_blocks` counts them); 0 for a model without."""
    by_class: dict[str, list[float]] = {}
    for run in tree.runs:
        by_class.setdefault(run[0].cls, []).extend(sum(costs[c.first:c.last + 1]) for c in run)
    if not by_class:
        return 0.0
    blocks = sorted(max(by_class.values(), key=sum))
    return blocks[len(blocks) // 2]


def _whole_blocks(costs: list[float], pens: list[float], clean: list[bool], n: int, bound: float,
                  ideal: float) -> list[int] | None:
    """The most even split into ``n`` stages cutting only before groups whose start splits no
    module call (``clean``: a repeated block's boundary), if its costliest stage costs at most
    ``bound``; the cut groups, or None."""
    keep = [0] + [g for g in range(1, len(costs)) if clean[g]]
    if len(keep) < n or bound <= 0:
        return None
    merged = [sum(costs[a:b]) for a, b in zip(keep, keep[1:] + [len(costs)])]
    best = _best_bound(merged, n)
    if best > bound * (1 + 1e-9):
        return None
    chosen = _most_even(merged, [pens[g] for g in keep], n, best, best + CUT_SLACK * ideal, ideal)
    return [keep[j] for j in chosen]


def _describe(tree: CallTree, lo: int, hi: int, ops: list[torch.fx.Node]) -> str:
    """The innermost module call holding all of ops[lo:hi], or the ops' names."""
    common = list(tree.stacks[lo])
    for st in tree.stacks[lo + 1:hi]:
        k = 0
        while k < min(len(common), len(st)) and common[k] == st[k]:
            k += 1
        del common[k:]
    if common:
        call = tree.calls[common[-1]]
        repeat = call.key.rsplit("@", 1)[1] if "@" in call.key else ""
        return f"module {call.path!r}" + (f" (call {int(repeat) + 1})" if repeat.isdigit() else "")
    names = [op.name for op in ops[lo:hi]]
    return "top-level ops " + ", ".join(names[:3]) + (" …" if len(names) > 3 else "")


def balance_warning(report: BalanceReport, n: int, num_blocks: int) -> str | None:
    """The warning for a split whose costliest stage exceeds ``TARGET_RATIO`` x the ideal."""
    if report.ratio <= TARGET_RATIO:
        return None
    worst = max(range(n), key=report.stage_costs.__getitem__)
    msg = (f"pipeline(model, {n}, balance={report.metric!r}): stage {worst} costs {report.ratio:.2f}x an even "
           f"stage (total / {n}); the best any cuts can do is {report.best_ratio:.2f}x")
    if report.indivisible is not None:
        where, cost = report.indivisible
        msg += f". The costliest piece no cut can enter is {where} ({cost / report.total:.0%} of the total)"
    if num_blocks < 2 * n:
        msg += f"; the model has {num_blocks} repeated blocks, fewer than 2 x {n}"
    return msg + ". Use fewer stages, or pass split points by FQN."

