"""The runtime's messages: what each comm action of a stage moves, and each microbatch in flight.

Part of the runtime (… → schedule → **runtime**), used by :class:`.runtime.Interpreter`.
:class:`Wiring` lists once per stage, from its inputs and outgoing edges, the tensors
each comm action exchanges with each peer stage, in the order both ends share (so the
k-th send of a pair meets its k-th receive, as NCCL pairs them). :class:`InFlight` is
the one record of a (stage, microbatch) whose values are moving: what arrived for its
forward or backward, what waits for its send, and the receives posted for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import torch

from ..split.spec import MODEL_INPUT, Edge, InputKind, StageInput, TensorSpec
from ..stage.arguments import StageArgs
from ..stage.errors import PipelineError
from ..stage.stage import PipelineStage
from ..stage.transport import P2POp

__all__ = ["PeerExchange", "Outgoing", "Wiring", "Arrival", "InFlight", "wire", "refuse_crossing", "release_storage"]


@dataclass(frozen=True)
class PeerExchange:
    """What one comm action exchanges with one peer stage, its k-th tensor at index k of each
    list, in the order both ends share. ``tag`` is the first tensor's tag for microbatch 0:
    a transport with ``ordered=False`` tags the k-th tensor of microbatch ``mb``
    ``tag + mb_stride * (mb % 1024) + k % 64``, alike at both ends."""

    peer_stage: int
    peer_rank: int
    keys: list[Any]  # sends: the key of its value in InFlight.to_send / grads_to_send; receives: where it lands
    specs: list[TensorSpec]  # receives: how to size the buffer (its dtype, its symbolic shape)
    shapes: list[tuple[int, ...] | None]  # ... its shape where no microbatch changes it (None: dynamic)
    dim_orders: list[tuple[int, ...] | None]  # the memory order it travels in, both ways (None: row-major)
    carries_grad: list[bool]  # forward receives: a gradient flows back along it
    releasable: list[bool]  # forward sends: a stage output (not a forwarded model input)
    tag: int
    mb_stride: int


@dataclass(frozen=True)
class Outgoing:
    """One of a stage's outgoing edges, as its forward hands the value on."""

    route: Edge
    index: int  # in ``stage.routes``: its key in ``InFlight.to_send``
    key: tuple[int, int]  # (sender stage, output): its key in the reader's ``InFlight.inputs``
    local: bool  # the reader is on this rank: handed over in memory
    from_input: bool  # a model input stage 0's rank forwards
    carries_grad: bool
    shape: tuple[int, ...] | None  # where no microbatch changes it (None: dynamic)


@dataclass(frozen=True)
class Wiring:
    """One stage's exchanges, fixed once its inputs and edges are known."""

    slots: list[StageInput]  # the stage's inputs
    args: StageArgs  # its forward's arguments from them, made once
    outgoing: list[Outgoing]
    send_forward: list[PeerExchange]
    recv_forward: list[PeerExchange]
    send_backward: list[PeerExchange]
    recv_backward: list[PeerExchange]


class Arrival(NamedTuple):
    """A posted receive of a microbatch, filed under where its value lands."""

    key: Any  # forward: (sender stage, output) in InFlight.inputs; backward: the output index
    carries_grad: bool  # forward: the received value becomes a leaf that requires grad
    op: P2POp


@dataclass
class InFlight:
    """One (stage, microbatch) while its values move between actions and ranks."""

    inputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    """Its forward's received or handed-over values, by (sender stage, output)."""
    output_grads: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Gradients of its outputs for B or I, by output index (one per reader, summed)."""
    to_send: dict[int, Any] = field(default_factory=dict)
    """F's values for other ranks, by route index, until their SEND_F."""
    grads_to_send: dict[int, torch.Tensor] = field(default_factory=dict)
    """B's or I's input gradients for other ranks, by input index, until their SEND_B."""
    arriving_inputs: list[Arrival] = field(default_factory=list)
    """Receives posted for its forward, waited for when F runs."""
    arriving_grads: list[Arrival] = field(default_factory=list)
    """Receives posted for its backward, waited for when B or I runs."""


