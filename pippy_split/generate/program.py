"""Each stage's decode program and where its KV cache lives (generate, built once per Pipe).

:func:`decode_program` traces :class:`~.decode_model.DecodeRoot` once, with the batch, the
new tokens ``T`` and the past ``P`` dynamic, and cuts it where the training pipe was cut
(:func:`pippy_split.split.retrace.trace_again`). One program serves the prefill (``P = 0``)
and every decode step (``T = 1``) of a model with a KV cache; a model with a recurrent state
gets a :class:`~.phased.PhasedProgram` (a step program and a prefill program per prompt
length) with the same methods.

The cache tensors are the trace's own inputs and outputs, so the splitter sees them as
model inputs and as values flowing to the output. :class:`DecodeProgram` turns them into
stage state: the stage that reads layer ``j``'s past is the stage that makes its new
cache (checked here, refused by name otherwise), it keeps both, and they never cross a
cut: the last stage, which returns every output leaf, gets ``None`` for a cache tensor
another stage made (its graph only returns it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..split.pipe import Pipe
from ..split.spec import MODEL_INPUT, InputKind, StageInput, gather_inputs
from .cache_growth import grow_in_place
from .decode_model import LayoutEntry
from .errors import GenerationError
from .recompute import TokenPrefix
from .recurrent import FixedState

__all__ = ["DecodeProgram", "StagePlan", "example_step", "past_shape", "empty_past", "growth_dim", "N_STEP_INPUTS"]

N_STEP_INPUTS = 3  # input_ids, attention_mask, position_ids; the cache tensors follow


@dataclass(frozen=True)
class StagePlan:
    """What one stage of the decode program reads and keeps."""

    index: int
    kv: tuple[int, ...]
    """The cache tensors (flat indices: layer ``j`` keys ``2j``, values ``2j + 1``) this stage keeps."""
    kv_inputs: dict[int, int] = field(default_factory=dict)
    """Stage input position -> cache tensor it reads (the past)."""
    kv_shapes: dict[int, int] = field(default_factory=dict)
    """Stage input position -> cache tensor of another stage whose sizes only it reads (given a
    stand-in of that shape with no memory)."""
    kv_outputs: dict[int, int] = field(default_factory=dict)
    """Cache tensor -> the stage output that is its new value."""
    dropped_inputs: frozenset[int] = frozenset()
    """Inputs of the last stage that are another stage's new cache (given ``None``)."""
    step_inputs: dict[int, int] = field(default_factory=dict)
    """Stage input position -> step input (0 ids, 1 mask, 2 positions) it reads."""


