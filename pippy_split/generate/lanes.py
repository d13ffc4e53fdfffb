"""Lanes, their slots and the rows' progress: the decode-time microbatches (generate, host side).

A lane is a group of slots that travel through the stages together, one step (prefill,
then one token) per round; each stage keeps each lane's KV cache. A slot holds one prompt
row at a time. The lane's first rows fill its slots at round 0 (the prefill); when more
rows were given to a lane than it has slots, a slot whose row finished (its
``eos_token_id`` or its ``max_new_tokens``-th token) takes the lane's next waiting row at
the next round (continuous batching): that row's prompt is fed one token per round, its
attention mask hides the cache columns of the rows before it, and its positions count its
own tokens only, so it decodes as it would alone. An idle slot (its row done, none waiting)
feeds the pad token attending only to itself, so its position stays 0 however long the lane
runs.

:class:`Lane` is a pure function of the prompts and of the tokens chosen so far, run the
same way on every rank: each rank computes what a lane feeds (ids, mask, positions) itself,
and only the chosen tokens travel, from the last stage to the other ranks.
:class:`Progress` records the chosen tokens where the logits are (the last stage).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .options import GenerateOptions
from .sampling import choose_tokens

__all__ = ["lane_rows", "StepInputs", "Lane", "make_lanes", "Progress"]


def lane_rows(batch: int, lanes: int) -> list[list[int]]:
    """Rows ``0..batch-1`` in ``lanes`` contiguous groups, sizes differing by at most one (no
    empty lane: at most ``batch`` lanes).

    Example:
        >>> lane_rows(5, 2)
        [[0, 1, 2], [3, 4]]
    """
    lanes = max(1, min(lanes, batch))
    base, extra = divmod(batch, lanes)
    out, start = [], 0
    for i in range(lanes):
        n = base + (1 if i < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


@dataclass(frozen=True)
class StepInputs:
    """What a lane feeds the model at one round."""

    ids: torch.Tensor
    """``(b, T)`` tokens (``T`` = prompt length at round 0, else 1)."""
    mask: torch.Tensor
    """``(b, P + T)`` attention mask over the cache and the new tokens."""
    positions: torch.Tensor
    """``(b, T)`` position ids (Hugging Face's: count of real tokens before, pads at 1)."""

    def as_list(self) -> list[torch.Tensor]:
        return [self.ids, self.mask, self.positions]


@dataclass(frozen=True)
class Produced:
    """A slot whose logits choose a token at this round: its row and the row's step."""

    slot: int
    row: int
    step: int


class Lane:
    """One lane's slots over the rounds (see the module docstring).

    Rounds go in order: :meth:`inputs` of round ``t`` needs :meth:`advance` of round ``t - 1``.

    Example (one slot, two prompts, two new tokens each):
        >>> ids = torch.tensor([[5, 6], [7, 8]])
        >>> lane = Lane(ids, torch.ones_like(ids), [0, 1], slots=1, max_new_tokens=2, eos=())
        >>> lane.rounds   # 2 rounds for row 0, then row 1: fed 2 prompt tokens, 1 more token
        5
        >>> lane.inputs(0).ids.tolist(), lane.advance(0, torch.tensor([9]))
        ([[5, 6]], [Produced(slot=0, row=0, step=0)])
        >>> _ = lane.advance(1, torch.tensor([9]))   # row 0 is done: row 1 starts at round 2
        >>> lane.inputs(2).ids.tolist(), lane.inputs(2).mask.tolist(), lane.inputs(2).positions.tolist()
        ([[7]], [[0, 0, 0, 1]], [[0]])
    """

    def __init__(self, prompt: torch.Tensor, mask: torch.Tensor, rows: list[int], *, slots: int,
                 max_new_tokens: int, eos: tuple[int, ...], pad: int = 0) -> None:
        slots = max(1, min(slots, len(rows)))
        self.prompt, self.prompt_mask = prompt, mask
        self.max_new, self.eos, self.pad = max_new_tokens, set(eos), pad
        self.slots = slots
        self.occupant: list[int | None] = list(rows[:slots])
        self.start = [0] * slots  # round at which the occupant came in
        self.wait = [0] * slots  # rounds it feeds before its logits choose (prompt tokens - 1; 0 at the prefill)
        self.queue: deque[int] = deque(rows[slots:])
        self.mask = mask[rows[:slots]]
        self.next_ids: torch.Tensor = prompt[rows[:slots]]
        self._fed: dict[int, StepInputs] = {}
        self.advanced = -1  # the last round advanced
        self.idle_after: int | None = None
        """The round after which every slot is idle and no row waits (None: not yet)."""
        self.rounds = self._rounds_without_eos() if max_new_tokens > 0 else 0
        """Rounds this lane runs at most (every row running to ``max_new_tokens``)."""

    def _rounds_without_eos(self) -> int:
        """Rounds until the last row's last token if no row stops early (pure bookkeeping)."""
        free_at = [self.wait[i] + self.max_new for i in range(self.slots)]  # first round the slot is free
        for row in self.queue:
            i = min(range(self.slots), key=lambda k: (free_at[k], k))
            free_at[i] += self._prompt_len(row) - 1 + self.max_new
        return max(free_at)

    def _prompt_len(self, row: int) -> int:
        return int(self.prompt_mask[row].sum())

    def producing(self, t: int) -> list[Produced]:
        """The slots whose logits at round ``t`` choose their row's next token."""
        out = []
        for i, row in enumerate(self.occupant):
            if row is not None and t - self.start[i] >= self.wait[i]:
                out.append(Produced(i, row, t - self.start[i] - self.wait[i]))
        return out

    def inputs(self, t: int) -> StepInputs:
        """What the lane feeds at round ``t`` (kept, as several stages on a rank ask for it)."""
        fed = self._fed.get(t)
        if fed is None:
            if t != self.advanced + 1:
                raise RuntimeError(f"lane inputs of round {t} asked after round {self.advanced} was advanced")
            m = self.mask
            if t == 0:
                pos = (m.cumsum(-1) - 1).masked_fill(m == 0, 1)
            else:
                pos = m.sum(-1, keepdim=True) - 1
            fed = StepInputs(self.next_ids, m, pos)
            self._fed = {t: fed}
        return fed

    def advance(self, t: int, tokens: torch.Tensor) -> list[Produced]:
        """Take round ``t``'s chosen ``tokens`` (``(slots,)``; pad where a slot chose nothing):
        finished rows leave, waiting rows come in, and round ``t + 1``'s inputs are set.
        Returns the slots that produced at round ``t``."""
        if t != self.advanced + 1:
            raise RuntimeError(f"lane advanced to round {t} after round {self.advanced}")
        produced = self.producing(t)
        values = tokens.tolist()
        for p in produced:
            if values[p.slot] in self.eos or p.step + 1 >= self.max_new:
                self.occupant[p.slot] = None
        ids = [values[i] if self.occupant[i] is not None else self.pad for i in range(self.slots)]
        new_mask = self.mask.new_ones(self.slots, 1)
        mask = torch.cat([self.mask, new_mask], dim=1)
        for i in range(self.slots):
            row = self.occupant[i]
            if row is None and self.queue:
                row = self.occupant[i] = self.queue.popleft()
                self.start[i], self.wait[i] = t + 1, self._prompt_len(row) - 1
                mask[i, :-1] = 0  # the rows before it in this slot are not its context
            if row is None:
                mask[i, :-1] = 0  # an idle slot sees only itself: its position stays 0, within any limit
            elif t + 1 - self.start[i] < self.wait[i] + (self.start[i] > 0):
                real = self.prompt[row][self.prompt_mask[row].bool()]
                ids[i] = int(real[t + 1 - self.start[i]])
        self.mask = mask
        self.next_ids = torch.tensor(ids, dtype=self.prompt.dtype, device=self.prompt.device)[:, None]
        self.advanced = t
        if self.idle_after is None and not self.queue and all(o is None for o in self.occupant):
            self.idle_after = t
        return produced


def make_lanes(prompt: torch.Tensor, mask: torch.Tensor, lanes: int, slots: int | None,
               opts: GenerateOptions) -> list[Lane]:
    """The rows in ``lanes`` contiguous groups, each lane with ``slots`` slots (all its rows
    at once where None)."""
    groups = lane_rows(prompt.shape[0], lanes)
    return [Lane(prompt, mask, rows, slots=slots or len(rows), max_new_tokens=opts.max_new_tokens,
                 eos=opts.eos_tokens(), pad=opts.pad_token_id) for rows in groups]


class Progress:
    """Every row's output so far (on the rank that holds the last stage)."""

    def __init__(self, prompt: torch.Tensor, opts: GenerateOptions) -> None:
        batch, length = prompt.shape
        self.opts = opts
        self.prompt_len = length
        self.sequences = torch.full((batch, length + opts.max_new_tokens), opts.pad_token_id, dtype=torch.long,
                                    device=prompt.device)
        self.sequences[:, :length] = prompt
        self.logprobs = torch.zeros(batch, opts.max_new_tokens, dtype=torch.float32, device=prompt.device)

    def record(self, lane: Lane, t: int, logits: torch.Tensor) -> torch.Tensor:
        """Choose the tokens of ``lane``'s producing slots at round ``t`` from ``logits
        (slots, V)`` and record them in their rows. Returns ``(slots,)`` tokens (pad where a
        slot produced nothing) for :meth:`Lane.advance`."""
        produced = lane.producing(t)
        tokens = torch.full((lane.slots,), self.opts.pad_token_id, dtype=torch.long, device=logits.device)
        if produced:
            slots = torch.tensor([p.slot for p in produced], device=logits.device)
            chosen, logprobs = choose_tokens(logits[slots], [p.row for p in produced], [p.step for p in produced],
                                             self.opts)
            tokens[slots] = chosen
            rows = torch.tensor([p.row for p in produced], device=self.sequences.device)
            steps = torch.tensor([p.step for p in produced], device=self.sequences.device)
            self.sequences[rows, self.prompt_len + steps] = chosen.to(self.sequences.device)
            self.logprobs[rows, steps] = logprobs.float().to(self.logprobs.device)
        return tokens
