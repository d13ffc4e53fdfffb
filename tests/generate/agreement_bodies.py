"""Rank bodies of the argument-agreement tests: rank 1 gives generate() something rank 0 does not."""

from __future__ import annotations

import time
from typing import Any

import torch

from .gen_bodies import build
from .models import prompts

BASE: dict[str, Any] = {"max_new_tokens": 3, "eos_token_id": 999, "pad_token_id": 0}


def _call(rank: int, which: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """Rank 0's call, or rank 1's with ``which`` changed (``"none"``: the same call)."""
    ids, mask = prompts(True, batch=4)
    ids = ids % 64
    kwargs = {**BASE, "attention_mask": mask}
    if rank == 0 or which == "none":
        return ids, kwargs
    change: dict[str, Any] = {
        "input_ids": {}, "attention_mask": {"attention_mask": torch.ones_like(mask)},
        "max_new_tokens": {"max_new_tokens": 4}, "eos_token_id": {"eos_token_id": 998},
        "pad_token_id": {"pad_token_id": 1}, "lanes": {"lanes": 1}, "slots": {"slots": 1},
        "do_sample": {"do_sample": True, "seed": 3}, "temperature": {"temperature": 0.5},
        "top_k": {"top_k": 5}, "top_p": {"top_p": 0.5}, "seed": {"seed": 4},
        "return_logprobs": {"return_logprobs": True},
        "bad_eos": {"eos_token_id": -1},
    }[which]
    if which == "input_ids":
        ids = ids.flip(0)
    return ids, {**kwargs, **change}


def disagreeing_body(rank: int, world: int, cases: list[str]) -> dict[str, Any]:
    """One schedule; for each case both ranks call generate() (rank 1 differing as the case
    says), catch what they raise and go on: the failing rank stays alive, as in a loop that
    skips a bad request. Returns per case the exception's type and text and the seconds."""
    _, _, sched = build("tiny_gpt", "1F1B", 2)
    out: dict[str, Any] = {}
    for which in cases:
        ids, kwargs = _call(rank, which)
        start = time.perf_counter()
        try:
            result = sched.generate(ids, **kwargs)
            out[which] = ("ok", result.sequences, time.perf_counter() - start)
        except Exception as e:
            out[which] = (type(e).__name__, str(e), time.perf_counter() - start)
    return out
