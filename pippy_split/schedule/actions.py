"""The action IR: what one rank does at one step of a pipeline schedule.

Sits between the schedule generators (which emit compute actions F, B, I, W)
and the lowering pass (which adds SEND_F/RECV_F/SEND_B/RECV_B). Text form is
``{stage}{kind}{mb}``: ``2F0`` is the forward of microbatch 0 on stage 2,
``1SEND_B3`` sends stage 1's input gradients for microbatch 3. Orders save to
and load from CSV with one row per rank (an empty cell is an idle step), and
print as a table with :func:`format_order` (what a ``ScheduleError`` shows).

Communication actions move *messages*. A message is everything one stage
sends one other stage for one microbatch in one direction (one tensor per
edge between them). A comm action names its own stage and, with ``peer``, the
stage at the other end: ``3RECV_F0<0`` is stage 3 receiving stage 0's forward
of microbatch 0, ``0SEND_F0>3`` the matching send. Without a peer
(``1RECV_F0``) the action covers every stage on another rank that it
exchanges with in that direction, in ascending stage order; ``lower`` writes
the peer only where a stage has more than one such peer.

The NCCL rules the IR is built for (gloo is run the same way in the tests):

* Between two ranks, the k-th message one posts to the other is taken by the
  k-th receive the other posts from it; tags play no part. So on every
  directed channel (sender rank -> receiver rank) the sender's sends and the
  receiver's receives must name the same messages in the same order.
* A **batch** is a maximal run of consecutive comm actions on one rank. It is
  posted at once (``torch.distributed.batch_isend_irecv``) in list order, and
  completes only when every message in it has its counterpart posted by the
  peer. A rank posts its next batch only after its previous one completed.
  ``lower`` writes each batch sorted by peer rank, then by the message's place
  on its channel; ``validate`` and ``simulate`` use exactly this rule, so an
  order they accept cannot deadlock or swap messages on NCCL.
"""

from __future__ import annotations

import csv
import enum
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

__all__ = ["ActionKind", "Action", "Order", "parse_action", "order_to_csv", "order_from_csv", "comm_batches",
           "format_order"]


class ActionKind(str, enum.Enum):
    F = "F"  # forward
    B = "B"  # full backward (input grad + weight grad)
    I = "I"  # backward, input gradient only  # noqa: E741
    W = "W"  # backward, weight gradient only
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    D = "D"  # decode: one stage's step for a lane at a round (generation)
    SEND_D = "SEND_D"  # decode: a stage's values for another stage
    RECV_D = "RECV_D"
    SEND_T = "SEND_T"  # decode: the tokens the last stage chose, for a stage reading input ids
    RECV_T = "RECV_T"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE_KINDS  # a set: the simulator and lowering ask this millions of times

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    @property
    def is_decode(self) -> bool:
        """A kind of the decode program (``generate``): D and its messages."""
        return self in _DECODE_KINDS

    def __str__(self) -> str:
        return self.value


_COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.D})
_DECODE_KINDS = frozenset({ActionKind.D, ActionKind.SEND_D, ActionKind.RECV_D, ActionKind.SEND_T, ActionKind.RECV_T})
_SEND_KINDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.SEND_D, ActionKind.SEND_T})


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``kind`` of microbatch ``mb`` on ``stage``.

    ``peer`` (comm actions only) is the stage at the other end of the message;
    ``None`` means every remote peer of ``stage`` in that direction. Decode actions
    (``generate``'s program) name a lane in ``mb`` and a ``round`` (0 the prefill, then
    one token per round); their text is ``{stage}{kind}{lane}.{round}``.

    Example:
        >>> str(Action(3, ActionKind.RECV_F, 0, peer=0))
        '3RECV_F0<0'
        >>> str(Action(1, ActionKind.SEND_T, 0, peer=0, round=5))
        '1SEND_T0.5>0'
    """

    stage: int
    kind: ActionKind
    mb: int
    peer: int | None = None
    round: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.stage < 0 or self.mb < 0:
            raise ValueError(f"Action stage and mb must be >= 0, got stage={self.stage} mb={self.mb}")
        if self.peer is not None:
            if self.kind.is_compute:
                raise ValueError(f"{self.stage}{self.kind.value}{self.mb}: only comm actions have a peer stage")
            if self.peer < 0 or self.peer == self.stage:
                raise ValueError(f"{self.stage}{self.kind.value}{self.mb}: peer stage must be another stage >= 0, "
                                 f"got {self.peer}")
        if (self.round is not None) != self.kind.is_decode or (self.round is not None and self.round < 0):
            raise ValueError(f"{self.stage}{self.kind.value}{self.mb}: decode actions (and only they) have a round "
                             f">= 0, got round={self.round}")
        if self.kind.is_decode and self.kind.is_comm and self.peer is None:
            raise ValueError(f"{self.stage}{self.kind.value}{self.mb}.{self.round}: a decode message names its peer stage")

    @property
    def is_send(self) -> bool:
        return self.kind in _SEND_KINDS

    @property
    def lane(self) -> int:
        """A decode action's lane (its ``mb``)."""
        return self.mb

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.mb}"
        if self.round is not None:
            text += f".{self.round}"
        if self.peer is None:
            return text
        return f"{text}{'>' if self.is_send else '<'}{self.peer}"

    def __repr__(self) -> str:
        return f"Action({self})"



_ACTION_RE = re.compile(r"^\s*(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|SEND_D|RECV_D|SEND_T|RECV_T|F|B|I|W|D)(\d+)"
                        r"(?:\.(\d+))?(?:([<>])(\d+))?\s*$")

# {rank: [Action | None, ...]}: None is an idle step (a bubble).
Order = dict[int, list["Action | None"]]


