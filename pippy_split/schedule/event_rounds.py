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
from typing import Iterator, Mapping, Sequence

import torch

from .actions import Action, Order
from .event_loop import CODE, COMPUTE_KINDS, Encoded, LoopRun, LoweredOrder

__all__ = ["Packed", "pack_order", "placement", "worth_it", "run_rounds", "count_peaks", "busy_time"]

_COMPUTE_CODE = {k.value: CODE[k.value] for k in COMPUTE_KINDS}
_B = CODE["B"]
_KIND = attrgetter("kind")
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
    """A compute-only order as tensors: every action's key (encoded as in
    :mod:`.event_loop`) and parts of it, all ranks one after another (idle steps dropped)."""

    ranks: list[int]
    num_stages: int
    num_mb: int
    lengths: torch.Tensor
    """Per rank (in ``ranks``), how many actions it runs."""
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


def _ints(values: list[int]) -> torch.Tensor:
    return torch.frombuffer(array("q", values), dtype=torch.int64) if values else torch.zeros(0, dtype=torch.int64)


def pack_order(order: Order) -> Packed:
    """Encode ``order`` (as :func:`.event_loop.encode`, the same keys) with C-level maps.

    Raises:
        LoweredOrder: the order has a communication action.
    """
    ranks = list(order)
    flat = list(filter(None, chain.from_iterable(order.values())))  # None idles out (an Action is always truthy)
    lengths = list(map(len, order.values()))
    if len(flat) != sum(lengths):  # some idle steps: count each rank's actions
        lengths = [len(list(filter(None, acts))) for acts in order.values()]
    codes = _codes(flat)
    stages = _ints(list(map(_STAGE, flat)))
    mbs = _ints(list(map(_MB, flat)))
    S = int(stages.max()) + 1 if flat else 0
    M = int(mbs.max()) + 1 if flat else 1
    sk = codes * S + stages
    keys_flat = sk * M + mbs
    n = torch.tensor(lengths, dtype=torch.int64)
    rank_of = torch.repeat_interleave(torch.arange(len(ranks)), n)
    return Packed(ranks, S, M, n, stages, rank_of, keys_flat, sk, mbs)


def _codes(flat: list[Action]) -> torch.Tensor:
    """The code of every action's kind. A compute kind's value is one letter and a kind
    is a ``str``, so the kinds join into one string of one letter per action, read as
    bytes through a table (a comm kind's longer name shows as a longer string).

    Raises:
        LoweredOrder: a communication action.
    """
    letters = "".join(map(_KIND, flat))
    if len(letters) != len(flat):
        comm = next(a.kind.value for a in flat if a.kind.value not in _COMPUTE_CODE)
        raise LoweredOrder(f"the compute-only event loop got a communication action ({comm})")
    if not flat:
        return torch.zeros(0, dtype=torch.int64)
    return _LETTER_CODE[torch.frombuffer(bytearray(letters, "ascii"), dtype=torch.uint8).long()]


_LETTER_CODE = torch.zeros(128, dtype=torch.int64)
for _kind, _code in _COMPUTE_CODE.items():
    _LETTER_CODE[ord(_kind)] = _code


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
    result, or ``None`` when the order writes a key twice or a time is negative or not
    finite (the caller runs the sequential loop).

    Every action's requirements, their latencies and its cost are laid out per action
    first (:func:`_layout`), so that a round is a gather, a max and one scatter over
    every rank. A rank's previous action is one more requirement (latency 0:
    ``max(free, ...)`` is the max over one more term), and a rank that has run its list
    sits on a sentinel that is never ready, so a round needs neither a ``free`` vector
    nor a list of live ranks. A rank not ready writes ``inf`` to its key (not done yet,
    so ``inf`` already) and stays where it is. Start times are not kept per round: after
    the last one, every requirement's end is final, and one more max over all actions
    gives them from the same operands (:class:`_Starts`).
    """
    lay = _layout(packed, table, cost, scale)
    if lay is None:
        return None
    need, key, wait, span, done, cursor = lay.need, lay.key, lay.wait, lay.span, lay.done, lay.first.clone()
    pick, take, put = torch.Tensor.index_select, torch.take, torch.Tensor.index_copy_
    inf, rounds = float("inf"), 0
    while True:  # one round; written with plain calls (indexing syntax costs more per call)
        ends = take(done, pick(need, 0, cursor))  # (ranks, columns)
        if wait is not None:
            ends.add_(pick(wait, 0, cursor))
        t = ends.amax(1).add_(pick(span, 0, cursor))
        put(done, 0, pick(key, 0, cursor), t)
        ready = t.lt(inf)
        cursor.add_(ready)
        rounds += 1
        if rounds % _CHECK_EVERY == 0 and not bool(ready.any()):
            break
    return _result(packed, lay, table, cursor)


_CHECK_EVERY = 8
"""Rounds between two checks that some rank moved: a round where none is ready changes
nothing, so a few extra ones cost less than a check each round."""


@dataclass
class _Layout:
    """What :func:`run_rounds` reads per action, at positions with one sentinel after each
    rank's actions (rank ``i``'s ``j``-th action at ``begin[i] + i + j``)."""

    need: torch.Tensor
    """``(positions, columns)``: the slots of ``done`` whose ends each position waits for.
    Column 0 is the previous action's key (the zero slot for a first one), then its
    requirements, padded with slots that hold 0.0; a required ``I`` that the order runs as
    a full ``B`` reads that ``B``'s key. A sentinel waits for the never slot."""
    key: torch.Tensor
    """Per position, the slot its end goes to (a sentinel's: the spare slot)."""
    wait: torch.Tensor | None
    """``(positions, columns)``: the latency added to each waited end (times the
    microbatch's scale); ``None`` when every latency is 0."""
    span: torch.Tensor
    """Per position, its time (cost times scale)."""
    done: torch.Tensor
    """Per key, its end (``inf``: not yet); then the spare, zero and never slots and
    ``num_mb`` more zero slots (the padding)."""
    first: torch.Tensor
    """Per rank, the position of its first action (its sentinel when it has none)."""
    positions: torch.Tensor
    """Each action's position (actions in :class:`Packed` order)."""

    @property
    def columns(self) -> int:
        """Waited-for slots per position."""
        return self.need.shape[1]


