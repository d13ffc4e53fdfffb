"""Interleaved 1F1B (Megatron-LM virtual pipeline): 1F1B over ``v`` model
chunks per rank, microbatches taken in groups of ``p`` per chunk (depth first).

Paper: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC 2021, section 2.2.2.

Placement: ``"loop"``, ``stages_per_rank = v >= 2`` (rank ``r`` holds stages
``r, r + p, ...``). Each rank walks a *virtual* forward sequence: chunk 0 for
microbatches ``0..p-1``, chunk 1 for the same group, ..., then the next group;
backwards walk the chunks in reverse. Rank ``r`` warms up with
``(v - 1) * g + 2 * (p - 1 - r)`` forwards (``g`` = first group size), then
alternates F and B. The bubble shrinks by ``v`` against 1F1B.

Microbatch counts that are not a multiple of ``p`` work: groups are then
near-equal and at least ``p`` wide (see :func:`microbatch_groups`).

p=2, v=2 (stages 0,2 on rank 0; 1,3 on rank 1), m=2, F=1, B=2; ``'`` marks
the second local stage::

    rank 0  F0  F1  F0' F1' .   .   B0' B0' .   B1' B1' B0  B0  B1  B1
    rank 1  .   F0  F1  F0' B0' B0' F1' B1' B1' B0  B0  B1  B1
"""

from __future__ import annotations

from ..actions import Order
from ..placement import Style
from .common import Action, B, F, check_sizes, local_stages

__all__ = ["compute_order", "microbatch_groups", "virtual_sequence"]

# What this family needs, as data (read by the registry in orders/__init__.py):
PLACEMENT: Style = "loop"
STAGES_PER_RANK: int | None = None  # None: any count >= MIN_STAGES_PER_RANK
MIN_STAGES_PER_RANK = 2
SPLIT_BACKWARD = False  # whether the order uses I and W
PAPER = "Narayanan et al. 2021, Megatron-LM (SC)"


def microbatch_groups(n_microbatches: int, num_ranks: int) -> list[range]:
    """Split microbatches into ``max(1, m // p)`` consecutive groups of near-equal size.

    Every group has at least ``p`` microbatches (when ``m >= p``) and larger
    groups come first. A group smaller than ``p`` after a full one would let a
    rank start a later chunk's forward that the next rank cannot feed before it
    needs this rank's backward: a deadlock. Big-first groups avoid it because
    the warm-up is sized from the first (largest) group.

    Example:
        >>> [list(g) for g in microbatch_groups(9, 4)]
        [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    """
    rounds = max(1, n_microbatches // num_ranks)
    base, extra = divmod(n_microbatches, rounds)
    groups, lo = [], 0
    for i in range(rounds):
        size = base + (1 if i < extra else 0)
        groups.append(range(lo, lo + size))
        lo += size
    return groups


def compute_order(num_ranks: int, n_microbatches: int, stages_per_rank: int = 2) -> Order:
    """Megatron interleaved 1F1B order.

    Example:
        >>> [str(a) for a in compute_order(2, 2, 2)[1]]
        ['1F0', '1F1', '3F0', '3B0', '3F1', '3B1', '1B0', '1B1']
    """
    check_sizes("Interleaved1F1B", num_ranks, n_microbatches, stages_per_rank, min_stages=2)
    return {r: _rank_order(r, num_ranks, n_microbatches, stages_per_rank) for r in range(num_ranks)}


def virtual_sequence(rank: int, p: int, groups: list[range], v: int, backward: bool,
                     style: Style = PLACEMENT) -> list[tuple[int, int]]:
    """``(stage, mb)`` in the order this rank visits them: per group, chunk by chunk
    (chunk ``c`` is the rank's ``c``-th stage under placement ``style``)."""
    stages = local_stages(p, v, style)[rank]
    chunks = stages[::-1] if backward else stages
    return [(s, mb) for group in groups for s in chunks for mb in group]


def _rank_order(rank: int, p: int, m: int, v: int) -> list[Action | None]:
    groups = microbatch_groups(m, p)
    fwd = [Action(s, F, mb) for s, mb in virtual_sequence(rank, p, groups, v, backward=False)]
    bwd = [Action(s, B, mb) for s, mb in virtual_sequence(rank, p, groups, v, backward=True)]
    total = len(fwd)
    # Warm up until the first backward (last chunk, mb 0) can have come back
    # around the ring: the other chunks of the first group, plus 2 per hop.
    warmup = min((v - 1) * len(groups[0]) + 2 * (p - 1 - rank), total)
    ops: list[Action | None] = list(fwd[:warmup])
    for i in range(total - warmup):
        ops += [fwd[warmup + i], bwd[i]]
    ops += bwd[total - warmup :]
    return ops