def parse_action(text: str) -> Action:
    """Parse ``"2F0"`` / ``"1SEND_B3"`` back into an :class:`Action`.

    Example:
        >>> parse_action("1SEND_B3")
        Action(1SEND_B3)
    """
    m = _ACTION_RE.match(text)
    if m is None:
        raise ValueError(
            f"cannot parse action {text!r}: expected <stage><kind><mb> with kind in "
            f"{[k.value for k in ActionKind]}, e.g. '2F0' or '1SEND_B3' (a comm action may name its peer "
            "stage: '0SEND_F3>3', '3RECV_F3<0')"
        )
    kind = ActionKind(m.group(2))
    round_ = None if m.group(4) is None else int(m.group(4))
    if m.group(5) is None:
        return Action(int(m.group(1)), kind, int(m.group(3)), round=round_)
    arrow = ">" if kind in _SEND_KINDS else "<"
    if kind.is_compute or m.group(5) != arrow:
        raise ValueError(f"cannot parse action {text!r}: only a SEND names its peer with '>' and only a RECV with "
                         f"'<' (e.g. '0SEND_F3>3', '3RECV_F3<0')")
    return Action(int(m.group(1)), kind, int(m.group(3)), int(m.group(6)), round=round_)


def comm_batches(actions: list["Action | None"]) -> list[tuple[int, list[Action]]]:
    """The batches of one rank's list: ``(index of the first action, [comm actions])``.

    A batch is a maximal run of consecutive comm actions (idle ``None`` steps
    in between do not split it).

    Example:
        >>> acts = [parse_action(t) for t in "0F0 0SEND_F0 0RECV_B0 0B0".split()]
        >>> [(i, [str(a) for a in b]) for i, b in comm_batches(acts)]
        [(1, ['0SEND_F0', '0RECV_B0'])]
    """
    out: list[tuple[int, list[Action]]] = []
    current: list[Action] | None = None
    for i, a in enumerate(actions):
        if a is None:
            continue
        if a.kind.is_compute:
            current = None
            continue
        if current is None:
            current = []
            out.append((i, current))
        current.append(a)
    return out


def order_to_csv(order: Order, path: str | Path | None = None) -> str:
    """Write an order as CSV, one row per rank (rank order), empty cell = idle.

    Returns the CSV text; also writes it to ``path`` when given.
    """
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for rank in sorted(order):
        writer.writerow(["" if a is None else str(a) for a in order[rank]])
    text = buf.getvalue()
    if path is not None:
        Path(path).write_text(text)
    return text


def order_from_csv(source: str | Path) -> Order:
    """Read an order written by :func:`order_to_csv` (a path or the CSV text itself)."""
    text = source
    if isinstance(source, Path) or ("\n" not in str(source) and Path(str(source)).exists()):
        text = Path(source).read_text()
    order: Order = {}
    for rank, row in enumerate(csv.reader(io.StringIO(str(text)))):
        order[rank] = [parse_action(cell) if cell.strip() else None for cell in row]
    return order


def format_order(
    order: Order,
    mark: tuple[int, int] | Mapping[int, int] | None = None,
    *,
    max_steps: int | None = 24,
) -> str:
    """The order as a table, one row per rank; marked cells are shown as ``[0F3]``.

    Args:
        order: ``{rank: [Action | None, ...]}``; ``None`` (idle) prints as ``.``.
        mark: a ``(rank, step)`` or ``{rank: step}`` to highlight.
        max_steps: widest window of steps shown (around the marks, else from
            step 0); ``None`` shows every step.

    Example:
        >>> print(format_order({0: [Action(0, ActionKind.F, 0), None]}, mark=(0, 1)))
        step     0     1
        rank 0  0F0   [.]
    """
    marks = _marks(mark)
    n_steps = max((len(a) for a in order.values()), default=0)
    lo, hi = _window(n_steps, marks, max_steps)
    cells = {
        r: [_cell(acts, i, marks.get(r) == i) for i in range(lo, hi)] for r, acts in order.items()
    }
    width = max([len(str(i)) for i in range(lo, hi)] + [len(c.strip("[]")) + 2 for row in cells.values() for c in row])
    label_w = len(f"rank {max(order, default=0)}")
    head = ["…"] if lo > 0 else []
    tail = ["…"] if hi < n_steps else []
    lines = [_row("step".ljust(label_w), head + [str(i) for i in range(lo, hi)] + tail, width)]
    for r in sorted(order):
        pad_l = [" "] if lo > 0 else []
        pad_r = [" "] if hi < n_steps else []
        lines.append(_row(f"rank {r}".ljust(label_w), pad_l + cells[r] + pad_r, width))
    return "\n".join(line.rstrip() for line in lines)


def _marks(mark: tuple[int, int] | Mapping[int, int] | None) -> dict[int, int]:
    if mark is None:
        return {}
    if isinstance(mark, Mapping):
        return {r: s for r, s in mark.items() if s is not None}
    rank, step = mark
    return {} if rank is None or step is None else {rank: step}


def _window(n_steps: int, marks: Mapping[int, int], max_steps: int | None) -> tuple[int, int]:
    if max_steps is None or n_steps <= max_steps:
        return 0, n_steps
    if not marks:
        return 0, max_steps
    first, last = min(marks.values()), max(marks.values())
    lo = max(0, min(first - 6, (first + last - max_steps) // 2))
    return lo, min(n_steps, lo + max_steps)


def _cell(actions: list[Action | None], step: int, marked: bool) -> str:
    if step >= len(actions):
        text = "" if not marked else "<end>"
    else:
        text = "." if actions[step] is None else str(actions[step])
    return f"[{text}]" if marked else text


def _row(label: str, cells: list[str], width: int) -> str:
    return label + " " + " ".join(c.center(width) for c in cells)
