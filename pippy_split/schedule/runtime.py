"""The one interpreter: runs this rank's lowered action list for one step.

Last step of the flow (… → schedule → **runtime**). A table maps each compute
kind to a handler; no schedule has its own loop. Values between stages on the
same rank are handed over in memory (a detached view: no copy, no message).
Hand-built stages learn their shapes once, on the first step (:mod:`.manual_shapes`).
Each run of consecutive comm actions is one batch, posted at once through the
:class:`~pippy_split.stage.transport.P2P` transport in list order (one tensor
per edge, in the order :mod:`.exchange` fixes for both ends), as the lowered order
and ``validate`` describe it; a received tensor is waited for only when the
action that consumes it runs. Each (stage, microbatch) in flight is one
:class:`~.exchange.InFlight` record.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch

from ..split.spec import MODEL_INPUT, InputKind, TensorSpec
from ..stage.arguments import concrete_shape
from ..stage.data_parallel import set_grad_sync
from ..stage.errors import PipelineError
from ..stage.loss import LossRule
from ..stage.stage import PipelineStage
from ..stage.transport import P2P, Batch, P2POp
from .actions import Action, ActionKind
from .decode_exchange import DecodeSession, post_decode_batch
from .exchange import Arrival, InFlight, Wiring, refuse_crossing, release_storage, wire
from .manual_shapes import infer_manual_shapes
from .step_words import profiler_label, where_failed

__all__ = ["StepContext", "Interpreter", "ActionObserver", "DecodeSession", "profiler_label"]


class ActionObserver(Protocol):
    """Told right before and right after each compute action (see ``PipelineSchedule.timed_actions``)."""

    def before(self, action: Action) -> None: ...

    def after(self, action: Action) -> None: ...

    def batch(self, actions: list[Action], start: float, end: float) -> None:
        """A batch of comm actions posted at ``start`` (``time.perf_counter()``), the runtime going on at ``end``."""
        ...


@dataclass
class StepContext:
    """Everything one step needs besides the stages."""

    n_microbatches: int
    train: bool
    flat_inputs: list[list[Any]] | None = None  # per mb, on the rank holding stage 0 (traced stages)
    mb_args: list[tuple] | None = None  # per mb, manual stage 0
    mb_kwargs: list[dict] | None = None
    targets: list[Any] | None = None  # per mb, on the rank holding the last stage
    bindings: list[dict] = field(default_factory=list)  # per mb, each dynamic symbol's size (see .dynamic_sizes)
    per_microbatch: bool = False  # given Microbatches: outputs stay per microbatch
    loss: LossRule | None = None  # the step's loss rule (loss_fn, divisor, scale) for the last stage


class Interpreter:
    """Executes lowered actions for this rank's stages."""

    def __init__(self, stages: Mapping[int, PipelineStage], stage_rank: Mapping[int, int], rank: int,
                 transport: P2P | None) -> None:
        self.stages = dict(stages)
        # Free a sent output's storage once its send buffer is done (see exchange.release_storage). Auto (None):
        # on accelerators only, whose caching allocators make it free; on CPU, glibc hands the pages
        # back and the next forward faults them in again, which costs more time than it saves.
        self.release_sent: bool | None = None
        self.stage_rank = dict(stage_rank)
        self.rank = rank
        self.p2p = transport
        self.handlers: dict[ActionKind, Callable[[Action, StepContext], None]] = {
            ActionKind.F: self._forward,
            ActionKind.B: self._backward,
            ActionKind.I: self._backward,
            ActionKind.W: self._backward_weight,
        }
        # per stage, what its comm actions exchange (hand-built stages: known after the first step's shape pass)
        self.wiring: dict[int, Wiring] = {}
        self._flight: defaultdict[tuple[int, int], InFlight] = defaultdict(InFlight)
        self._sends: list[Batch] = []
        self._shapes: dict[tuple[int, tuple[int, ...]], tuple[int, ...]] = {}
        self._steps: dict[int, list[Action | list[Action]]] = {}  # id(actions) -> compute actions and batches
        self.failed_at: str | None = None  # after a failed run: the action it failed in, in words
        # measuring only: called right before and right after each compute action
        self.observer: ActionObserver | None = None
        if all(st.pipe is not None for st in self.stages.values()):
            self._wire()

    def _wire(self) -> None:
        """Each stage's exchanges, and whether its sent outputs record what autograd saves
        (for release_storage); once its inputs and routes are known."""
        for s, st in self.stages.items():
            if st.in_slots is None:
                raise PipelineError(f"stage {s}: its inputs are not known yet (the shape handshake of hand-built "
                                    "stages has not run)")
            self.wiring[s] = wire(st, st.in_slots, self.stage_rank, self.rank)
            on = self.release_sent if self.release_sent is not None else st.device.type != "cpu"
            st.track_saved_storages = on and any(any(ch.releasable) for ch in self.wiring[s].send_forward)

    def set_release_sent(self, on: bool | None) -> None:
        """Free sent outputs (``release_sent``: True, False, or None for auto); each stage then records what
        autograd saves for its sent outputs, or stops."""
        self.release_sent = None if on is None else bool(on)
        if self.wiring:
            self._wire()

    def run(self, actions: list[Action], ctx: StepContext) -> None:
        last_backward = {}  # per stage, its last action that accumulates weight gradients
        for action in actions:
            fused = action.stage in self.stages and self.stages[action.stage].weight_grads_in_input
            if action.kind is ActionKind.B or action.kind is (ActionKind.I if fused else ActionKind.W):
                last_backward[action.stage] = action
        for st in self.stages.values():
            set_grad_sync(st.module, False)
        self._shapes.clear()
        if not self.wiring:
            infer_manual_shapes(self.stages, self.stage_rank, self.rank, self.p2p, ctx)
            self._wire()
        steps = self._steps_of(actions)

        def compute(a: Action) -> None:
            if last_backward.get(a.stage) is a:
                set_grad_sync(self.stages[a.stage].module, True)  # data-parallel sync once, on the last backward
            self._arrive(a)  # waiting for its inputs is not the action's own time
            self._observed(a, lambda: self.handlers[a.kind](a, ctx))

        self._execute(steps, compute, lambda batch: self._post_batch(batch, ctx))
        self.finish()

    def decode(self, actions: list[Action], session: DecodeSession) -> None:
        """Run this rank's part of a lowered decode order (:mod:`.decode_order`) for one
        ``generate`` call: each ``D`` through ``session``, each maximal run of comm actions as
        one batch on the pipeline's transport, receives waited at once (the tokens they bring
        decide what the rank skips next); actions of rounds a lane no longer runs are skipped."""

        def compute(a: Action) -> None:
            if not session.skipped(a):
                self._observed(a, lambda: session.compute(a))

        def post(batch: list[Action]) -> None:
            batch = [a for a in batch if not session.skipped(a)]
            if batch:
                self._post_decode(batch, session)

        self._execute(self._steps_of(actions), compute, post)
        self._settle()

    def _steps_of(self, actions: list[Action]) -> list[Action | list[Action]]:
        """Compute actions as they are, each maximal run of comm actions as one batch (kept per list)."""
        steps = self._steps.get(id(actions))
        if steps is None:
            steps = self._steps[id(actions)] = []
            for a in actions:
                if a.kind.is_compute:
                    steps.append(a)
                elif steps and isinstance(steps[-1], list):
                    steps[-1].append(a)
                else:
                    steps.append([a])
        return steps

    def _execute(self, steps: list[Action | list[Action]], compute: Callable[[Action], None],
                 post: Callable[[list[Action]], None]) -> None:
        """The one loop: each step in order, named for a profiler; where a run failed is kept."""
        self.failed_at = None
        profiled = torch.autograd.profiler._is_profiler_enabled  # a profiler sees every action by name
        step: Action | list[Action] | None = None
        try:
            for step in steps:
                run = (lambda s=step: post(s)) if isinstance(step, list) else (lambda s=step: compute(s))
                if profiled:
                    with torch.profiler.record_function(profiler_label(step)):
                        run()
                else:
                    run()
                if len(self._sends) > 8:  # release delivered send buffers (else they live to the step's end)
                    self._release_sends()
            step = None
        except BaseException:
            self.failed_at = where_failed(step)
            raise

    def _observed(self, a: Action, run: Callable[[], None]) -> None:
        if self.observer is not None:
            self.observer.before(a)
        run()
        if self.observer is not None:
            self.observer.after(a)

    def _release_sends(self) -> None:
        done = [b for b in self._sends if b.is_completed()]
        for b in done:
            assert self.p2p is not None  # it was posted through it
            self.p2p.wait(b)  # already complete: surfaces an error without blocking
        self._sends = [b for b in self._sends if b not in done]

    def _post_decode(self, batch: list[Action], session: DecodeSession) -> None:
        if self.p2p is None:
            raise PipelineError(f"rank {self.rank}: a communication action on a run without a process group")
        start = time.perf_counter() if self.observer is not None else 0.0
        posted = post_decode_batch(self.p2p, batch, session, self.stage_rank,
                                   lambda s: self.stages[s].device if s in self.stages else torch.device("cpu"))
        if self.observer is not None:
            self.observer.batch(batch, start, time.perf_counter())
        if posted is not None:
            self._sends.append(posted)

    def _settle(self) -> None:
        for batch in self._sends:
            assert self.p2p is not None  # it was posted through it
            self.p2p.wait(batch)
        self._sends.clear()

    def _post_batch(self, batch: list[Action], ctx: StepContext) -> None:
        ops: list[P2POp] = []
        for a in batch:
            backward = a.kind is ActionKind.SEND_B or a.kind is ActionKind.RECV_B
            if a.kind is ActionKind.SEND_F or a.kind is ActionKind.SEND_B:
                ops += self._send(a, backward)
            else:
                ops += self._receive(a, ctx, backward)
        if self.p2p is None:
            raise PipelineError(f"rank {self.rank}: a communication action on a run without a process group")
        start = time.perf_counter() if self.observer is not None else 0.0
        posted = self.p2p.post(ops)
        if self.observer is not None:
            self.observer.batch(batch, start, time.perf_counter())
        if any(op.send for op in ops):
            self._sends.append(posted)

    def _shape(self, spec: TensorSpec, ctx: StepContext, mb: int) -> tuple[int, ...]:
        """Concrete shape of a dynamic spec for microbatch ``mb`` of this step (its own sizes:
        microbatches may differ in a dynamic dim); evaluated once per distinct sizes, not per
        message. Static shapes are read off the wiring (``PeerExchange.shapes``, ``Outgoing.shape``)."""
        bindings = ctx.bindings[mb]
        key = (id(spec), tuple(bindings.values()))
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = concrete_shape(spec.shape, bindings)
        return shape

    def finish(self) -> None:
        """Wait for every send of the step; a receive nobody consumed is a bug in the order."""
        self._settle()
        left = sorted(k for k, r in self._flight.items() if r.arriving_inputs or r.arriving_grads)
        self._flight.clear()
        if left:
            raise PipelineError(f"rank {self.rank}: messages for (stage, microbatch) {left} were received but never "
                                "used by the step's actions")

    def reset(self) -> None:
        """Forget everything in flight (after a failure)."""
        self._flight.clear()
        self._sends.clear()
        for st in self.stages.values():
            st.clear()

    # ---- compute -----------------------------------------------------------------
    def _forward(self, a: Action, ctx: StepContext) -> None:
        stage, wiring, record = self.stages[a.stage], self.wiring[a.stage], self._flight[(a.stage, a.mb)]
        if stage.pipe is None and stage.is_first:
            assert ctx.mb_args is not None and ctx.mb_kwargs is not None  # split where stage 0 lives
            args = [_to(x, stage.device) for x in ctx.mb_args[a.mb]]
            kwargs = {k: _to(v, stage.device) for k, v in ctx.mb_kwargs[a.mb].items()}
        else:
            args, kwargs = self._gather(stage, wiring, record, a.mb, ctx), None
        target = _to(ctx.targets[a.mb], stage.device) if (stage.is_last and ctx.targets is not None) else None
        outs = stage.forward(a.mb, args, kwargs, train=ctx.train, target=target, loss=ctx.loss)
        for out in wiring.outgoing:
            if out.from_input:
                assert ctx.flat_inputs is not None  # the rank given the data forwards model inputs
                value = _to(ctx.flat_inputs[a.mb][out.route.src_output], stage.device)
            else:
                value = outs[out.route.src_output]
            if isinstance(value, torch.Tensor) and out.route.spec is not None:
                expected = out.shape if out.shape is not None else self._shape(out.route.spec, ctx, a.mb)
                wrong_grad = ctx.train and not out.carries_grad and not out.from_input and value.requires_grad
                if tuple(value.shape) != expected or value.dtype != out.route.spec.dtype or wrong_grad:
                    refuse_crossing(value, out.route, expected, wrong_grad, out.shape is None, f"stage {a.stage}, microbatch "
                            f"{a.mb}, forward to stage {out.route.dst_stage} (rank {self.stage_rank[out.route.dst_stage]})")
            if out.local:
                self._flight[(out.route.dst_stage, a.mb)].inputs[out.key] = _received(value, out.carries_grad)
            else:
                record.to_send[out.index] = value

    def _arrive(self, a: Action) -> None:
        """Wait for the messages compute action ``a`` reads (a forward's inputs, a backward's
        output gradients) and file them in its in-flight record."""
        record = self._flight.get((a.stage, a.mb))
        if record is None:
            return
        if a.kind is ActionKind.F and record.arriving_inputs:
            for key, carries_grad, op in record.arriving_inputs:
                assert self.p2p is not None  # it was posted through it
                record.inputs[key] = _received(self.p2p.wait_recv(op), carries_grad)
            record.arriving_inputs = []
        elif (a.kind is ActionKind.B or a.kind is ActionKind.I) and record.arriving_grads:
            for output, _, op in record.arriving_grads:
                assert self.p2p is not None  # it was posted through it
                record.output_grads.setdefault(output, []).append(self.p2p.wait_recv(op))
            record.arriving_grads = []

    def _gather(self, stage: PipelineStage, wiring: Wiring, record: InFlight, mb: int, ctx: StepContext) -> list[Any]:
        """The forward's arguments: its received values (waited for by :meth:`_arrive`), then every input in order."""
        inbox, record.inputs = record.inputs, {}

        def missing(slot: Any) -> None:
            raise PipelineError(f"stage {stage.stage_index}, microbatch {mb}: input {slot.index} from "
                                f"{_who(slot.src_stage)} output {slot.src_output} has not arrived "
                                "(the schedule ran a forward before its input was received)")

        flat = ctx.flat_inputs[mb] if ctx.flat_inputs is not None else None
        args = wiring.args(flat, inbox, ctx.bindings[mb] if ctx.bindings else {}, on_missing=missing)
        return [_to(a, stage.device) if slot.kind is InputKind.MODEL else a for a, slot in zip(args, wiring.slots)]

    def _backward(self, a: Action, ctx: StepContext) -> None:
        """B, or its input half I: the output gradients in, the input gradients on their way."""
        stage, wiring, record = self.stages[a.stage], self.wiring[a.stage], self._flight[(a.stage, a.mb)]
        grads = {i: (gs[0] if len(gs) == 1 else torch.stack(gs).sum(0)) for i, gs in record.output_grads.items()}
        record.output_grads = {}
        run = stage.backward if a.kind is ActionKind.B else stage.backward_input
        for i, g in run(a.mb, grads).items():
            edge = wiring.slots[i].edge
            if edge is None or edge.src_stage == MODEL_INPUT:
                continue
            if self.stage_rank[edge.src_stage] == self.rank:
                self._flight[(edge.src_stage, a.mb)].output_grads.setdefault(edge.src_output, []).append(g)
            else:
                record.grads_to_send[i] = g

    def _backward_weight(self, a: Action, ctx: StepContext) -> None:
        self.stages[a.stage].backward_weight(a.mb)

    # ---- communication: each comm action expands into its ops, in the order both ends share ----
    def _send(self, a: Action, backward: bool) -> list[P2POp]:
        wiring, record = self.wiring[a.stage], self._flight[(a.stage, a.mb)]
        waiting = record.grads_to_send if backward else record.to_send
        ops, sent = [], []
        for ch in wiring.send_backward if backward else wiring.send_forward:
            if a.peer is not None and ch.peer_stage != a.peer:
                continue  # kept for its own SEND
            what = (f"stage {a.stage} sending the {'gradient' if backward else 'forward'} of microbatch {a.mb} to "
                    f"stage {ch.peer_stage} on rank {ch.peer_rank}")
            values = [(i, waiting.pop(key)) for i, key in enumerate(ch.keys) if key in waiting]
            tag = ch.tag + ch.mb_stride * (a.mb % 1024)
            ops += [P2P.send_op(v, ch.peer_rank, what, tag + k % 64, ch.dim_orders[i]) for k, (i, v) in enumerate(values)]
            sent += [v for i, v in values if ch.releasable[i]]
        stage = self.stages[a.stage]
        if stage.track_saved_storages:  # a value read by several stages: only after its last send
            for value in sent:
                if all(value is not v for v in waiting.values()) and stage.may_release(a.mb, value):
                    release_storage(value)
        return ops

    def _receive(self, a: Action, ctx: StepContext, backward: bool) -> list[P2POp]:
        """One receive per tensor, sized exactly by its spec for this step (never a reused buffer);
        the action that uses it waits for it."""
        wiring, record, device = self.wiring[a.stage], self._flight[(a.stage, a.mb)], self.stages[a.stage].device
        landing = record.arriving_grads if backward else record.arriving_inputs
        ops = []
        for ch in wiring.recv_backward if backward else wiring.recv_forward:
            if a.peer is not None and ch.peer_stage != a.peer:
                continue
            what = (f"stage {a.stage} waiting for the {'gradient' if backward else 'forward'} of microbatch {a.mb} "
                    f"from stage {ch.peer_stage} on rank {ch.peer_rank}")
            tag = ch.tag + ch.mb_stride * (a.mb % 1024)
            for k, (key, spec, shape) in enumerate(zip(ch.keys, ch.specs, ch.shapes)):
                op, _ = P2P.recv_op(shape if shape is not None else self._shape(spec, ctx, a.mb), spec.dtype, device,
                                    ch.peer_rank, what, tag + k % 64, ch.dim_orders[k])
                landing.append(Arrival(key, ch.carries_grad[k], op))
                ops.append(op)
        return ops


def _received(t: torch.Tensor, carries_grad: bool) -> torch.Tensor:
    """A value from another stage, as this stage's leaf (gradients flow back along it)."""
    t = t.detach()
    if carries_grad and (t.is_floating_point() or t.is_complex()):
        t.requires_grad_(True)
    return t


def _to(value: Any, device: torch.device) -> Any:
    """Model inputs and targets arrive wherever the user made them; stages run on their device."""
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device, non_blocking=True)
    return value


def _who(stage: int) -> str:
    return "the model input" if stage == MODEL_INPUT else f"stage {stage}"
