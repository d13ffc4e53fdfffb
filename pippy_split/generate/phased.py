"""A recurrent model's decode as two programs behind one (generate, built once per Pipe).

Hugging Face's Mamba-style mixers run one code path for a prompt (a scan from a zero state)
and another for one token after a state (``seq_len == 1``: an in-place state update), so one
trace cannot serve both. :func:`phased_program` traces the decode step twice, both cut where
the training pipe was cut: the *prefill* (``T`` new tokens, a fresh cache: no past inputs;
RWKV's, whose state is an argument, reads a fresh state as its past, each stage its own
layers') and the *step* (one token after the cache: each layer's keys and values, conv and
SSM states). :class:`PhasedProgram` shows the two as the one program the drivers know: a
step with ``past == 0`` is the prefill, any other the step.

Its stage outputs and messages are *virtual*: stage ``s``'s outputs are ``[logits (last stage
only, else None), *prefill outputs, *step outputs]`` and :meth:`PhasedProgram.messages` lists
both programs' edges at those indices. An edge of the phase not running has the shape
``(0,)`` under that phase's :meth:`PhasedProgram.bindings` and its value is an empty tensor,
so a driver that packs a stage's values into one message sends and receives only the running
phase's values, without knowing there are two programs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..split.pipe import Pipe
from ..split.retrace import trace_again
from .decode_model import DecodeRoot, LayoutEntry
from .errors import GenerationError
from .program import DecodeProgram, example_step
from .stand_ins import meta_stood_in

__all__ = ["PhasedProgram", "phased_program", "PhaseBindings"]

PREFILL, STEP = "prefill", "step"


class PhaseBindings(dict):
    """A phase's symbol bindings (``{symbol: size}``), with the phase and the new tokens they are for."""

    def __init__(self, phase: str, new: int, values: dict) -> None:
        super().__init__(values)
        self.phase, self.new = phase, new


@dataclass(frozen=True)
class PhaseSpec:
    """The spec of message ``k`` of a phase: its shape in that phase (the prefill's read from the
    prefill program of that prompt length), ``(0,)`` in the other."""

    owner: Any
    phase: str
    k: int
    dtype: torch.dtype

    def concrete_shape(self, bindings: Any) -> tuple[int, ...]:
        if bindings.phase != self.phase:
            return (0,)
        return self.owner.program(self.phase, bindings.new).messages()[self.k].spec.concrete_shape(bindings)


@dataclass(frozen=True)
class PhaseEdge:
    """Message ``k`` of a phase, at the virtual output index of its source stage."""

    src_stage: int
    src_output: int
    dst_stage: int
    dst_input: int
    spec: PhaseSpec
    phase: str
    k: int


