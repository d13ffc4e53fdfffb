"""``pipe.generate``: every stage's decode step in one process (generate's one-process driver).

The same decode program, stage decoders, lanes and token choice as ``sched.generate``, run
stage after stage in this process: the result equals the pipelined one's.
"""

from __future__ import annotations

from typing import Any

import torch

from .checks import checked_call
from .lanes import Progress, make_lanes
from .program import decode_program
from .result import Generation
from .stage_step import StageDecoder

__all__ = ["generate_in_process"]


def generate_in_process(pipe: Any, input_ids: torch.Tensor, **kwargs: Any) -> Generation:
    """See :meth:`pippy_split.Pipe.generate`."""
    call = checked_call(pipe, input_ids, **kwargs)
    program = decode_program(pipe)
    opts, mask = call.options, call.mask
    device = input_ids.device
    decoders = [StageDecoder(program, s, program.stage_module(s), device, call.dtype)
                for s in range(program.num_stages)]
    lanes = make_lanes(input_ids, mask, call.lanes or program.num_stages, call.slots, opts)
    progress = Progress(input_ids, opts)
    for round_ in range(max((lane.rounds for lane in lanes), default=0)):
        for lane_index, lane in enumerate(lanes):
            if round_ >= lane.rounds or lane.idle_after is not None:
                continue
            step = lane.inputs(round_).as_list()
            produced: dict[tuple[int, int], Any] = {}
            outs: tuple[Any, ...] = ()
            for s, decoder in enumerate(decoders):
                outs = decoder.run(lane_index, step, produced)
                produced.update({(s, i): v for i, v in enumerate(outs)})
            lane.advance(round_, progress.record(lane, round_, outs[program.logits_output]))
    return Generation(progress.sequences, progress.logprobs if opts.return_logprobs else None)
