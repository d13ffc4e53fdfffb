"""The event loop of :mod:`.event_loop`, run in rounds over all ranks at once (torch
tensors on the CPU): what :func:`.simulate` uses for big compute-only orders.

Same model, same numbers: every rank runs its list in order; an action starts at
``max(rank free, every requirement's end + its latency x scale)`` and ends ``cost x
scale`` later. Where :func:`.event_loop.run_loop` runs one rank as far as it can and
parks it, a round here takes the next action of every rank at once, runs those whose
requirements are done, and repeats until no rank moves. Each time is computed from the
same operands in the same order (one add, then ``max``), so starts and ends are equal
bit for bit; the result does not depend on which rank ran first because every key is
written once. An order where a key would be written twice (an action repeated, or a
``B`` beside its own ``I``) is left to the sequential loop, which settles it by order of
visit.

A round costs a few tensor operations over the ranks, so this pays off with many ranks
(1F1B on 1024 ranks x 2048 microbatches: a few thousand rounds instead of 4M Python
iterations); :func:`worth_it` says when. The tensors never leave this module.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from operator import attrgetter
from typing import Iterable, Sequence

import torch

from .actions import Order
from .event_loop import CODE, COMPUTE_KINDS, Encoded, LoopRun, LoweredOrder

__all__ = ["Packed", "pack", "placement", "worth_it", "run_rounds", "count_peaks", "busy_time"]

_COMPUTE_CODE = {k.value: CODE[k.value] for k in COMPUTE_KINDS}
_B = CODE["B"]
_KIND_VALUE = attrgetter("kind._value_")
_STAGE = attrgetter("stage")
_MB = attrgetter("mb")

MIN_RANKS = 32
"""Fewest ranks for which rounds beat the sequential loop."""
MIN_ACTIONS = 100_000
"""Fewest actions in all for which rounds are worth setting up."""


def worth_it(order: Order) -> bool:
    """Whether ``order`` is big and wide enough for rounds (:data:`MIN_RANKS`, :data:`MIN_ACTIONS`)."""
    return len(order) >= MIN_RANKS and sum(map(len, order.values())) >= MIN_ACTIONS


@dataclass
class Packed:
    """A compute-only order as tensors: ``keys[i, j]`` is the ``j``-th action of the
    ``i``-th rank (in ``ranks``), encoded as in :mod:`.event_loop`; ``-1`` pads."""

    ranks: list[int]
    num_stages: int
    num_mb: int
    keys: torch.Tensor
    lengths: torch.Tensor
    stages: torch.Tensor
    """The stage of every action, all ranks one after another."""
    rank_of: torch.Tensor
    """The rank position of every action, as ``stages``."""
    flat_keys: torch.Tensor
    """Every action's key, as ``stages``."""
    flat_sk: torch.Tensor
    """Every action's ``code * S + stage`` (its key divided by ``num_mb``), as ``stages``."""
    flat_mb: torch.Tensor
    """Every action's microbatch, as ``stages``."""

    @cached_property
    def enc(self) -> Encoded:
        """The same order as Python lists (:class:`.event_loop.Encoded`), made on first use."""
        parts = self.flat_keys.split(self.lengths.tolist())
        return Encoded(self.ranks, {r: part.tolist() for r, part in zip(self.ranks, parts)}, self.num_stages,
                       self.num_mb)


def _ints(values: Iterable[int]) -> torch.Tensor:
    return torch.frombuffer(array("q", values), dtype=torch.int64) if values else torch.zeros(0, dtype=torch.int64)


def pack(order: Order) -> Packed:
    """Encode ``order`` (as :func:`.event_loop.encode`, the same keys) with C-level maps.

    Raises:
        LoweredOrder: the order has a communication action.
    """
    ranks = list(order)
    rows = [list(filter(None, order[r])) for r in ranks]  # None idles out (an Action is always truthy)
    lengths = [len(row) for row in rows]
    flat = list(chain.from_iterable(rows))
    try:
        codes = _ints(list(map(_COMPUTE_CODE.__getitem__, map(_KIND_VALUE, flat))))
    except KeyError as e:
        raise LoweredOrder(f"the compute-only event loop got a communication action ({e.args[0]})") from None
    stages = _ints(list(map(_STAGE, flat)))
    mbs = _ints(list(map(_MB, flat)))
    S = int(stages.max()) + 1 if flat else 0
    M = int(mbs.max()) + 1 if flat else 1
    sk = codes * S + stages
    keys_flat = sk * M + mbs
    n = torch.tensor(lengths, dtype=torch.int64)
    rank_of = torch.repeat_interleave(torch.arange(len(ranks)), n)
    keys = torch.full((len(ranks), max(lengths, default=0) + 1), -1, dtype=torch.int64)
    keys[rank_of, torch.arange(len(flat)) - (torch.cumsum(n, 0) - n)[rank_of]] = keys_flat
    return Packed(ranks, S, M, keys, n, stages, rank_of, keys_flat, sk, mbs)


def placement(packed: Packed) -> dict[int, int] | None:
    """``{stage: rank}`` as :func:`.placement.placement_of_order` reads it, or ``None``
    when a stage is on two ranks (the caller asks that function, which names the conflict)."""
    if packed.stages.numel() == 0:
        return {}
    S = packed.num_stages
    lo = torch.full((S,), len(packed.ranks), dtype=torch.int64).scatter_reduce(
        0, packed.stages, packed.rank_of, "amin")
    hi = torch.full((S,), -1, dtype=torch.int64).scatter_reduce(0, packed.stages, packed.rank_of, "amax")
    if bool((lo != hi)[hi >= 0].any()):
        return None
    return {s: packed.ranks[i] for s, i in enumerate(hi.tolist()) if i >= 0}