class PhasedProgram:
    """The prefill programs (one per prompt length, traced on first use) and the step program
    of a recurrent model as one decode program (see the module docstring)."""

    def __init__(self, trace: Callable[[int, int], DecodeProgram], reference_len: int = 2) -> None:
        self._trace = trace
        self.step = trace(1, 4)
        # the reference prefill (the first call's prompt length): its messages stand for every length's
        self._ref_len = reference_len
        self._prefills = {reference_len: trace(reference_len, 0)}
        ref = self._prefills[reference_len]
        self.num_stages: int = self.step.num_stages
        self.layout = self.step.layout
        self.logits_output = 0
        self._check(ref)
        virtual: dict[tuple[str, int, int], int] = {}  # (phase, stage, program output) -> virtual index
        edges = []
        for phase, prog in ((PREFILL, ref), (STEP, self.step)):
            for k, e in enumerate(prog.messages()):
                i = virtual.setdefault((phase, e.src_stage, e.src_output), 1 + len(virtual))
                edges.append(PhaseEdge(e.src_stage, i, e.dst_stage, e.dst_input, PhaseSpec(self, phase, k, e.spec.dtype),
                                       phase, k))
        self._messages = sorted(edges, key=lambda e: (e.src_stage, e.dst_stage, e.src_output, e.dst_input))
        self._width = 1 + len(virtual)

    def _check(self, prog: DecodeProgram) -> None:
        """``prog`` (a prefill) keeps what the step keeps on each stage and sends the reference's messages."""
        for s in range(self.num_stages):
            if prog.plans[s].kv != self.step.plans[s].kv:
                raise GenerationError(f"stage {s} keeps cache tensors {prog.plans[s].kv} after the prefill but "
                                      f"{self.step.plans[s].kv} after a step; cut the model at block boundaries")
        ref = self._prefills.get(self._ref_len)
        if ref is not None and [(e.src_stage, e.dst_stage, e.spec.dtype) for e in prog.messages()] != [
                (e.src_stage, e.dst_stage, e.spec.dtype) for e in ref.messages()]:
            raise GenerationError("the prefill sends other values between stages for another prompt length; "
                                  f"pad the prompts to {self._ref_len} tokens")

    def phase(self, past: int) -> str:
        """The phase of a step after ``past`` tokens (0: the prefill)."""
        return PREFILL if past == 0 else STEP

    def program(self, phase: str, new: int) -> DecodeProgram:
        """The step program, or the prefill program of ``new`` tokens (traced on first use)."""
        if phase == STEP:
            return self.step
        prog = self._prefills.get(new)
        if prog is None:
            prog = self._prefills[new] = self._trace(new, 0)
            self._check(prog)
        return prog

    def prepare(self, prompt_len: int) -> None:
        """Trace the prefill of ``prompt_len`` tokens now (a driver calls it before its first
        message, so that no rank traces while another waits for it)."""
        self.program(PREFILL, prompt_len)

    def stage_module(self, s: int) -> torch.nn.Module:
        """Stage ``s``'s reference prefill module (the one a driver binds to its live tensors;
        the other programs' modules take them from it: :func:`~pippy_split.split.materialize.share_tensors`)."""
        return self._prefills[self._ref_len].stage_module(s)

    def bindings(self, batch: int, new: int, past: int) -> PhaseBindings:
        """The running phase's symbols for ``batch`` rows extended by ``new`` tokens after ``past``."""
        phase = self.phase(past)
        return PhaseBindings(phase, new, self.program(phase, new).bindings(batch, new, past))

    def messages(self) -> list[PhaseEdge]:
        """Both phases' edges between stages at virtual output indices, sorted."""
        return list(self._messages)

    def message_layout(self, src: int, dst: int, batch: int, new: int, past: int
                       ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """``(shape, dtype)`` of each value of stage ``src``'s message to ``dst`` (empty ones for
        the phase not running), in :meth:`messages` order."""
        bindings = self.bindings(batch, new, past)
        return [(e.spec.concrete_shape(bindings), e.spec.dtype) for e in self._messages
                if e.src_stage == src and e.dst_stage == dst]

    def links(self) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for e in self._messages:
            out.setdefault(e.dst_stage, set()).add(e.src_stage)
        return out

    def token_readers(self) -> set[int]:
        return self._prefills[self._ref_len].token_readers() | self.step.token_readers()

    def real_produced(self, phase: str, new: int, produced: dict[tuple[int, int], Any]) -> dict[tuple[int, int], Any]:
        """``produced`` (virtual indices) as the phase's program keys it (its own output indices)."""
        real = self.program(phase, new).messages()
        out = {}
        for e in self._messages:
            if e.phase == phase and (e.src_stage, e.src_output) in produced:
                out[(e.src_stage, real[e.k].src_output)] = produced[(e.src_stage, e.src_output)]
        return out

    def virtual_outputs(self, s: int, phase: str, new: int, outs: Sequence[Any]) -> tuple[Any, ...]:
        """Stage ``s``'s outputs ``outs`` of ``phase`` at their virtual indices; the other phase's
        messages as empty tensors."""
        prog = self.program(phase, new)
        real = prog.messages()
        virtual: list[Any] = [None] * self._width
        for e in self._messages:
            if e.src_stage != s:
                continue
            virtual[e.src_output] = (outs[real[e.k].src_output] if e.phase == phase
                                     else torch.empty(0, dtype=e.spec.dtype, device=_device_of(outs)))
        if s == self.num_stages - 1:
            virtual[0] = outs[prog.logits_output]
        return tuple(virtual)


def _device_of(outs: Sequence[Any]) -> torch.device:
    return next((o.device for o in outs if isinstance(o, torch.Tensor)), torch.device("cpu"))


def phased_program(pipe: Pipe, root: DecodeRoot, layout: list[LayoutEntry], device: torch.device,
                   dtype: torch.dtype, prompt_len: int | None = None) -> PhasedProgram:
    """``root`` traced as a one-token step and as a prefill of each prompt length (a fresh
    cache; the reference length now: ``prompt_len``, the first call's, where it is 2 or more,
    else 2; any other on first use), all cut where ``pipe`` was cut. A prompt length per
    prefill: Hugging Face's Mamba scan is a Python loop over the tokens."""
    model = pipe.model
    assert model is not None  # decode_program refused a Pipe without its model
    given = root.signature.cache_arg == "state"  # RWKV's prefill reads a fresh state as its past, each stage its layers'

    def trace(t: int, p: int) -> DecodeProgram:
        args, shapes = example_step(layout, device, dtype, t=t, p=p, given_state=given)
        if p == 0:  # the prefill: every size but the batch as traced
            shapes = {**shapes, "input_ids": {0: shapes["input_ids"][0]}, "attention_mask": {0: shapes["input_ids"][0]},
                      "position_ids": {0: shapes["input_ids"][0]}}
        with meta_stood_in(model, device), warnings.catch_warnings():
            # a custom autograd Function traced through (RecurrentGemma's): decoding takes no gradient
            warnings.filterwarnings("ignore", message=".*custom autograd Function.*")
            return DecodeProgram(trace_again(pipe, root, args, {}, dynamic_shapes=shapes), layout,
                                 fresh=p == 0 and not given)

    return PhasedProgram(trace, prompt_len if prompt_len is not None and prompt_len >= 2 else 2)
