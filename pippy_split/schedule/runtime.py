"""The one interpreter: runs this rank's lowered action list for one step.

Last step of the flow (… → schedule → **runtime**). A table maps each compute
kind to a handler; no schedule has its own loop. Values between stages on the
same rank are handed over in memory (a detached view: no copy, no message).
Hand-built stages learn their shapes once, on the first step (:mod:`.manual_shapes`).
Each run of consecutive comm actions is one batch, posted at once through the
:class:`~pippy_split.stage.transport.P2P` transport in list order (one tensor
per edge, in a key order both ends share), as the lowered order and
``validate`` describe it; a received tensor is waited for only when the
action that consumes it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch

from ..split.spec import MODEL_INPUT, Edge, InputKind, StageInput, TensorSpec, gather_inputs
from ..stage.errors import PipelineError
from ..stage.stage import PipelineStage
from ..stage.transport import P2P, Batch, P2POp, Pending
from .actions import Action, ActionKind
from .manual_shapes import infer_manual_shapes

__all__ = ["StepContext", "Interpreter", "ActionObserver"]


class ActionObserver(Protocol):
    """Told right before and right after each compute action (see ``PipelineSchedule.timed_actions``)."""

    def before(self, action: Action) -> None: ...

    def after(self, action: Action) -> None: ...


@dataclass
class StepContext:
    """Everything one step needs besides the stages."""

    n_microbatches: int
    train: bool
    loss_divisor: float = 1.0  # the last stage's loss is divided by this (mean over microbatches or items)
    loss_scale: float = 1.0  # ... and multiplied by this (fp16 loss scaling) before backward
    flat_inputs: list[list[Any]] | None = None  # per mb, on the rank holding stage 0 (traced stages)
    mb_args: list[tuple] | None = None  # per mb, manual stage 0
    mb_kwargs: list[dict] | None = None
    targets: list[Any] | None = None  # per mb, on the rank holding the last stage
    bindings: list[dict] = field(default_factory=list)  # per mb, each dynamic symbol's size (see .dynamic_sizes)
    per_microbatch: bool = False  # given Microbatches: outputs stay per microbatch
    outputs: dict[int, Any] = field(default_factory=dict)
    loss: Any = None  # the schedule's LossRule (loss_fn, on_nonfinite) for the last stage


class Interpreter:
    """Executes lowered actions for this rank's stages."""

    def __init__(self, stages: Mapping[int, PipelineStage], stage_rank: Mapping[int, int], rank: int,
                 transport: P2P | None, links: list[tuple[int, int, bool]] | None = None) -> None:
        self.stages = dict(stages)
        self.senders: dict[int, list[int]] = {}
        for src, dst, _ in links or []:
            self.senders.setdefault(dst, []).append(src)
        self._shapes_known = all(st.pipe is not None for st in self.stages.values())  # hand-built: first step
        # Free a sent output's storage once its send buffer is done (see _release_storage). Auto (None):
        # on accelerators only, whose caching allocators make it free; on CPU, glibc hands the pages
        # back and the next forward faults them in again (measured: ZBV d=256 step +15-20% on 2 cores).
        self.release_sent: bool | None = None
        self.stage_rank = dict(stage_rank)
        self.rank = rank
        self.p2p = transport
        self.num_stages = len(stage_rank)
        self.handlers: dict[ActionKind, Callable[[Action, StepContext], None]] = {
            ActionKind.F: self._forward,
            ActionKind.B: self._backward,
            ActionKind.I: self._backward_input,
            ActionKind.W: self._backward_weight,
        }
        # comm kind -> expands one action into its ops (a receive with where its result lands)
        self.posters: dict[ActionKind, Callable[[Action, StepContext], list[tuple[P2POp, Any]]]] = {
            ActionKind.SEND_F: self._send_forward,
            ActionKind.RECV_F: self._recv_forward,
            ActionKind.SEND_B: self._send_backward,
            ActionKind.RECV_B: self._recv_backward,
        }
        self._fwd_inbox: dict[tuple[int, int], dict[tuple[int, int], torch.Tensor]] = {}
        self._bwd_inbox: dict[tuple[int, int], dict[int, list[torch.Tensor]]] = {}
        self._outbox: dict[tuple[int, int], list[tuple[Edge, torch.Tensor]]] = {}
        self._grad_outbox: dict[tuple[int, int], list[tuple[StageInput, torch.Tensor]]] = {}
        # receives posted but not yet waited for: (stage, mb) -> [(slot or route, Pending)]
        self._fwd_pending: dict[tuple[int, int], list[tuple[StageInput, Pending]]] = {}
        self._bwd_pending: dict[tuple[int, int], list[tuple[Edge, Pending]]] = {}
        self._sends: list[Batch] = []
        self._shapes: dict[tuple[int, tuple[int, ...]], tuple[int, ...]] = {}
        self._steps: dict[int, list[Action | list[Action]]] = {}  # id(actions) -> compute actions and batches
        # measuring only: called right before and right after each compute action
        self.observer: ActionObserver | None = None
        self.track_sent_outputs()

    def track_sent_outputs(self) -> None:
        """Stages whose outputs go to other ranks record what autograd saves (for _release_storage)."""
        for st in self.stages.values():
            on = self.release_sent if self.release_sent is not None else st.device.type != "cpu"
            st.track_saved_storages = on and any(not r.from_input and not self._local(r.dst_stage) for r in st.routes)

    def run(self, actions: list[Action], ctx: StepContext) -> None:
        last_backward = {}  # per stage, its last action that accumulates weight gradients
        for action in actions:
            fused = action.stage in self.stages and self.stages[action.stage].weight_grads_in_input
            if action.kind is ActionKind.B or action.kind is (ActionKind.I if fused else ActionKind.W):
                last_backward[action.stage] = action
        for st in self.stages.values():
            st.set_grad_sync(False)
        self._shapes.clear()
        if not self._shapes_known:
            infer_manual_shapes(self.stages, self.stage_rank, self.rank, self.p2p, ctx)
            self._shapes_known = True
            self.track_sent_outputs()
        for step in self._grouped(actions):
            if isinstance(step, list):
                self._post_batch(step, ctx)
                continue
            if last_backward.get(step.stage) is step:
                self.stages[step.stage].set_grad_sync(True)  # data-parallel sync once, on the last backward
            if self.observer is not None:
                self.observer.before(step)
            self.handlers[step.kind](step, ctx)
            if self.observer is not None:
                self.observer.after(step)
            if len(self._sends) > 8:
                self._prune_sends()
        self.finish()

    def _grouped(self, actions: list[Action]) -> list[Action | list[Action]]:
        """Compute actions as they are, each maximal run of comm actions as one batch (cached)."""
        steps = self._steps.get(id(actions))
        if steps is None:
            steps = []
            for a in actions:
                if a.kind.is_compute:
                    steps.append(a)
                elif steps and isinstance(steps[-1], list):
                    steps[-1].append(a)
                else:
                    steps.append([a])
            self._steps[id(actions)] = steps
        return steps

    def _post_batch(self, batch: list[Action], ctx: StepContext) -> None:
        expanded = [item for a in batch for item in self.posters[a.kind](a, ctx)]
        posted = self._net().post([op for op, _ in expanded])
        if any(op.send for op, _ in expanded):
            self._sends.append(posted)
        for index, (op, landing) in enumerate(expanded):
            if landing is not None:  # a receive: its tensor is waited for by the action that uses it
                box, key, where, complex_dtype = landing
                box.setdefault(key, []).append((where, Pending(posted, index, op.tensor, complex_dtype, op.what)))

    def _prune_sends(self) -> None:
        """Release send buffers whose messages are delivered (they would otherwise live to the step's end)."""
        still = []
        for batch in self._sends:
            if batch.is_completed():
                self._net().wait(batch)  # already complete: surfaces an error without blocking
            else:
                still.append(batch)
        self._sends = still

    def _recv_op(self, spec: TensorSpec | None, stage: PipelineStage, peer: int, what: str, ctx: StepContext,
                 box: dict, key: tuple[int, int], where: Any, tag: int) -> tuple[P2POp, Any]:
        """One receive sized exactly by the spec for this step (never a reused buffer); once the
        batch is posted, its Pending lands in ``box[key]`` next to ``where`` (its slot or route)."""
        assert spec is not None  # every received value is an edge, and an edge has a spec
        op, complex_dtype = P2P.recv_op(self._shape(spec, ctx, key[1]), spec.dtype, stage.device, peer, what, tag)
        return op, (box, key, where, complex_dtype)

    def _shape(self, spec: TensorSpec, ctx: StepContext, mb: int) -> tuple[int, ...]:
        """Concrete shape of a spec for microbatch ``mb`` of this step (its own sizes: microbatches
        may differ in a dynamic dim); evaluated once per distinct sizes, not per message."""
        if not spec.is_dynamic:
            return spec.shape
        bindings = ctx.bindings[mb]
        key = (id(spec), tuple(bindings.values()))
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = spec.concrete_shape(bindings)
        return shape

    def finish(self) -> None:
        """Wait for every send of the step; a receive nobody consumed is a bug in the order."""
        for batch in self._sends:
            self._net().wait(batch)
        self._sends.clear()
        left = sorted(set(self._fwd_pending) | set(self._bwd_pending))
        if left:
            self._fwd_pending.clear()
            self._bwd_pending.clear()
            raise PipelineError(f"rank {self.rank}: messages for (stage, microbatch) {left} were received but never "
                                "used by the step's actions")

    def reset(self) -> None:
        """Forget everything in flight (after a failure)."""
        self._fwd_inbox.clear()
        self._bwd_inbox.clear()
        self._outbox.clear()
        self._grad_outbox.clear()
        self._fwd_pending.clear()
        self._bwd_pending.clear()
        self._sends.clear()
        for st in self.stages.values():
            st.clear()

    # ---- helpers -----------------------------------------------------------------
    def _net(self) -> P2P:
        """The transport (a lowered order has comm actions only where there are several ranks)."""
        if self.p2p is None:
            raise PipelineError(f"rank {self.rank}: a communication action on a run without a process group")
        return self.p2p

    @staticmethod
    def _slots(stage: PipelineStage) -> list[StageInput]:
        """The stage's inputs (a hand-built stage learns them before its first action)."""
        if stage.in_slots is None:
            raise PipelineError(f"stage {stage.stage_index}: its inputs are not known yet (the shape handshake "
                                "of hand-built stages has not run)")
        return stage.in_slots

    def _local(self, stage: int) -> bool:
        return self.stage_rank[stage] == self.rank

    @staticmethod
    def _received(t: torch.Tensor, spec: TensorSpec | None) -> torch.Tensor:
        t = t.detach()
        if spec is not None and spec.carries_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t

    def _arrived_forward(self, stage: int, mb: int) -> None:
        """Wait for the posted receives of (stage, mb)'s inputs and file them in the inbox."""
        pending = self._fwd_pending.pop((stage, mb), None)
        if pending:
            box = self._fwd_inbox.setdefault((stage, mb), {})
            for slot, p in pending:
                self._net().wait_recv(p)
                box[(slot.src_stage, slot.src_output)] = self._received(p.result(), slot.spec)

    def _arrived_backward(self, stage: int, mb: int) -> None:
        pending = self._bwd_pending.pop((stage, mb), None)
        if pending:
            box = self._bwd_inbox.setdefault((stage, mb), {})
            for route, p in pending:
                self._net().wait_recv(p)
                box.setdefault(route.src_output, []).append(p.result())

    def _gather(self, stage: PipelineStage, mb: int, ctx: StepContext) -> list[Any]:
        self._arrived_forward(stage.stage_index, mb)
        inbox = self._fwd_inbox.pop((stage.stage_index, mb), {})

        def missing(slot: StageInput) -> None:
            raise PipelineError(f"stage {stage.stage_index}, microbatch {mb}: input {slot.index} from "
                                f"{_who(slot.src_stage)} output {slot.src_output} has not arrived "
                                "(the schedule ran a forward before its input was received)")

        flat = ctx.flat_inputs[mb] if ctx.flat_inputs is not None else None
        slots = self._slots(stage)
        args = gather_inputs(slots, flat, inbox, ctx.bindings[mb] if ctx.bindings else {}, on_missing=missing)
        return [_to(a, stage.device) if slot.kind is InputKind.MODEL else a for a, slot in zip(args, slots)]

    def _check(self, t: Any, spec: TensorSpec | None, ctx: StepContext, mb: int, what: str) -> None:
        if spec is None or not isinstance(t, torch.Tensor):
            return
        expected = self._shape(spec, ctx, mb)
        if tuple(t.shape) != tuple(expected) or t.dtype != spec.dtype:
            changed = [f"dim {i}: traced {spec.shape[i]}, got {g}" for i, (g, e) in enumerate(zip(t.shape, expected)) if g != e]
            hint = (" — declare it dynamic with dynamic_shapes=... when calling pipeline()" if changed and not spec.is_dynamic
                    else "")
            raise PipelineError(f"{what}: expected shape {tuple(expected)} {spec.dtype}, got {tuple(t.shape)} {t.dtype}"
                                f" ({'; '.join(changed) or 'dtype differs'}){hint}")

    # ---- compute -----------------------------------------------------------------
    def _forward(self, a: Action, ctx: StepContext) -> None:
        stage = self.stages[a.stage]
        if stage.pipe is None and stage.is_first:
            assert ctx.mb_args is not None and ctx.mb_kwargs is not None  # split where stage 0 lives
            args = [_to(x, stage.device) for x in ctx.mb_args[a.mb]]
            kwargs = {k: _to(v, stage.device) for k, v in ctx.mb_kwargs[a.mb].items()}
        else:
            args, kwargs = self._gather(stage, a.mb, ctx), None
        target = _to(ctx.targets[a.mb], stage.device) if (stage.is_last and ctx.targets is not None) else None
        outs = stage.forward(a.mb, args, kwargs, train=ctx.train, target=target, loss=ctx.loss)
        if stage.is_last:
            ctx.outputs[a.mb] = stage.model_output(tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs))
        for route in stage.routes:
            if route.from_input:
                assert ctx.flat_inputs is not None  # the rank given the data forwards model inputs
                value = _to(ctx.flat_inputs[a.mb][route.src_output], stage.device)
            else:
                value = outs[route.src_output]
            what = f"stage {a.stage}, microbatch {a.mb}, forward to stage {route.dst_stage} (rank {self.stage_rank[route.dst_stage]})"
            self._check(value, route.spec, ctx, a.mb, what)
            if ctx.train and route.spec is not None and not route.spec.carries_grad and not route.from_input \
                    and isinstance(value, torch.Tensor) and value.requires_grad:
                raise PipelineError(f"{what}: value {route.src_output} requires grad at run time but the traced "
                                    "edge says it does not; its gradient would be lost")
            if self._local(route.dst_stage):
                box = self._fwd_inbox.setdefault((route.dst_stage, a.mb), {})
                box[(route.src_stage, route.src_output)] = self._received(value, route.spec)
            else:
                self._outbox.setdefault((a.stage, a.mb), []).append((route, value))

    def _output_grads(self, stage: PipelineStage, mb: int) -> dict[int, torch.Tensor]:
        self._arrived_backward(stage.stage_index, mb)
        box = self._bwd_inbox.pop((stage.stage_index, mb), {})
        return {i: (gs[0] if len(gs) == 1 else torch.stack(gs).sum(0)) for i, gs in box.items()}

    def _deliver_grads(self, stage: PipelineStage, mb: int, grads: dict[int, torch.Tensor]) -> None:
        for i, g in grads.items():
            slot = self._slots(stage)[i]
            if slot.kind is not InputKind.EDGE or slot.src_stage == MODEL_INPUT:
                continue
            if self._local(slot.src_stage):
                self._bwd_inbox.setdefault((slot.src_stage, mb), {}).setdefault(slot.src_output, []).append(g)
            else:
                self._grad_outbox.setdefault((stage.stage_index, mb), []).append((slot, g))

    def _backward(self, a: Action, ctx: StepContext) -> None:
        stage = self.stages[a.stage]
        grads = stage.backward(a.mb, self._output_grads(stage, a.mb), ctx.loss_divisor / ctx.loss_scale)
        self._deliver_grads(stage, a.mb, grads)

    def _backward_input(self, a: Action, ctx: StepContext) -> None:
        stage = self.stages[a.stage]
        grads = stage.backward_input(a.mb, self._output_grads(stage, a.mb), ctx.loss_divisor / ctx.loss_scale)
        self._deliver_grads(stage, a.mb, grads)

    def _backward_weight(self, a: Action, ctx: StepContext) -> None:
        self.stages[a.stage].backward_weight(a.mb)

    # ---- communication: each poster expands one comm action into its ops, in key order ----
    def _tag(self, backward: int, sender: int, receiver: int, mb: int, k: int) -> int:
        """The k-th tensor of one message, numbered alike at both ends. Used only by a
        transport with ``ordered=False``; the default sends everything with tag 0."""
        n = self.num_stages
        return ((((mb % 1024) * 2 + backward) * n + sender) * n + receiver) * 64 + k % 64
    def _peers(self, a: Action, remote: list[int]) -> list[int]:
        """The peer stages an action talks to: the one it names, else every remote one, ascending."""
        return [a.peer] if a.peer is not None else sorted(set(remote))

    def _send_forward(self, a: Action, ctx: StepContext) -> list[tuple[P2POp, Any]]:
        entries = self._outbox.pop((a.stage, a.mb), [])
        ops, sent = [], []
        for dst in self._peers(a, [r.dst_stage for r, _ in entries]):
            mine = sorted((e for e in entries if e[0].dst_stage == dst),
                          key=lambda e: (e[0].from_input, e[0].src_output, e[0].dst_input))
            peer = self.stage_rank[dst]
            what = f"stage {a.stage} sending the forward of microbatch {a.mb} to stage {dst} on rank {peer}"
            ops += [(P2P.send_op(value, peer, what, self._tag(0, a.stage, dst, a.mb, k)), None)
                    for k, (_, value) in enumerate(mine)]
            sent += [value for route, value in mine if not route.from_input]
            entries = [e for e in entries if e[0].dst_stage != dst]
        if entries:  # messages for other peers: kept for their own SEND
            self._outbox[(a.stage, a.mb)] = entries
        stage = self.stages[a.stage]
        if stage.track_saved_storages:  # a value read by several stages: only after its last send
            for value in sent:
                if all(value is not v for _, v in entries) and stage.may_release(a.mb, value):
                    _release_storage(value)
        return ops

    def _recv_forward(self, a: Action, ctx: StepContext) -> list[tuple[P2POp, Any]]:
        stage = self.stages[a.stage]
        remote = [sl for sl in self._slots(stage) if sl.kind is InputKind.EDGE and not self._local(sl.sender_stage)]
        ops = []
        for src in self._peers(a, [sl.sender_stage for sl in remote]):
            peer = self.stage_rank[src]
            what = (f"stage {a.stage} waiting for the forward of microbatch {a.mb} from stage {src} "
                    f"on rank {peer}")
            mine = sorted((sl for sl in remote if sl.sender_stage == src),
                          key=lambda sl: (sl.src_stage == MODEL_INPUT, sl.src_output, sl.index))
            for k, slot in enumerate(mine):
                ops.append(self._recv_op(slot.spec, stage, peer, what, ctx, self._fwd_pending, (a.stage, a.mb), slot,
                                         self._tag(0, src, a.stage, a.mb, k)))
        return ops

    def _send_backward(self, a: Action, ctx: StepContext) -> list[tuple[P2POp, Any]]:
        entries = self._grad_outbox.pop((a.stage, a.mb), [])
        ops = []
        for dst in self._peers(a, [slot.src_stage for slot, _ in entries]):
            mine = sorted((e for e in entries if e[0].src_stage == dst), key=lambda e: (e[0].src_output, e[0].index))
            peer = self.stage_rank[dst]
            what = f"stage {a.stage} sending the gradient of microbatch {a.mb} to stage {dst} on rank {peer}"
            ops += [(P2P.send_op(grad, peer, what, self._tag(1, a.stage, dst, a.mb, k)), None)
                    for k, (_, grad) in enumerate(mine)]
            entries = [e for e in entries if e[0].src_stage != dst]
        if entries:
            self._grad_outbox[(a.stage, a.mb)] = entries
        return ops

    def _recv_backward(self, a: Action, ctx: StepContext) -> list[tuple[P2POp, Any]]:
        stage = self.stages[a.stage]
        remote = [r for r in stage.routes if not r.from_input and not self._local(r.dst_stage)
                  and r.spec is not None and r.spec.carries_grad]
        ops = []
        for dst in self._peers(a, [r.dst_stage for r in remote]):
            peer = self.stage_rank[dst]
            what = (f"stage {a.stage} waiting for the gradient of microbatch {a.mb} from stage {dst} "
                    f"on rank {peer}")
            mine = sorted((r for r in remote if r.dst_stage == dst), key=lambda r: (r.src_output, r.dst_input))
            for k, route in enumerate(mine):
                ops.append(self._recv_op(route.spec, stage, peer, what, ctx, self._bwd_pending, (a.stage, a.mb),
                                         route, self._tag(1, dst, a.stage, a.mb, k)))
        return ops


def _release_storage(value: Any) -> None:
    """Let an output that went to another rank give its memory back (Megatron's
    ``deallocate_output_tensor`` idea). Backward needs only its autograd node and its
    shape: the tensor now points at one element expanded to the same shape, and the
    old storage lives on only where something else holds it (the send buffer until
    the send completes, a same-rank hand-off), so nothing that reads the values
    changes. Outputs whose storage autograd saved (``PipelineStage.may_release``),
    leaves (parameters, buffers, inputs) and views are left alone."""
    if not isinstance(value, torch.Tensor) or value.grad_fn is None or value._base is not None:
        return
    value.data = torch.empty((), dtype=value.dtype, device=value.device).expand(value.shape)


def _to(value: Any, device: torch.device) -> Any:
    """Model inputs and targets arrive wherever the user made them; stages run on their device."""
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device, non_blocking=True)
    return value


def _who(stage: int) -> str:
    return "the model input" if stage == MODEL_INPUT else f"stage {stage}"
