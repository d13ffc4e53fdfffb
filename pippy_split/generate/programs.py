"""Which decode program a Pipe generates with, traced once and kept on the pipe (generate).

A model with a KV cache decodes with one :class:`~.program.DecodeProgram` (one trace for the
prefill and every step); a model with a recurrent state with a :class:`~.phased.PhasedProgram`
(a step program and a prefill program per prompt length, behind the same methods). The
drivers use either through the same methods (:data:`Program`).
"""

from __future__ import annotations

import torch

from ..split.pipe import Pipe
from ..split.retrace import trace_again
from .decode_model import DecodeRoot, kv_layout
from .eager import EagerProgram, eager_program
from .errors import GenerationError
from .phased import PhasedProgram, phased_program
from .program import DecodeProgram, example_step
from .stand_ins import meta_stood_in

__all__ = ["Program", "decode_program", "in_process_program"]

Program = DecodeProgram | PhasedProgram | EagerProgram
"""A decode program as the drivers see it."""


def in_process_program(pipe: Pipe, prompt_len: int | None = None) -> Program:
    """The program ``pipe.generate`` decodes with in this process: the model's own modules run
    eagerly stage by stage where the model qualifies (:mod:`.eager`: no trace), else
    :func:`decode_program`.

    Example:
        >>> type(in_process_program(pipe)).__name__  # a Hugging Face Llama cut at a layer  # doctest: +SKIP
        'EagerProgram'
    """
    return eager_program(pipe) or decode_program(pipe, prompt_len)


def decode_program(pipe: Pipe, prompt_len: int | None = None) -> Program:
    """The pipe's decode program, traced on first use and kept in ``pipe.derived``: one
    :class:`DecodeProgram` for a model with a KV cache, a :class:`~.phased.PhasedProgram`
    (a prefill and a step program behind the same methods) for one with a recurrent state,
    whose first prefill is traced for ``prompt_len`` (the first call's prompts), so that a
    call's prompts need no second prefill trace.

    Example:
        >>> program = decode_program(pipe)  # doctest: +SKIP
        >>> program.num_stages, program.logits_output  # doctest: +SKIP
        (2, 0)
    """
    cached = pipe.derived.get("decode_program")
    if cached is not None:
        return cached
    model = pipe.model
    if model is None:
        raise GenerationError("this Pipe does not hold its model (it was not built by pipeline()); generation "
                              "traces the model's decode step, so build the Pipe with pippy_split.pipeline()")
    root = DecodeRoot(model)
    tensors = [*model.parameters(), *model.buffers()]
    # A pipe built on meta and filled per rank: the trace reads shapes only, on stand-ins
    # (each stage binds its live tensors before it decodes; bind_live refuses a stand-in left)
    device = next((t.device for t in tensors if t.device.type != "meta"), torch.device("cpu"))
    dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.float32)
    with meta_stood_in(model, device):
        layout = kv_layout(model, device)
        if root.signature.recurrent:  # a prefill and a step: two programs (phased.py)
            program: Program = phased_program(pipe, root, layout, device, dtype, prompt_len)
        else:
            args, shapes = example_step(layout, device, dtype)
            program = DecodeProgram(trace_again(pipe, root, args, {}, dynamic_shapes=shapes), layout)
    pipe.derived["decode_program"] = program
    return program
