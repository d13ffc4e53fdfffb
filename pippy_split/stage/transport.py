"""Point-to-point transport between ranks of one process group.

Sits under the runtime: the interpreter hands it one *batch* (a run of comm
actions of the lowered order, expanded to one tensor per edge) and it posts
the batch at once with ``torch.distributed.batch_isend_irecv``, in the given
order. Matching is by order, as on NCCL: by default (``ordered=True``) every
message goes with tag 0 on every backend, so a gloo run that would only be
right thanks to tags fails here instead of on a cluster. Complex tensors go as
real views. Every wait has a timeout whose error says what was awaited.

After a rank fails in the middle of a step nobody knows which messages paired up, so
:meth:`P2P.abort` breaks every message of this rank on the group, pending or future
(the schedule layer decides when: :mod:`pippy_split.schedule.agree`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .errors import PipelineError, PipelineTimeout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# A tag no message of the pipeline uses (ordered mode sends tag 0; the per-edge tags of the
# unordered mode stay below it up to about a hundred stages): a receive posted with it never takes a real message.
_ABORT_TAG = 2**31 - 1

__all__ = ["P2P", "P2POp", "Batch"]


@dataclass(eq=False)
class P2POp:
    """One tensor to send to, or receive from, ``peer`` (a rank of the group). Once posted,
    ``batch`` and ``index`` say which work to wait on; :meth:`P2P.wait_recv` returns a
    receive's tensor."""

    send: bool
    tensor: torch.Tensor
    peer: int
    what: str  # "stage 2 waiting for the forward of microbatch 5 from stage 0 on rank 0"
    tag: int = 0
    complex_dtype: torch.dtype | None = None  # a receive of complex values, as a real view
    dim_order: tuple[int, ...] | None = None  # a receive laid out in this memory order (not row-major)
    batch: Batch | None = None
    index: int = 0


@dataclass(eq=False)
class Batch:
    """The works of one posted batch: one per op (gloo), or one for all (NCCL coalesces)."""

    works: list[Any]
    what: list[str]
    done: bool = False
    waited: set[int] = field(default_factory=set)  # a gloo work must be waited for once only

    def is_completed(self) -> bool:
        return self.done or all(w.is_completed() for w in self.works)



