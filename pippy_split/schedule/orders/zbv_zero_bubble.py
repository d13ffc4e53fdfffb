"""ZB-V: zero bubble on a V placement, two stages per rank.

Paper: Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024
(arXiv:2401.10241), section 6 ("ZB-V", figure 8).

Placement: ``"v"``, exactly 2 stages per rank: rank ``r`` holds chunk 0 =
stage ``r`` and chunk 1 = stage ``2p - 1 - r``, so the first and the last
stage share rank 0 and the loss gradient turns around without a hop. Memory is
1F1B's peak: ``2p`` half-size stage activations per rank. With F=I=W and
``m >= 2p - 1`` the paper's pattern (phases below, counts for rank ``r``) has
no bubble in its steady state::

    1  F0                    x 2(p - r) - 1
    2  F1 F0                 x r
    3  F1 I1 W1              x p - r
    4  F0 I0 W0 F1 I1 W1     until every forward is done
    5  I0 I1                 x r            input gradients first ...
    6  I0 W0                 x p - r
    7  W                     the rest       ... weights fill behind them

For fewer microbatches the pattern would idle on missing ones, so the order
comes from the greedy scheduler of :mod:`.greedy` instead (F and I alternate
under the same memory cap, ``W`` fills gaps), whichever is shorter.

p=2 (stages 0,3 on rank 0; 1,2 on rank 1), m=4, F=I=W=1; ``'`` marks chunk 1
(stages 2 and 3)::

    rank 0  F0  F1  F2  F0' I0' W0' F1' I1' W1' F3  I0  W0  F2' I2' W2' I1  W1  F3' I3' W3' I2  W2  I3  W3
    rank 1  .   F0  F0' F1  F1' I0' W0' F2  I0  W0  F2' I1' W1' F3  I1  W1  F3' I2' W2' I2  I3' I3  W2  W3' W3
"""

from __future__ import annotations

from ..actions import Order
from ..placement import Style, stage_to_rank
from ..simulate import simulate
from .common import ZB_PAPER, RankOps, check_sizes, local_stages
from .greedy import best_greedy_order

__all__ = ["compute_order"]

# What this family needs, as data (read by the registry in orders/__init__.py):
PLACEMENT: Style = "v"
STAGES_PER_RANK: int | None = 2  # None: any count >= MIN_STAGES_PER_RANK
MIN_STAGES_PER_RANK = 2
SPLIT_BACKWARD = True  # whether the order uses I and W
PAPER = ZB_PAPER + ", ZB-V"


def compute_order(num_ranks: int, n_microbatches: int, stages_per_rank: int = 2) -> Order:
    """ZB-V order (F, I, W actions) on V placement, any ``n_microbatches >= 1``.

    Example:
        >>> [str(a) for a in compute_order(1, 1)[0]]
        ['0F0', '1F0', '1I0', '1W0', '0I0', '0W0']
    """
    check_sizes("ZBVZeroBubble", num_ranks, n_microbatches, stages_per_rank, exact_stages=2)
    chunks = local_stages(num_ranks, stages_per_rank, PLACEMENT)
    pattern = {r: _rank_pattern(r, num_ranks, n_microbatches, *chunks[r]) for r in range(num_ranks)}
    if n_microbatches >= 2 * num_ranks - 1:
        return pattern
    # Too few microbatches for the pattern's steady state: let the greedy fill
    # the holes, and keep it only where it is really shorter.
    placement = stage_to_rank(stages_per_rank * num_ranks, num_ranks, PLACEMENT)
    greedy = best_greedy_order(placement, num_ranks, n_microbatches, [2 * num_ranks] * num_ranks)
    return greedy if simulate(greedy).makespan < simulate(pattern).makespan else pattern


def _rank_pattern(r: int, p: int, m: int, c0: int, c1: int) -> list:
    n = max(m, 2 * p - 1)  # the pattern is drawn for >= 2p - 1 microbatches
    ops = RankOps(m)  # ... and actions on the missing ones are dropped
    for _ in range(2 * (p - r) - 1):  # 1
        ops.forward(c0)
    for _ in range(r):  # 2
        ops.forward(c1)
        ops.forward(c0)
    for _ in range(p - r):  # 3
        ops.forward(c1)
        ops.backward(c1, split=True)
        ops.weight()
    while ops.forwards_done(c0) < n or ops.forwards_done(c1) < n:  # 4
        if ops.forwards_done(c0) < n:
            ops.forward(c0)
        ops.backward(c0, split=True)
        ops.weight()
        ops.forward(c1)
        ops.backward(c1, split=True)
        ops.weight()
    for _ in range(r):  # 5
        ops.backward(c0, split=True)
        ops.backward(c1, split=True)
    for _ in range(p - r):  # 6
        ops.backward(c0, split=True)
        ops.weight()
    while ops.deferred_w:  # 7
        ops.weight()
    return ops.ops