def run_rounds(packed: Packed, table: Sequence[Sequence[tuple[int, float]]], cost: Sequence[float],
               scale: Sequence[float] | None = None) -> LoopRun | None:
    """:func:`.event_loop.run_loop` in rounds (see the module docstring); same arguments, same
    result, or ``None`` when a key was written twice (the caller runs the sequential loop).

    Every action's requirements, their latencies and its cost are laid out per action
    first (a flat index per action, ranks one after another), so that a round is a few
    gathers and scatters over the ranks still running.
    """
    M, S, R = packed.num_mb, packed.num_stages, len(packed.ranks)
    D = max((len(reqs) for reqs in table), default=0) or 1
    delta = torch.zeros((len(table), D), dtype=torch.int64)
    lat = torch.full((len(table), D), float("-inf"), dtype=torch.float64)  # -inf: no requirement
    for row, reqs in enumerate(table):
        for j, (base, latency) in enumerate(reqs):
            delta[row, j], lat[row, j] = base - row * M, latency
    key, sk = packed.flat_keys, packed.flat_sk
    f = None if scale is None else torch.tensor(list(scale), dtype=torch.float64)[packed.flat_mb]
    need = key[:, None] + delta[sk]
    absent = torch.isinf(lat)[sk]
    wait = lat[sk] if f is None else lat[sk] * f[:, None]
    span = torch.tensor(list(cost), dtype=torch.float64)[sk]
    span = span if f is None else span * f
    SM4 = 4 * S * M
    also = torch.where(sk >= _B * S, key - 2 * S * M, SM4)  # a B also writes its I; others a spare slot
    done = torch.full((SM4 + 1,), -1.0, dtype=torch.float64)
    starts = torch.zeros(key.shape, dtype=torch.float64)
    end = torch.cumsum(packed.lengths, 0)
    cursor = end - packed.lengths  # each rank's next action, as a flat index
    free = torch.zeros(R, dtype=torch.float64)
    live = torch.nonzero(packed.lengths > 0).flatten()
    take, pick, put = torch.take, torch.Tensor.index_select, torch.Tensor.index_copy_
    while live.numel():  # one round; written with plain calls (indexing syntax costs more per call)
        at = pick(cursor, 0, live)
        ends = take(done, pick(need, 0, at))
        ready = (ends.ge(0.0).logical_or_(pick(absent, 0, at))).all(1)
        rows = live.masked_select(ready)
        if not rows.numel():
            break
        at = at.masked_select(ready)
        start = torch.maximum(pick(free, 0, rows), ends[ready].add_(pick(wait, 0, at)).amax(1))
        t = start + pick(span, 0, at)
        put(starts, 0, at, start)
        put(free, 0, rows, t)
        put(done, 0, pick(key, 0, at), t)
        put(done, 0, pick(also, 0, at), t)
        cursor.index_add_(0, rows, torch.ones_like(rows))
        live = live.masked_select(pick(cursor, 0, live).lt(pick(end, 0, live)))
    begin = end - packed.lengths
    ran = torch.arange(key.numel()) < cursor[packed.rank_of]
    if int((done[:SM4] >= 0.0).sum()) != int(ran.sum()) + int((ran & (also < SM4)).sum()):
        return None  # a key written twice: which write counts depends on the order of visits
    counts = (cursor - begin).tolist()
    run_starts = {r: part.tolist()[:c] for r, part, c in zip(packed.ranks, starts.split(packed.lengths.tolist()),
                                                               counts)}
    blocked = {}
    stuck = [i for i in range(R) if counts[i] < int(packed.lengths[i])]
    if stuck:
        done_list = done.tolist()
        for i in stuck:
            k = int(key[int(cursor[i])])
            base_k = k - (k // M) * M
            blocked[packed.ranks[i]] = next(base + base_k for base, _ in table[k // M] if done_list[base + base_k] < 0.0)
    return LoopRun(run_starts, dict(zip(packed.ranks, free.tolist())), blocked)


def count_peaks(packed: Packed) -> dict[int, int]:
    """Per rank, the most ``(stage, mb)`` forward activations held at once: F holds one,
    W or B frees it (:func:`.event_loop.held_peaks` with ones, in integers)."""
    S, M = packed.num_stages, packed.num_mb
    keys = packed.keys
    add = ((keys >= 0) & (keys < S * M)).to(torch.int64)  # F (code 0); -1 pads
    release = (keys >= 2 * S * M).to(torch.int64)  # W or B (codes 2, 3)
    held = torch.cumsum(add - release, 1) + release  # after each action's add, before its release
    peak = torch.where(keys >= 0, held, 0).amax(1).clamp(min=0) if keys.shape[1] else torch.zeros(len(keys))
    return dict(zip(packed.ranks, map(int, peak.tolist())))


def busy_time(packed: Packed, cost: Sequence[float], scale: Sequence[float] | None) -> float:
    """Sum of every action's time, rank after rank in list order (the same float sum as a
    Python loop over the ranks' keys)."""
    times = torch.tensor(list(cost), dtype=torch.float64)[packed.flat_sk]
    if scale is not None:
        times = times * torch.tensor(list(scale), dtype=torch.float64)[packed.flat_mb]
    return sum(times.tolist())
