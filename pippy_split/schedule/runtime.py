"""The one interpreter: runs this rank's lowered action list for one step.

Last step of the flow (… → schedule → **runtime**). A table maps each action
kind to a handler; no schedule has its own loop. Values between stages on the
same rank are handed over in memory (a detached view: no copy, no message);
values to other ranks go through the :class:`~pippy_split.stage.transport.P2P`
transport with one tagged message per edge and microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..split.spec import MODEL_INPUT, TensorSpec
from ..stage.errors import PipelineError
from ..stage.stage import InputSlot, PipelineStage, Route
from ..stage.transport import P2P, Pending
from .actions import Action, ActionKind

__all__ = ["StepContext", "Interpreter"]

_MB_SLOTS, _OUT_SLOTS = 64, 256


def _tag(mb: int, src: int, out: int, dst: int, n: int, kind: int) -> int:
    """Unique per (microbatch window, edge, direction) between a pair of ranks."""
    return (((((mb % _MB_SLOTS) * n + dst) * (n + 1) + src + 1) * _OUT_SLOTS + out % _OUT_SLOTS) * 3 + kind)


@dataclass
class StepContext:
    """Everything one step needs besides the stages."""

    n_microbatches: int
    train: bool
    flat_inputs: list[list[Any]] | None = None  # per mb, on the rank holding stage 0 (traced stages)
    mb_args: list[tuple] | None = None  # per mb, manual stage 0
    mb_kwargs: list[dict] | None = None
    targets: list[Any] | None = None  # per mb, on the rank holding the last stage
    bindings: dict = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)


class Interpreter:
    """Executes lowered actions for this rank's stages."""

    def __init__(self, stages: Mapping[int, PipelineStage], stage_rank: Mapping[int, int], rank: int,
                 transport: P2P | None, links: list[tuple[int, int, bool]] | None = None) -> None:
        self.stages = dict(stages)
        self.senders: dict[int, list[int]] = {}
        for src, dst, _ in links or []:
            self.senders.setdefault(dst, []).append(src)
        self._headers_sent: set[tuple[int, int]] = set()
        self.stage_rank = dict(stage_rank)
        self.rank = rank
        self.p2p = transport
        self.num_stages = len(stage_rank)
        self.handlers: dict[ActionKind, Callable[[Action, StepContext], None]] = {
            ActionKind.F: self._forward,
            ActionKind.B: self._backward,
            ActionKind.I: self._backward_input,
            ActionKind.W: self._backward_weight,
            ActionKind.SEND_F: self._send_forward,
            ActionKind.RECV_F: self._recv_forward,
            ActionKind.SEND_B: self._send_backward,
            ActionKind.RECV_B: self._recv_backward,
        }
        self._fwd_inbox: dict[tuple[int, int], dict[tuple[int, int], torch.Tensor]] = {}
        self._bwd_inbox: dict[tuple[int, int], dict[int, list[torch.Tensor]]] = {}
        self._outbox: dict[tuple[int, int], list[tuple[Route, torch.Tensor]]] = {}
        self._grad_outbox: dict[tuple[int, int], list[tuple[InputSlot, torch.Tensor]]] = {}
        self._sends: list[Pending] = []
        self._shapes: dict[int, tuple[int, ...]] = {}

    def run(self, actions: list[Action], ctx: StepContext) -> None:
        last_backward = {}
        for i, action in enumerate(actions):
            if action.kind in (ActionKind.B, ActionKind.W):
                last_backward[action.stage] = i
        for st in self.stages.values():
            st.set_grad_sync(False)
        self._shapes.clear()
        for i, action in enumerate(actions):
            if last_backward.get(action.stage) == i:
                self.stages[action.stage].set_grad_sync(True)  # data-parallel sync once, on the last backward
            self.handlers[action.kind](action, ctx)
            if len(self._sends) > 8:
                self._prune_sends()
        self.finish()

    def _prune_sends(self) -> None:
        """Release send buffers whose messages are delivered (they would otherwise live to the step's end)."""
        still = []
        for pending in self._sends:
            if pending.work.is_completed():
                self.p2p.wait(pending)  # already complete: surfaces an error without blocking
            else:
                still.append(pending)
        self._sends = still

    def _post_recv(self, spec: TensorSpec, stage: PipelineStage, peer: int, tag: int, what: str,
                   ctx: StepContext) -> Pending:
        """Post one receive sized exactly by the spec for this step (never a reused buffer)."""
        return self.p2p.recv(self._shape(spec, ctx), spec.dtype, stage.device, peer, tag, what)

    def _shape(self, spec: TensorSpec, ctx: StepContext) -> tuple[int, ...]:
        """Concrete shape of a spec for this step (evaluated once per step, not per message)."""
        if not spec.is_dynamic:
            return spec.shape
        key = id(spec)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = spec.concrete_shape(ctx.bindings)
        return shape

    def finish(self) -> None:
        for pending in self._sends:
            self.p2p.wait(pending)
        self._sends.clear()

    def reset(self) -> None:
        """Forget everything in flight (after a failure)."""
        self._fwd_inbox.clear()
        self._bwd_inbox.clear()
        self._outbox.clear()
        self._grad_outbox.clear()
        self._sends.clear()
        for st in self.stages.values():
            st.clear()

    # ---- helpers -----------------------------------------------------------------
    def _local(self, stage: int) -> bool:
        return self.stage_rank[stage] == self.rank

    @staticmethod
    def _received(t: torch.Tensor, spec: TensorSpec | None) -> torch.Tensor:
        t = t.detach()
        if spec is not None and spec.carries_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t

    def _gather(self, stage: PipelineStage, mb: int, ctx: StepContext) -> list[Any]:
        inbox = self._fwd_inbox.pop((stage.stage_index, mb), {})
        args = []
        for slot in stage.in_slots:
            if slot.kind == "model":
                args.append(_to(ctx.flat_inputs[mb][slot.src_output], stage.device))
            elif slot.kind == "symbol":
                args.append(int(slot.expr.xreplace(ctx.bindings)))
            else:
                key = (slot.src_stage, slot.src_output)
                if key not in inbox:
                    raise PipelineError(f"stage {stage.stage_index}, microbatch {mb}: input {slot.index} from "
                                        f"{_who(slot.src_stage)} output {slot.src_output} has not arrived "
                                        "(the schedule ran a forward before its input was received)")
                args.append(inbox[key])
        return args

    def _check(self, t: Any, spec: TensorSpec | None, ctx: StepContext, what: str) -> None:
        if spec is None or not isinstance(t, torch.Tensor):
            return
        expected = self._shape(spec, ctx)
        if tuple(t.shape) != tuple(expected) or t.dtype != spec.dtype:
            changed = [f"dim {i}: traced {spec.shape[i]}, got {g}" for i, (g, e) in enumerate(zip(t.shape, expected)) if g != e]
            hint = (" — declare it dynamic with dynamic_shapes=... when calling pipeline()" if changed and not spec.is_dynamic
                    else "")
            raise PipelineError(f"{what}: expected shape {tuple(expected)} {spec.dtype}, got {tuple(t.shape)} {t.dtype}"
                                f" ({'; '.join(changed) or 'dtype differs'}){hint}")

    # ---- compute -----------------------------------------------------------------
    def _forward(self, a: Action, ctx: StepContext) -> None:
        stage = self.stages[a.stage]
        if stage.in_slots is None:
            self._handshake(stage, ctx)
        if stage.pipe is None and stage.is_first:
            args = [_to(x, stage.device) for x in ctx.mb_args[a.mb]]
            kwargs = {k: _to(v, stage.device) for k, v in ctx.mb_kwargs[a.mb].items()}
        else:
            args, kwargs = self._gather(stage, a.mb, ctx), None
        target = _to(ctx.targets[a.mb], stage.device) if (stage.is_last and ctx.targets is not None) else None
        outs = stage.forward(a.mb, args, kwargs, train=ctx.train, target=target)
        if stage.lazy and not stage.routes:
            _manual_routes(stage, outs)
        if stage.is_last:
            ctx.outputs[a.mb] = stage.model_output(tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs))
        for route in stage.routes:
            value = _to(ctx.flat_inputs[a.mb][route.src_index], stage.device) if route.from_input else outs[route.src_index]
            what = f"stage {a.stage}, microbatch {a.mb}, forward to stage {route.dst_stage} (rank {self.stage_rank[route.dst_stage]})"
            self._check(value, route.spec, ctx, what)
            if ctx.train and route.spec is not None and not route.spec.carries_grad and not route.from_input \
                    and isinstance(value, torch.Tensor) and value.requires_grad:
                raise PipelineError(f"{what}: value {route.src_index} requires grad at run time but the traced "
                                    "edge says it does not; its gradient would be lost")
            if self._local(route.dst_stage):
                box = self._fwd_inbox.setdefault((route.dst_stage, a.mb), {})
                box[(MODEL_INPUT if route.from_input else a.stage, route.src_index)] = self._received(value, route.spec)
            else:
                self._outbox.setdefault((a.stage, a.mb), []).append((route, value))

    def _output_grads(self, stage: PipelineStage, mb: int) -> dict[int, torch.Tensor]:
        box = self._bwd_inbox.pop((stage.stage_index, mb), {})
        return {i: (gs[0] if len(gs) == 1 else torch.stack(gs).sum(0)) for i, gs in box.items()}

    def _deliver_grads(self, stage: PipelineStage, mb: int, grads: dict[int, torch.Tensor]) -> None:
        for i, g in grads.items():
            slot = stage.in_slots[i]
            if slot.kind != "edge" or slot.src_stage == MODEL_INPUT:
                continue
            if self._local(slot.src_stage):
                self._bwd_inbox.setdefault((slot.src_stage, mb), {}).setdefault(slot.src_output, []).append(g)
            else:
                self._grad_outbox.setdefault((stage.stage_index, mb), []).append((slot, g))

    def _backward(self, a: Action, ctx: StepContext) -> None:
        stage = self.stages[a.stage]
        grads = stage.backward(a.mb, self._output_grads(stage, a.mb), ctx.n_microbatches)
        self._deliver_grads(stage, a.mb, grads)

    def _backward_input(self, a: Action, ctx: StepContext) -> None:
        stage = self.stages[a.stage]
        grads = stage.backward_input(a.mb, self._output_grads(stage, a.mb), ctx.n_microbatches)
        self._deliver_grads(stage, a.mb, grads)

    def _backward_weight(self, a: Action, ctx: StepContext) -> None:
        self.stages[a.stage].backward_weight(a.mb)

    # ---- communication -----------------------------------------------------------
    def _send_forward(self, a: Action, ctx: StepContext) -> None:
        stage = self.stages[a.stage]
        if stage.lazy:
            self._send_headers(stage)
        for route, value in self._outbox.pop((a.stage, a.mb), []):
            src = MODEL_INPUT if route.from_input else a.stage
            peer = self.stage_rank[route.dst_stage]
            tag = _tag(a.mb, src, route.src_index, route.dst_stage, self.num_stages, 0)
            what = f"stage {a.stage} sending the forward of microbatch {a.mb} to stage {route.dst_stage} on rank {peer}"
            self._sends.append(self.p2p.send(value, peer, tag, what))

    def _recv_forward(self, a: Action, ctx: StepContext) -> None:
        stage = self.stages[a.stage]
        if stage.in_slots is None:
            self._handshake(stage, ctx)
        pendings = []
        for slot in stage.in_slots:
            if slot.kind != "edge" or self._local(slot.sender_stage):
                continue
            peer = self.stage_rank[slot.sender_stage]
            tag = _tag(a.mb, slot.src_stage, slot.src_output, a.stage, self.num_stages, 0)
            what = (f"stage {a.stage} waiting for the forward of microbatch {a.mb} from stage {slot.sender_stage} "
                    f"on rank {peer}")
            pendings.append((slot, self._post_recv(slot.spec, stage, peer, tag, what, ctx)))
        box = self._fwd_inbox.setdefault((a.stage, a.mb), {})
        for slot, pending in pendings:
            self.p2p.wait(pending)
            box[(slot.src_stage, slot.src_output)] = self._received(pending.result(), slot.spec)

    def _send_headers(self, stage: PipelineStage) -> None:
        by_dst: dict[int, list[Route]] = {}
        for r in stage.routes:
            by_dst.setdefault(r.dst_stage, []).append(r)
        for dst, routes in by_dst.items():
            if self._local(dst) or (stage.stage_index, dst) in self._headers_sent:
                continue
            peer = self.stage_rank[dst]
            tag = _tag(0, stage.stage_index, _OUT_SLOTS - 1, dst, self.num_stages, 2)
            what = f"stage {stage.stage_index} sending shapes to stage {dst} on rank {peer}"
            self._sends.append(self.p2p.send(_encode_routes(routes), peer, tag, what))
            self._headers_sent.add((stage.stage_index, dst))

    def _handshake(self, stage: PipelineStage, ctx: StepContext) -> None:
        """First step of a hand-built stage: learn its inputs' shapes from its senders."""
        described = []
        for src in self.senders.get(stage.stage_index, []):
            if self._local(src):
                sender = self.stages[src]
                described += [(src, r.src_index, r.dst_input, r.spec) for r in sender.routes
                              if r.dst_stage == stage.stage_index]
                continue
            peer = self.stage_rank[src]
            tag = _tag(0, src, _OUT_SLOTS - 1, stage.stage_index, self.num_stages, 2)
            what = f"stage {stage.stage_index} waiting for the shapes of its inputs from stage {src} on rank {peer}"
            pending = self.p2p.recv((1 + _HEADER_ROWS * _HEADER_COLS,), torch.int64, torch.device("cpu"), peer, tag,
                                    what)
            self.p2p.wait(pending)
            described += _decode_routes(pending.result(), src)
        stage.in_slots = _build_slots(stage, described)

    def _send_backward(self, a: Action, ctx: StepContext) -> None:
        for slot, grad in self._grad_outbox.pop((a.stage, a.mb), []):
            peer = self.stage_rank[slot.src_stage]
            tag = _tag(a.mb, slot.src_stage, slot.src_output, a.stage, self.num_stages, 1)
            what = f"stage {a.stage} sending the gradient of microbatch {a.mb} to stage {slot.src_stage} on rank {peer}"
            self._sends.append(self.p2p.send(grad, peer, tag, what))

    def _recv_backward(self, a: Action, ctx: StepContext) -> None:
        stage = self.stages[a.stage]
        pendings = []
        for route in stage.routes:
            if route.from_input or self._local(route.dst_stage) or route.spec is None or not route.spec.carries_grad:
                continue
            peer = self.stage_rank[route.dst_stage]
            tag = _tag(a.mb, a.stage, route.src_index, route.dst_stage, self.num_stages, 1)
            what = (f"stage {a.stage} waiting for the gradient of microbatch {a.mb} from stage {route.dst_stage} "
                    f"on rank {peer}")
            pendings.append((route, self._post_recv(route.spec, stage, peer, tag, what, ctx)))
        box = self._bwd_inbox.setdefault((a.stage, a.mb), {})
        for route, pending in pendings:
            self.p2p.wait(pending)
            box.setdefault(route.src_index, []).append(pending.result())


