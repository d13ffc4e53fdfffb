"""Every rank's generate() call, agreed before the first message (generate's first step on ranks).

``sched.generate`` is the same call on every rank, and it must be: the prompts' rows are
fed by the first stage's rank, the mask each stage uses is computed on its own rank, and
the tokens are chosen on the last stage's rank. Ranks given different prompts, masks or
options would return tokens wrong for at least one rank's arguments, and ranks given
different lanes, slots or token counts would post messages the others never match.

:func:`agreed_call` checks this rank's arguments (:func:`~.checks.checked_call`) and then
runs the schedule layer's one agreement (:func:`pippy_split.schedule.agree.agree_before_step`,
one small all-reduce) carrying a digest of each argument: a rank whose own checks failed
raises its error and every other rank a :class:`~pippy_split.stage.errors.PipelineError`
naming it; ranks whose arguments differ all raise one :class:`~.errors.GenerationError`
naming the arguments. Either way before any message, with the group left usable.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch

from ..schedule.agree import agree_before_step
from ..split.pipe import Pipe
from ..stage.groups import PipelineGroup
from .checks import CheckedCall, checked_call
from .errors import GenerationError

__all__ = ["ARGUMENTS", "argument_digest", "agreed_call"]

ARGUMENTS = ("input_ids", "attention_mask", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed",
             "eos_token_id", "pad_token_id", "lanes", "slots", "return_logprobs")
"""The arguments of generate() every rank must give alike, in the digest's order."""

_BITS = 52  # a digest travels as a float64 in the agreement: exact below 2**53
_WEIGHTS_SEED = 0x5EED


def _value_digest(value: Any) -> int:
    if isinstance(value, list):
        value = tuple(value)
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> (64 - _BITS)


def _tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 digest of ``t``'s dtype, shape and values, computed where ``t`` lives (no
    host read): the values times fixed pseudo-random weights, summed with int64 wrap-around."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.int64)
    elif flat.is_floating_point() or flat.is_complex():
        flat = flat.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
                                      [flat.element_size()])
    weights = torch.randint(-(2**62), 2**62, (flat.numel(),), generator=torch.Generator().manual_seed(_WEIGHTS_SEED))
    head = _value_digest((str(t.dtype), tuple(t.shape)))
    total = (flat.to(torch.int64) * weights.to(flat.device)).sum() + head
    return total & ((1 << _BITS) - 1)


def argument_digest(input_ids: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """``(1, len(ARGUMENTS))`` int64 digests of one generate() call's arguments, each in
    ``[0, 2**52)``; equal calls give equal digests on every rank.

    Example:
        >>> ids = torch.tensor([[3, 4, 5]])
        >>> a = argument_digest(ids, {"max_new_tokens": 4})
        >>> b = argument_digest(ids, {"max_new_tokens": 5})
        >>> [ARGUMENTS[i] for i in (a != b).nonzero()[:, 1].tolist()]
        ['max_new_tokens']
    """
    parts = []
    for name in ARGUMENTS:
        value = input_ids if name == "input_ids" else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            parts.append(_tensor_digest(value).cpu())
        else:
            parts.append(torch.tensor(_value_digest(value), dtype=torch.int64))
    return torch.stack(parts)[None]


def agreed_call(pipe: Pipe, pg: PipelineGroup, input_ids: torch.Tensor, kwargs: dict[str, Any],
                prepare: Callable[[], str], fallback: Callable[[], object]) -> CheckedCall:
    """This rank's checked call, once every rank of ``pg`` has checked its own and all gave
    the same arguments (one all-reduce). ``prepare`` runs after this rank's checks and before
    the all-reduce (the decode program's choice, and its trace where it is traced): where it
    raises on one rank, every rank raises, before any message, instead of the others waiting
    for that rank's first message. What it returns (the kind of decode program) is agreed
    too: ranks decoding with different programs would send each other other messages, so
    where they differ every rank runs ``fallback`` (the traced program) and a second
    all-reduce makes a failure of it on one rank a failure on every rank.

    Raises:
        GenerationError: this rank's arguments are wrong (on this rank), or the ranks gave
            different arguments (on every rank, naming them).
        PipelineError: another rank's arguments are wrong (naming that rank and its error).
    """
    error: BaseException | None = None
    call: CheckedCall | None = None
    kind = None
    try:
        call = checked_call(pipe, input_ids, **kwargs)
        kind = prepare()
    except Exception as e:  # every rank learns it in the agreement below
        error = e
    digest = torch.cat([argument_digest(input_ids, kwargs), torch.tensor([[_value_digest(kind)]])], dim=1)
    agreed = agree_before_step(error, pg, "generate()", sizes=digest)
    assert agreed.sizes is not None and call is not None
    most, least = agreed.sizes
    differ = [ARGUMENTS[i] for i, (a, b) in enumerate(zip(most[0][:-1], least[0][:-1])) if a != b]
    if not differ and most[0][-1] != least[0][-1]:
        failed: BaseException | None = None
        try:
            fallback()
        except Exception as e:
            failed = e
        agree_before_step(failed, pg, "generate()")
    if differ:
        raise GenerationError(f"rank {pg.rank}: the ranks gave generate() different {', '.join(differ)}; every rank "
                              "must make the same call (the same prompts, mask and options), so nothing was sent. "
                              "What works: give every rank the same arguments (e.g. build the prompts on every rank "
                              "from the same seed, or broadcast them first)")
    return call
