"""One stage's part of one lane's step, with the stage's KV cache (generate, per action).

:class:`StageDecoder` runs stage ``s`` of the decode program for a lane: it gathers the
stage's arguments (the step inputs it reads, values other stages sent, its own past for
each layer it holds), runs the stage module, keeps the new cache and returns the outputs
other stages read. The cache of a lane lives here, keyed by lane, and never leaves.
"""

from __future__ import annotations

from typing import Any

import torch

from .program import DecodeProgram

__all__ = ["StageDecoder"]


class StageDecoder:
    """Stage ``s``'s decode step over lanes, with each lane's KV cache."""

    def __init__(self, program: DecodeProgram, s: int, module: torch.nn.Module, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.program = program
        self.s = s
        self.plan = program.plans[s]
        self.module = module
        self.device = device
        self.dtype = dtype
        self.cache: dict[int, dict[int, torch.Tensor]] = {}  # lane -> cache tensor index -> (b, H, P, D)

    def reset(self) -> None:
        self.cache.clear()

    def _past(self, lane: int, batch: int, past_len: int) -> dict[int, torch.Tensor]:
        kv = self.cache.get(lane)
        if kv is None:  # prefill: an empty past
            kv = {j: torch.zeros(batch, h, 0, d, device=self.device, dtype=self.dtype)
                  for j, (h, d) in enumerate(self.program.layout) if j in self.plan.kv}
        out = dict(kv)
        for j in self.plan.kv_shapes.values():  # another stage's cache, read for its sizes only
            h, d = self.program.layout[j]
            out[j] = torch.empty((), device=self.device, dtype=self.dtype).expand(batch, h, past_len, d)
        return out

    def run(self, lane: int, step: list[Any], produced: dict[tuple[int, int], Any]) -> tuple[Any, ...]:
        """Run the stage for ``lane`` on ``step`` (ids, mask, positions; ids may be None where
        this stage does not read them) and the values in ``produced``; returns its outputs."""
        mask, ids_or_pos = step[1], step[2]
        batch, past_len = int(mask.shape[0]), int(mask.shape[1]) - int(ids_or_pos.shape[1])
        kv = self._past(lane, batch, past_len)
        args = self.program.gather(self.s, step, dict(produced), kv)
        with torch.no_grad():
            outs = self.module(*args)
        self.cache[lane] = {j: outs[o] for j, o in self.plan.kv_outputs.items()}
        return tuple(outs)
