"""Order generators: one pure function per schedule family, and their registry.

Each family module exposes ``compute_order(num_ranks, n_microbatches,
stages_per_rank) -> Order``: compute actions only (F, B, I, W) per rank in
execution order, no torch, no process group. Lowering adds the comms later.
:data:`ORDERS` says, as data, what each family needs (placement, stages per
rank, whether the backward is split) so that stage building, lowering and
validation never guess.

Example:
    >>> spec = get_order_spec("zbvzerobubble")
    >>> spec.placement, spec.stages_per_rank
    ('v', 2)
    >>> [str(a) for a in spec.compute_order(2, 4, 2)[0]][:3]
    ['0F0', '0F1', '0F2']
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Literal

from ..actions import Order
from . import (
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    interleaved_zero_bubble,
    looped_bfs,
    one_f_one_b,
    zbv_zero_bubble,
)

__all__ = ["OrderSpec", "ORDERS", "get_order_spec"]


@dataclass(frozen=True)
class OrderSpec:
    """What one schedule family is and needs."""

    name: str
    """Registry name, e.g. ``"ZBVZeroBubble"``."""
    compute_order: Callable[..., Order]
    """``(num_ranks, n_microbatches, stages_per_rank) -> Order``."""
    placement: Literal["loop", "v"]
    """Stage-to-rank style the order assumes (see :mod:`..placement`)."""
    stages_per_rank: int | None
    """Fixed stages per rank, or ``None`` for any ``>= min_stages_per_rank``."""
    min_stages_per_rank: int
    """Fewest stages per rank the family accepts."""
    split_backward: bool
    """Whether the order uses I and W (else only B)."""
    paper: str
    """Where the schedule comes from."""

    def __post_init__(self) -> None:
        if self.placement not in ("loop", "v"):
            raise ValueError(f"{self.name}: placement must be 'loop' or 'v', got {self.placement!r}")
        if self.stages_per_rank is not None and self.stages_per_rank < self.min_stages_per_rank:
            raise ValueError(f"{self.name}: stages_per_rank {self.stages_per_rank} < min {self.min_stages_per_rank}")

    def default_stages_per_rank(self) -> int:
        """The fixed count, else the minimum."""
        return self.stages_per_rank if self.stages_per_rank is not None else self.min_stages_per_rank

    def stage_rule(self) -> str:
        """Which stage counts the family accepts, in words.

        Example:
            >>> get_order_spec("ZBVZeroBubble").stage_rule()
            'exactly 2 stages per rank (stages = 2 x ranks)'
        """
        if self.stages_per_rank is not None:
            k = self.stages_per_rank
            return f"exactly {k} stage{'s' if k > 1 else ''} per rank (stages = {k if k > 1 else ''}{' x ' if k > 1 else ''}ranks)"
        return f"{self.min_stages_per_rank} or more stages per rank, the same on every rank (stages a multiple of ranks)"

    def fits(self, num_stages: int, num_ranks: int) -> bool:
        """Whether ``num_stages`` stages on ``num_ranks`` ranks follow :meth:`stage_rule`."""
        if num_ranks < 1 or num_stages % num_ranks:
            return False
        per_rank = num_stages // num_ranks
        if self.stages_per_rank is not None:
            return per_rank == self.stages_per_rank
        return per_rank >= self.min_stages_per_rank

    def nearest(self, num_stages: int, num_ranks: int) -> str:
        """What would work instead of ``num_stages`` stages on ``num_ranks`` ranks, in words."""
        per = self.default_stages_per_rank()
        options = [f"{_count(per * num_ranks, 'stage')} on {_count(num_ranks, 'rank')} "
                   f"(pipeline(model, {per * num_ranks}, ...))"]
        if num_stages % per == 0 and (self.stages_per_rank is not None or num_stages // per >= 1):
            ranks = num_stages // per if self.stages_per_rank is not None else max(
                r for r in range(1, num_stages + 1) if num_stages % r == 0 and num_stages // r >= per)
            if ranks != num_ranks:
                options.append(f"{_count(num_stages, 'stage')} on {_count(ranks, 'rank')}")
        others = [name for name, spec in ORDERS.items() if spec.fits(num_stages, num_ranks)]
        if others:
            options.append(f"another schedule: {', '.join(others)}")
        return "; or ".join(options)


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _spec(
    name: str, module: ModuleType, placement: str, stages: int | None, min_stages: int, split: bool, paper: str
) -> OrderSpec:
    return OrderSpec(
        name=name,
        compute_order=module.compute_order,
        placement=placement,  # type: ignore[arg-type]
        stages_per_rank=stages,
        min_stages_per_rank=min_stages,
        split_backward=split,
        paper=paper,
    )


_ZB_PAPER = "Qi et al. 2024, Zero Bubble Pipeline Parallelism (ICLR)"
_SPECS = [
    # name, module, placement, stages per rank (None = any), min stages, split backward, paper
    _spec("GPipe", gpipe, "loop", 1, 1, False, "Huang et al. 2019, GPipe (NeurIPS)"),
    _spec("1F1B", one_f_one_b, "loop", 1, 1, False, "Narayanan et al. 2021, PipeDream-Flush (ICML)"),
    _spec("Interleaved1F1B", interleaved_1f1b, "loop", None, 2, False, "Narayanan et al. 2021, Megatron-LM (SC)"),
    _spec("LoopedBFS", looped_bfs, "loop", None, 1, False, "Lamy-Poirier 2023, Breadth-First Pipeline Parallelism"),
    _spec("InterleavedZeroBubble", interleaved_zero_bubble, "loop", None, 1, True, _ZB_PAPER + ", ZB-H1"),
    _spec("ZBVZeroBubble", zbv_zero_bubble, "v", 2, 2, True, _ZB_PAPER + ", ZB-V"),
    _spec("DualPipeV", dualpipe_v, "v", 2, 2, True, "DeepSeek-AI 2024, DeepSeek-V3 Technical Report (DualPipe)"),
]

ORDERS: dict[str, OrderSpec] = {spec.name: spec for spec in _SPECS}


def get_order_spec(name: str) -> OrderSpec:
    """Look up a family by name, case-insensitively.

    Raises:
        ValueError: for an unknown name, listing the valid ones.
    """
    by_lower = {key.lower(): spec for key, spec in ORDERS.items()}
    spec = by_lower.get(name.lower())
    if spec is None:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(ORDERS)}")
    return spec