# ---- shape handshake of hand-built stages ----------------------------------------
_HEADER_ROWS, _HEADER_COLS, _MAX_DIMS = 32, 16, 8
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


def _encode_routes(routes: list[Route]) -> torch.Tensor:
    """Plain int64 metadata (no pickling): count, then per route
    [src_output, dst_input, ndim, dtype code, requires_grad, dims...]."""
    if len(routes) > _HEADER_ROWS:
        raise PipelineError(f"a hand-built stage can send at most {_HEADER_ROWS} tensors to one stage")
    header = torch.zeros(1 + _HEADER_ROWS * _HEADER_COLS, dtype=torch.int64)
    header[0] = len(routes)
    for k, r in enumerate(routes):
        if r.spec is None:
            raise PipelineError(f"output {r.src_index} sent to stage {r.dst_stage} is not a tensor")
        if len(r.spec.shape) > _MAX_DIMS:
            raise PipelineError(f"output {r.src_index} has more than {_MAX_DIMS} dims")
        row = [r.src_index, r.dst_input, len(r.spec.shape), _DTYPES.index(r.spec.dtype), int(r.spec.requires_grad),
               *r.spec.shape]
        header[1 + k * _HEADER_COLS: 1 + k * _HEADER_COLS + len(row)] = torch.tensor(row)
    return header


