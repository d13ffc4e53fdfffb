"""1F1B (PipeDream-Flush): warm up with forwards, then alternate one forward
and one backward, then drain the backwards.

Paper: Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training"
(PipeDream-2BW / PipeDream-Flush), ICML 2021; also Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021, section 2.2.1.

Placement: ``"loop"``, one stage per rank. Rank ``r`` runs ``p - 1 - r``
warm-up forwards, so it holds at most ``p - r`` activations (GPipe holds
``m``); the bubble is the same as GPipe's, ``(p - 1) / (m + p - 1)`` of the
time with F=1, B=2.

p=2, m=3, unit costs (F=1, B=2)::

    rank 0  F0  F1  .   .   B0  B0  F2  B1  B1  .   B2  B2
    rank 1  .   F0  B0  B0  F1  B1  B1  F2  B2  B2
"""

from __future__ import annotations

from itertools import repeat

from ..actions import Order
from ..placement import Style
from .common import Action, B, F, actions_of, check_sizes, gc_paused, local_stages

__all__ = ["compute_order"]

# What this family needs, as data (read by the registry in orders/__init__.py):
PLACEMENT: Style = "loop"
STAGES_PER_RANK: int | None = 1  # None: any count >= MIN_STAGES_PER_RANK
MIN_STAGES_PER_RANK = 1
SPLIT_BACKWARD = False  # whether the order uses I and W
PAPER = "Narayanan et al. 2021, PipeDream-Flush (ICML)"


def compute_order(num_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Order:
    """1F1B order for ``num_ranks`` ranks and any ``n_microbatches >= 1``.

    Example:
        >>> [str(a) for a in compute_order(2, 3)[0]]
        ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    """
    check_sizes("1F1B", num_ranks, n_microbatches, stages_per_rank, exact_stages=1)
    stages = local_stages(num_ranks, stages_per_rank, PLACEMENT)
    with gc_paused():
        return {r: _rank_order(r, num_ranks, n_microbatches, stages[r][0]) for r in range(num_ranks)}


def _rank_order(rank: int, p: int, m: int, stage: int) -> list[Action | None]:
    warmup = min(p - 1 - rank, m)
    steady = m - warmup  # steady state: the next forward, then the oldest backward
    kinds = [F] * warmup + [F, B] * steady + [B] * warmup
    mbs = list(range(warmup)) + [0] * (2 * steady) + list(range(steady, m))
    mbs[warmup:warmup + 2 * steady:2] = range(warmup, m)
    mbs[warmup + 1:warmup + 2 * steady:2] = range(steady)
    ops: list[Action | None] = list(actions_of(repeat(stage), kinds, mbs, 2 * m))
    return ops
