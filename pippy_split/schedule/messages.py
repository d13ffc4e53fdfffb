"""Peers and messages: whom a stage exchanges with across ranks, what a comm action
moves, and which channel it travels on.

Sits under :mod:`.lower`, :mod:`.validate`, :mod:`.simulate` and the runtime (above
:mod:`.actions` and :mod:`.deps` only), which all need the same answers to "which
stages on other ranks does this stage send to and receive from" (:class:`Peers`,
:func:`peer_table`, from the links and the placement) and "which messages does this
SEND/RECV name, and in which order". A :class:`Message` is everything one stage sends
one other stage for one microbatch in one direction; its *channel* is the pair (sender
rank, receiver rank). NCCL matches the k-th send on a channel with the k-th receive on
it, so both ends must list a channel's messages in one order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple

from .actions import Action, ActionKind
from .deps import Link

__all__ = ["Peers", "peer_table", "peers", "Message", "Channel", "action_messages", "required_messages",
           "send_action", "recv_action"]

SEND_F, RECV_F = ActionKind.SEND_F, ActionKind.RECV_F
SEND_B, RECV_B = ActionKind.SEND_B, ActionKind.RECV_B
SEND_D, RECV_D = ActionKind.SEND_D, ActionKind.RECV_D


@dataclass(frozen=True)
class Peers:
    """The stages on *other* ranks that one stage exchanges tensors with.

    Same-rank stages are left out: they hand values over in memory.
    """

    recv_f: tuple[int, ...] = ()
    """Stages whose forward outputs this stage receives (links into it)."""
    send_f: tuple[int, ...] = ()
    """Stages this stage sends its forward outputs to (links out of it)."""
    recv_b: tuple[int, ...] = ()
    """Stages whose input gradients this stage receives (grad links out of it)."""
    send_b: tuple[int, ...] = ()
    """Stages this stage sends its input gradients to (grad links into it)."""


def peer_table(num_stages: int, links: Iterable[Link], placement: Mapping[int, int]) -> dict[int, Peers]:
    """:class:`Peers` of every stage, indexing ``links`` once.

    Args:
        num_stages: total pipeline stages.
        links: ``(src_stage, dst_stage, carries_grad)`` triples.
        placement: ``{stage: rank}`` for every stage.

    Returns:
        ``{stage: Peers}`` for every stage in ``range(num_stages)``.

    Example:
        >>> peer_table(3, [(0, 1, True), (1, 2, True), (0, 2, False)], {0: 0, 1: 1, 2: 0})[0]
        Peers(recv_f=(), send_f=(1,), recv_b=(1,), send_b=())
    """
    table: dict[int, dict[str, list[int]]] = {
        s: {"recv_f": [], "send_f": [], "recv_b": [], "send_b": []} for s in range(num_stages)
    }
    for src, dst, carries_grad in links:
        if not (0 <= src < num_stages and 0 <= dst < num_stages):
            raise ValueError(f"link ({src} -> {dst}) names a stage outside [0, {num_stages})")
        if placement[src] == placement[dst]:
            continue  # local hand-off, no communication
        _add(table[src]["send_f"], dst)
        _add(table[dst]["recv_f"], src)
        if carries_grad:
            _add(table[dst]["send_b"], src)
            _add(table[src]["recv_b"], dst)
    return {s: Peers(**{k: tuple(v) for k, v in d.items()}) for s, d in table.items()}


def _add(bucket: list[int], stage: int) -> None:
    if stage not in bucket:
        bucket.append(stage)


def peers(stage: int, links: Iterable[Link], placement: Mapping[int, int]) -> Peers:
    """:class:`Peers` of one stage (see :func:`peer_table` for all at once).

    Example:
        >>> peers(1, [(0, 1, True), (1, 2, True)], {0: 0, 1: 1, 2: 1}).recv_f
        (0,)
    """
    links = list(links)
    num_stages = max([stage, *placement, *(max(s, d) for s, d, _ in links)]) + 1
    return peer_table(num_stages, links, placement)[stage]


class Message(NamedTuple):
    """``sender`` stage's ``direction`` ("F" activations, "B" gradients; in a decode
    program "D" a stage's values, "T" the chosen tokens) for ``receiver``, microbatch
    ``mb`` (a decode program's lane, at its ``round``).

    Example:
        >>> str(Message("B", 3, 0, 1))
        'stage 3 -> stage 0 gradient of mb 1'
        >>> str(Message("T", 3, 0, 1, 4))
        'stage 3 -> stage 0 tokens of lane 1 round 4'
    """

    direction: str
    sender: int
    receiver: int
    mb: int
    round: int = -1

    def __str__(self) -> str:
        if self.round >= 0:
            what = "values" if self.direction == "D" else "tokens"
            return f"stage {self.sender} -> stage {self.receiver} {what} of lane {self.mb} round {self.round}"
        what = "activations" if self.direction == "F" else "gradient"
        return f"stage {self.sender} -> stage {self.receiver} {what} of mb {self.mb}"


class Channel(NamedTuple):
    """A directed pair of ranks; messages on it are matched in posting order."""

    sender: int
    receiver: int

    def __str__(self) -> str:
        return f"rank {self.sender} -> rank {self.receiver}"


def _remote_peers(action: Action, table: Mapping[int, Peers]) -> tuple[int, ...]:
    p = table[action.stage]
    return {SEND_F: p.send_f, RECV_F: p.recv_f, SEND_B: p.send_b, RECV_B: p.recv_b}[action.kind]


def action_messages(action: Action, table: Mapping[int, Peers]) -> list[Message]:
    """The messages a comm action posts, in posting order.

    ``table`` is :func:`peer_table`'s result. An
    action without a peer covers every remote peer in that direction, in
    ascending stage order.

    Raises:
        ValueError: the action names a peer it does not exchange with (or has none).

    Example:
        >>> table = peer_table(3, [(0, 1, True), (0, 2, False)], {0: 0, 1: 1, 2: 1})
        >>> [str(m) for m in action_messages(Action(0, SEND_F, 0), table)]
        ['stage 0 -> stage 1 activations of mb 0', 'stage 0 -> stage 2 activations of mb 0']
    """
    if action.kind.is_decode:  # a decode message always names its peer; the order is its own table
        assert action.peer is not None and action.round is not None
        direction = "D" if action.kind in (SEND_D, RECV_D) else "T"
        ends = (action.stage, action.peer) if action.is_send else (action.peer, action.stage)
        return [Message(direction, *ends, action.mb, action.round)]
    remote = _remote_peers(action, table)
    if action.peer is not None:
        if action.peer not in remote:
            where = f"one of stages {sorted(remote)}" if remote else "no stage on another rank"
            raise ValueError(f"{action} names peer stage {action.peer}, but in this direction stage {action.stage} "
                             f"exchanges with {where}")
        others: tuple[int, ...] = (action.peer,)
    else:
        if not remote:
            raise ValueError(f"{action} stage has no peer on another rank in this direction")
        others = tuple(sorted(remote))
    s, mb, kind = action.stage, action.mb, action.kind
    if kind is SEND_F:
        return [Message("F", s, p, mb) for p in others]
    if kind is RECV_F:
        return [Message("F", p, s, mb) for p in others]
    if kind is SEND_B:
        return [Message("B", s, p, mb) for p in others]
    return [Message("B", p, s, mb) for p in others]


def required_messages(table: Mapping[int, Peers], n_microbatches: int) -> list[Message]:
    """Every message a step must move, given the peer table: each cross-rank
    link once per microbatch forward, and back when it carries a gradient."""
    out = []
    for s in sorted(table):
        for d in table[s].send_f:
            out += [Message("F", s, d, mb) for mb in range(n_microbatches)]
        for src in table[s].send_b:
            out += [Message("B", s, src, mb) for mb in range(n_microbatches)]
    return out


def send_action(message: Message, unique: bool = False) -> Action:
    """The SEND that posts ``message`` (without a peer when it is the sender's only one)."""
    kind = SEND_F if message.direction == "F" else SEND_B
    return Action(message.sender, kind, message.mb, None if unique else message.receiver)


def recv_action(message: Message, unique: bool = False) -> Action:
    """The RECV that takes ``message`` (without a peer when it is the receiver's only one)."""
    kind = RECV_F if message.direction == "F" else RECV_B
    return Action(message.receiver, kind, message.mb, None if unique else message.sender)