def _layout(packed: Packed, table: Sequence[Sequence[tuple[int, float]]], cost: Sequence[float],
            scale: Sequence[float] | None) -> _Layout | None:
    """The per-position tensors of :func:`run_rounds`, or ``None`` when it cannot run the
    order: a key written twice (an action repeated, or a ``B`` beside its own ``I``), or a
    cost, latency or scale negative or not finite (``inf`` means "not done" here, and the
    zero padding must not raise a start).

    Each row is ``key + delta[code * S + stage]`` (a requirement's key is the action's
    own key plus a fixed delta, :func:`.event_loop.requirement_table`); sentinels are one
    more ``code * S + stage`` row, whose key is the spare slot.
    """
    M, S, R = packed.num_mb, packed.num_stages, len(packed.ranks)
    SM, SM4, N = S * M, 4 * S * M, packed.flat_keys.numel()
    SPARE, ZERO, NEVER, PAD = SM4, SM4 + 1, SM4 + 2, SM4 + 3
    uses = torch.bincount(packed.flat_keys, minlength=SM4).view(4, S, M)
    if bool((uses > 1).any()) or bool((uses[1] & uses[3]).any()):
        return None
    D = max((len(reqs) for reqs in table), default=1) or 1  # at least one: a sentinel's never slot
    rows = len(table) + 1  # the sentinel's row last
    delta = torch.zeros((rows, D), dtype=torch.int64)
    lat = torch.zeros((rows, D), dtype=torch.float64)
    as_b = (uses[3].any(1) & ~uses[1].any(1)).tolist()  # stages whose backward is only ever B
    for row, reqs in enumerate(table):
        delta[row] = PAD - row * M  # the padding: zero slot PAD + mb
        for j, (base, latency) in enumerate(reqs):
            ds = base // M - S  # the stage of a required I (code 1)
            delta[row, j] = base + (2 * SM if 0 <= ds < S and as_b[ds] else 0) - row * M
            lat[row, j] = latency
    delta[-1] = NEVER - SPARE
    span_sk = torch.tensor(list(cost) + [0.0], dtype=torch.float64)
    f = None if scale is None else torch.tensor(list(scale) + [1.0], dtype=torch.float64)
    if not all(bool((x.isfinite() & (x >= 0)).all()) for x in (lat, span_sk, f) if x is not None):
        return None
    end = torch.cumsum(packed.lengths, 0)
    pos = torch.arange(N) + packed.rank_of
    sentinel = end + torch.arange(R)
    first = sentinel - packed.lengths
    key = torch.full((N + R,), SPARE, dtype=torch.int64).index_copy_(0, pos, packed.flat_keys)
    sk = torch.full((N + R,), rows - 1, dtype=torch.int64).index_copy_(0, pos, packed.flat_sk)
    prev = torch.empty(N + R, dtype=torch.int64)
    prev[1:] = key[:-1]
    prev[first] = ZERO
    need = torch.cat((prev[:, None], delta.index_select(0, sk).add_(key[:, None])), 1)
    if bool((uses[1].any(1) & uses[3].any(1)).any()):  # a stage with both: choose per microbatch
        slot = need[:, 1:]
        is_i = (slot >= SM) & (slot < 2 * SM)
        need[:, 1:] = torch.where(is_i & (uses.view(-1)[(slot + 2 * SM).clamp(max=SM4 - 1)] > 0), slot + 2 * SM, slot)
    mb_f = None if f is None else f[torch.full((N + R,), M, dtype=torch.int64).index_copy_(0, pos, packed.flat_mb)]
    wait = None
    if bool((lat != 0).any()):
        lats = lat.index_select(0, sk)
        wait = torch.cat((torch.zeros((N + R, 1), dtype=torch.float64), lats if mb_f is None else lats * mb_f[:, None]), 1)
    span = span_sk[sk] if mb_f is None else span_sk[sk] * mb_f
    done = torch.full((PAD + M,), float("inf"), dtype=torch.float64)
    done[ZERO] = 0.0
    done[PAD:] = 0.0
    return _Layout(need, key, wait, span, done, first, pos)


