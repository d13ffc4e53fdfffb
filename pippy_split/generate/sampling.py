"""Choosing each new token from the last stage's logits (generate, on the last stage's rank).

A pure function of the logits, the rows' identities and the step: row ``r``'s token at
step ``t`` is drawn from its own generator seeded from ``(seed, r, t)``, so the tokens never
depend on how rows are grouped into lanes, on placement or on world size. Temperature,
top-k and top-p follow Hugging Face's ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
``TopPLogitsWarper`` (in that order, keeping at least one token).
"""

from __future__ import annotations

import torch

from .options import GenerateOptions

__all__ = ["choose_tokens", "row_seed"]

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, row: int, step: int) -> int:
    """The generator seed of row ``row`` at step ``step`` (a 63-bit int).

    Example:
        >>> row_seed(0, 1, 2) == row_seed(0, 1, 2) != row_seed(0, 2, 1)
        True
    """
    return _mix(_mix(_mix(seed) ^ row) ^ step) >> 1


def _processed(scores: torch.Tensor, opts: GenerateOptions) -> torch.Tensor:
    """Hugging Face's warpers on ``(b, V)`` fp32 scores."""
    if opts.temperature != 1.0:
        scores = scores / opts.temperature
    if opts.top_k is not None:
        k = min(opts.top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if opts.top_p is not None and opts.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - opts.top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    return scores


def choose_tokens(logits: torch.Tensor, rows: list[int], step: list[int], opts: GenerateOptions
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens (b,) int64, logprobs (b,) fp32)`` for ``logits (b, V)`` of rows ``rows`` at their
    steps ``step`` (each row's count of tokens generated so far).

    Example:
        >>> opts = GenerateOptions(max_new_tokens=1)
        >>> choose_tokens(torch.tensor([[0.0, 2.0, 1.0]]), [0], [0], opts)[0]
        tensor([1])
    """
    scores = logits.float()
    logprobs_all = torch.log_softmax(scores, dim=-1)
    if not opts.do_sample:
        tokens = scores.argmax(dim=-1)
    else:
        probs = _processed(scores, opts).softmax(dim=-1).cpu()
        seed = 0 if opts.seed is None else opts.seed
        picks = []
        for i, (r, t) in enumerate(zip(rows, step)):
            g = torch.Generator(device="cpu").manual_seed(row_seed(seed, r, t))
            picks.append(torch.multinomial(probs[i], 1, generator=g))
        tokens = torch.cat(picks).to(logits.device)
    return tokens, logprobs_all.gather(1, tokens[:, None])[:, 0]
