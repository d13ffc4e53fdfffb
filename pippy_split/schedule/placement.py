"""Placement: which rank holds which pipeline stage. The one home for it.

Used by stage building, order generation, lowering and validation alike.

* ``"loop"``: stage ``s`` lives on rank ``s % p`` (rank 0 holds 0, p, 2p, ...).
* ``"v"``: zig-zag; stages go down the ranks then back up, so with p=4 and
  8 stages rank 0 holds stages 0 and 7, rank 3 holds 3 and 4.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["stage_to_rank", "rank_to_stages"]



def stage_to_rank(num_stages: int, num_ranks: int, style: str | Mapping[int, int] = "loop") -> dict[int, int]:
    """Map every stage to its rank.

    Args:
        num_stages: total pipeline stages.
        num_ranks: ranks in the pipeline group; must divide ``num_stages``.
        style: ``"loop"``, ``"v"``, or an explicit ``{stage: rank}`` map (checked).

    Returns:
        ``{stage: rank}`` for every stage.

    Example:
        >>> stage_to_rank(8, 4, "v")[7]
        0
    """
    if num_ranks < 1 or num_stages < 1:
        raise ValueError(f"need num_stages >= 1 and num_ranks >= 1, got {num_stages} and {num_ranks}")
    if not isinstance(style, str):
        mapping = {int(s): int(r) for s, r in style.items()}
        missing = sorted(set(range(num_stages)) - set(mapping))
        if missing:
            raise ValueError(f"custom placement has no rank for stages {missing}")
        bad = {s: r for s, r in mapping.items() if not 0 <= r < num_ranks}
        if bad:
            raise ValueError(f"custom placement puts stages on ranks outside [0, {num_ranks}): {bad}")
        return mapping
    if num_stages % num_ranks != 0:
        raise ValueError(
            f"{num_stages} stages cannot be spread evenly over {num_ranks} ranks "
            f"(stages must be a multiple of ranks)"
        )
    if style == "loop":
        return {s: s % num_ranks for s in range(num_stages)}
    if style == "v":
        out = {}
        for s in range(num_stages):
            lap, pos = divmod(s, num_ranks)
            out[s] = pos if lap % 2 == 0 else num_ranks - 1 - pos
        return out
    raise ValueError(f"unknown placement style {style!r}: expected 'loop', 'v' or a {{stage: rank}} map")


def rank_to_stages(num_stages: int, num_ranks: int, style: str | Mapping[int, int] = "loop") -> dict[int, list[int]]:
    """Inverse of :func:`stage_to_rank`: ``{rank: [stages, ascending]}``.

    Example:
        >>> rank_to_stages(8, 4, "v")[0]
        [0, 7]
    """
    out: dict[int, list[int]] = {r: [] for r in range(num_ranks)}
    for s, r in sorted(stage_to_rank(num_stages, num_ranks, style).items()):
        out[r].append(s)
    return out
