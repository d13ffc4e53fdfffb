"""Decoding a model that keeps no cache: the tokens so far are its cache (generate, the decode step).

A causal LM whose forward takes its tokens and no cache (torchtitan's ``Decoder``:
``forward(tokens)``; any module that embeds token ids with a ``torch.nn.Embedding`` and
returns logits ``(batch, seq, vocab)``) keeps nothing between steps. It decodes by
recomputation: the decode step's one cache tensor is the prefix of tokens so far,
``(batch, P)`` (:class:`TokenPrefix`), kept on the stage that reads the tokens (the
embedding's) like any stage's cache; a step appends the ``T`` new tokens and runs the model's
own forward over all ``P + T`` of them, and the last position's logits choose the next token.
Every token is the argmax (or the sample) of the unsplit model's full forward over the growing
sequence, by construction; the cost is a forward over the whole sequence per new token (no KV
cache: quadratic in the length), and each stage's message carries every position.

Such a model reads no attention mask, so left-padded prompts would attend to their pads:
a mask with zeros is refused by name at ``generate``'s first line, as is a slot taking a
waiting prompt (continuous batching), whose row would start mid-sequence
(:func:`refuse_call`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .errors import GenerationError

__all__ = ["TokenPrefix", "RECOMPUTE_WORKS", "recompute_refusal", "prefix_step", "prefix_layout", "refuse_call"]

RECOMPUTE_WORKS = ("a causal LM without a cache, decoded by recomputing the whole prefix each step "
                   "(torchtitan's Decoder, or any forward(tokens) of a model with a torch.nn.Embedding that returns "
                   "logits (batch, seq, vocab); prompts of one length)")
"""What the recomputation route takes, for the messages of the refusals."""


@dataclass(frozen=True)
class TokenPrefix:
    """The layout entry of the one cache tensor of a model decoded by recomputation: the tokens
    so far, ``(batch, past)`` of ``dtype``.

    Example:
        >>> TokenPrefix().full_shape(2, 5), TokenPrefix().dtype
        ((2, 5), torch.int64)
    """

    dtype: torch.dtype = torch.long

    def full_shape(self, batch: int, past: int) -> tuple[int, int]:
        return (batch, past)


def _required_after_first(params: Mapping[str, inspect.Parameter]) -> list[str]:
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                  inspect.Parameter.KEYWORD_ONLY)
    named = [p for p in params.values() if p.kind in positional]
    return [p.name for p in named[1:] if p.default is inspect.Parameter.empty]


def recompute_refusal(model: torch.nn.Module, params: Mapping[str, inspect.Parameter]) -> str | None:
    """Why ``model`` (no cache argument) cannot decode by recomputation, or None where it can: its
    forward takes the tokens first and nothing else it needs, and it embeds them
    (a ``torch.nn.Embedding``: a forward of floats, such as an MLP, is no language model).

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
        >>> recompute_refusal(m, inspect.signature(m.forward).parameters) is None
        True
        >>> recompute_refusal(torch.nn.Linear(2, 2), inspect.signature(torch.nn.Linear(2, 2).forward).parameters)
        'it holds no torch.nn.Embedding, so its forward does not take token ids'
    """
    if not params:
        return "its forward's signature cannot be read"
    required = _required_after_first(params)
    if required:
        return f"its forward needs {', '.join(required)} besides the tokens"
    if not any(isinstance(m, torch.nn.Embedding) for m in model.modules()):
        return "it holds no torch.nn.Embedding, so its forward does not take token ids"
    return None


def prefix_step(model: torch.nn.Module, input_ids: torch.Tensor, past: list[torch.Tensor]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One decode step by recomputation: the model's own forward over the prefix ``past[0]``
    ``(batch, P)`` and ``input_ids`` ``(batch, T)``; returns the last position's logits
    ``(batch, vocab)`` and the new prefix ``[(batch, P + T)]``."""
    tokens = torch.cat([past[0], input_ids], dim=1) if past else input_ids
    out = model.forward(tokens)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return logits[:, -1], [tokens]


def prefix_layout(model: torch.nn.Module, device: torch.device | str) -> list[TokenPrefix]:
    """The cache layout of a model decoded by recomputation (one :class:`TokenPrefix`), after one
    forward of two tokens checks that it returns logits ``(batch, seq, vocab)``.

    The check runs in eval mode, modes put back after: it reads shapes only, and must write no
    training state (a torchtitan MoE in train mode adds to its ``tokens_per_expert``, which on a
    pipe built on ``meta`` is a stand-in of another rank's layer).

    Raises:
        GenerationError: the forward returns anything else (each position's logits are what the
            step reads the last of).
    """
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    with torch.no_grad(), _eval_mode(model):
        out = model.forward(ids)
    logits: Any = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != (1, 2):
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(out).__name__
        raise GenerationError(f"{type(model).__name__}.forward(tokens (1, 2)) returned {got}, not logits (1, 2, vocab): "
                              f"it cannot be decoded by recomputation. What works: {RECOMPUTE_WORKS}")
    return [TokenPrefix()]


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Every module of ``model`` in eval mode for the ``with``, each one's own mode put back after."""
    modes = [(m, m.training) for m in model.modules()]
    for m, _ in modes:
        m.training = False
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def refuse_call(model: torch.nn.Module, mask: torch.Tensor, batch: int, slots: int | None) -> None:
    """What a ``generate`` call on a model decoded by recomputation cannot do exactly, refused by
    name (the same on every rank: it reads the arguments only): left-padded prompts, and a slot
    taking a waiting prompt."""
    name = type(model).__name__
    if bool((mask == 0).any()):
        raise GenerationError(f"{name} keeps no cache and reads no attention mask, so it decodes by recomputing the "
                              "whole prefix, pads included: left-padded prompts would decode other than alone. What "
                              "works: prompts of one length, no padding (attention_mask=None or all ones); generate "
                              "prompts of different lengths in separate calls")
    if slots is not None and slots < batch:
        raise GenerationError(f"slots={slots} refills a finished row's slot with a waiting prompt, but {name} decodes "
                              "by recomputing each row's whole prefix, with no mask to start a row mid-lane. What works: "
                              "prompts of one length with slots=None (every row of a lane in flight at once)")