class DecodeProgram:
    """The decode Pipe with each stage's :class:`StagePlan` and the cache layout."""

    def __init__(self, pipe: Pipe, layout: list[LayoutEntry], *, fresh: bool = False) -> None:
        self.pipe = pipe
        self.layout = layout
        self.fresh = fresh
        """The program starts from an empty cache and reads no past (a recurrent model's prefill;
        not RWKV's, which reads its fresh state as the past)."""
        self.num_stages: int = pipe.num_stages
        self.plans = _stage_plans(pipe, len(layout))
        for plan, stage in zip(self.plans, pipe.stages):  # each cache's past grows in place (cache_growth.py)
            if isinstance(stage.module, torch.fx.GraphModule):
                grow_in_place(stage.module, set(plan.kv_inputs))
        last_outputs = len(pipe.stages[-1].output_names)
        logits_out, _ = pipe.unflatten_outputs(list(range(last_outputs)))
        self.logits_output: int = logits_out

    def stage_module(self, s: int) -> torch.nn.Module:
        return self.pipe.stages[s].module

    def prepare(self, prompt_len: int) -> None:
        """Nothing to do: one program serves every prompt length (a recurrent model's
        :class:`~.phased.PhasedProgram` traces its prefill of that length here)."""

    def inputs(self, s: int) -> list[StageInput]:
        return self.pipe.stages[s].inputs

    def gather(self, s: int, step: Sequence[torch.Tensor], produced: dict[tuple[int, int], Any],
               kv: dict[int, torch.Tensor]) -> list[Any]:
        """Stage ``s``'s arguments: ``step`` (ids, mask, positions), values from other stages in
        ``produced`` (keyed ``(stage, output)``; the step inputs also under ``(MODEL_INPUT, i)``),
        its own cache ``kv`` (flat index -> tensor)."""
        plan = self.plans[s]
        flat: list[Any] = [*step, *([None] * (2 * len(self.layout)))]
        for i, x in enumerate(step):
            produced[(MODEL_INPUT, i)] = x
        for j, t in kv.items():
            flat[N_STEP_INPUTS + j] = t
            produced[(MODEL_INPUT, N_STEP_INPUTS + j)] = t
        for slot in self.inputs(s):
            if slot.index in plan.dropped_inputs:
                produced.setdefault(slot.key, None)
        return gather_inputs(self.inputs(s), flat, produced, self.bindings_of(step))

    def bindings_of(self, step: Sequence[Any]) -> dict:
        """The decode pipe's symbols for a step of ``step`` (ids or None, mask, positions)."""
        mask, positions = step[1], step[2]
        return self.bindings(int(mask.shape[0]), int(positions.shape[1]), int(mask.shape[1]) - int(positions.shape[1]))

    def bindings(self, batch: int, new: int, past: int) -> dict:
        """The decode pipe's symbols for ``batch`` rows extended by ``new`` tokens after ``past``:
        a step input's dims, and each cache tensor's ``(batch, heads, past, head_dim)``."""
        sizes = {0: (batch, new), 1: (batch, past + new), 2: (batch, new)}
        out = {}
        for src in self.pipe.symbols:
            i = src.input_index
            if i < N_STEP_INPUTS:
                out[src.symbol] = sizes[i][src.dim]
            else:
                out[src.symbol] = past_shape(self.layout[i - N_STEP_INPUTS], batch, past)[src.dim]
        return out

    def links(self) -> dict[int, set[int]]:
        """``{stage: stages it reads values from}``, cache tensors left out (they never cross)."""
        out: dict[int, set[int]] = {}
        for e in self.messages():
            out.setdefault(e.dst_stage, set()).add(e.src_stage)
        return out

    def messages(self) -> list[Any]:
        """The decode pipe's edges between stages that carry values (not the cache), sorted."""
        dropped = self.plans[-1].dropped_inputs
        return sorted((e for e in self.pipe.edges if e.src_stage != MODEL_INPUT
                       and not (e.dst_stage == self.num_stages - 1 and e.dst_input in dropped)),
                      key=lambda e: (e.src_stage, e.dst_stage, e.src_output, e.dst_input))

    def token_readers(self) -> set[int]:
        """The stages that read ``input_ids``."""
        return {p.index for p in self.plans if 0 in p.step_inputs.values()}


def past_shape(entry: LayoutEntry, batch: int, past: int) -> tuple[int, ...]:
    """The shape of a cache tensor before a step of ``batch`` rows after ``past`` tokens.

    Example:
        >>> past_shape((4, 8), 2, 5), past_shape(FixedState((64, 4)), 2, 5)
        ((2, 4, 5, 8), (2, 64, 4))
    """
    if isinstance(entry, FixedState):
        return entry.full_shape(batch)
    if isinstance(entry, TokenPrefix):  # a model decoded by recomputation: the tokens so far
        return entry.full_shape(batch, past)
    h, d = entry
    return (batch, h, past, d)


