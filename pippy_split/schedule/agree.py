"""Every rank learns that a rank failed: before a step communicates, and during it.

Where this sits: in the schedule layer, around ``step()`` / ``eval()``.

*Before the first message* (:func:`agree_before_step`): between the checks a rank
makes alone (splitting its inputs into microbatches, finding a ``loss_fn`` and a
``target`` for the last stage, the target against the output's shape) and the first
message of the step. Without it a rank whose checks fail raises while the others
wait for its messages until their timeout; with it every rank raises at once, the
failing rank its own exception and the others a :class:`PipelineError` that names
the failing rank and its cause. The group is untouched and the next step works. The
cost on the happy path is one small all-reduce (on the CPU where the group has a CPU
backend), which also carries what the step must share (dynamic sizes, ``loss_count``'s
items); the messages travel only after a failure. A schedule runs it while no step has
run, and afterwards only where something must be shared (or ``agree_every_step``): a
steady static-shape step runs no collective, and a check failing there is a failure
*after* the first message (below).

*After it* (:class:`FailureChannel`): a rank that raises in the middle of a step
(a user's module or ``loss_fn``, a ``KeyboardInterrupt``) cannot be waited for, and
which messages paired up is no longer known. Its process may live on (a notebook,
a loop that skips a bad batch), so no connection closes by itself. The failing rank
writes what failed (rank, stage, microbatch, action, error) to the group's c10d
store, off the pipeline's channels (NCCL pairs the k-th send with the k-th
receive, so nothing may travel there that the order does not name), and breaks its
own messages (:meth:`~pippy_split.stage.transport.P2P.abort`). Every other rank
watches that key while a step runs (a daemon thread, one store read every
:data:`POLL_S`; no collective, no host sync), breaks its own messages on seeing it,
and raises :class:`PipelineAborted` naming the failure, within about a second. The
group then carries no pipeline message: every later step of the schedule raises the
same error at once on every rank, without communicating.
"""

from __future__ import annotations

import threading
import time
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

from ..stage.errors import PipelineAborted, PipelineError
from ..stage.groups import PipelineGroup

if TYPE_CHECKING:
    from ..stage.transport import P2P

__all__ = ["agree_before_step", "Agreed", "FailureChannel", "StepGuard", "POLL_S"]

POLL_S = 0.5
"""How often a rank reads the store for another rank's failure while a step runs (torch's NCCL watchdog
reads its store for a dump signal once a second on every rank)."""

_MESSAGE_BYTES = 2048  # of each failing rank's message
_NONE = -1e300  # a rank without a value, in the agreement's max


class Agreed(NamedTuple):
    """What one step's agreement told every rank."""

    share: float | None
    """The number one rank shared (``loss_count``'s items), None where no rank gave one."""
    sizes: tuple[list[list[int]], list[list[int]]] | None
    """Per microbatch and symbol, the largest and the smallest dynamic size among the ranks
    that read them (equal where they agree; -1 where no rank read one), or None where no
    sizes were given (static shapes)."""


def agree_before_step(error: BaseException | None, pg: PipelineGroup, what: str = "step()",
                      share: torch.Tensor | None = None, sizes: torch.Tensor | None = None) -> Agreed:
    """Raise on every rank if ``error`` is set on any; one all-reduce (max) over ``pg``.

    Args:
        error: this rank's failure of its local checks, or None.
        pg: the schedule's group, its size, this rank and where it takes tensors when it
            has no CPU backend.
        what: the call being prepared, for the message.
        share: a number one rank knows and every rank needs (the batch's item count for
            ``loss_count``, where the last stage lives), carried by the same all-reduce.
        sizes: this rank's dynamic sizes (:class:`~.dynamic_sizes.SizeReader`, -1 where it
            read none; the same shape on every rank), carried by the same all-reduce.

    Returns:
        :class:`Agreed`: ``share`` and the sizes as every rank now knows them, read with the
        step's one host read.

    Raises:
        ``error`` itself on the rank it happened on; elsewhere a
        :class:`PipelineError` naming each failing rank and its exception.

    Example:
        >>> agree_before_step(None, PipelineGroup.of(None))  # one rank: nothing to agree on
        Agreed(share=None, sizes=None)
    """
    if pg.world == 1 or not (dist.is_available() and dist.is_initialized()):
        return _alone(error, share, sizes)
    where = _agreement_device(pg)
    agreed = _ballot(error, share, sizes, where)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=pg.group)
    values = agreed.tolist()  # the step's one host read
    if values[0] == 0:
        return _read_ballots(values, sizes)
    _raise_failures(error, pg, what, where)


