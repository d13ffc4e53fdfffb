"""``GenerateOptions``: one generate() call's arguments, checked (generate's first step).

Every check runs on every rank before any message, from the arguments alone (which every
rank is given), so a bad call fails everywhere with the same message and never hangs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import GenerationError

__all__ = ["GenerateOptions", "prompt_mask"]


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """How to choose tokens and when to stop (Hugging Face's meanings)."""

    max_new_tokens: int
    """Tokens added to every row (the output has ``prompt_len + max_new_tokens`` columns)."""
    do_sample: bool = False
    """Sample from the (processed) distribution; else take the argmax (greedy)."""
    temperature: float = 1.0
    """Logits are divided by it before sampling (> 0)."""
    top_k: int | None = None
    """Keep the ``top_k`` most likely tokens (>= 1), or all (None)."""
    top_p: float | None = None
    """Keep the smallest set of tokens whose probability reaches ``top_p`` (0 < top_p <= 1)."""
    seed: int | None = None
    """Row ``r``'s token at step ``t`` is drawn from a generator seeded from ``(seed, r, t)``."""
    eos_token_id: int | tuple[int, ...] | None = None
    """A row that produces it (or one of them) stops; the rest of the row is ``pad_token_id``."""
    pad_token_id: int = 0
    """What fills a finished row."""
    return_logprobs: bool = False
    """Also return each chosen token's log-probability."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise GenerationError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise GenerationError(f"top_k must be None or an int >= 1, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise GenerationError(f"top_p must be None or a number in (0, 1], got {self.top_p!r}")
        if self.eos_token_id is not None and not all(isinstance(e, int) and e >= 0 for e in self.eos_tokens()):
            raise GenerationError(f"eos_token_id must be None, an int >= 0 or a list of them, got {self.eos_token_id!r}")
        if not isinstance(self.pad_token_id, int) or self.pad_token_id < 0:
            raise GenerationError(f"pad_token_id must be an int >= 0, got {self.pad_token_id!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise GenerationError(f"seed must be None or an int >= 0, got {self.seed!r}")


    def eos_tokens(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return () if e is None else (e,) if isinstance(e, int) else tuple(e)


def prompt_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The prompts' attention mask (ones where None), checked against ``input_ids``: left-padded
    prompts (Hugging Face's convention for decoder-only models) of shape ``(batch, prompt_len)``."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (
            torch.int64, torch.int32):
        raise GenerationError("input_ids must be an int64 tensor of shape (batch, prompt_len), got "
                              f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                              f"{tuple(getattr(input_ids, 'shape', ()))}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise GenerationError(f"input_ids must hold at least one prompt of at least one token, got shape "
                              f"{tuple(input_ids.shape)}")
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.long)
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise GenerationError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                              f"{tuple(input_ids.shape)}: they must match")
    mask = attention_mask.long()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise GenerationError("attention_mask must hold only 0 and 1")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise GenerationError("attention_mask has a 0 after a 1: prompts must be left-padded (Hugging Face's "
                              "convention for decoder-only models; tokenizer.padding_side = 'left')")
    if bool((mask.sum(1) == 0).any()):
        raise GenerationError("a prompt has no token (its attention_mask row is all 0)")
    return mask
