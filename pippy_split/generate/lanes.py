"""Lanes and the rows' progress: the decode-time microbatches (generate, host side).

A lane is a fixed group of prompt rows that travel through the stages together, one step
(prefill, then one token) at a time; each stage keeps each lane's KV cache. What a lane
feeds at round ``t`` is a pure function of the prompts and of the tokens chosen so far, so
every rank computes the attention mask and positions itself; only the new tokens travel
(from the last stage to the stages that read ``input_ids``). :class:`Progress` records the
chosen tokens where the logits are (the last stage) and pads finished rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .options import GenerateOptions
from .sampling import choose_tokens

__all__ = ["lane_rows", "StepInputs", "step_inputs", "Progress"]


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

    ids: torch.Tensor | None
    """``(b, T)`` tokens (``T`` = prompt length at round 0, else 1); None where not known here."""
    mask: torch.Tensor
    """``(b, P + T)`` attention mask over the cache and the new tokens."""
    positions: torch.Tensor
    """``(b, T)`` position ids (Hugging Face's: count of real tokens before, pads at 1)."""

    def as_list(self) -> list[torch.Tensor | None]:
        return [self.ids, self.mask, self.positions]


def step_inputs(prompt: torch.Tensor, mask: torch.Tensor, rows: list[int], round_: int,
                tokens: torch.Tensor | None) -> StepInputs:
    """Lane ``rows``' inputs at ``round_``: the prompts at round 0, then the last ``tokens``
    (``(b,)``, None on a rank that does not read them)."""
    m = mask[rows]
    if round_ == 0:
        pos = (m.cumsum(-1) - 1).masked_fill(m == 0, 1)
        return StepInputs(prompt[rows], m, pos)
    full = torch.cat([m, m.new_ones(len(rows), round_)], dim=1)  # (b, P + round_)
    pos = full.sum(-1, keepdim=True) - 1  # (b, 1)
    return StepInputs(None if tokens is None else tokens[:, None], full, pos)


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
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=prompt.device)

    def record(self, rows: list[int], round_: int, logits: torch.Tensor) -> torch.Tensor:
        """Choose the tokens of ``rows`` at step ``round_`` from ``logits (b, V)``; a finished
        row gets ``pad_token_id`` (and log-probability 0). Returns the tokens ``(b,)`` the
        lane feeds next (Hugging Face feeds the pad too)."""
        opts = self.opts
        tokens, logprobs = choose_tokens(logits, rows, [round_] * len(rows), opts)
        index = torch.tensor(rows, device=self.sequences.device)
        live = self.unfinished[index]
        tokens = torch.where(live, tokens.to(self.sequences.device), opts.pad_token_id)
        self.sequences[index, self.prompt_len + round_] = tokens
        self.logprobs[index, round_] = torch.where(live, logprobs.float().to(self.logprobs.device), 0.0)
        if opts.eos_token_id is not None:
            eos = torch.tensor(opts.eos_tokens(), device=tokens.device)
            self.unfinished[index] = live & ~torch.isin(tokens, eos)
        return tokens