def _alone(error: BaseException | None, share: torch.Tensor | None, sizes: torch.Tensor | None) -> Agreed:
    """One rank (or no process group): nothing to agree on; ``error`` raised as it is."""
    if error is not None:
        raise error
    return Agreed(None if share is None else float(share), None if sizes is None else (sizes.tolist(),) * 2)


def _agreement_device(pg: PipelineGroup) -> torch.device:
    """Where the agreement's tensors live: the CPU where the group has a CPU backend (no device
    sync for a few numbers), else the group's device."""
    backend = str(dist.get_backend(pg.group))
    return torch.device("cpu") if backend in ("gloo", "mpi") or "cpu:" in backend else pg.device


def _ballot(error: BaseException | None, share: torch.Tensor | None, sizes: torch.Tensor | None,
            where: torch.device) -> torch.Tensor:
    """This rank's entry of the all-reduce (max over the group): ``(failed, shares, the shared
    value, sizes, -sizes)``; a rank without a value gives one below every real value (float64
    holds sizes exactly)."""
    head = torch.tensor([0.0 if error is None else 1.0, 0.0, _NONE], dtype=torch.float64, device=where)
    if share is not None and error is None:
        head[1] = 1
        head[2] = share.to(device=where, dtype=torch.float64)
    parts = [head]
    if sizes is not None:
        read = sizes.reshape(-1).to(device=where, dtype=torch.float64)  # -1 where this rank read none
        negated = torch.where(read >= 0, -read, torch.full_like(read, _NONE))
        parts += [read, negated if error is None else torch.full_like(read, _NONE)]
    return torch.cat(parts)


def _read_ballots(values: list[float], sizes: torch.Tensor | None) -> Agreed:
    """The reduced ballots of a step no rank failed: the shared value, and per microbatch and
    symbol the largest and the smallest size (``sizes``: this rank's, for their shape)."""
    got = None
    if sizes is not None:
        n_sizes = sizes.numel()
        width = sizes.shape[-1] if sizes.dim() else 1
        most = [int(v) for v in values[3:3 + n_sizes]]
        least = [int(-v) if v > _NONE / 2 else -1 for v in values[3 + n_sizes:]]
        got = ([most[i:i + width] for i in range(0, n_sizes, width)],
               [least[i:i + width] for i in range(0, n_sizes, width)])
    return Agreed(values[2] if values[1] else None, got)


def _raise_failures(error: BaseException | None, pg: PipelineGroup, what: str, where: torch.device) -> NoReturn:
    """A rank failed its checks: every rank's message gathered (one all-gather of fixed-size
    bytes), then ``error`` raised on the rank it happened on and, on every other rank, a
    :class:`PipelineError` naming each failing rank and its cause."""
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


