"""The action IR: what one rank does at one step of a pipeline schedule.

Sits between the schedule generators (which emit compute actions F, B, I, W)
and the lowering pass (which adds SEND_F/RECV_F/SEND_B/RECV_B). Text form is
``{stage}{kind}{mb}``: ``2F0`` is the forward of microbatch 0 on stage 2,
``1SEND_B3`` sends stage 1's input gradients for microbatch 3. Orders save to
and load from CSV with one row per rank (an empty cell is an idle step).
"""

from __future__ import annotations

import csv
import enum
import io
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ActionKind", "Action", "Order", "parse_action", "order_to_csv", "order_from_csv"]


class ActionKind(str, enum.Enum):
    F = "F"  # forward
    B = "B"  # full backward (input grad + weight grad)
    I = "I"  # backward, input gradient only  # noqa: E741
    W = "W"  # backward, weight gradient only
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)

    @property
    def is_comm(self) -> bool:
        return not self.is_compute

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``kind`` of microbatch ``mb`` on ``stage``."""

    stage: int
    kind: ActionKind
    mb: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.stage < 0 or self.mb < 0:
            raise ValueError(f"Action stage and mb must be >= 0, got stage={self.stage} mb={self.mb}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> "Action":
        return parse_action(text)


_ACTION_RE = re.compile(r"^\s*(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)\s*$")

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
            f"{[k.value for k in ActionKind]}, e.g. '2F0' or '1SEND_B3'"
        )
    return Action(int(m.group(1)), ActionKind(m.group(2)), int(m.group(3)))


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
