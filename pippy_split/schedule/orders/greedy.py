"""Greedy list scheduling with split backward: the engine behind zero-bubble orders.

The zero-bubble paper (Qi et al. 2024, section 3) builds its schedules by
simulating time with unit-ish costs and letting each idle worker pick the most
useful ready action, under a cap on activation memory. This module does that
for any placement: time advances in unit steps (F = I = W = 1) and every
rank picks, among its ready actions,

1. an ``F`` or an ``I`` (oldest microbatch first). When both are ready it
   alternates, F after I and I after F (the 1F1B rhythm), or, with
   ``alternate=False``, always takes the ``I`` (it unblocks the rank
   upstream). An ``F`` is only taken while the rank holds fewer than
   ``max_held[rank]`` activations;
2. else the oldest pending ``W`` (weight gradient: nobody waits for it, so it
   fills what would be a bubble, and it frees an activation).

Each stage runs its forwards and its backwards in microbatch order. What an
action waits for is :mod:`..deps`'s rule (the one the simulator and the
validator use), indexed once per stage. Because the result is read off a
feasible execution, the order can never deadlock, whatever the real costs
turn out to be. :func:`best_greedy_order` runs it
with and without strict F/I alternation and keeps the shorter.

Used where no hand-drawn pattern fits (ZB-V with fewer than ``2p - 1``
microbatches). Orders tuned this tightly to unit costs are less forgiving of
real, uneven costs than the paper's regular patterns, which is why those are
preferred wherever they apply.
"""

from __future__ import annotations

from collections import deque

from ..actions import Action, ActionKind, Order
from ..deps import DepIndex, chain_links
from .common import F, I, W

__all__ = ["greedy_split_order", "best_greedy_order", "ALL_VARIANTS_UP_TO"]

_INF = float("inf")


class _State:
    """Queues, completion times and memory of one greedy run (linear chain).

    Work waits in one queue of ``(stage, mb)`` per local stage; a rank looks
    only at the head of each of its queues.
    """

    def __init__(self, stage_rank: dict[int, int], num_ranks: int, m: int, alternate: bool) -> None:
        n = len(stage_rank)
        self.m, self.last, self.alternate = m, n - 1, alternate
        self.f_end = [[_INF] * m for _ in range(n)]
        self.i_end = [[_INF] * m for _ in range(n)]
        # What F and I of each stage wait for (deps.DepIndex: a required I is met by I,
        # the only backward this scheduler emits), as the end-time rows to look up.
        index = DepIndex(chain_links(n), n)
        ends = {F: self.f_end, I: self.i_end}
        self.f_needs = [[ends[k][ds] for ds, k, _ in index.keys(s, F, 0)] for s in range(n)]
        self.i_needs = [[ends[k][ds] for ds, k, _ in index.keys(s, I, 0)] for s in range(n)]
        self.f_queues: list[list[list]] = []  # per rank: [[(stage, mb), ...], head index]
        self.i_queues: list[list[list]] = []
        for r in range(num_ranks):
            # Later stages first, so that a tie on mb goes depth first.
            stages = sorted((s for s, rr in stage_rank.items() if rr == r), reverse=True)
            self.f_queues.append([[[(s, mb) for mb in range(m)], 0] for s in stages])
            self.i_queues.append([[[(s, mb) for mb in range(m)], 0] for s in stages])
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(num_ranks)]
        self.held = [0] * num_ranks
        self.last_was_f = [False] * num_ranks  # was the rank's last F-or-I an F?

    def pick(self, rank: int, t: float, cap: float) -> tuple[ActionKind, list | None, int, int] | None:
        """The best ready ``(kind, queue, stage, mb)`` of ``rank`` at time ``t``."""
        f_needs, i_needs = self.f_needs, self.i_needs
        bi, bi_mb = None, self.m
        for q in self.i_queues[rank]:  # an I needs its own F and the gradient from stage + 1
            seq, pos = q
            if pos < len(seq):
                s, mb = seq[pos]
                if mb < bi_mb and all(row[mb] <= t for row in i_needs[s]):
                    bi, bi_mb = q, mb
        bf, bf_mb = None, self.m
        if self.held[rank] < cap:
            for q in self.f_queues[rank]:  # an F needs the forward of stage - 1
                seq, pos = q
                if pos < len(seq):
                    s, mb = seq[pos]
                    if mb < bf_mb and all(row[mb] <= t for row in f_needs[s]):
                        bf, bf_mb = q, mb
        # 1F1B rhythm (when ``alternate``): after a backward prefer a forward,
        # so that neither direction of the pipeline starves the other.
        if bf is not None and (bi is None or (self.alternate and not self.last_was_f[rank])):
            return (F, bf, *bf[0][bf[1]])
        if bi is not None:
            return (I, bi, *bi[0][bi[1]])
        if self.pending_w[rank]:
            return (W, None, *self.pending_w[rank][0])
        return None

    def run(self, kind: ActionKind, queue: list | None, s: int, mb: int, rank: int, end: float) -> None:
        if kind is F:
            assert queue is not None  # pick gives F and I their queue
            self.f_end[s][mb] = end
            queue[1] += 1
            self.held[rank] += 1
            self.last_was_f[rank] = True
        elif kind is I:
            assert queue is not None
            self.i_end[s][mb] = end
            queue[1] += 1
            self.pending_w[rank].append((s, mb))
            self.last_was_f[rank] = False
        else:
            self.pending_w[rank].popleft()
            self.held[rank] -= 1


