"""Interleaved zero bubble (ZB-H1 on looped placement): 1F1B with the backward
split into input-gradient ``I`` and weight-gradient ``W``, the ``W``s moved
into what would be bubbles.

Paper: Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024
(arXiv:2401.10241), section 3.1 (ZB-H1), applied to Megatron's interleaved
order (:mod:`.interleaved_1f1b`) for ``v > 1`` stages per rank.

Placement: ``"loop"``, any ``stages_per_rank = v >= 1`` (rank ``r`` holds
stages ``r, r + p, ...``). Rank ``r`` visits ``(stage, mb)`` in Megatron's
virtual order, warms up with ``(v - 1) * g + (p - 1 - r)`` forwards (``g`` =
first microbatch group; ZB-H1 needs one forward per hop less than 1F1B, as
``I`` alone comes back sooner), then runs ``F I`` pairs. Its ``W``s trail
its ``I``s by ``r`` places: late ranks postpone weight work into the bubbles
at the end, early ranks do it at once. That keeps every rank at ``v * p``
stage activations (``p`` full microbatches, 1F1B's peak on rank 0). With
F=I=W the bubble is about a third of 1F1B's. Any ``n_microbatches >= 1``.

p=2, v=1, m=3, unit costs (F=I=W=1)::

    rank 0  F0  F1  .   I0  W0  F2  I1  W1  I2  W2
    rank 1  .   F0  I0  F1  I1  W0  F2  I2  W1  W2
"""

from __future__ import annotations

from ..actions import Order
from ..placement import Style
from .common import ZB_PAPER, RankOps, check_sizes
from .interleaved_1f1b import microbatch_groups, virtual_sequence

__all__ = ["compute_order"]

# What this family needs, as data (read by the registry in orders/__init__.py):
PLACEMENT: Style = "loop"
STAGES_PER_RANK: int | None = None  # None: any count >= MIN_STAGES_PER_RANK
MIN_STAGES_PER_RANK = 1
SPLIT_BACKWARD = True  # whether the order uses I and W
PAPER = ZB_PAPER + ", ZB-H1"


def compute_order(num_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Order:
    """ZB-H1-style order on looped placement (F, I, W actions).

    Example:
        >>> [str(a) for a in compute_order(2, 2)[1]]
        ['1F0', '1I0', '1F1', '1I1', '1W0', '1W1']
    """
    check_sizes("InterleavedZeroBubble", num_ranks, n_microbatches, stages_per_rank)
    return {r: _rank_order(r, num_ranks, n_microbatches, stages_per_rank) for r in range(num_ranks)}


def _rank_order(rank: int, p: int, m: int, v: int) -> list:
    groups = microbatch_groups(m, p)
    # Each stage's microbatches come in increasing order in these sequences, so
    # RankOps' per-stage counters give back the right mb.
    fwd = [s for s, _ in virtual_sequence(rank, p, groups, v, backward=False, style=PLACEMENT)]
    bwd = [s for s, _ in virtual_sequence(rank, p, groups, v, backward=True, style=PLACEMENT)]
    warmup = min((v - 1) * len(groups[0]) + (p - 1 - rank), len(fwd))
    ops = RankOps()
    for stage in fwd[:warmup]:
        ops.forward(stage)
    for j, stage in enumerate(bwd):
        if warmup + j < len(fwd):
            ops.forward(fwd[warmup + j])
        ops.backward(stage, split=True)
        if j >= rank:  # W trails I by `rank` places
            ops.weight()
    while ops.deferred_w:
        ops.weight()
    return ops.ops