def _result(packed: Packed, lay: _Layout, table: Sequence[Sequence[tuple[int, float]]],
            cursor: torch.Tensor) -> LoopRun:
    """:func:`run_rounds`'s :class:`.event_loop.LoopRun`: the starts from the final ends, where
    each rank got and, for a stuck rank, the first requirement not done (in ``table`` order)."""
    M = packed.num_mb
    counts = cursor - lay.first
    free = torch.take(lay.done, lay.need[:, 0].index_select(0, cursor))
    blocked, done = {}, lay.done
    for i in torch.nonzero(counts < packed.lengths).flatten().tolist():
        slots = lay.need[int(cursor[i])].tolist()
        k = int(lay.key[int(cursor[i])])  # the key it stopped at; its requirements are slots[1:], in table order
        blocked[packed.ranks[i]] = next(base + k % M for (base, _), slot in zip(table[k // M], slots[1:])
                                        if not float(done[slot]) < float("inf"))
    return LoopRun(_Starts(packed, lay, counts), dict(zip(packed.ranks, free.tolist())), blocked)


class _Starts(Mapping[int, list[float]]):
    """:attr:`.event_loop.LoopRun.starts` of a run in rounds, computed and made into lists
    on first use (only the timeline and a deadlock's message read it): each action's start
    is the max of its waited ends plus latencies, as in the round that ran it."""

    def __init__(self, packed: Packed, lay: _Layout, counts: torch.Tensor) -> None:
        self._packed, self._lay, self._counts = packed, lay, counts
        self._lists: dict[int, list[float]] | None = None

    def _built(self) -> dict[int, list[float]]:
        if self._lists is None:
            lay = self._lay
            ends = torch.take(lay.done, lay.need.index_select(0, lay.positions))
            if lay.wait is not None:
                ends.add_(lay.wait.index_select(0, lay.positions))
            parts = ends.amax(1).split(self._packed.lengths.tolist())
            self._lists = {r: part[:c].tolist() for r, part, c in zip(self._packed.ranks, parts,
                                                                       self._counts.tolist())}
        return self._lists

    def __getitem__(self, rank: int) -> list[float]:
        return self._built()[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self._packed.ranks)

    def __len__(self) -> int:
        return len(self._packed.ranks)


def count_peaks(packed: Packed) -> dict[int, int]:
    """Per rank, the most ``(stage, mb)`` forward activations held at once: F holds one,
    W or B frees it (:func:`.event_loop.held_peaks` with ones, in integers)."""
    SM, keys = packed.num_stages * packed.num_mb, packed.flat_keys
    add = (keys < SM).to(torch.int64)  # F (code 0)
    release = (keys >= 2 * SM).to(torch.int64)  # W or B (codes 2, 3)
    total = torch.cumsum(add - release, 0)  # over all ranks, one after another
    before = torch.cumsum(packed.lengths, 0) - packed.lengths  # each rank's first action
    offset = torch.cat((torch.zeros(1, dtype=torch.int64), total))[before]
    held = total - offset[packed.rank_of] + release  # after each action's add, before its release
    peak = torch.zeros(len(packed.ranks), dtype=torch.int64).scatter_reduce_(0, packed.rank_of, held, "amax")
    return dict(zip(packed.ranks, peak.tolist()))


def busy_time(packed: Packed, cost: Sequence[float], scale: Sequence[float] | None) -> float:
    """Sum of every action's time, rank after rank in list order (the same float sum as a
    Python loop over the ranks' keys)."""
    times = torch.tensor(list(cost), dtype=torch.float64)[packed.flat_sk]
    if scale is not None:
        times = times * torch.tensor(list(scale), dtype=torch.float64)[packed.flat_mb]
    return sum(times.tolist())
