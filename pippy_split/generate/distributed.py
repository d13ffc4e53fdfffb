"""``sched.generate``: the decode order run on the schedule's ranks (generate's runtime).

Every rank gets the same call. It checks the arguments (:mod:`.checks`), takes the Pipe's
decode program (:mod:`.program`, traced once per Pipe on each rank) and binds each of its
stages to the live tensors of this rank's training stage (the same parameter objects the
optimizer updates: no copy), builds the decode order for the schedule's placement
(:mod:`.order`: built, lowered, validated), then runs its own actions: ``D`` through a
:class:`~.stage_step.StageDecoder` (the lane's KV cache stays on the stage), each maximal run
of ``SEND``/``RECV`` as one batch on the pipeline's order-matched transport. The last stage
chooses the tokens (:class:`~.lanes.Progress`); at the end one broadcast gives every rank
the sequences.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist

from ..split.module_calls import parent_of
from ..stage.data_parallel import holds_sharded_state
from ..stage.transport import P2P, P2POp
from .checks import checked_call
from .errors import GenerationError
from .lanes import Progress, lane_rows, step_inputs
from .order import DecodeAction, decode_order, lower_decode, validate_decode
from .program import DecodeProgram, decode_program
from .result import Generation
from .stage_step import StageDecoder

__all__ = ["generate_on_schedule", "bind_live"]


def bind_live(decode_module: torch.nn.Module, live: torch.nn.Module) -> None:
    """Point ``decode_module``'s parameters and buffers at ``live``'s tensors of the same name
    (the training stage's: what the optimizer updates, wherever the stage was filled)."""
    tensors: dict[str, torch.Tensor] = dict(live.named_parameters(remove_duplicate=False))
    tensors.update(live.named_buffers(remove_duplicate=False))
    for name, t in [*decode_module.named_parameters(remove_duplicate=False),
                    *decode_module.named_buffers(remove_duplicate=False)]:
        new = tensors.get(name)
        if new is None or new is t:
            continue
        parent, leaf = parent_of(decode_module, name)
        if leaf in parent._parameters:
            parent._parameters[leaf] = new  # type: ignore[assignment]
        else:
            parent._buffers[leaf] = new


def _pipe_of(sched: Any) -> Any:
    pipe = getattr(sched.stages[0], "pipe", None)
    if pipe is None or not hasattr(pipe, "derived"):
        raise GenerationError(f"{type(sched).__name__}.generate needs stages built from a Pipe "
                              "(ps.build_schedule(pipe, ...) or pipe.build_stage(i)); hand-built stages have no "
                              "traced model to decode with")
    return pipe


class _Run:
    """One generate() call on this rank: the lanes' values in flight and the tokens."""

    def __init__(self, sched: Any, program: DecodeProgram, prompt: torch.Tensor, mask: torch.Tensor,
                 rows: list[list[int]], decoders: dict[int, StageDecoder], progress: Progress | None) -> None:
        self.sched, self.program, self.prompt, self.mask, self.rows = sched, program, prompt, mask, rows
        self.decoders, self.progress = decoders, progress
        self.device = prompt.device
        self.values: dict[tuple[int, int], dict[tuple[int, int], Any]] = {}  # (lane, round) -> (stage, out)
        self.tokens: dict[tuple[int, int], torch.Tensor] = {}  # (lane, round) -> tokens fed at that round
        self.edges = program.messages()
        self.last = program.num_stages - 1

    def compute(self, a: DecodeAction) -> None:
        lane, t = a.lane, a.round
        step = step_inputs(self.prompt, self.mask, self.rows[lane], t, self.tokens.get((lane, t))).as_list()
        produced = self.values.setdefault((lane, t), {})
        outs = self.decoders[a.stage].run(lane, step, produced)
        produced.update({(a.stage, i): v for i, v in enumerate(outs)})
        if a.stage == self.last:
            assert self.progress is not None
            logits = outs[self.program.logits_output]
            self.tokens[(lane, t + 1)] = self.progress.record(self.rows[lane], t, logits)
            self.values.pop((lane, t), None)  # the round is done on this rank's last stage

    def _edges(self, src: int, dst: int) -> list[Any]:
        return [e for e in self.edges if e.src_stage == src and e.dst_stage == dst]

    def ops(self, a: DecodeAction) -> list[tuple[P2POp, Any]]:
        """The transport ops of one comm action, each with where a received tensor goes."""
        peer = self.sched.placement[a.peer]
        lane, t = a.lane, a.round
        b = len(self.rows[lane])
        if a.what == "t":
            if a.kind == "SEND":
                return [(P2P.send_op(self.tokens[(lane, t)], peer, f"stage {a.stage} sending tokens of lane {lane} "
                                     f"round {t} to stage {a.peer}"), None)]
            op, _ = P2P.recv_op((b,), torch.long, self.device, peer, f"stage {a.stage} waiting for the tokens of "
                                f"lane {lane} round {t} from stage {a.peer} on rank {peer}")
            return [(op, ("t", lane, t))]
        if a.kind == "SEND":
            produced = self.values[(lane, t)]
            return [(P2P.send_op(produced[(a.stage, e.src_output)], peer, f"stage {a.stage} sending lane {lane} "
                                 f"round {t} to stage {a.peer}"), None) for e in self._edges(a.stage, a.peer)]
        new = self.prompt.shape[1] if t == 0 else 1
        past = 0 if t == 0 else self.prompt.shape[1] + t - 1
        bindings = self.program.bindings(b, new, past)
        out = []
        for e in self._edges(a.peer, a.stage):
            op, _ = P2P.recv_op(e.spec.concrete_shape(bindings), e.spec.dtype, self.device, peer,
                                f"stage {a.stage} waiting for {e.display_name} of lane {lane} round {t} from stage "
                                f"{a.peer} on rank {peer}")
            out.append((op, ("h", lane, t, e.src_stage, e.src_output)))
        return out

    def exchange(self, p2p: P2P, batch: list[DecodeAction]) -> None:
        ops = [pair for a in batch for pair in self.ops(a)]
        posted = p2p.post([op for op, _ in ops])
        p2p.wait(posted)
        for op, where in ops:
            if where is None:
                continue
            value = p2p.wait_recv(op)
            if where[0] == "t":
                self.tokens[(where[1], where[2])] = value
            else:
                self.values.setdefault((where[1], where[2]), {})[(where[3], where[4])] = value


def _run_actions(run: _Run, actions: list[DecodeAction], p2p: P2P | None, record: list | None) -> None:
    """This rank's part of the lowered decode order: computes one by one, each run of comm
    actions as one batch."""
    begin = time.perf_counter()
    i = 0
    while i < len(actions):
        if actions[i].kind == "D":
            start = time.perf_counter()
            run.compute(actions[i])
            if record is not None:
                a = actions[i]
                record.append(("D", a.stage, a.lane, a.round, start, time.perf_counter()))
            i += 1
            continue
        j = i
        while j < len(actions) and actions[j].kind != "D":
            j += 1
        assert p2p is not None, "one rank has no messages"
        run.exchange(p2p, actions[i:j])
        i = j
    if record is not None:
        record.append(("run", -1, -1, -1, begin, time.perf_counter()))


def refuse_sharded_stages(stages: list) -> None:
    """Decoding reads each stage's parameters in traced ops, outside the modules' own
    ``forward``: FSDP2 would not gather them and a TP DTensor would meet plain tensors.
    Refused by name instead of running on shards."""
    sharded = [st.stage_index for st in stages if holds_sharded_state(st.module)]
    if sharded:
        raise GenerationError(f"stage{'s' if len(sharded) > 1 else ''} {sharded} hold FSDP2 or tensor-parallel "
                              "(DTensor) parameters, which generate() does not gather yet: decoding reads them in "
                              "traced ops, not through the modules' own forward. What works: generate on a schedule "
                              "of unsharded stages (e.g. pipe.generate(...) in one process on the model, or a "
                              "schedule built without fully_shard / parallelize_module)")


def generate_on_schedule(sched: Any, input_ids: torch.Tensor, *, record: list | None = None,
                         **kwargs: Any) -> Generation:
    """See :meth:`pippy_split.schedule.PipelineSchedule.generate`. ``record``, where given, gets
    ``(what, stage, lane, round, start, end)`` (``time.perf_counter()``) for each compute (what
    ``"D"``) and for the whole run (what ``"run"``): the benchmark's busy fractions."""
    pipe = _pipe_of(sched)
    call = checked_call(pipe, input_ids, **kwargs)  # on every rank, before any message
    refuse_sharded_stages(sched.stages)
    program = decode_program(pipe)
    opts = call.options
    device = sched.stages[0].device
    prompt, mask = input_ids.to(device), call.mask.to(device)
    rows = lane_rows(prompt.shape[0], call.lanes or program.num_stages)
    placement = dict(sched.placement)
    order = decode_order(placement, lanes=len(rows), rounds=opts.max_new_tokens)
    lowered = lower_decode(order, placement, links=program.links(), token_readers=program.token_readers())
    validate_decode(lowered, placement, lanes=len(rows), rounds=opts.max_new_tokens)
    decoders = {}
    for st in sched.stages:
        module = program.stage_module(st.stage_index)
        bind_live(module, st.module)
        decoders[st.stage_index] = StageDecoder(program, st.stage_index, module, device, call.dtype)
    last_rank = placement[program.num_stages - 1]
    progress = Progress(prompt, opts) if last_rank == sched.rank else None
    run = _Run(sched, program, prompt, mask, rows, decoders, progress)
    # The schedule's own transport and failure channel: a rank that fails mid-generation posts
    # its cause and every other rank stops with PipelineAborted naming it, as in step().
    p2p = getattr(getattr(sched, "_runtime", None), "p2p", None) if sched.world > 1 else None
    if p2p is None and sched.world > 1:
        p2p = P2P(sched.group, timeout=300.0)
    failures = getattr(sched, "_failures", None)
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