def greedy_split_order(
    stage_rank: dict[int, int],
    num_ranks: int,
    n_microbatches: int,
    max_held: list[int],
    alternate: bool = True,
) -> Order:
    """Build an F/I/W order by greedy unit-cost list scheduling.

    Args:
        stage_rank: ``{stage: rank}`` (linear chain of stages).
        num_ranks: ranks in the pipeline.
        n_microbatches: microbatches per step.
        max_held: per rank, the most activations it may hold before it must
            run a ``W``; relaxed only if every rank would otherwise stall.
        alternate: keep the 1F1B rhythm when both an F and an I are ready
            (else the I always goes first).

    Returns:
        ``{rank: [Action, ...]}`` with one F, I and W per ``(stage, mb)``.
    """
    return _to_order(_run(_State(stage_rank, num_ranks, n_microbatches, alternate), max_held)[0])


# Above this many actions only the alternating variant runs, so that large
# pipelines still generate in a fraction of a second.
ALL_VARIANTS_UP_TO = 32_768


def best_greedy_order(stage_rank: dict[int, int], num_ranks: int, n_microbatches: int, max_held: list[int]) -> Order:
    """:func:`greedy_split_order` with and without strict alternation; the one
    with the shorter unit-cost makespan (then smaller peak memory) wins."""
    variants = [True, False] if 3 * len(stage_rank) * n_microbatches <= ALL_VARIANTS_UP_TO else [True]
    best: tuple | None = None
    for alternate in variants:
        steps, makespan, peak = _run(_State(stage_rank, num_ranks, n_microbatches, alternate), max_held)
        if best is None or (makespan, peak) < best[:2]:
            best = (makespan, peak, steps)
    assert best is not None
    return _to_order(best[2])


def _run(st: _State, max_held: list[int]) -> tuple[list[list[tuple]], float, int]:
    """Greedy event loop in unit steps (every action costs 1, so every rank is
    free again at the next step). Returns ``(kind, stage, mb)`` lists per rank,
    the makespan and the peak held activations."""
    num_ranks = len(max_held)
    steps: list[list[tuple]] = [[] for _ in range(num_ranks)]
    remaining = 3 * len(st.f_end) * st.m
    peak, t = 0, 0.0
    while remaining:
        ran = 0
        for rank in range(num_ranks):
            choice = st.pick(rank, t, max_held[rank])
            if choice is not None:
                st.run(*choice, rank, t + 1.0)
                steps[rank].append((choice[0], choice[2], choice[3]))
                ran += 1
        if not ran:  # every rank idle or capped: let the first runnable one exceed its cap
            for rank in range(num_ranks):
                choice = st.pick(rank, t, _INF)
                if choice is not None:
                    st.run(*choice, rank, t + 1.0)
                    steps[rank].append((choice[0], choice[2], choice[3]))
                    ran = 1
                    break
            if not ran:
                raise RuntimeError("greedy scheduler stalled with no ready action; this is a bug")
        remaining -= ran
        peak = max(peak, max(st.held))
        t += 1.0
    return steps, t, peak


def _to_order(steps: list[list[tuple]]) -> Order:
    return {r: [Action(s, kind, mb) for kind, s, mb in acts] for r, acts in enumerate(steps)}
