"""Shared checks and small helpers for the order generators in this package.

Every generator is a pure function ``(num_ranks, n_microbatches,
stages_per_rank) -> Order``; this module holds what they have in common:
argument checks with errors that say what is required, and the per-rank
stage lists for a placement (from :mod:`pippy_split.schedule.placement`).
"""

from __future__ import annotations

from ..actions import Action, ActionKind
from ..placement import rank_to_stages

__all__ = ["check_sizes", "local_stages", "F", "B", "I", "W", "Action"]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def check_sizes(
    family: str,
    num_ranks: int,
    n_microbatches: int,
    stages_per_rank: int,
    *,
    exact_stages: int | None = None,
    min_stages: int = 1,
    min_microbatches: int = 1,
) -> None:
    """Raise ``ValueError`` naming ``family`` and the requirement that failed."""
    if num_ranks < 1:
        raise ValueError(f"{family}: num_ranks must be >= 1, got {num_ranks}")
    if exact_stages is not None and stages_per_rank != exact_stages:
        raise ValueError(f"{family} needs exactly {exact_stages} stages per rank, got {stages_per_rank}")
    if stages_per_rank < min_stages:
        raise ValueError(f"{family} needs stages_per_rank >= {min_stages}, got {stages_per_rank}")
    if n_microbatches < min_microbatches:
        raise ValueError(f"{family} needs n_microbatches >= {min_microbatches}, got {n_microbatches}")


def local_stages(num_ranks: int, stages_per_rank: int, style: str) -> dict[int, list[int]]:
    """``{rank: [stages, ascending]}`` for ``num_ranks * stages_per_rank`` stages."""
    return rank_to_stages(num_ranks * stages_per_rank, num_ranks, style)
