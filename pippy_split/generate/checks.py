"""A generate() call checked against the model before anything runs (generate's first step).

:func:`checked_call` turns the user's arguments into :class:`~.options.GenerateOptions`,
fills ``eos_token_id`` / ``pad_token_id`` from the model's generation config as Hugging Face
does, and refuses a prompt plus ``max_new_tokens`` beyond the model's positions. It reads
only the arguments and the model, so every rank raises the same error before any message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..split.pipe import Pipe
from .decode_model import decode_signature
from .errors import GenerationError
from .options import GenerateOptions, prompt_mask
from .recompute import refuse_call

__all__ = ["CheckedCall", "checked_call", "position_limit"]


@dataclass(frozen=True)
class CheckedCall:
    options: GenerateOptions
    mask: torch.Tensor
    """``(batch, prompt_len)`` the prompts' attention mask."""
    lanes: int | None
    slots: int | None
    """Rows in flight per lane (None: all of the lane's rows at once)."""
    dtype: torch.dtype
    """The cache's dtype (the model's floating-point parameters')."""


def position_limit(model: torch.nn.Module) -> tuple[int, str] | None:
    """``(limit, where it comes from)`` of the positions the model has, or None if unbounded."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value, f"config.{name}"
    value = getattr(model, "max_positions", None)
    if isinstance(value, int):
        return value, f"{type(model).__name__}.max_positions"
    return None


def _generation_default(model: torch.nn.Module, name: str) -> Any:
    config = getattr(model, "generation_config", None)
    return getattr(config, name, None)


def checked_call(pipe: Pipe, input_ids: torch.Tensor, *, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, lanes: int | None = None, slots: int | None = None,
                 return_logprobs: bool = False
                 ) -> CheckedCall:
    model = pipe.model
    if model is None:
        raise GenerationError("this Pipe does not hold its model (it was not built by pipeline())")
    if eos_token_id is None:
        eos_token_id = _generation_default(model, "eos_token_id")
    if pad_token_id is None:
        pad_token_id = _generation_default(model, "pad_token_id")
    eos: tuple[int, ...] = (() if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int)
                            else tuple(eos_token_id))
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0  # as Hugging Face: pad with eos
    if do_sample and seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    opts = GenerateOptions(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                           top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos or None,
                           pad_token_id=pad_token_id, return_logprobs=return_logprobs)
    mask = prompt_mask(input_ids, attention_mask)
    if lanes is not None and (not isinstance(lanes, int) or lanes < 1):
        raise GenerationError(f"lanes must be None or an int >= 1, got {lanes!r}")
    if slots is not None and (not isinstance(slots, int) or isinstance(slots, bool) or slots < 1):
        raise GenerationError(f"slots must be None or an int >= 1 (rows in flight per lane), got {slots!r}")
    signature = decode_signature(model)  # a model that cannot decode step by step is refused here, by name
    if signature.cache_arg == "state" and bool((mask == 0).any()):
        raise GenerationError(f"{type(model).__name__} reads no attention mask (its state runs over every token, "
                              "pads included), so left-padded prompts would decode other than alone. What works: "
                              "prompts of equal length, no padding (attention_mask=None or all ones); generate "
                              "prompts of different lengths in separate calls")
    if signature.cache_arg == "prefix":  # decoded by recomputation: prompts of one length, no refilled slot
        refuse_call(model, mask, int(input_ids.shape[0]), slots)
    if not signature.positions and slots is not None and slots < int(input_ids.shape[0]):
        raise GenerationError(f"slots={slots} refills a finished row's slot with a waiting prompt, which needs "
                              f"position_ids= to place the new row's tokens; {type(model).__name__}.forward takes "
                              "none. What works: slots=None (every row of a lane in flight at once)")
    limit = position_limit(model)
    total = int(input_ids.shape[1]) + max_new_tokens
    if limit is not None and total > limit[0]:
        raise GenerationError(f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} = {total} "
                              f"positions, beyond the model's {limit[0]} ({limit[1]}); shorten the prompt or "
                              "ask for fewer tokens")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return CheckedCall(opts, mask.to(input_ids.device), lanes, slots, dtype)
