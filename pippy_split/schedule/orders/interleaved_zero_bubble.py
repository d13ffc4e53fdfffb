"""Interleaved zero bubble (ZB-H1 on looped placement): 1F1B with the backward
split into input-gradient ``I`` and weight-gradient ``W``, the ``W``s moved
into what would be bubbles.

Paper: Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024
(arXiv:2401.10241), sections 3 (ZB-H1, automatic scheduling) and 4.

Placement: ``"loop"``, any ``stages_per_rank = v >= 1`` (rank ``r`` holds
stages ``r, r + p, ...``). Memory is ZB-H1's: every rank holds at most
``v * p`` stage activations (``p`` full microbatches, 1F1B's peak on rank 0).
The order comes from :mod:`.greedy`: forwards and input-backwards alternate
(1F1B rhythm) under the memory cap, ``W`` fills the gaps; ``(stage, mb)`` are
visited in Megatron's interleaved order, or freely, whichever is shorter. With F=I=W the bubble is about a third of 1F1B's.

p=2, v=1, m=3, unit costs (F=I=W=1)::

    rank 0  F0  F1  .   I0  W0  F2  I1  W1  I2  W2
    rank 1  .   F0  I0  F1  I1  W0  F2  I2  W1  W2
"""

from __future__ import annotations

from ..actions import Order
from ..placement import stage_to_rank
from .common import check_sizes
from .greedy import best_greedy_order
from .interleaved_1f1b import microbatch_groups, virtual_sequence

__all__ = ["compute_order"]


def compute_order(num_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Order:
    """ZB-H1-style order on looped placement (F, I, W actions).

    Example:
        >>> [str(a) for a in compute_order(2, 2)[1]]
        ['1F0', '1I0', '1F1', '1I1', '1W0', '1W1']
    """
    check_sizes("InterleavedZeroBubble", num_ranks, n_microbatches, stages_per_rank)
    placement = stage_to_rank(num_ranks * stages_per_rank, num_ranks, "loop")
    cap = stages_per_rank * num_ranks
    # Visit (stage, mb) in Megatron's interleaved order; the greedy only decides
    # how F, I and W interleave.
    groups = microbatch_groups(n_microbatches, num_ranks)
    sequences = {
        r: (
            virtual_sequence(r, num_ranks, groups, stages_per_rank, backward=False),
            virtual_sequence(r, num_ranks, groups, stages_per_rank, backward=True),
        )
        for r in range(num_ranks)
    }
    # Most often best first: it is the only one run for large pipelines.
    if stages_per_rank == 1:
        variants = [(None, True), (None, False)]
    elif n_microbatches % num_ranks == 0:
        variants = [(sequences, False), (sequences, True), (None, True), (None, False)]
    else:
        variants = [(None, True), (sequences, True), (sequences, False), (None, False)]
    return best_greedy_order(placement, num_ranks, n_microbatches, [cap] * num_ranks, variants)