class FailureChannel:
    """One schedule's side channel for a failure in the middle of a step (see the module
    docstring): a key in the group's c10d store, written once by the rank that fails
    first, and a watcher thread on every rank that reads it while a step runs.

    Args:
        pg: the schedule's group.
        transport: the schedule's transport, broken once a failure is known.
        owner: the schedule; the watcher thread ends when it is collected.

    Example:
        >>> schedule = torch.nn.Module()  # stands for the schedule that owns the channel
        >>> channel = FailureChannel(PipelineGroup.of(None), None, owner=schedule)
        >>> with channel.guard("step()") as guard:  # one rank: nothing to watch, nothing to break
        ...     guard.communicating()
    """

    def __init__(self, pg: PipelineGroup, transport: P2P | None, owner: object) -> None:
        self.pg, self.transport = pg, transport
        self.stopped: str | None = None  # what failed, once known on this rank
        self._store = _store_of(pg) if transport is not None else None
        self._key = ""
        if self._store is not None:
            # The k-th schedule built on this group has the same k on every rank (building one is
            # collective): its own key, which a failure of an earlier group of the same name or of
            # another schedule never matches.
            built = self._store.add(f"pippy_split/schedules_built/{pg.rank}", 1)
            self._key = f"pippy_split/failed_mid_step/{built}"
        self._active = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        weakref.finalize(owner, self._close)

    def guard(self, what: str) -> StepGuard:
        """The context of one ``step()`` / ``eval()``: refuses at once after a failure, watches
        while it runs, and turns an error into the right one (see :class:`StepGuard`)."""
        if self.stopped is not None:
            raise PipelineAborted(f"rank {self.pg.rank}: {what} refused: the schedule stopped when {self.stopped}; "
                                  + _AFTER)
        return StepGuard(self, what)

    def posted(self) -> str | None:
        """What another rank wrote, or None (also where the store cannot be read)."""
        if self._store is None:
            return None
        try:
            return self._store.get(self._key).decode() if self._store.check([self._key]) else None
        except Exception:  # the store went away with its host: the peer died, nothing to name
            return None

    def fail(self, record: str) -> str:
        """Post ``record`` unless a rank did first; stop this rank. Returns the record that stands."""
        if self._store is not None:
            try:
                record = self._store.compare_set(self._key, "", record.encode()).decode()
            except Exception:
                pass
        self.stop(record)
        return record

    def stop(self, record: str) -> None:
        """Know ``record`` and break this rank's messages (from the step or the watcher)."""
        if self.stopped is None:
            self.stopped = record
            if self.transport is not None:
                self.transport.abort()

    # ---- the watcher: parked between steps, one store read every POLL_S during one ----
    def _watch(self, on: bool) -> None:
        if self._store is None:
            return
        if on and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pippy_split-failure-watch", daemon=True)
            self._thread.start()
        if on:
            self._active.set()
        else:
            self._active.clear()

    def _run(self) -> None:
        while True:
            self._active.wait()
            if self._closed or self.stopped is not None:
                return
            record = self.posted()
            if record is not None:
                self.stop(record)
                return
            time.sleep(POLL_S)

    def _close(self) -> None:
        self._closed = True
        self._active.set()


class StepGuard:
    """One ``step()`` / ``eval()`` under a :class:`FailureChannel`. An error before
    :meth:`communicating` is the step's own (agreed on by every rank, the group intact)
    unless another rank posted a failure; from then on any error stops the pipeline:
    the first rank to fail raises its own error, every other :class:`PipelineAborted`."""

    def __init__(self, channel: FailureChannel, what: str) -> None:
        self.channel, self.what = channel, what
        self.where = "before its first message"
        self._messages = False

    def communicating(self, where: str = "") -> None:
        """From here on the step's messages flow; ``where`` says what runs (for the record)."""
        self._messages = True
        self.where = where or "during the step"

    def __enter__(self) -> StepGuard:
        self.channel._watch(True)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        channel = self.channel
        channel._watch(False)
        if error is None or isinstance(error, PipelineAborted) or channel.transport is None:
            return  # one rank without a group: nothing to tell, nothing to break
        record = channel.stopped or channel.posted()
        if record is None and not self._messages and isinstance(error, Exception):
            return  # the step's own error, raised alike on every rank before any message
        if record is None:
            text = str(error).splitlines()[0] if str(error) else ""
            cause = f"{type(error).__name__}: {text}" if text else type(error).__name__
            mine = f"rank {channel.pg.rank} failed {self.where}: {cause}"[:_MESSAGE_BYTES]
            record = channel.fail(mine)
            if record == mine:
                return  # the first failure: the user sees their own error
        channel.stop(record)
        raise PipelineAborted(f"rank {channel.pg.rank}: {self.what} stopped because {record}; " + _AFTER) from error


_AFTER = ("the pipeline's process group carries no more messages (which ones had paired up is unknown): build a "
          "new process group and schedule (in a notebook, restart the ranks) and resume from a checkpoint")


def _store_of(pg: PipelineGroup) -> Any:
    """The group's c10d store (a prefix store of its own), or None where torch does not say."""
    if pg.world < 2:
        return None
    try:
        group = pg.group if pg.group is not None else dist.group.WORLD
        return None if group is None else dist.distributed_c10d._get_process_group_store(group)
    except Exception:  # an older or newer torch without it: mid-step failures wait for the timeout
        return None
