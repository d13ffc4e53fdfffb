"""Every rank learns, before a step communicates, whether any rank's own checks failed.

Where this sits: in the schedule layer, at the start of ``step()`` / ``eval()``,
between the checks a rank makes alone (splitting its inputs into microbatches,
finding a ``loss_fn`` and a ``target`` for the last stage) and the first message
of the step. Without it a rank whose checks fail raises while the others wait for
its messages until their timeout; with it every rank raises at once, the failing
rank its own exception and the others a :class:`PipelineError` that names the
failing rank and its cause.

The cost on the happy path is one all-reduce of one integer per step (on the CPU
where the group has a CPU backend); the messages travel only after a failure.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..stage.errors import PipelineError
from ..stage.groups import PipelineGroup

__all__ = ["agree_before_step"]

_MESSAGE_BYTES = 2048  # of each failing rank's message


def agree_before_step(error: BaseException | None, pg: PipelineGroup, what: str = "step()") -> None:
    """Raise on every rank if ``error`` is set on any; collective over ``pg``.

    Args:
        error: this rank's failure of its local checks, or None.
        pg: the schedule's group, its size, this rank and where it takes tensors when it
            has no CPU backend.
        what: the call being prepared, for the message.

    Raises:
        ``error`` itself on the rank it happened on; elsewhere a
        :class:`PipelineError` naming each failing rank and its exception.

    Example:
        >>> agree_before_step(None, PipelineGroup.of(None))  # one rank: nothing to agree on
    """
    if pg.world == 1 or not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    backend = str(dist.get_backend(pg.group))  # a CPU backend: no device sync for one integer
    where = torch.device("cpu") if backend in ("gloo", "mpi") or "cpu:" in backend else pg.device
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=where)
    dist.all_reduce(failed, group=pg.group)
    if int(failed.item()) == 0:
        return
    text = "" if error is None else f"{type(error).__name__}: {error}"
    mine = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    data = text.encode("utf-8")[:_MESSAGE_BYTES]
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = [torch.empty_like(mine, device=where) for _ in range(pg.world)]
    dist.all_gather(every, mine.to(where), group=pg.group)
    if error is not None:
        raise error
    causes = [(r, bytes(t.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")) for r, t in enumerate(every)]
    causes = [(r, c) for r, c in causes if c]
    detail = "; ".join(f"rank {r}: {c}" for r, c in causes)
    raise PipelineError(f"rank {pg.rank}: {what} stopped before any communication because "
                        f"{'ranks' if len(causes) > 1 else 'rank'} {', '.join(str(r) for r, _ in causes)} "
                        f"failed {'their' if len(causes) > 1 else 'its'} own checks: {detail}")

