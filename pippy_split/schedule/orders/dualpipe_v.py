"""DualPipeV: DeepSeek's DualPipe folded onto ``p`` ranks ("cut-in-half").

Paper: DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, section
3.2.1 (DualPipe); the V ("cut-in-half") variant as published in
github.com/deepseek-ai/DualPipe (``dualpipev.py``).

Placement: ``"v"``, exactly 2 stages per rank: rank ``r`` holds chunk 0 =
stage ``r`` and chunk 1 = stage ``2p - 1 - r``. Needs ``m >= 2p - 1``
microbatches. Each rank runs eight phases (counts for rank ``r``)::

    1  F0                 x 2(p - r - 1)   warm up chunk 0
    2  F0 F1              x r + 1
    3  I1 W F1            x p - r - 1      zero bubble: W right behind its I
    4  F0 B1 F1 B0        x m - 2p + r + 1 main phase (F/B pairs DeepSeek overlaps)
    5  B1 F1 B0           x p - r - 1
    6  B1 B0              x r + 1          second half split into I (W deferred)
    7  W B0               x p - r - 1      (B0 split into I once phase 6 switched)
    8  W                  x r + 1          drain deferred weight gradients

We emit the F/B pairs one after the other (forward first), not overlapped in
one step. ``W`` always takes the oldest deferred weight gradient.

p=2 (stages 0,3 on rank 0; 1,2 on rank 1), m=4, F=I=W=1, B=2; ``'`` marks
chunk 1::

    rank 0  F0  F1  F2  F0' I0' W0' F1' F3  B1' B1' F2' B0  B0  B2' B2' F3' .   B1  B1  B3' B3' I2  W2  I3  W3
    rank 1  .   F0  F0' F1  F1' F2  B0' B0' F2' B0  B0  F3  B1' B1' F3' B1  B1  B2' B2' B2  B2  I3' I3  W3' W3
"""

from __future__ import annotations

from ..actions import Order
from ..placement import Style
from .common import Action, RankOps, check_sizes, local_stages

__all__ = ["compute_order"]

# What this family needs, as data (read by the registry in orders/__init__.py):
PLACEMENT: Style = "v"
STAGES_PER_RANK: int | None = 2  # None: any count >= MIN_STAGES_PER_RANK
MIN_STAGES_PER_RANK = 2
SPLIT_BACKWARD = True  # whether the order uses I and W
PAPER = "DeepSeek-AI 2024, DeepSeek-V3 Technical Report (DualPipe)"


def compute_order(num_ranks: int, n_microbatches: int, stages_per_rank: int = 2) -> Order:
    """DualPipeV order (F, B, I, W actions) on V placement.

    Example:
        >>> [str(a) for a in compute_order(1, 2)[0]]
        ['0F0', '1F0', '0F1', '1B0', '1F1', '0B0', '1B1', '0I1', '0W1']
    """
    check_sizes("DualPipeV", num_ranks, n_microbatches, stages_per_rank, exact_stages=2)
    if n_microbatches < 2 * num_ranks - 1:
        raise ValueError(
            f"DualPipeV needs n_microbatches >= 2 * num_ranks - 1 = {2 * num_ranks - 1}, got {n_microbatches}"
        )
    stages = local_stages(num_ranks, stages_per_rank, PLACEMENT)
    return {r: _rank_order(r, num_ranks, n_microbatches, *stages[r]) for r in range(num_ranks)}


def _rank_order(r: int, p: int, m: int, s0: int, s1: int) -> list[Action | None]:
    ops = RankOps()
    for _ in range(2 * (p - r - 1)):  # 1
        ops.forward(s0)
    for _ in range(r + 1):  # 2
        ops.forward(s0)
        ops.forward(s1)
    for _ in range(p - r - 1):  # 3
        ops.backward(s1, split=True)
        ops.weight()
        ops.forward(s1)
    for _ in range(m - 2 * p + r + 1):  # 4
        ops.forward(s0)
        ops.backward(s1)
        ops.forward(s1)
        ops.backward(s0)
    for _ in range(p - r - 1):  # 5
        ops.backward(s1)
        ops.forward(s1)
        ops.backward(s0)
    split, half = False, (r + 1) // 2
    for i in range(r + 1):  # 6: odd ranks switch to split before chunk 1, even ranks after
        split = split or (i == half and r % 2 == 1)
        ops.backward(s1, split)
        split = split or (i == half and r % 2 == 0)
        ops.backward(s0, split)
    for _ in range(p - r - 1):  # 7
        ops.weight()
        ops.backward(s0, split=True)
    for _ in range(r + 1):  # 8
        ops.weight()
    return ops.ops
