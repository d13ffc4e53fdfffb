"""What a running action is called: a profiler's label and, after a failure, where a rank was.

Example:
    >>> from pippy_split.schedule.actions import Action, ActionKind
    >>> where_failed(Action(2, ActionKind.D, 1, round=4))
    'in 2D1.4 (stage 2, lane 1 round 4, decode)'
"""

from __future__ import annotations

from .actions import Action, ActionKind

__all__ = ["profiler_label", "where_failed"]

_WORDS = {ActionKind.F: "forward", ActionKind.B: "backward", ActionKind.I: "backward input",
          ActionKind.W: "backward weight", ActionKind.D: "decode"}


def _unit(a: Action) -> str:
    return f"lane {a.mb} round {a.round}" if a.round is not None else f"microbatch {a.mb}"


def profiler_label(step: Action | list[Action]) -> str:
    """The name a profiler trace shows for one compute action, or one batch of comm actions.

    Example:
        >>> profiler_label(Action(1, ActionKind.I, 3))
        'pippy_split 1I3: stage 1 backward input, mb 3'
        >>> profiler_label([Action(0, ActionKind.SEND_F, 2), Action(0, ActionKind.RECV_B, 0)])
        'pippy_split comm 0SEND_F2 0RECV_B0'
    """
    if isinstance(step, list):
        return "pippy_split comm " + " ".join(str(a) for a in step)
    unit = f"mb {step.mb}" if step.round is None else _unit(step)
    return f"pippy_split {step}: stage {step.stage} {_WORDS[step.kind]}, {unit}"


def where_failed(step: Action | list[Action] | None) -> str:
    """Where a run failed, for the other ranks: "in 2F3 (stage 2, microbatch 3, forward)"."""
    if step is None:
        return "waiting for its sends at the end of the step"
    if isinstance(step, list):
        return f"posting the messages of {', '.join(str(a) for a in step)}"
    kind = "input backward" if step.kind is ActionKind.I else ("weight backward" if step.kind is ActionKind.W
                                                                 else _WORDS[step.kind])
    return f"in {step} (stage {step.stage}, {_unit(step)}, {kind})"
