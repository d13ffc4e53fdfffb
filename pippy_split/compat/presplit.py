"""The peer's microbatches already split (``step(arg_mbs=, kwarg_mbs=, target_mbs=)``, torch 2.14+)
as :class:`pippy_split.Microbatches`.

Part of the drop-in (:mod:`pippy_split.compat`), used by :mod:`.schedules`' ``step`` and
``eval``. The peer takes one tuple of positional inputs per microbatch, one dict of keyword
inputs per microbatch and one target per microbatch; pippy_split takes, for each argument,
one :class:`~pippy_split.Microbatches` holding its value in every microbatch. Here one is
turned into the other, after the peer's checks (a list of ``n_microbatches`` entries, no
whole-batch input beside them). Microbatches may differ in size (rows, or a dim the pipe
was traced dynamic in), which the peer's own merge of the outputs cannot always follow:
:func:`merged` concatenates the outputs as the peer does where their shapes allow and
otherwise returns them as ``Microbatches``.
"""

from __future__ import annotations

from typing import Any

from ..microbatch import MicrobatchError, Microbatches, merge_chunks

__all__ = ["PreSplit", "presplit_inputs", "merged"]

PreSplit = tuple[tuple[Any, ...], dict[str, Any], Any]  # (args, kwargs, target), each argument as Microbatches


def presplit_inputs(n_microbatches: int, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
                    arg_mbs: Any, kwarg_mbs: Any, target_mbs: Any, call: str) -> PreSplit | None:
    """``(args, kwargs, target)`` for pippy_split's step, each argument a ``Microbatches``;
    None when no pre-split container is given (the whole-batch call).

    Args:
        n_microbatches: the schedule's.
        args / kwargs / target: the call's whole-batch inputs (must be empty beside pre-split ones).
        arg_mbs: ``[(x0, ...), (x1, ...), ...]``, one tuple per microbatch, or None.
        kwarg_mbs: ``[{"mask": m0}, {"mask": m1}, ...]``, one dict per microbatch, or None.
        target_mbs: ``[y0, y1, ...]``, one target per microbatch, or None.
        call: ``"step"`` or ``"eval"``, for messages.

    Raises:
        TypeError: a container is not a list, or an entry not a tuple (``arg_mbs``) / dict (``kwarg_mbs``).
        ValueError: whole-batch inputs beside pre-split ones, a list of another length than
            ``n_microbatches``, or microbatches that differ in their arguments. Each message
            carries the peer's words for the same refusal (2.15.0's), then ours.

    Example:
        >>> import torch
        >>> x0, x1 = torch.zeros(2, 4), torch.zeros(3, 4)
        >>> args, kwargs, target = presplit_inputs(2, (), {}, None, [(x0,), (x1,)], None, [1, 2], "step")
        >>> [t.shape[0] for t in args[0]], kwargs, target
        ([2, 3], {}, Microbatches([1, 2]))
    """
    if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
        return None
    # The peer's messages (2.15.0, word for word) first, so code that matches on them keeps working.
    if args:
        raise ValueError(f"{call}(): When using pre-split inputs, pass pre-split positional inputs through "
                         "arg_mbs=... instead of positional args (one tuple per microbatch: [(x0, ...), ...])")
    if kwargs:
        raise ValueError(f"{call}(): Unexpected keyword arguments with pre-split inputs: {', '.join(sorted(kwargs))}. "
                         "Pass pre-split keyword inputs through kwarg_mbs=... (one dict per microbatch)")
    if target is not None:
        raise ValueError(f"{call}(): When using pre-split inputs, pass pre-split targets through target_mbs=... "
                         "instead of target=...")
    for name, mbs in (("arg_mbs", arg_mbs), ("kwarg_mbs", kwarg_mbs), ("target_mbs", target_mbs)):
        if mbs is None:
            continue
        if not isinstance(mbs, list):
            raise TypeError(f"{call}(): {name} must be a list but got a {type(mbs)} (one entry per microbatch)")
        if len(mbs) != n_microbatches:
            raise ValueError(f"{call}(): Expecting {n_microbatches} {name} but got {len(mbs)} (the schedule runs "
                             f"{n_microbatches} microbatches)")
    _check_entries(arg_mbs, kwarg_mbs, call)
    out_args = _positional(arg_mbs, call) if arg_mbs is not None else ()
    out_kwargs = _keywords(kwarg_mbs, call) if kwarg_mbs is not None else {}
    return out_args, out_kwargs, Microbatches(target_mbs) if target_mbs is not None else None


def _check_entries(arg_mbs: list | None, kwarg_mbs: list | None, call: str) -> None:
    """Each microbatch's entries of the right type, checked in the peer's order (microbatch by microbatch)."""
    n = len(arg_mbs if arg_mbs is not None else kwarg_mbs or [])
    for mb in range(n):
        if arg_mbs is not None and not isinstance(arg_mbs[mb], tuple):
            raise TypeError(f"{call}(): arg_mbs must be a list of tuples, but arg_mbs[{mb}] is a "
                            f"{type(arg_mbs[mb])}; each entry is the tuple of that microbatch's positional inputs, "
                            "e.g. (x0,)")
        if kwarg_mbs is not None and not isinstance(kwarg_mbs[mb], dict):
            raise TypeError(f"{call}(): kwarg_mbs must be a list of dicts, but kwarg_mbs[{mb}] is a "
                            f"{type(kwarg_mbs[mb])}; each entry is the dict of that microbatch's keyword inputs, "
                            "e.g. {'mask': m0}")


def _positional(arg_mbs: list, call: str) -> tuple[Microbatches, ...]:
    counts = {len(entry) for entry in arg_mbs}
    if len(counts) > 1:
        raise ValueError(f"{call}(arg_mbs=...): microbatches give different numbers of positional inputs "
                         f"{[len(e) for e in arg_mbs]}")
    return tuple(Microbatches(entry[i] for entry in arg_mbs) for i in range(counts.pop()))


def _keywords(kwarg_mbs: list, call: str) -> dict[str, Microbatches]:
    names = list(kwarg_mbs[0]) if kwarg_mbs else []
    for mb, entry in enumerate(kwarg_mbs):
        if set(entry) != set(names):
            raise ValueError(f"{call}(kwarg_mbs=...): microbatch {mb} has keywords {sorted(entry)}, microbatch 0 "
                             f"has {sorted(names)}; every microbatch passes the same keywords")
    return {name: Microbatches(entry[name] for entry in kwarg_mbs) for name in names}


def merged(outputs: Any, spec: Any) -> Any:
    """The last stage's per-microbatch outputs merged with the schedule's ``output_merge_spec``
    (default: concatenated along dim 0), as the peer returns them; where microbatches differ
    in another dim (the peer's merge would raise) the outputs stay ``Microbatches``.

    Example:
        >>> import torch
        >>> merged(Microbatches([torch.zeros(2, 3), torch.zeros(1, 3)]), None).shape
        torch.Size([3, 3])
        >>> type(merged(Microbatches([torch.zeros(2, 3), torch.zeros(2, 5)]), None)).__name__
        'Microbatches'
    """
    if not isinstance(outputs, Microbatches):
        return outputs
    try:
        return merge_chunks(list(outputs), spec)
    except MicrobatchError:
        return outputs
