"""A decode order's messages on the transport, and what the runtime asks of a ``generate`` call.

The :class:`~.runtime.Interpreter` runs a lowered decode order (:mod:`.decode_order`) as it
runs a training step; what differs is who makes and takes the values: a
:class:`DecodeSession` (``generate/`` supplies it) computes each ``D``, says what a send
carries and how big a receive is, and takes what arrives.
"""

from __future__ import annotations

from typing import Callable, Mapping, Protocol

import torch

from ..stage.transport import P2P, Batch, P2POp
from .actions import Action, ActionKind

__all__ = ["DecodeSession", "post_decode_batch"]


class DecodeSession(Protocol):
    """What the runtime asks of one ``generate`` call while it runs a lowered decode order
    (``generate/`` supplies it: the stages' decoders, the lanes and the token choice)."""

    def skipped(self, action: Action) -> bool:
        """Whether ``action`` belongs to a round its lane no longer runs (every rank agrees)."""
        ...

    def compute(self, action: Action) -> None:
        """Run a ``D`` action: one stage's step for a lane at a round."""
        ...

    def payload(self, action: Action) -> torch.Tensor:
        """The one tensor a ``SEND_D`` / ``SEND_T`` sends."""
        ...

    def landing(self, action: Action) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of what a ``RECV_D`` / ``RECV_T`` receives."""
        ...

    def deliver(self, action: Action, value: torch.Tensor) -> None:
        """Hand a received ``value`` to the session."""
        ...


def post_decode_batch(p2p: P2P, batch: list[Action], session: DecodeSession, stage_rank: Mapping[int, int],
                      device_of: Callable[[int], torch.device]) -> Batch | None:
    """Post one batch of a decode order, one op per message (a stage's values go packed in
    one buffer) in the order both ends share; wait for its receives and deliver them at once
    (the tokens they bring decide what the rank skips next). Returns the posted batch if it
    sends anything (the caller waits for it later), else None."""
    ops: list[P2POp] = []
    landing: list[tuple[Action, P2POp]] = []
    for a in batch:
        assert a.peer is not None
        peer = stage_rank[a.peer]
        what = "tokens" if a.kind is ActionKind.SEND_T or a.kind is ActionKind.RECV_T else "values"
        if a.is_send:
            ops.append(P2P.send_op(session.payload(a), peer, f"stage {a.stage} sending the {what} of lane {a.mb} "
                                   f"round {a.round} to stage {a.peer}"))
            continue
        shape, dtype = session.landing(a)
        op, _ = P2P.recv_op(shape, dtype, device_of(a.stage), peer, f"stage {a.stage} waiting for the {what} of "
                            f"lane {a.mb} round {a.round} from stage {a.peer} on rank {peer}")
        ops.append(op)
        landing.append((a, op))
    posted = p2p.post(ops)
    for a, op in landing:
        session.deliver(a, p2p.wait_recv(op))
    return posted if any(op.send for op in ops) else None
