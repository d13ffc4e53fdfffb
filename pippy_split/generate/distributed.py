"""``sched.generate``: the decode order run on the schedule's ranks (generate's runtime).

Every rank gets the same call. It checks the arguments (:mod:`.checks`), takes the Pipe's
decode program (:mod:`.program`, traced once per Pipe on each rank) and binds each of its
stages to the live tensors of this rank's training stage (the same parameter objects the
optimizer updates: no copy; FSDP2 / TP shards are made whole for the call by
:mod:`.gathered`), builds the decode order for the schedule's placement
(:mod:`pippy_split.schedule.decode_order`: built, lowered, validated), then runs its own
actions: ``D`` through a :class:`~.stage_step.StageDecoder` (the lane's KV cache stays on
the stage), each maximal run of ``SEND``/``RECV`` as one batch on the pipeline's
order-matched transport (one op per message: a stage's values go packed in one buffer;
receives waited at once, sends later), skipping the rounds of a lane that has nothing left. The last
stage chooses the tokens (:class:`~.lanes.Progress`) and sends them to every other rank,
where :class:`~.lanes.Lane` follows which row holds which slot; at the end one broadcast
gives every rank the sequences.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from ..schedule.agree import FailureChannel
from ..schedule.decode_order import (
    DecodeAction,
    content_round,
    decision_lag,
    decode_order,
    lower_decode,
    validate_decode,
)
from ..split.module_calls import parent_of
from ..stage.transport import P2P, Batch, P2POp
from .agreement import agreed_call
from .errors import GenerationError
from .gathered import unsharded_stages
from .lanes import Lane, Progress, make_lanes
from .program import DecodeProgram, decode_program
from .result import Generation
from .stage_step import StageDecoder
from .stand_ins import is_stand_in

__all__ = ["generate_on_schedule", "bind_live", "pack", "unpack", "packed_size"]

_ALIGN = 16  # bytes: each value of a packed message starts at a multiple (any dtype's view is aligned)
_SENDS_IN_FLIGHT = 8  # batches whose sends are waited for later (their buffers live until then)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def packed_size(layout: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of a message of values of these ``(shape, dtype)`` packed by :func:`pack`."""
    return sum(n + (-n % _ALIGN) for n in (_nbytes(shape, dtype) for shape, dtype in layout))


