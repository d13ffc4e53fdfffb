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
            ``n_microbatches``, or microbatches that differ in their arguments.

    Example:
        >>> import torch
        >>> x0, x1 = torch.zeros(2, 4), torch.zeros(3, 4)
        >>> args, kwargs, target = presplit_inputs(2, (), {}, None, [(x0,), (x1,)], None, [1, 2], "step")
        >>> [t.shape[0] for t in args[0]], kwargs, target
        ([2, 3], {}, Microbatches([1, 2]))
    """
    if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
        return None
    mixed = [what for what, given in (("positional inputs", bool(args)), (f"keyword inputs {sorted(kwargs)}", bool(kwargs)),
                                      ("target=", target is not None)) if given]
    if mixed:
        raise ValueError(f"{call}(): {' and '.join(mixed)} given beside pre-split microbatches; pass every input of "
                         "a pre-split call through arg_mbs=[(x0, ...), ...], kwarg_mbs=[{...}, ...] and "
                         "target_mbs=[y0, ...], or none of them")
    for name, mbs in (("arg_mbs", arg_mbs), ("kwarg_mbs", kwarg_mbs), ("target_mbs", target_mbs)):
        if mbs is None:
            continue
        if not isinstance(mbs, list):
            raise TypeError(f"{call}({name}=...) takes a list with one entry per microbatch, got {type(mbs).__name__}")
        if len(mbs) != n_microbatches:
            raise ValueError(f"{call}({name}=...) has {len(mbs)} entries, but the schedule runs {n_microbatches} "
                             "microbatches")
    out_args = _positional(arg_mbs, call) if arg_mbs is not None else ()
    out_kwargs = _keywords(kwarg_mbs, call) if kwarg_mbs is not None else {}
    return out_args, out_kwargs, Microbatches(target_mbs) if target_mbs is not None else None


def _positional(arg_mbs: list, call: str) -> tuple[Microbatches, ...]:
    for mb, entry in enumerate(arg_mbs):
        if not isinstance(entry, tuple):
            raise TypeError(f"{call}(arg_mbs=...): microbatch {mb} is a {type(entry).__name__}; each entry is the "
                            "tuple of that microbatch's positional inputs, e.g. (x0,)")
    counts = {len(entry) for entry in arg_mbs}
    if len(counts) > 1:
        raise ValueError(f"{call}(arg_mbs=...): microbatches give different numbers of positional inputs "
                         f"{[len(e) for e in arg_mbs]}")
    return tuple(Microbatches(entry[i] for entry in arg_mbs) for i in range(counts.pop()))


def _keywords(kwarg_mbs: list, call: str) -> dict[str, Microbatches]:
    for mb, entry in enumerate(kwarg_mbs):
        if not isinstance(entry, dict):
            raise TypeError(f"{call}(kwarg_mbs=...): microbatch {mb} is a {type(entry).__name__}; each entry is the "
                            "dict of that microbatch's keyword inputs, e.g. {'mask': m0}")
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