def _decode_routes(header: torch.Tensor, src: int) -> list[tuple[int, int, int, TensorSpec]]:
    out = []
    for k in range(int(header[0])):
        row = header[1 + k * _HEADER_COLS: 1 + (k + 1) * _HEADER_COLS].tolist()
        ndim = row[2]
        spec = TensorSpec(tuple(row[5:5 + ndim]), _DTYPES[row[3]], bool(row[4]))
        out.append((src, row[0], row[1], spec))
    return out


def _build_slots(stage: PipelineStage, described: list[tuple[int, int, int, TensorSpec]]) -> list[InputSlot]:
    """Slots of a hand-built stage: declared positions first, chain values fill the rest in order."""
    fixed = {d: (src, out, spec) for src, out, d, spec in described if d >= 0}
    chain = sorted(((out, src, spec) for src, out, d, spec in described if d < 0))
    n = len(fixed) + len(chain)
    slots, free = [], iter(i for i in range(n) if i not in fixed)
    placed = dict(fixed)
    for out, src, spec in chain:
        placed[next(free)] = (src, out, spec)
    for i in range(n):
        if i not in placed:
            raise PipelineError(f"stage {stage.stage_index}: nothing is sent to input {i}")
        src, out, spec = placed[i]
        slots.append(InputSlot(i, "edge", src, out, spec))
    return slots


def _to(value: Any, device: torch.device) -> Any:
    """Model inputs and targets arrive wherever the user made them; stages run on their device."""
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device, non_blocking=True)
    return value


def _who(stage: int) -> str:
    return "the model input" if stage == MODEL_INPUT else f"stage {stage}"


def _manual_routes(stage: PipelineStage, outs: tuple) -> None:
    """Routes of a hand-built stage, from its declared outputs_to and the chain."""
    for i, out in enumerate(outs):
        spec = None
        if isinstance(out, torch.Tensor):
            spec = TensorSpec(tuple(out.shape), out.dtype, bool(out.requires_grad))
        if i in stage.outputs_to:
            for dst, dst_in in stage.outputs_to[i]:
                stage.routes.append(Route(i, dst, dst_in, spec))
        elif not stage.is_last:
            stage.routes.append(Route(i, stage.stage_index + 1, -1, spec))
