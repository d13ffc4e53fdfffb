"""``sched.generate``: the decode order run on the schedule's ranks by the training runtime.

Every rank gets the same call. It agrees on the arguments with every rank (:mod:`.agreement`),
takes the Pipe's decode program (:mod:`.program`, traced once per Pipe on each rank) and
binds each of its stages to the live tensors of this rank's training stage (the same
parameter objects the optimizer updates: no copy; FSDP2 / TP shards are made whole for the
call by :mod:`.gathered`), builds the decode order for the schedule's placement
(:mod:`pippy_split.schedule.decode_order`: built, lowered, validated), and hands it to the
schedule's own :class:`~pippy_split.schedule.runtime.Interpreter` with a
:class:`DecodeRun`, the session that computes each ``D`` through a
:class:`~.stage_step.StageDecoder` (the lane's KV cache stays on the stage), packs a stage's
values into one message, and says which rounds a lane no longer runs. The last stage chooses
the tokens (:class:`~.lanes.Progress`) and sends them to every other rank, where
:class:`~.lanes.Lane` follows which row holds which slot; at the end one broadcast gives
every rank the sequences.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from ..schedule.actions import Action, ActionKind
from ..schedule.agree import FailureChannel
from ..schedule.decode_order import content_round, decision_lag, decode_order, lower_decode, round_of, validate_decode
from ..schedule.runtime import Interpreter
from ..split.hand_over import Generation, provide
from ..split.materialize import named_tensors, share_tensors
from ..split.pipe import Pipe
from ..stage.groups import PipelineGroup
from ..stage.stage import PipelineStage
from .agreement import agreed_call
from .checks import CheckedCall, checked_call
from .eager import EagerProgram, eager_on_stages
from .errors import GenerationError
from .gathered import traced_program, unsharded_stages
from .lanes import Lane, Progress, make_lanes
from .programs import Program, in_process_program
from .stage_step import StageDecoder
from .stand_ins import is_stand_in

__all__ = ["generate_on_schedule", "generate_in_process", "run_decode", "bind_live", "pack_message", "unpack_message", "packed_size", "DecodeRun", "lowered_decode"]

_ALIGN = 16  # bytes: each value of a packed message starts at a multiple (any dtype's view is aligned)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def packed_size(layout: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of a message of values of these ``(shape, dtype)`` packed by :func:`pack_message`."""
    return sum(n + (-n % _ALIGN) for n in (_nbytes(shape, dtype) for shape, dtype in layout))