def pack(values: list[torch.Tensor]) -> torch.Tensor:
    """``values`` as one flat ``uint8`` buffer, each row-major and padded to :data:`_ALIGN` bytes:
    one message (one rendezvous on the transport) instead of one per value.

    Example:
        >>> x, m = torch.arange(3.0), torch.tensor([True, False])
        >>> y, n = unpack(pack([x, m]), [((3,), torch.float32), ((2,), torch.bool)])
        >>> y.tolist(), n.tolist()
        ([0.0, 1.0, 2.0], [True, False])
    """
    parts = []
    for v in values:
        v = v.detach()
        if v.is_complex():
            v = torch.view_as_real(v)
        flat = v.contiguous().reshape(-1).view(torch.uint8)
        parts.append(flat)
        if flat.numel() % _ALIGN:
            parts.append(flat.new_zeros(-flat.numel() % _ALIGN))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(buffer: torch.Tensor, layout: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """The values :func:`pack` put in ``buffer``, each a view of it with its ``(shape, dtype)``."""
    out, offset = [], 0
    for shape, dtype in layout:
        n = _nbytes(shape, dtype)
        raw = buffer[offset:offset + n]
        if dtype.is_complex:
            out.append(torch.view_as_complex(raw.view(dtype.to_real()).view(*shape, 2)))
        else:
            out.append(raw.view(dtype).view(shape))
        offset += n + (-n % _ALIGN)
    return out


def bind_live(decode_module: torch.nn.Module, live: torch.nn.Module, stage: int = 0) -> None:
    """Point ``decode_module``'s parameters and buffers at ``live``'s tensors of the same name
    (the training stage's: what the optimizer updates, wherever the stage was filled).

    Raises:
        GenerationError: where a tensor the decode step of ``stage`` reads was traced on a
            stand-in (a pipe built on ``meta``) and this rank's training stage does not hold it.
    """
    tensors: dict[str, torch.Tensor] = dict(live.named_parameters(remove_duplicate=False))
    tensors.update(live.named_buffers(remove_duplicate=False))
    unbound = []
    for name, t in [*decode_module.named_parameters(remove_duplicate=False),
                    *decode_module.named_buffers(remove_duplicate=False)]:
        new = tensors.get(name)
        if new is None:
            if is_stand_in(t) or t.device.type == "meta":
                unbound.append(name)
            continue
        if new is t:
            continue
        parent, leaf = parent_of(decode_module, name)
        if leaf in parent._parameters:
            parent._parameters[leaf] = new  # type: ignore[assignment]
        else:
            parent._buffers[leaf] = new
    if unbound:
        raise GenerationError(f"stage {stage}'s decode step reads {', '.join(sorted(unbound)[:4])}"
                              f"{' ...' if len(unbound) > 4 else ''}, which the model held on meta and this rank's "
                              "training stage does not hold: generation cannot read their values here. What works: "
                              "build the model with real tensors on every rank (not on meta), or a split whose stages "
                              "hold every tensor their layers read")


def _pipe_of(sched: Any) -> Any:
    pipe = getattr(sched.stages[0], "pipe", None)
    if pipe is None or not hasattr(pipe, "derived"):
        raise GenerationError(f"{type(sched).__name__}.generate needs stages built from a Pipe "
                              "(ps.build_schedule(pipe, ...) or pipe.build_stage(i)); hand-built stages have no "
                              "traced model to decode with")
    return pipe


class _Run:
    """One generate() call on this rank: the lanes, the values in flight and the tokens."""

    def __init__(self, sched: Any, program: DecodeProgram, lanes: list[Lane], decoders: dict[int, StageDecoder],
                 progress: Progress | None, lag: int, device: torch.device) -> None:
        self.sched, self.program, self.lanes = sched, program, lanes
        self.decoders, self.progress, self.lag, self.device = decoders, progress, lag, device
        self.prompt_len = lanes[0].prompt.shape[1]
        self.values: dict[tuple[int, int], dict[tuple[int, int], Any]] = {}  # (lane, round) -> (stage, out)
        self.tokens: dict[tuple[int, int], torch.Tensor] = {}  # (lane, round) -> tokens chosen at round - 1
        self.edges = program.messages()
        self._edge_lists: dict[tuple[int, int], list[Any]] = {}
        self.last = program.num_stages - 1
        self.sends: deque[Batch] = deque()  # posted batches with sends not yet waited for

    def stops_at(self, lane: int) -> int:
        """The first round of ``lane`` that does not run (as far as this rank knows yet)."""
        state = self.lanes[lane]
        if state.idle_after is None:
            return state.rounds
        return min(state.rounds, state.idle_after + self.lag)

    def skipped(self, a: DecodeAction) -> bool:
        return content_round(a) >= self.stops_at(a.lane)

    def compute(self, a: DecodeAction) -> None:
        lane, t = a.lane, a.round
        step = self.lanes[lane].inputs(t).as_list()
        produced = self.values.setdefault((lane, t), {})
        outs = self.decoders[a.stage].run(lane, step, produced)
        produced.update({(a.stage, i): v for i, v in enumerate(outs)})
        if a.stage == self.last:
            assert self.progress is not None
            tokens = self.progress.record(self.lanes[lane], t, outs[self.program.logits_output])
            self.lanes[lane].advance(t, tokens)
            self.tokens[(lane, t + 1)] = tokens
            self.values.pop((lane, t), None)  # the round is done on this rank's last stage

    def _edges(self, src: int, dst: int) -> list[Any]:
        key = (src, dst)
        edges = self._edge_lists.get(key)
        if edges is None:
            edges = self._edge_lists[key] = [e for e in self.edges if e.src_stage == src and e.dst_stage == dst]
        return edges

    def _layout(self, src: int, dst: int, b: int, t: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Each value's (shape, dtype) in stage ``src``'s message to ``dst`` for ``b`` slots at round ``t``."""
        new = self.prompt_len if t == 0 else 1
        past = 0 if t == 0 else self.prompt_len + t - 1
        bindings = self.program.bindings(b, new, past)
        return [(e.spec.concrete_shape(bindings), e.spec.dtype) for e in self._edges(src, dst)]

    def ops(self, a: DecodeAction) -> list[tuple[P2POp, Any]]:
        """The transport ops of one comm action, each with where a received tensor goes: one
        op per message (a stage's values to another stage go packed in one buffer, one
        rendezvous per message, not one per value)."""
        peer = self.sched.placement[a.peer]
        lane, t = a.lane, a.round
        b = self.lanes[lane].slots
        if a.what == "t":
            if a.kind == "SEND":
                return [(P2P.send_op(self.tokens[(lane, t)], peer, f"stage {a.stage} sending tokens of lane "
                                     f"{lane} round {t} to stage {a.peer}"), None)]
            op, _ = P2P.recv_op((b,), torch.long, self.device, peer, f"stage {a.stage} waiting for the tokens of "
                                f"lane {lane} round {t} from stage {a.peer} on rank {peer}")
            return [(op, ("t", lane, t))]
        if a.kind == "SEND":
            produced = self.values[(lane, t)]
            values = [produced[(a.stage, e.src_output)] for e in self._edges(a.stage, a.peer)]
            return [(P2P.send_op(pack(values), peer, f"stage {a.stage} sending lane {lane} round {t} to stage "
                                 f"{a.peer}"), None)]
        layout = self._layout(a.peer, a.stage, b, t)
        op, _ = P2P.recv_op((packed_size(layout),), torch.uint8, self.device, peer,
                            f"stage {a.stage} waiting for the values of lane {lane} round {t} from stage {a.peer} "
                            f"on rank {peer}")
        return [(op, ("h", lane, t, a.peer, a.stage, layout))]

    def exchange(self, p2p: P2P, batch: list[DecodeAction]) -> None:
        """Post ``batch``'s messages in order and wait for its receives; its sends are waited
        later (:meth:`settle`), so a rank does not wait for its receiver before computing on."""
        ops = [pair for a in batch for pair in self.ops(a)]
        posted = p2p.post([op for op, _ in ops])
        for op, where in ops:
            if where is None:
                continue
            value = p2p.wait_recv(op)
            if where[0] == "t":
                self.lanes[where[1]].advance(where[2] - 1, value)
            else:
                _, lane, t, src, dst, layout = where
                produced = self.values.setdefault((lane, t), {})
                for e, v in zip(self._edges(src, dst), unpack(value, layout)):
                    produced[(src, e.src_output)] = v
        if any(op.send for op, _ in ops):
            self.sends.append(posted)
        while len(self.sends) > _SENDS_IN_FLIGHT:
            p2p.wait(self.sends.popleft())

    def settle(self, p2p: P2P | None) -> None:
        """Wait for every send still in flight (the run leaves no work outstanding)."""
        while self.sends:
            assert p2p is not None
            p2p.wait(self.sends.popleft())


def _run_actions(run: _Run, actions: list[DecodeAction], p2p: P2P | None, record: list | None) -> None:
    """This rank's part of the lowered decode order: computes one by one, each run of comm
    actions as one batch; the rounds a lane no longer runs are skipped (every rank knows which
    before it reaches them: :func:`~pippy_split.schedule.decode_order.decision_lag`)."""
    begin = time.perf_counter()
    i = 0
    while i < len(actions):
        if actions[i].kind == "D":
            a = actions[i]
            i += 1
            if run.skipped(a):
                continue
            start = time.perf_counter()
            run.compute(a)
            if record is not None:
                record.append(("D", a.stage, a.lane, a.round, start, time.perf_counter()))
            continue
        j = i
        while j < len(actions) and actions[j].kind != "D":
            j += 1
        batch = [a for a in actions[i:j] if not run.skipped(a)]
        i = j
        if batch:
            assert p2p is not None, "one rank has no messages"
            run.exchange(p2p, batch)
    run.settle(p2p)
    if record is not None:
        record.append(("run", -1, -1, -1, begin, time.perf_counter()))


def lowered_decode(placement: dict[int, int], program: DecodeProgram, lanes: list[Lane]
                   ) -> tuple[dict[int, list[DecodeAction]], int]:
    """The decode order for ``lanes`` on ``placement``, lowered and validated, and its
    :func:`~pippy_split.schedule.decode_order.decision_lag`. Every rank but the last stage's
    learns each round's tokens (at its lowest stage), so each can follow the lanes' slots."""
    rounds = max(lane.rounds for lane in lanes)
    order = decode_order(placement, lanes=len(lanes), rounds=rounds)
    last_rank = placement[program.num_stages - 1]
    lowest = {r: min(s for s in placement if placement[s] == r) for r in set(placement.values()) if r != last_rank}
    readers = program.token_readers() | set(lowest.values())
    lowered = lower_decode(order, placement, links=program.links(), token_readers=readers)
    validate_decode(lowered, placement, lanes=len(lanes), rounds=rounds)
    return lowered, decision_lag(lowered, placement)


def generate_on_schedule(sched: Any, transport: P2P | None, failures: FailureChannel | None, input_ids: torch.Tensor,
                         *, record: list | None = None, **kwargs: Any) -> Generation:
    """See :meth:`pippy_split.schedule.PipelineSchedule.generate`: ``sched``'s stages, with its
    point-to-point ``transport`` (None on one rank) and its ``failures`` channel (a rank failing
    mid-generation stops every rank, as in ``step()``). ``record``, where given, gets
    ``(what, stage, lane, round, start, end)`` (``time.perf_counter()``) for each compute (what
    ``"D"``) and for the whole run (what ``"run"``): the benchmark's busy fractions."""
    pipe = _pipe_of(sched)
    call = agreed_call(pipe, sched.pipeline_group, input_ids, kwargs)  # every rank, before any message
    # FSDP2 / TP stages: their DTensors whole for this call, freed after it (gathered.py)
    with unsharded_stages(sched.stages, pipe):
        return _generate(sched, pipe, call, input_ids, record, transport, failures)


def _generate(sched: Any, pipe: Any, call: Any, input_ids: torch.Tensor, record: list | None,
              transport: P2P | None, failures: FailureChannel | None) -> Generation:
    program = decode_program(pipe)
    opts = call.options
    device = sched.stages[0].device
    prompt, mask = input_ids.to(device), call.mask.to(device)
    lanes = make_lanes(prompt, mask, call.lanes or program.num_stages, call.slots, opts)
    placement = dict(sched.placement)
    lowered, lag = lowered_decode(placement, program, lanes)
    decoders = {}
    for st in sched.stages:
        module = program.stage_module(st.stage_index)
        bind_live(module, st.module, st.stage_index)
        decoders[st.stage_index] = StageDecoder(program, st.stage_index, module, device, call.dtype)
    last_rank = placement[program.num_stages - 1]
    progress = Progress(prompt, opts) if last_rank == sched.rank else None
    run = _Run(sched, program, lanes, decoders, progress, lag, device)
    # The schedule's own transport and failure channel: a rank that fails mid-generation posts
    # its cause and every other rank stops with PipelineAborted naming it, as in step().
    p2p = transport if sched.world > 1 else None
    if p2p is None and sched.world > 1:
        p2p = P2P(sched.group, timeout=300.0)
    with failures.guard("generate()") if failures is not None else contextlib.nullcontext() as guard:
        if guard is not None:
            guard.communicating("in generate()")
        _run_actions(run, lowered.get(sched.rank, []), p2p, record)
        for d in decoders.values():
            d.reset()  # the lanes' caches are freed at the end of the call
        sequences = progress.sequences if progress is not None else torch.empty(
            prompt.shape[0], prompt.shape[1] + opts.max_new_tokens, dtype=torch.long, device=device)
        logprobs = progress.logprobs if progress is not None else torch.empty(
            prompt.shape[0], opts.max_new_tokens, dtype=torch.float32, device=device)
        if sched.world > 1:
            dist.broadcast(sequences, group=sched.group, group_src=last_rank)
            dist.broadcast(logprobs, group=sched.group, group_src=last_rank)
    return Generation(sequences, logprobs if opts.return_logprobs else None)
