"""``Generation``: what ``generate`` returns (the end of generate's flow, on every rank)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Generation"]


@dataclass(frozen=True)
class Generation:
    """The output of ``sched.generate`` / ``pipe.generate``, the same on every rank.

    Example:
        >>> out = Generation(torch.tensor([[5, 6, 7]]), None)
        >>> out.sequences.shape
        torch.Size([1, 3])
    """

    sequences: torch.Tensor
    """``(batch, prompt_len + max_new_tokens)`` int64: each prompt followed by its new tokens;
    after a row's ``eos_token_id`` the rest of the row is ``pad_token_id``."""
    logprobs: torch.Tensor | None
    """``(batch, max_new_tokens)`` float32: ``log_softmax`` of the model's logits at the chosen
    token (before temperature, top-k, top-p), 0 where the row had finished; None unless
    ``return_logprobs=True``."""