@dataclass
class P2P:
    """Batched isend/irecv over ``group`` with group-local ranks and a timeout on every wait.

    Args:
        group: the pipeline's process group (``None``: the default group).
        timeout: seconds any wait may take before a :class:`PipelineTimeout`.
        ordered: send every message with tag 0 (NCCL's behaviour, the default);
            ``False`` uses each op's own tag (gloo honours tags, NCCL ignores them).

    Example:
        >>> p2p = P2P(group=None, timeout=60)
        >>> op = P2P.send_op(torch.ones(4), peer=1, what="stage 0 sending mb 0 to stage 1")
        >>> batch = p2p.post([op]); p2p.wait(batch)  # doctest: +SKIP
    """

    group: ProcessGroup | None = None
    timeout: float = 300.0
    ordered: bool = True
    _delta: datetime.timedelta = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._delta = datetime.timedelta(seconds=self.timeout)

    @staticmethod
    def recv_op(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, peer: int, what: str,
                tag: int = 0, dim_order: tuple[int, ...] | None = None) -> tuple[P2POp, torch.dtype | None]:
        """A receive op with a fresh buffer sized exactly ``shape`` (complex as a real view), its
        memory in ``dim_order`` (the sender's layout, see :meth:`send_op`) where one is given."""
        complex_dtype = dtype if dtype.is_complex else None
        stored = shape if dim_order is None else tuple(shape[d] for d in dim_order)
        if complex_dtype is not None:
            buf = torch.empty((*stored, 2), dtype=torch.empty((), dtype=dtype).real.dtype, device=device)
        else:
            buf = torch.empty(stored, dtype=dtype, device=device)
        return P2POp(False, buf, peer, what, tag, complex_dtype, dim_order), complex_dtype

    @staticmethod
    def send_op(tensor: torch.Tensor, peer: int, what: str, tag: int = 0,
                dim_order: tuple[int, ...] | None = None) -> P2POp:
        """A send op of ``tensor``'s values in ``dim_order``'s memory order (a channels-last
        tensor goes without a copy, and is received channels-last), else row-major."""
        if dim_order is not None:
            tensor = tensor.permute(dim_order)
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        return P2POp(True, tensor.detach().contiguous(), peer, what, tag)

    def post(self, ops: list[P2POp]) -> Batch:
        """Post ``ops`` together, in order, as one batch (each op learns its batch and index)."""
        p2p_ops = [dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, group=self.group,
                              tag=0 if self.ordered else op.tag, group_peer=op.peer) for op in ops]
        try:
            works = dist.batch_isend_irecv(p2p_ops) if p2p_ops else []
        except Exception as e:
            raise PipelineError(f"{ops[0].what}: posting a batch of {len(ops)} message(s) failed: {e}") from e
        batch = Batch(list(works or []), [op.what for op in ops])
        for index, op in enumerate(ops):
            op.batch, op.index = batch, index
        return batch

    def wait(self, batch: Batch) -> None:
        """Wait for every op of ``batch``."""
        if not batch.done:
            waiting = [w for w in batch.what if "waiting" in w] or batch.what  # name a receive where there is one
            more = f" (and {len(waiting) - 1} more in the same batch)" if len(waiting) > 1 else ""
            self._wait(batch, range(len(batch.works)), waiting[0] + more)
            batch.done = True

    def wait_recv(self, op: P2POp) -> torch.Tensor:
        """Wait for one posted receive (not for the sends posted beside it, where the backend
        allows: gloo gives a work per op, NCCL one for the whole batch); returns its tensor
        (complex again where it crossed as a real view)."""
        batch = op.batch
        assert batch is not None, "a receive is waited for only once posted"
        if not batch.done:
            self._wait(batch, [op.index] if len(batch.works) == len(batch.what) else range(len(batch.works)), op.what)
        value = torch.view_as_complex(op.tensor) if op.complex_dtype is not None else op.tensor
        if op.dim_order is not None:  # the buffer holds the dims in memory order: back to the logical order
            value = value.permute(sorted(range(len(op.dim_order)), key=op.dim_order.__getitem__))
        return value

    def abort(self) -> None:
        """Break every message of this rank on the group, posted or still to come: a blocked
        wait here or in a collective on the group raises at once, and the ranks connected
        to this one see their connection close. The group carries no message afterwards
        (as after a wait that ran past its timeout, only sooner).

        On gloo (CPU) this is gloo's own timeout path: a receive that no rank will ever
        send to, waited for a millisecond; gloo then closes every connection of the group
        on this rank and wakes every blocked wait (``ProcessGroup.abort()`` does not wake
        them there). On other backends (NCCL) the group's ``abort()``.
        """
        group = self.group if self.group is not None else dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if world < 2 or group is None:
            return
        if "gloo" not in str(dist.get_backend(group)):
            group.abort()
            return
        for k in range(1, world):  # through any peer whose connection is still open
            try:
                work = group.recv([torch.empty(1)], (rank + k) % world, _ABORT_TAG)
                work.wait(datetime.timedelta(milliseconds=1))
            except Exception as e:  # expected: the timeout that closes the group's connections
                if "timed out" in str(e).lower():
                    return

    def _wait(self, batch: Batch, indices: Any, what: str) -> None:
        for i in indices:
            if i in batch.waited:
                continue
            batch.waited.add(i)
            work = batch.works[i]
            try:
                ok = work.wait(self._delta)
            except Exception as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                if "timed out" in msg.lower() or "timeout" in msg.lower():
                    raise PipelineTimeout(f"{what}: no message within {self.timeout:.0f} s ({msg})") from e
                raise PipelineError(f"{what}: the peer failed or went away ({msg})") from e
            if ok is False:
                raise PipelineTimeout(f"{what}: no message within {self.timeout:.0f} s")

