"""``pipe.generate``: every stage's decode step in one process (generate's one-process driver).

The same decode program, stage decoders, lanes and token choice as ``sched.generate``, run
stage after stage in this process: the result equals the pipelined one's.
"""

from __future__ import annotations

from typing import Any

import torch

from .checks import checked_call
from .lanes import Progress, lane_rows, step_inputs
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
    lanes = lane_rows(input_ids.shape[0], call.lanes or program.num_stages)
    progress = Progress(input_ids, opts)
    tokens: dict[int, torch.Tensor | None] = {lane: None for lane in range(len(lanes))}
    for round_ in range(opts.max_new_tokens):
        for lane, rows in enumerate(lanes):
            step = step_inputs(input_ids, mask, rows, round_, tokens[lane]).as_list()
            produced: dict[tuple[int, int], Any] = {}
            outs: tuple[Any, ...] = ()
            for s, decoder in enumerate(decoders):
                outs = decoder.run(lane, step, produced)
                produced.update({(s, i): v for i, v in enumerate(outs)})
            tokens[lane] = progress.record(rows, round_, outs[program.logits_output])
    return Generation(progress.sequences, progress.logprobs if opts.return_logprobs else None)
