"""Messages: what a comm action moves, and which channel it travels on.

Sits under :mod:`.lower`, :mod:`.validate`, :mod:`.simulate` and the runtime,
which all need the same answer to "which messages does this SEND/RECV name,
and in which order". A :class:`Message` is everything one stage sends one
other stage for one microbatch in one direction; its *channel* is the pair
(sender rank, receiver rank). NCCL matches the k-th send on a channel with the
k-th receive on it, so both ends must list a channel's messages in one order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, NamedTuple

from .actions import Action, ActionKind

if TYPE_CHECKING:
    from .lower import Peers

__all__ = ["Message", "Channel", "action_messages", "required_messages", "send_action", "recv_action"]

SEND_F, RECV_F = ActionKind.SEND_F, ActionKind.RECV_F
SEND_B, RECV_B = ActionKind.SEND_B, ActionKind.RECV_B


class Message(NamedTuple):
    """``sender`` stage's ``direction`` ("F" activations, "B" gradients) for ``receiver``, microbatch ``mb``.

    Example:
        >>> str(Message("B", 3, 0, 1))
        'stage 3 -> stage 0 gradient of mb 1'
    """

    direction: str
    sender: int
    receiver: int
    mb: int

    def __str__(self) -> str:
        what = "activations" if self.direction == "F" else "gradient"
        return f"stage {self.sender} -> stage {self.receiver} {what} of mb {self.mb}"


class Channel(NamedTuple):
    """A directed pair of ranks; messages on it are matched in posting order."""

    sender: int
    receiver: int

    def __str__(self) -> str:
        return f"rank {self.sender} -> rank {self.receiver}"


def _remote_peers(action: Action, table: Mapping[int, Peers]) -> tuple[int, ...]:
    peers = table[action.stage]
    return {SEND_F: peers.send_f, RECV_F: peers.recv_f, SEND_B: peers.send_b, RECV_B: peers.recv_b}[action.kind]


def action_messages(action: Action, table: Mapping[int, Peers]) -> list[Message]:
    """The messages a comm action posts, in posting order.

    ``table`` is :func:`~pippy_split.schedule.lower.peer_table`'s result. An
    action without a peer covers every remote peer in that direction, in
    ascending stage order.

    Raises:
        ValueError: the action names a peer it does not exchange with (or has none).

    Example:
        >>> from pippy_split.schedule.lower import peer_table
        >>> table = peer_table(3, [(0, 1, True), (0, 2, False)], {0: 0, 1: 1, 2: 1})
        >>> [str(m) for m in action_messages(Action(0, SEND_F, 0), table)]
        ['stage 0 -> stage 1 activations of mb 0', 'stage 0 -> stage 2 activations of mb 0']
    """
    remote = _remote_peers(action, table)
    if action.peer is not None:
        if action.peer not in remote:
            where = f"one of stages {sorted(remote)}" if remote else "no stage on another rank"
            raise ValueError(f"{action} names peer stage {action.peer}, but in this direction stage {action.stage} "
                             f"exchanges with {where}")
        peers: tuple[int, ...] = (action.peer,)
    else:
        if not remote:
            raise ValueError(f"{action} stage has no peer on another rank in this direction")
        peers = tuple(sorted(remote))
    s, mb, kind = action.stage, action.mb, action.kind
    if kind is SEND_F:
        return [Message("F", s, p, mb) for p in peers]
    if kind is RECV_F:
        return [Message("F", p, s, mb) for p in peers]
    if kind is SEND_B:
        return [Message("B", s, p, mb) for p in peers]
    return [Message("B", p, s, mb) for p in peers]


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
