"""One stage's part of one lane's step, with the stage's cache (generate, per action).

:class:`StageDecoder` runs stage ``s`` of the decode program for a lane: it gathers the
stage's arguments (the step inputs it reads, values other stages sent, its own past for
each layer it holds), runs the stage module, keeps the new cache and returns the outputs
other stages read. The cache of a lane lives here, keyed by lane, and never leaves.

A recurrent model's program is a :class:`~.phased.PhasedProgram`: the decoder runs its
prefill program where the lane has no cache yet and its step program after, and a slot that
took a new prompt (continuous batching) starts that row from a fresh state (zeros, or each
state's own fresh value: :class:`~.recurrent.FixedState`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..split.materialize import share_tensors
from .cache_growth import with_room
from .decode_model import LayoutEntry
from .eager import EagerProgram
from .phased import PhasedProgram
from .program import DecodeProgram, empty_past, growth_dim, past_shape
from .recurrent import FixedState, state_rows_reset

__all__ = ["StageDecoder"]


class StageDecoder:
    """Stage ``s``'s decode step over lanes, with each lane's cache.

    Example (``pipe.generate`` runs every stage so, one after the other):
        >>> decoders = [StageDecoder(program, s, program.stage_module(s), device, dtype)  # doctest: +SKIP
        ...             for s in range(program.num_stages)]
        >>> outs = decoders[0].run(lane, step, produced)  # doctest: +SKIP
    """

    def __init__(self, program: DecodeProgram | PhasedProgram | EagerProgram, s: int, module: torch.nn.Module,
                 device: torch.device, dtype: torch.dtype, *, room: int = 0) -> None:
        self.program = program
        self.room = room
        """Tokens a lane's cache makes room for after its prompt (the call's ``max_new_tokens``):
        its keys and values grow in place up to that (:mod:`.cache_growth`)."""
        self.s = s
        self.module = module
        self.device = device
        self.dtype = dtype
        self.cache: dict[int, Any] = {}  # lane -> cache tensor index -> tensor (an eager program's: its cache object)
        self.plan = (None if isinstance(program, EagerProgram)
                     else program.step.plans[s] if isinstance(program, PhasedProgram) else program.plans[s])
        self._bound: set[int] = set()  # the phased programs whose stage module shares ``module``'s tensors

    def reset(self) -> None:
        self.cache.clear()

    def _module(self, program: DecodeProgram) -> torch.nn.Module:
        """``program``'s stage module, sharing the tensors the driver bound ``self.module`` to."""
        if not isinstance(self.program, PhasedProgram):
            return self.module
        module = program.stage_module(self.s)
        if module is not self.module and id(program) not in self._bound:
            share_tensors(module, self.module)
            self._bound.add(id(program))
        return module

    def _past(self, program: DecodeProgram, lane: int, mask: torch.Tensor, past_len: int) -> dict[int, torch.Tensor]:
        batch = int(mask.shape[0])
        plan = program.plans[self.s]
        kv = self.cache.get(lane)
        if program.fresh:  # a recurrent model's prefill: it reads no past
            return {}
        if kv is None:  # prefill: an empty past (RWKV's: its fresh state), with room to grow into
            kv = {j: self._fresh(e, batch, int(mask.shape[1])) for j, e in enumerate(program.layout) if j in plan.kv}
        out = {}
        for j, t in kv.items():
            e = program.layout[j]
            out[j] = state_rows_reset(t, mask, e.fill) if isinstance(e, FixedState) else t
        for j in plan.kv_shapes.values():  # another stage's cache, read for its sizes only
            shape = past_shape(program.layout[j], batch, past_len)
            out[j] = torch.empty((), device=self.device, dtype=self.dtype).expand(*shape)
        return out

    def _fresh(self, entry: LayoutEntry, batch: int, prompt_len: int) -> torch.Tensor:
        empty = empty_past(entry, batch, self.device, self.dtype)
        dim = growth_dim(entry)
        return empty if dim is None else with_room(empty, dim, prompt_len + self.room)

    def run(self, lane: int, step: list[Any], produced: dict[tuple[int, int], Any]) -> tuple[Any, ...]:
        """Run the stage for ``lane`` on ``step`` (ids, mask, positions; ids may be None where
        this stage does not read them) and the values in ``produced``; returns its outputs."""
        if isinstance(self.program, EagerProgram):  # the model's own modules and cache object (eager.py)
            cache = self.cache.get(lane)
            if cache is None:
                cache = self.cache[lane] = self.program.new_cache(self.s, self.room)
            return self.program.run_stage(self.s, cache, step, produced)
        mask, ids_or_pos = step[1], step[2]
        new = int(ids_or_pos.shape[1])
        past_len = int(mask.shape[1]) - new
        phased = self.program if isinstance(self.program, PhasedProgram) else None
        program = phased.program(phased.phase(past_len), new) if phased is not None else self.program
        assert isinstance(program, DecodeProgram)
        kv = self._past(program, lane, mask, past_len)
        inputs = dict(produced) if phased is None else phased.real_produced(phased.phase(past_len), new, produced)
        args = program.gather(self.s, step, inputs, kv)
        with torch.no_grad():
            outs = self._module(program)(*args)
        self.cache[lane] = {j: outs[o] for j, o in program.plans[self.s].kv_outputs.items()}
        if phased is not None:
            return phased.virtual_outputs(self.s, phased.phase(past_len), new, outs)
        return tuple(outs)
