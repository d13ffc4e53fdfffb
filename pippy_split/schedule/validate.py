"""Checking an order before anything runs it: :func:`validate` (raising :class:`ScheduleError`,
which lives in :mod:`.errors` and is importable from here too).

Sits after the order generators and before the runtime; :mod:`.lower` calls it to say
why a compute order cannot be lowered, and the schedule classes on every lowered order.
It takes a compute-only order (F, B, I, W) or a lowered one (with SEND/RECV), checks it
statically, then dry-runs every rank together (:mod:`.event_loop`, :mod:`.batch_loop`):

* in a compute-only order, a compute action waits for its
  :func:`~pippy_split.schedule.deps.compute_deps`: a same-rank producer must
  already have run, a producer on another rank is waited for;
* in a lowered order, NCCL's rules hold (see :mod:`.actions`): every message
  is sent once after its producer and received once before its consumer; on
  every channel (sender rank -> receiver rank) both ends list the messages in
  the same order; and a batch (a run of comm actions) completes only when every
  message in it has its counterpart posted, which the dry run enforces.

When no rank can advance the order would hang, and :class:`ScheduleError`
says which ranks are stuck and on what, with the order table printed and the
stuck steps marked. Every failure names the rank, step and action.
"""

from __future__ import annotations

from typing import Iterable, Mapping, NoReturn, cast

from .actions import Action, ActionKind, Order
from .batch_loop import run_batches
from .deps import DepIndex, Link, chain_links, deps_function
from .errors import Awaited, ScheduleError, deadlock_message
from .event_loop import CODE, COMPUTE_KINDS, KINDS, encode, requirement_table, run_loop, stopped_at
from .messages import Channel, Message, Peers, action_messages, peer_table, recv_action, required_messages, send_action
from .placement import PlacementConflict, resolve_placement

__all__ = ["ScheduleError", "validate"]  # ScheduleError lives in .errors; importable from here as before

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W

# The one integer encoding of action kinds (.event_loop): keys off Enum.__hash__ in the hot loops.
_F, _I, _W, _B, _SEND_F = CODE["F"], CODE["I"], CODE["W"], CODE["B"], CODE["SEND_F"]

Pos = tuple[int, int]  # (rank, step)


def validate(
    order: Order,
    num_stages: int,
    n_microbatches: int,
    *,
    links: Iterable[Link] | None = None,
    placement: Mapping[int, int] | str | None = None,
) -> None:
    """Raise :class:`ScheduleError` unless ``order`` is complete, well ordered and runs to the end.

    Checks: stage and microbatch ids in range; each stage on one rank (the one
    ``placement`` names, when given); every ``F`` and every backward (``B``, or
    ``I`` and ``W``) of every stage and microbatch exactly once; backward after
    forward and ``W`` after ``I``; in a lowered order every message has one
    ``SEND`` and one ``RECV``, a ``SEND`` follows the action producing it,
    remote inputs are received before the action using them, and on every
    channel the sends and receives name the same messages in the same order;
    finally a dry run of all ranks together (batches wait for their
    counterparts, as on NCCL) proves that no rank waits forever.

    Args:
        order: ``{rank: [Action | None, ...]}``, compute-only or lowered.
        num_stages: total pipeline stages.
        n_microbatches: microbatches per step.
        links: ``(src_stage, dst_stage, carries_grad)`` triples; default the chain.
        placement: ``{stage: rank}`` or ``"loop"``/``"v"``; default inferred.

    Example:
        >>> order = {0: [Action(0, F, 0), Action(0, B, 0)]}
        >>> validate(order, num_stages=1, n_microbatches=1)
        >>> validate({0: [Action(0, B, 0), Action(0, F, 0)]}, 1, 1)
        Traceback (most recent call last):
        ...
        pippy_split.schedule.errors.ScheduleError: rank 0, step 0, action 0B0: ...
    """
    if num_stages < 1 or n_microbatches < 1:
        raise ValueError(f"need num_stages >= 1 and n_microbatches >= 1, got {num_stages}, {n_microbatches}")
    try:  # the one set of placement rules, in placement.py; None: read off the order
        where = resolve_placement(placement, num_stages, max(len(order), 1), order)
    except PlacementConflict as e:
        raise ScheduleError(f"stage {e.stage} already has actions on rank {e.home}; a stage lives on one rank",
                            rank=e.rank, step=e.step, action=cast("Action | None", e.action), order=order) from None
    link_list = chain_links(num_stages) if links is None else list(links)
    check = _Checker(order, num_stages, n_microbatches, link_list, where)
    check.scan()
    check.completeness()
    if check.lowered:
        check.comm()
    check.dry_run()