def pack_message(values: list[torch.Tensor]) -> torch.Tensor:
    """``values`` as one flat ``uint8`` buffer, each row-major and padded to :data:`_ALIGN` bytes:
    one message (one rendezvous on the transport) instead of one per value.

    Example:
        >>> x, m = torch.arange(3.0), torch.tensor([True, False])
        >>> y, n = unpack_message(pack_message([x, m]), [((3,), torch.float32), ((2,), torch.bool)])
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


def unpack_message(buffer: torch.Tensor, layout: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """The values :func:`pack_message` put in ``buffer``, each a view of it with its ``(shape, dtype)``."""
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
    held = named_tensors(decode_module)
    unbound = [name for name in share_tensors(decode_module, live)
               if is_stand_in(held[name]) or held[name].device.type == "meta"]
    if unbound:
        raise GenerationError(f"stage {stage}'s decode step reads {', '.join(sorted(unbound)[:4])}"
                              f"{' ...' if len(unbound) > 4 else ''}, which the model held on meta and this rank's "
                              "training stage does not hold: generation cannot read their values here. What works: "
                              "build the model with real tensors on every rank (not on meta), or a split whose stages "
                              "hold every tensor their layers read")


class ScheduleView(Protocol):
    """What generation reads of a schedule (``PipelineSchedule``; the schedule layer is below this one)."""

    stages: Sequence[PipelineStage]
    placement: Mapping[int, int]
    rank: int
    world: int
    pipeline_group: PipelineGroup


def _pipe_of(sched: ScheduleView) -> Pipe:
    pipe = getattr(sched.stages[0], "pipe", None)
    if pipe is None or not hasattr(pipe, "derived"):
        raise GenerationError(f"{type(sched).__name__}.generate needs stages built from a Pipe "
                              "(ps.build_schedule(pipe, ...) or pipe.build_stage(i)); hand-built stages have no "
                              "traced model to decode with")
    return pipe


class DecodeRun:
    """One ``generate`` call on this rank, as the runtime's
    :class:`~pippy_split.schedule.decode_exchange.DecodeSession`: the lanes, the values in
    flight and the tokens."""

    def __init__(self, program: Program, lanes: list[Lane], decoders: dict[int, StageDecoder],
                 progress: Progress | None, lag: int, device: torch.device) -> None:
        self.program, self.lanes, self.decoders = program, lanes, decoders
        self.progress, self.lag, self.device = progress, lag, device
        self.prompt_len = lanes[0].prompt.shape[1]
        self.values: dict[tuple[int, int], dict[tuple[int, int], Any]] = {}  # (lane, round) -> (stage, out)
        self.tokens: dict[tuple[int, int], torch.Tensor] = {}  # (lane, round) -> tokens chosen at round - 1
        self.edges = program.messages()
        self._edge_lists: dict[tuple[int, int], list[Any]] = {}
        self.last = program.num_stages - 1

    def stops_at(self, lane: int) -> int:
        """The first round of ``lane`` that does not run (as far as this rank knows yet)."""
        state = self.lanes[lane]
        if state.idle_after is None:
            return state.rounds
        return min(state.rounds, state.idle_after + self.lag)

    def skipped(self, a: Action) -> bool:
        return content_round(a) >= self.stops_at(a.lane)

    def compute(self, a: Action) -> None:
        lane, t = a.lane, round_of(a)
        step = self.lanes[lane].inputs(t).as_list()
        # Round t runs on the tokens of round t - 1, so every stage of that round has run and
        # every message it sent was packed: drop its values (the stage outputs include each
        # layer's new cache; kept, a rank without the last stage held every round's cache)
        self.values.pop((lane, t - 1), None)
        produced = self.values.setdefault((lane, t), {})
        outs = self.decoders[a.stage].run(lane, step, produced)
        produced.update({(a.stage, i): v for i, v in enumerate(outs)})
        if a.stage == self.last:
            assert self.progress is not None
            tokens = self.progress.record(self.lanes[lane], t, outs[self.program.logits_output])
            self.lanes[lane].advance(t, tokens)
            self.tokens[(lane, t + 1)] = tokens
            self.values.pop((lane, t), None)  # the round is done on this rank's last stage

    def payload(self, a: Action) -> torch.Tensor:
        if a.kind is ActionKind.SEND_T:
            return self.tokens[(a.lane, round_of(a))]
        assert a.peer is not None
        produced = self.values[(a.lane, round_of(a))]
        return pack_message([produced[(a.stage, e.src_output)] for e in self._edges(a.stage, a.peer)])

    def landing(self, a: Action) -> tuple[tuple[int, ...], torch.dtype]:
        if a.kind is ActionKind.RECV_T:
            return (self.lanes[a.lane].slots,), torch.long
        assert a.peer is not None
        return (packed_size(self._layout(a.peer, a.stage, a.lane, round_of(a))),), torch.uint8

    def deliver(self, a: Action, value: torch.Tensor) -> None:
        t = round_of(a)
        if a.kind is ActionKind.RECV_T:
            self.lanes[a.lane].advance(t - 1, value)
            return
        assert a.peer is not None
        produced = self.values.setdefault((a.lane, t), {})
        layout = self._layout(a.peer, a.stage, a.lane, t)
        for e, v in zip(self._edges(a.peer, a.stage), unpack_message(value, layout)):
            produced[(a.peer, e.src_output)] = v

    def _edges(self, src: int, dst: int) -> list[Any]:
        key = (src, dst)
        edges = self._edge_lists.get(key)
        if edges is None:
            edges = self._edge_lists[key] = [e for e in self.edges if e.src_stage == src and e.dst_stage == dst]
        return edges

    def _layout(self, src: int, dst: int, lane: int, t: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Each value's (shape, dtype) in stage ``src``'s message to ``dst`` for ``lane`` at round ``t``."""
        new = self.prompt_len if t == 0 else 1
        past = 0 if t == 0 else self.prompt_len + t - 1
        bindings = self.program.bindings(self.lanes[lane].slots, new, past)
        return [(e.spec.concrete_shape(bindings), e.spec.dtype) for e in self._edges(src, dst)]


def lowered_decode(placement: dict[int, int], program: Program, lanes: list[Lane]
                   ) -> tuple[dict[int, list[Action]], int]:
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


def generate_on_schedule(sched: ScheduleView, runtime: Interpreter, failures: FailureChannel | None,
                         input_ids: torch.Tensor, **kwargs: Any) -> Generation:
    """See :meth:`pippy_split.schedule.PipelineSchedule.generate`: ``sched``'s stages, run by
    its ``runtime`` (the one :class:`~pippy_split.schedule.runtime.Interpreter` its steps run
    on, with its transport) and its ``failures`` channel (a rank failing mid-generation stops
    every rank, as in ``step()``)."""
    pipe = _pipe_of(sched)
    prompt_len = int(input_ids.shape[1])
    chosen: list[Program] = []

    def prepare() -> str:  # the model's own modules where they qualify, else the trace (eager.py)
        eager = eager_on_stages(pipe, sched.stages)
        chosen.append(eager if eager is not None else traced_program(sched.stages, pipe, prompt_len))
        return "eager" if eager is not None else "traced"

    def traced() -> None:  # where the ranks chose differently (a rank that cannot run the model's modules)
        chosen[0] = traced_program(sched.stages, pipe, prompt_len)

    # every rank, before any message
    call = agreed_call(pipe, sched.pipeline_group, input_ids, kwargs, prepare=prepare, fallback=traced)
    # FSDP2 / TP stages: their DTensors whole for this call, freed after it (gathered.py)
    with unsharded_stages(sched.stages, pipe, prompt_len):
        return _generate(sched, chosen[0], call, input_ids, runtime, failures)