def wire(stage: PipelineStage, slots: list[StageInput], stage_rank: Mapping[int, int], rank: int) -> Wiring:
    """The exchanges of ``stage`` (its inputs ``slots``) under ``stage_rank``, seen from ``rank``."""
    n, me = len(stage_rank), stage.stage_index
    index = {id(r): i for i, r in enumerate(stage.routes)}

    def channels(items: list[Any], peer_of: Callable, order: Callable, key: Callable, spec: Callable,
                 backward: int, sending: bool) -> list[PeerExchange]:
        out = []
        for peer in sorted({peer_of(x) for x in items}):
            mine = sorted((x for x in items if peer_of(x) == peer), key=order)
            specs = [spec(x) for x in mine]
            sender, receiver = (me, peer) if sending else (peer, me)
            out.append(PeerExchange(peer, stage_rank[peer], [key(x) for x in mine], specs,
                               [None if s is None or s.is_dynamic else s.shape for s in specs],
                               [None if s is None else s.dim_order for s in specs],
                               [s is not None and s.carries_grad for s in specs],
                               [sending and not backward and not x.from_input for x in mine],
                               ((backward * n + sender) * n + receiver) * 64, 2 * n * n * 64))
        return out

    routes = [r for r in stage.routes if stage_rank[r.dst_stage] != rank]
    inputs = [sl for sl in slots if sl.kind is InputKind.EDGE and stage_rank[sl.sender_stage] != rank]
    return Wiring(
        slots=list(slots),
        args=StageArgs(slots),
        outgoing=[Outgoing(r, i, (r.src_stage, r.src_output), stage_rank[r.dst_stage] == rank, r.from_input,
                           r.spec is not None and r.spec.carries_grad,
                           None if r.spec is None or r.spec.is_dynamic else r.spec.shape)
                  for i, r in enumerate(stage.routes)],
        send_forward=channels(routes, lambda r: r.dst_stage, lambda r: (r.from_input, r.src_output, r.dst_input),
                              lambda r: index[id(r)], lambda r: r.spec, 0, True),
        recv_forward=channels(inputs, lambda sl: sl.sender_stage,
                              lambda sl: (sl.src_stage == MODEL_INPUT, sl.src_output, sl.index),
                              lambda sl: sl.key, lambda sl: sl.spec, 0, False),
        send_backward=channels([sl for sl in slots if sl.kind is InputKind.EDGE and sl.src_stage != MODEL_INPUT
                                and stage_rank[sl.src_stage] != rank], lambda sl: sl.src_stage,
                               lambda sl: (sl.src_output, sl.index), lambda sl: sl.index, lambda sl: sl.spec, 1, True),
        recv_backward=channels([r for r in routes if not r.from_input and r.spec is not None and r.spec.carries_grad],
                               lambda r: r.dst_stage, lambda r: (r.src_output, r.dst_input), lambda r: r.src_output,
                               lambda r: r.spec, 1, False))


def refuse_crossing(value: torch.Tensor, route: Edge, expected: tuple[int, ...], wrong_grad: bool, dynamic: bool,
            what: str) -> None:
    """A value about to cross a cut that is not what the trace said (``dynamic``: its shape has a dynamic dim)."""
    spec = route.spec
    if tuple(value.shape) != tuple(expected) or value.dtype != spec.dtype:
        changed = [f"dim {i}: traced {spec.shape[i]}, got {g}" for i, (g, e) in enumerate(zip(value.shape, expected))
                   if g != e]
        hint = (" — declare it dynamic with dynamic_shapes=... when calling pipeline()" if changed and not dynamic
                else "")
        raise PipelineError(f"{what}: expected shape {tuple(expected)} {spec.dtype}, got {tuple(value.shape)} "
                            f"{value.dtype} ({'; '.join(changed) or 'dtype differs'}){hint}")
    raise PipelineError(f"{what}: value {route.src_output} requires grad at run time but the traced edge says it does not; its gradient "
                        "would be lost")


def release_storage(value: Any) -> None:
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