class _Checker:
    """One validation: the static passes, then the dry run. Holds the shared indexes.

    Every (kind, stage, mb) is an integer event key ``(code * S + stage) * M + mb``;
    ``pos[key]`` is where the order runs it, ``(rank, step)``, or ``None``.
    """

    def __init__(
        self,
        order: Order,
        num_stages: int,
        n_microbatches: int,
        links: list[Link],
        placement: dict[int, int],
    ) -> None:
        self.order = order
        self.S, self.M = num_stages, n_microbatches
        self.links = links
        self.where: dict[int, int] = dict(placement)
        self.pos: list[Pos | None] = [None] * (len(COMPUTE_KINDS) * num_stages * n_microbatches)  # compute only
        self.comms: list[tuple[int, int, Action]] = []  # (rank, step, comm action)
        self.lowered = False
        self.table: dict[int, Peers] = {}

    # -- keys -----------------------------------------------------------------
    def key(self, code: int, stage: int, mb: int) -> int:
        return (code * self.S + stage) * self.M + mb

    def unkey(self, key: int) -> Action:
        rest, mb = divmod(key, self.M)
        code, stage = divmod(rest, self.S)
        return Action(stage, KINDS[code], mb)

    def fail(self, reason: str, at: Pos | None, action: Action, marks: Mapping[int, int] | None = None) -> NoReturn:
        rank, step = at if at is not None else (self.where.get(action.stage), None)
        raise ScheduleError(reason, rank=rank, step=step, action=action, order=self.order, marks=marks)

    # -- pass 1: ids, placement, duplicates ------------------------------------
    def scan(self) -> None:
        S, M, where, pos = self.S, self.M, self.where, self.pos
        comms, code_of = self.comms, CODE
        for rank in sorted(self.order):
            for step, a in enumerate(self.order[rank]):
                if a is None:
                    continue
                if a.__class__ is not Action and not isinstance(a, Action):
                    raise ScheduleError(
                        f"expected an Action or None, got {a!r}", rank=rank, step=step, order=self.order
                    )
                s, mb = a.stage, a.mb
                if s >= S or mb >= M:
                    self._out_of_range(a, (rank, step))
                home = where[s]  # given, or read off the order (placement.placement_of_order)
                if home != rank:
                    self.fail(f"stage {s} is placed on rank {home}; a stage lives on one rank", (rank, step), a)
                code = code_of[a.kind._value_]
                if code >= _SEND_F:  # many comm actions may share (kind, stage, mb): one per peer
                    comms.append((rank, step, a))
                    continue
                k = (code * S + s) * M + mb
                if pos[k] is not None:
                    r0, i0 = cast(Pos, pos[k])
                    self.fail(f"duplicate {a} (already at rank {r0}, step {i0})", (rank, step), a)
                pos[k] = (rank, step)
        self.lowered = bool(comms)
        missing = sorted(set(range(S)) - set(where))
        if missing:  # only possible for a placement read off the order: a stage with no actions
            self.fail(f"stage {missing[0]} has no actions on any rank", None, Action(missing[0], F, 0))
        self.table = peer_table(S, self.links, where)

    def _out_of_range(self, a: Action, at: Pos) -> NoReturn:
        if a.stage >= self.S:
            self.fail(f"stage {a.stage} is out of range [0, {self.S})", at, a)
        self.fail(f"microbatch {a.mb} is out of range [0, {self.M})", at, a)

    # -- pass 2: every F and backward once, in order ----------------------------
    def completeness(self) -> None:
        pos, SM = self.pos, self.S * self.M
        for k in range(SM):
            f, b, i, w = pos[k], pos[_B * SM + k], pos[_I * SM + k], pos[_W * SM + k]
            if f is not None and (b is not None) != (i is not None) and (i is None) == (w is None):
                # the common case: F, then B or I-then-W
                bwd = cast(Pos, b if b is not None else i)  # exactly one of b, i is set
                if f[1] < bwd[1] and (w is None or cast(Pos, i)[1] < w[1]):  # i is set with w
                    continue
            s, mb = divmod(k, self.M)
            self._incomplete(s, mb, f, b, i, w)

    def _incomplete(self, s: int, mb: int, f: Pos | None, b: Pos | None, i: Pos | None, w: Pos | None) -> NoReturn:
        """Report what is wrong with stage ``s`` microbatch ``mb`` (something is)."""
        act = {kind: Action(s, kind, mb) for kind in (F, B, I, W)}
        if b is not None and (i is not None or w is not None):
            later, kind = max((b, B), (i, I) if i is not None else (w, W))
            self.fail(f"stage {s} mb {mb} has both B and I/W: its backward runs twice", later, act[kind])
        bwd, bkind = (b, B) if b is not None else (i, I)
        if f is None:
            present = [(p, kind) for p, kind in ((bwd, bkind), (w, W)) if p is not None]
            if present:
                at, kind = min(present)
                self.fail(f"{act[kind]} has no forward {act[F]}", at, act[kind])
            self.fail(f"forward of stage {s} mb {mb} is missing", None, act[F])
        if bwd is None:
            if w is not None:
                self.fail(f"{act[W]} has no {act[I]}", w, act[W])
            self.fail(f"backward of stage {s} mb {mb} is missing (no B, no I/W)", None, act[B])
        if bwd[1] < f[1]:
            self.fail(f"{act[bkind]} comes before its forward {act[F]} (step {f[1]})", bwd, act[bkind])
        if w is None:
            self.fail(f"{act[I]} has no {act[W]}", i, act[I])
        assert i is not None  # w is set, so b is not (failed above): bwd is i
        self.fail(f"{act[W]} comes before its {act[I]} (step {i[1]})", w, act[W])

    # -- pass 3 (lowered orders): messages, where they sit, channel order --------
    def comm(self) -> None:
        """Every required message sent once and received once, after its producer and
        before its consumer; on every channel both ends list the messages in one order."""
        self.sent: dict[Message, tuple[int, int, Action]] = {}
        self.received: dict[Message, tuple[int, int, Action]] = {}
        self.posts: dict[tuple[int, int], list[Message]] = {}  # (rank, step) -> messages, posting order
        channels: dict[Channel, tuple[list, list]] = {}
        for rank, step, a in self.comms:  # rank-major, then step order: posting order per rank
            try:
                msgs = action_messages(a, self.table)
            except ValueError as e:
                self.fail(str(e), (rank, step), a)
            self.posts[(rank, step)] = msgs
            book = self.sent if a.is_send else self.received
            for m in msgs:
                if m in book:
                    r0, i0, a0 = book[m]
                    self.fail(f"{a} {'sends' if a.is_send else 'receives'} {m} a second time (already {a0} at "
                              f"rank {r0}, step {i0})", (rank, step), a)
                book[m] = (rank, step, a)
                chan = Channel(self.where[m.sender], self.where[m.receiver])
                channels.setdefault(chan, ([], []))[0 if a.is_send else 1].append((m, rank, step, a))
        for m in required_messages(self.table, self.M):
            self._placed(m)
        for chan in sorted(channels):
            self._same_order(chan, *channels[chan])

    def _placed(self, m: Message) -> None:
        S, M, pos = self.S, self.M, self.pos
        send, recv = self.sent.get(m), self.received.get(m)
        if send is None and recv is None:
            consumer = self._consumer(m)
            at = pos[self.key(CODE[consumer.kind.value], consumer.stage, consumer.mb)] if consumer else None
            what = "activations" if m.direction == "F" else "output gradients"
            self.fail(f"{consumer} needs {what} from stage {m.sender} (rank {self.where[m.sender]}) but no "
                      f"{recv_action(m, True)} comes before it", at, consumer)
        if recv is None:
            assert send is not None  # not both None (failed above)
            r, i, a = send
            self.fail(f"{a} has no matching {recv_action(m, True)} on rank {self.where[m.receiver]}", (r, i), a)
        if send is None:
            r, i, a = recv
            self.fail(f"{a} has no matching {send_action(m, True)} on rank {self.where[m.sender]}", (r, i), a)
        s_rank, s_step, s_act = send
        producer = pos[(_F * S + m.sender) * M + m.mb] if m.direction == "F" else (
            pos[(_B * S + m.sender) * M + m.mb] or pos[(_I * S + m.sender) * M + m.mb])
        if producer is None or producer[1] > s_step:
            self.fail(f"{s_act} comes before the action that produces it", (s_rank, s_step), s_act)
        consumer = self._consumer(m)
        at = pos[self.key(CODE[consumer.kind.value], consumer.stage, consumer.mb)]
        assert at is not None  # completeness() found every F and every B or I
        if recv[1] > at[1]:
            what = "activations" if m.direction == "F" else "output gradients"
            self.fail(f"{consumer} needs {what} from stage {m.sender} (rank {self.where[m.sender]}) but its "
                      f"{recv[2]} comes only at step {recv[1]}, after it", at, consumer)

    def _consumer(self, m: Message) -> Action:
        """The compute action that uses message ``m`` (F for activations, B or I for gradients)."""
        if m.direction == "F":
            return Action(m.receiver, F, m.mb)
        if self.pos[self.key(_B, m.receiver, m.mb)] is not None:
            return Action(m.receiver, B, m.mb)
        return Action(m.receiver, I, m.mb)

    def _same_order(self, chan: Channel, sends: list, recvs: list) -> None:
        for k, ((ms, rs, ss, sa), (mr, rr, sr, ra)) in enumerate(zip(sends, recvs)):
            if ms != mr:
                self.fail(f"{chan}: message {k} on this channel differs between the ends: rank {rs}'s send #{k} "
                          f"is {sa} at step {ss} ({ms}), rank {rr}'s receive #{k} is {ra} ({mr}); NCCL matches "
                          "sends and receives by order, not by tag, so these two would be swapped",
                          (rr, sr), ra, marks={rs: ss, rr: sr})

    # -- pass 4: all ranks together ----------------------------------------------
    def dry_run(self) -> None:
        """Run every rank's list, each as far as it can, until all end or none can move.

        A compute-only order runs on :mod:`.event_loop` (the loop :func:`.simulate`
        times, here with zero costs); a lowered one under the batch rule."""
        self.done = bytearray(len(self.pos))  # event key -> happened
        if self.lowered:
            self._dry_run_batches()
            return
        enc = encode(self.order, self.S)
        table = requirement_table(DepIndex(self.links, self.S), self.where, enc.num_mb, lambda src, dst: 0.0)
        run = run_loop(enc, table, [0.0] * (len(COMPUTE_KINDS) * self.S))
        if not run.blocked:
            return
        stuck = stopped_at(enc, self.order, run)
        for r, (step, dep) in stuck.items():
            if self.where.get(dep.stage) == r:  # it can only come later on this very rank
                key = self.key(CODE[dep.kind.value], dep.stage, dep.mb)
                self._runs_later(cast(Action, self.order[r][step]), (r, step), key)  # a blocked rank is at an action
        self._deadlock(dict(stuck))

    def _dry_run_batches(self) -> None:
        """Lowered orders under NCCL's rule (:func:`~pippy_split.schedule.batch_loop.run_batches`):
        a rank posts a batch (a run of comm actions) and goes on only once every message in
        it has its counterpart posted. Compute actions take remote inputs from earlier
        receives (checked in pass 3); same-rank producers must already have run."""
        order, templates, S, M = self.order, self._dep_templates(), self.S, self.M
        for rank in sorted(order):  # same-rank producers come earlier in the list
            for i, a in enumerate(order[rank]):
                if a is None or a.kind.is_comm:
                    continue
                code = CODE[a.kind.value]
                for dcode, ds, local in templates[a.stage * 4 + code]:
                    k = (dcode * S + ds) * M + a.mb
                    if local and not self.done[k]:
                        self._runs_later(a, (rank, i), k)
                self.done[(code * S + a.stage) * M + a.mb] = 1
                if code == _B:
                    self.done[(_I * S + a.stage) * M + a.mb] = 1
        run = run_batches(order, self.table)
        if run.blocked:
            self._deadlock(dict(run.stuck()),
                           " once a batch of sends/receives waits for its counterparts (NCCL's rule)")

    def _dep_templates(self) -> dict[int, list[tuple[int, int, bool]]]:
        """``compute_deps`` per (stage, compute kind), for mb 0: deps keep the mb."""
        deps, where = deps_function(self.links, self.S), self.where
        templates = {}
        for s in range(self.S):
            for code in (_F, _B, _I, _W):
                reqs = deps(Action(s, KINDS[code], 0))
                templates[s * 4 + code] = [(CODE[d.kind.value], d.stage, where[d.stage] == where[s]) for d in reqs]
        return templates

    def _runs_later(self, a: Action, at: Pos, k: int) -> None:
        dep = self.unkey(k)
        later = self.pos[k]
        if later is None and dep.kind is I:  # a required I is met by B too
            dep = Action(dep.stage, B, dep.mb)
            later = self.pos[self.key(_B, dep.stage, dep.mb)]
        step = "" if later is None else f" only at step {later[1]}"
        self.fail(f"{a} needs {dep}, which rank {at[0]} runs{step}, after it", at, a)

    def _deadlock(self, stuck: dict[int, tuple[int, Awaited]], rule: str = "") -> NoReturn:
        """No rank can advance: a :class:`ScheduleError` at the first stuck rank, every stuck step marked."""
        first = min(stuck)
        step = stuck[first][0]
        self.fail(deadlock_message(self.order, stuck, self.where, rule=rule), (first, step),
                  cast(Action, self.order[first][step]), marks={r: s for r, (s, _) in stuck.items()})