def _generate(sched: ScheduleView, program: Program, call: CheckedCall, input_ids: torch.Tensor,
              runtime: Interpreter, failures: FailureChannel | None) -> Generation:
    """``sched.generate`` with ``program``: the eager one, or the traced one the Pipe keeps
    (:func:`~.gathered.unsharded_stages` bound its DTensors' stand-ins to whole tensors)."""
    device = sched.stages[0].device
    decoders = {}
    for st in sched.stages:
        module = program.stage_module(st.stage_index)
        if not isinstance(program, EagerProgram):  # eager_on_stages saw the stage's tensors are the model's
            bind_live(module, st.module, st.stage_index)
        decoders[st.stage_index] = StageDecoder(program, st.stage_index, module, device, call.dtype,
                                                room=call.options.max_new_tokens)
    prompt = input_ids.to(device)
    placement = dict(sched.placement)
    # A rank that fails mid-generation posts its cause and every other rank stops with
    # PipelineAborted naming it, as in step().
    with failures.guard("generate()") if failures is not None else contextlib.nullcontext() as guard:
        if guard is not None:
            guard.communicating("in generate()")
        progress = run_decode(program, decoders, placement, sched.rank, runtime, call, prompt)
        return _shared_result(sched, progress, prompt, call.options, placement[program.num_stages - 1], device)


def generate_in_process(pipe: Pipe, input_ids: torch.Tensor, **kwargs: Any) -> Generation:
    """See :meth:`pippy_split.Pipe.generate`: every stage in this process, on a runtime of one
    rank (no transport: values between stages are handed over in memory)."""
    call = checked_call(pipe, input_ids, **kwargs)
    program = in_process_program(pipe, int(input_ids.shape[1]))
    device = input_ids.device
    decoders = {s: StageDecoder(program, s, program.stage_module(s), device, call.dtype,
                                room=call.options.max_new_tokens) for s in range(program.num_stages)}
    placement = dict.fromkeys(range(program.num_stages), 0)
    progress = run_decode(program, decoders, placement, 0, Interpreter({}, placement, 0, None), call, input_ids)
    assert progress is not None
    return Generation(progress.sequences, progress.logprobs if call.options.return_logprobs else None)


def run_decode(program: Program, decoders: dict[int, StageDecoder], placement: dict[int, int], rank: int,
               runtime: Interpreter, call: CheckedCall, prompt: torch.Tensor) -> Progress | None:
    """The one decode driver: ``call``'s lanes, their decode order for ``placement`` lowered and
    validated, this rank's part run by ``runtime`` with ``decoders`` (this rank's stages) as
    the session. Returns the tokens chosen (on the rank of the last stage; None elsewhere);
    the lanes' caches are freed before it returns."""
    opts = call.options
    program.prepare(int(prompt.shape[1]))  # a recurrent model's prefill for this length, traced before any message
    lanes = make_lanes(prompt, call.mask.to(prompt.device), call.lanes or program.num_stages, call.slots, opts)
    lowered, lag = lowered_decode(placement, program, lanes)
    progress = Progress(prompt, opts) if placement[program.num_stages - 1] == rank else None
    run = DecodeRun(program, lanes, decoders, progress, lag, prompt.device)
    try:
        runtime.decode(lowered.get(rank, []), run)
    finally:
        for d in decoders.values():
            d.reset()
    return progress


def _shared_result(sched: ScheduleView, progress: Progress | None, prompt: torch.Tensor, opts: Any, last_rank: int,
                   device: torch.device) -> Generation:
    """The last stage's sequences (and log-probabilities) on every rank: one broadcast each."""
    sequences = progress.sequences if progress is not None else torch.empty(
        prompt.shape[0], prompt.shape[1] + opts.max_new_tokens, dtype=torch.long, device=device)
    logprobs = progress.logprobs if progress is not None else torch.empty(
        prompt.shape[0], opts.max_new_tokens, dtype=torch.float32, device=device)
    if sched.world > 1:
        group = sched.pipeline_group.group
        dist.broadcast(sequences, group=group, group_src=last_rank)
        dist.broadcast(logprobs, group=group, group_src=last_rank)
    return Generation(sequences, logprobs if opts.return_logprobs else None)


provide("pipe", generate_in_process)  # Pipe.generate and PipelineSchedule.generate call these
provide("schedule", generate_on_schedule)