def empty_past(entry: LayoutEntry, batch: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """A cache tensor before any token: no keys or values, or a recurrent state's fresh value.

    Example:
        >>> empty_past((4, 8), 2, "cpu", torch.float32).shape, empty_past(FixedState((3,), 1.0), 2, "cpu", torch.float32)
        (torch.Size([2, 4, 0, 8]), tensor([[1., 1., 1.],
                [1., 1., 1.]]))
    """
    if isinstance(entry, FixedState):
        return entry.fresh(batch, device, dtype)
    return torch.zeros(past_shape(entry, batch, 0), device=device,
                       dtype=entry.dtype if isinstance(entry, TokenPrefix) else dtype)


def _model_input_of(slot: StageInput) -> int | None:
    if slot.kind is InputKind.MODEL:
        return slot.model_input
    if slot.kind is InputKind.EDGE and slot.edge is not None and slot.edge.src_stage == MODEL_INPUT:
        return slot.edge.src_output
    return None


def _stage_plans(pipe: Pipe, n_kv: int) -> list[StagePlan]:
    n = pipe.num_stages
    last = pipe.stages[-1]
    _, kv_leaves = pipe.unflatten_outputs(list(range(len(last.output_names))))
    # Where each new cache tensor is made: (stage, output) of that stage.
    made: dict[int, tuple[int, int]] = {}
    dropped: set[int] = set()
    out_node = next(nd for nd in last.module.graph.nodes if nd.op == "output")
    returned = out_node.args[0]
    placeholders = [nd for nd in last.module.graph.nodes if nd.op == "placeholder"]
    for j, o in enumerate(kv_leaves):
        value = returned[o]
        if isinstance(value, torch.fx.Node) and value.op == "placeholder":
            pos = placeholders.index(value)
            slot = last.inputs[pos]
            if slot.kind is not InputKind.EDGE or slot.edge is None or slot.edge.src_stage == MODEL_INPUT:
                raise GenerationError(f"cache tensor {j} is returned unchanged by the decode step: the model does "
                                      "not update its cache")
            made[j] = (slot.edge.src_stage, slot.edge.src_output)
            if set(value.users) == {out_node}:
                dropped.add(pos)  # only returned: it stays on its stage
            # else the cut falls between the layer's cache update and its attention: the last
            # stage computes with the keys / values too, and they keep coming as a message
        else:
            made[j] = (n - 1, o)
    reads: dict[int, dict[int, int]] = {s: {} for s in range(n)}
    shapes: dict[int, dict[int, int]] = {s: {} for s in range(n)}
    steps: dict[int, dict[int, int]] = {s: {} for s in range(n)}
    for s in range(n):
        for slot in pipe.stages[s].inputs:
            i = _model_input_of(slot)
            if i is None:
                continue
            if i >= N_STEP_INPUTS:
                node = [nd for nd in pipe.stages[s].module.graph.nodes if nd.op == "placeholder"][slot.index]
                sizes_only = all(u.op == "call_function" and u.target is torch.ops.aten.sym_size.int
                                 for u in node.users)
                (shapes if sizes_only else reads)[s][slot.index] = i - N_STEP_INPUTS
            else:
                steps[s][slot.index] = i
    plans = []
    for s in range(n):
        kv = tuple(sorted(j for j, (src, _) in made.items() if src == s))
        for j in reads[s].values():
            if made[j][0] != s:
                raise GenerationError(
                    f"layer {j // 2}'s KV cache would cross a cut: stage {s} reads its past but stage {made[j][0]} "
                    "makes its new value (the split cuts inside that attention layer). Cut the model at block "
                    "boundaries (e.g. split_spec=['model.layers.2']) so each stage keeps its own layers' cache")
        plans.append(StagePlan(s, kv, dict(reads[s]), dict(shapes[s]), {j: made[j][1] for j in kv},
                               frozenset(dropped) if s == n - 1 else frozenset(), dict(steps[s])))
    return plans


def example_step(layout: list[LayoutEntry], device: torch.device | str, dtype: torch.dtype, *, t: int = 3,
                 p: int = 4, given_state: bool = False) -> tuple[tuple, dict]:
    """A decode step's arguments to trace on: ``t`` new tokens after ``p`` (no past at all where
    ``p`` is 0: a recurrent model's prefill, unless ``given_state``: the prefill of a model whose
    state is an argument (RWKV) reads the fresh state as its past), with the dynamic shapes to
    trace them with."""
    b = 2  # distinct sizes above 1: export keeps each dim general
    ids = torch.zeros(b, t, dtype=torch.long, device=device)
    mask = torch.ones(b, p + t, dtype=torch.long, device=device)
    pos = torch.arange(p, p + t, device=device).expand(b, t).contiguous()
    read = layout if p or given_state else []
    past = [torch.zeros(past_shape(e, b, p), device=device,
                        dtype=(e.dtype if isinstance(e, (FixedState, TokenPrefix)) else None) or dtype) for e in read]
    dyn = torch.export.Dim.DYNAMIC
    new = {0: dyn, 1: dyn} if t > 1 else {0: dyn}  # a step of one token is traced as such
    shapes = {"input_ids": new, "attention_mask": {0: dyn, 1: dyn}, "position_ids": new,
              "past": [{d: dyn for d in _dynamic_dims(e)} for e in read]}
    return (ids, mask, pos, past), shapes


def growth_dim(entry: LayoutEntry) -> int | None:
    """The dim along which a cache tensor grows each step (None: a recurrent state keeps its size).

    Example:
        >>> growth_dim((4, 8)), growth_dim(FixedState((64, 4)))
        (2, None)
    """
    return None if isinstance(entry, FixedState) else _dynamic_dims(entry)[-1]


def _dynamic_dims(entry: LayoutEntry) -> tuple[int, ...]:
    """The dims of a cache tensor that vary between calls: the batch, and the length where it grows
    (a recurrent state keeps its size; the tokens so far ``(B, P)``; keys and values ``(B, H, P, D)``)."""
    if isinstance(entry, FixedState):
        return (0,)
    return (0, 1) if isinstance(entry, TokenPrefix) else (0, 2)
