"""A decode step run eagerly, stage by stage, by the model's own modules (generate, no trace).

Tracing the decode step with dynamic shapes (:mod:`.programs`) costs seconds of torch's
symbolic shapes on every op of every layer, on the first ``generate`` of each Pipe. A Hugging
Face causal LM whose config declares its decoder layers a chain (``base_model_pp_plan``:
``layers`` maps ``hidden_states`` to ``hidden_states``), cut by the Pipe at those layers'
boundaries, needs no trace: :class:`EagerProgram` runs stage ``s`` as the model's own
``forward`` with its own cache class, where

- the layers of other stages pass their input through untouched (the instance's ``forward``
  is swapped for the call, and its forward hooks are set aside: they fire where the layer
  runs, once a step, as in the unsplit model; all put back after);
- a stage after the first hands its first layer the hidden states the stage before sent
  (a forward pre-hook); every stage gets the step's token ids, so whatever the model derives
  from them besides the layers' input (its embedding, per-layer inputs) is its own;
- a stage before the last stops at the end of its last layer (a forward hook raises its
  output out of the model's forward): that output is the only message between stages;
- the masks, positions and rotary embeddings are the model's, computed on every stage from the
  step's mask and positions (what each rank already has);
- the cache is the model's ``DynamicCache`` kind, its layers of this stage growing in place
  (:mod:`.cache_growth`); another stage's layers are stand-ins holding only their length,
  which the model reads for its masks and positions.

So every op is the one Hugging Face ``generate`` runs, in its order. Any other model, or a
cut elsewhere, decodes with the traced program. :func:`eager_program` says which.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from ..split.materialize import named_tensors
from ..split.pipe import Pipe
from ..stage.stage import PipelineStage
from .cache_growth import grow_cache, with_room
from .decode_model import decode_signature, is_hf_model, logits_of, router_loss_off, step_kwargs
from .errors import GenerationError

__all__ = ["EagerProgram", "eager_program", "eager_on_stages"]


class LayeredCache(Protocol):
    """A model's cache object as a stage keeps it: a layer each (Hugging Face's ``DynamicCache``)."""

    layers: list[Any]


@dataclass(frozen=True)
class HiddenSpec:
    """The hidden states a stage sends the next: ``(batch, new tokens, hidden)``."""

    hidden: int
    dtype: torch.dtype

    def concrete_shape(self, bindings: dict) -> tuple[int, ...]:
        return (bindings["batch"], bindings["new"], self.hidden)


@dataclass(frozen=True)
class HiddenEdge:
    """Stage ``src_stage``'s output 0 (its last layer's hidden states) to stage ``dst_stage``."""

    src_stage: int
    dst_stage: int
    spec: HiddenSpec
    src_output: int = 0
    dst_input: int = 0


class _StageOutput(BaseException):
    """Raised by a stage's last layer to leave the model's forward with its output (a
    BaseException: no ``except Exception`` in the model's code stops it)."""

    def __init__(self, value: object) -> None:
        super().__init__()
        self.value = value


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")
"""A module's forward hooks, as ``nn.Module`` keeps them (the dicts are swapped for empty ones, not emptied)."""


def _pass_through(hidden_states: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> torch.Tensor | None:
    return hidden_states


@functools.cache
def _cache_classes() -> tuple[type, type, type]:
    """The cache of an eager stage and its two kinds of layer (defined on first use: transformers
    is imported only for a Hugging Face model)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A layer of this stage: ``DynamicLayer`` whose keys and values grow in place into room
        for ``room`` tokens after the prompt (:func:`~.cache_growth.grow_cache`: the ``cat``'s values)."""

        def __init__(self, room: int) -> None:
            super().__init__()
            self.room = room

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.device, self.is_initialized = key_states.device, True
                room = key_states.shape[-2] + self.room
                self.keys = with_room(key_states.narrow(-2, 0, 0).clone(), key_states.dim() - 2, room)
                self.values = with_room(value_states.narrow(-2, 0, 0).clone(), value_states.dim() - 2, room)
            assert self.keys is not None and self.values is not None
            self.keys = grow_cache(self.keys, key_states, -2)
            self.values = grow_cache(self.values, value_states, -2)
            return self.keys, self.values

    class LengthOnly(DynamicLayer):
        """Another stage's layer: no keys or values, only how many tokens it holds (the model
        reads layer 0's length for its masks and positions)."""

        def __init__(self) -> None:
            super().__init__()
            self.length = 0
            self.is_initialized = True
            self.keys = self.values = torch.empty(0)

        def get_seq_length(self) -> int:
            return self.length

        def update(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            raise GenerationError("a decoder layer updated the cache of a layer another stage holds (layers that "
                                  "share their keys and values across stages). What works: "
                                  "model.config.base_model_pp_plan = None before its first generate (the traced "
                                  "decode step)")

    return DynamicCache, GrowingLayer, LengthOnly


class EagerProgram:
    """The decode program of an eligible model (see the module docstring), with the methods the
    drivers use: :meth:`run_stage` instead of a stage graph, and one message per cut (the hidden
    states). Built by :func:`eager_program`.

    Example:
        >>> program = eager_program(pipe)  # doctest: +SKIP
        >>> cache = program.new_cache(0, room=8)  # doctest: +SKIP
        >>> (hidden,) = program.run_stage(0, cache, [ids, mask, positions], {})  # doctest: +SKIP
    """

    logits_output = 0
    layout: list = []  # no cache tensors pass through the driver: each lane's cache is a model cache object

    def __init__(self, model: torch.nn.Module, layers: torch.nn.ModuleList, layer_prefix: str,
                 ranges: list[tuple[int, int]], hidden: int, dtype: torch.dtype) -> None:
        self.model = model
        self.layers = layers
        self.layer_prefix = layer_prefix
        """The layers' FQN in the model, with its dot (``model.layers.``)."""
        self.ranges = ranges
        self.num_stages = len(ranges)
        self.signature = decode_signature(model)
        self._edges = [HiddenEdge(s, s + 1, HiddenSpec(hidden, dtype)) for s in range(self.num_stages - 1)]
        self._classes = _cache_classes()

    def stage_module(self, s: int) -> torch.nn.Module:
        return self.model

    def prepare(self, prompt_len: int) -> None:
        """Nothing to trace."""

    def messages(self) -> list[HiddenEdge]:
        return list(self._edges)

    def links(self) -> dict[int, set[int]]:
        return {e.dst_stage: {e.src_stage} for e in self._edges}

    def token_readers(self) -> set[int]:
        return set(range(self.num_stages))  # every stage runs the model's forward on the step's ids

    def bindings(self, batch: int, new: int, past: int) -> dict:
        return {"batch": batch, "new": new, "past": past}

    def new_cache(self, s: int, room: int) -> LayeredCache:
        """An empty cache for stage ``s`` of one lane: its layers grow with room for ``room``
        tokens after the prompt; the others hold their length only."""
        cache_class, growing, length_only = self._classes
        a, b = self.ranges[s]
        cache = cache_class()
        cache.layers = [growing(room) if a <= j < b else length_only() for j in range(len(self.layers))]
        return cache

    def run_stage(self, s: int, cache: LayeredCache, step: Sequence[Any], produced: dict[tuple[int, int], Any]
                  ) -> tuple[torch.Tensor]:
        """Stage ``s``'s part of a step of ``step`` (ids, mask, positions) with its ``cache``:
        ``(hidden states,)`` for the next stage, or ``(last position's logits,)`` on the last."""
        ids, mask, positions = step
        past = int(mask.shape[1]) - int(positions.shape[1])
        for layer in cache.layers:
            if hasattr(layer, "length"):
                layer.length = past
        received = produced[(s - 1, 0)] if s > 0 else None
        kwargs = step_kwargs(self.signature, mask, positions, cache)
        with torch.no_grad(), router_loss_off(self.model), self._stage(s, received):
            try:
                out = self.model.forward(ids, **kwargs)
            except _StageOutput as o:
                return (self._checked(s, o.value, ids),)
        return (logits_of(out)[:, -1],)

    def _checked(self, s: int, value: object, new: torch.Tensor) -> torch.Tensor:
        """Stage ``s``'s output, as the message's spec says the next stage receives it (a rank
        unpacks a message by the spec: another dtype or shape would be read as other values)."""
        spec = self._edges[s].spec
        want = (int(new.shape[0]), int(new.shape[1]), spec.hidden)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != want or value.dtype != spec.dtype:
            got = (f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor)
                   else type(value).__name__)
            raise GenerationError(f"{type(self.layers[self.ranges[s][1] - 1]).__name__} returned {got}, not the "
                                  f"hidden states {want} {spec.dtype} its config's base_model_pp_plan declares. What "
                                  "works: model.config.base_model_pp_plan = None before its first generate (the "
                                  "traced decode step)")
        return value

    @contextlib.contextmanager
    def _stage(self, s: int, received: torch.Tensor | None) -> Iterator[None]:
        a, b = self.ranges[s]
        others = [layer for j, layer in enumerate(self.layers) if not a <= j < b]
        handles = []
        hooks = [{name: getattr(layer, name) for name in _HOOK_DICTS if hasattr(layer, name)} for layer in others]
        own = [vars(layer).get("forward") for layer in others]  # a forward set on the instance (accelerate's)
        for layer in others:  # passed through: neither the layer nor its hooks run on this stage
            layer.forward = _pass_through  # type: ignore[method-assign]
        for layer, held in zip(others, hooks):
            for name in held:
                setattr(layer, name, OrderedDict())
        try:
            if received is not None:
                def given(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                    if args:
                        return (received, *args[1:]), kwargs
                    return args, {**kwargs, "hidden_states": received}

                # first of its pre-hooks: the model's own (a user's steering hook) then see what was sent
                handles.append(self.layers[a].register_forward_pre_hook(given, with_kwargs=True, prepend=True))
            if s < self.num_stages - 1:
                def stop(module: torch.nn.Module, args: tuple, output: object) -> None:
                    raise _StageOutput(output)

                handles.append(self.layers[b - 1].register_forward_hook(stop))  # last: after the model's own
            yield
        finally:
            for h in handles:
                h.remove()
            for layer, held, forward in zip(others, hooks, own):
                if forward is None:
                    del layer.forward
                else:
                    layer.forward = forward  # type: ignore[method-assign]
                for name, value in held.items():
                    setattr(layer, name, value)


def _layer_ranges(pipe: Pipe, prefix: str, n_layers: int) -> list[tuple[int, int]] | None:
    """Each stage's layers ``[a, b)`` where the pipe is cut at layer boundaries, every stage has
    a layer and every layer's tensors sit on one stage; else None."""
    where: dict[int, set[int]] = {}
    for s, st in enumerate(pipe.stages):
        for name, _ in [*st.module.named_parameters(), *st.module.named_buffers()]:
            if name.startswith(prefix):
                head = name[len(prefix):].split(".", 1)[0]
                if head.isdigit():
                    where.setdefault(int(head), set()).add(s)
    if sorted(where) != list(range(n_layers)) or any(len(v) != 1 for v in where.values()):
        return None
    stage_of = [next(iter(where[j])) for j in range(n_layers)]
    ranges = []
    for s in range(pipe.num_stages):
        js = [j for j in range(n_layers) if stage_of[j] == s]
        if not js or js != list(range(js[0], js[-1] + 1)):
            return None
        ranges.append((js[0], js[-1] + 1))
    if any(ranges[s][1] != ranges[s + 1][0] for s in range(len(ranges) - 1)):
        return None
    return ranges


def _has_real_tensors(model: torch.nn.Module) -> bool:
    return all(t.device.type != "meta" and type(t).__name__ != "DTensor"
               for t in [*model.parameters(), *model.buffers()])


def eager_program(pipe: Pipe) -> EagerProgram | None:
    """``pipe``'s :class:`EagerProgram` where its model qualifies (see the module docstring:
    a Hugging Face causal LM with a KV cache and no recurrent state, its decoder layers a chain
    by its config's ``base_model_pp_plan``, every tensor real in this process, the Pipe cut at
    layer boundaries with a layer on every stage); None where the traced program decodes it.
    Kept in ``pipe.derived`` once built.

    Example:
        >>> program = eager_program(pipe)  # doctest: +SKIP
        >>> program.ranges  # doctest: +SKIP
        [(0, 2), (2, 4)]
    """
    if "eager_program" in pipe.derived:
        return pipe.derived["eager_program"]
    program = _build(pipe)
    pipe.derived["eager_program"] = program
    return program


def _build(pipe: Pipe) -> EagerProgram | None:
    model = pipe.model
    if model is None or not is_hf_model(model) or pipe.num_stages < 1:
        return None
    try:
        sig = decode_signature(model)
    except GenerationError:
        return None
    if sig.cache_arg not in ("cache", "past_key_values") or sig.recurrent:
        return None
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None) or {}
    layers_io = plan.get("layers")
    if not layers_io or list(layers_io[1]) != ["hidden_states"] or layers_io[0][:1] != ["hidden_states"]:
        return None
    base = getattr(model, "base_model", None)
    layers = getattr(base, "layers", None)
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers) or not isinstance(hidden, int):
        return None
    if getattr(config, "num_hidden_layers", len(layers)) != len(layers) or not _has_real_tensors(model):
        return None
    prefix = next((f"{name}." for name, mod in model.named_modules() if mod is layers), None)
    ranges = _layer_ranges(pipe, prefix, len(layers)) if prefix else None
    if prefix is None or ranges is None:
        return None
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return EagerProgram(model, layers, prefix, ranges, hidden, dtype)


def eager_on_stages(pipe: Pipe, stages: Sequence[PipelineStage]) -> EagerProgram | None:
    """``pipe``'s :class:`EagerProgram` for a ``sched.generate`` on this rank's ``stages``
    (``PipelineStage`` objects), where it qualifies (:func:`eager_program`) and each stage
    trains the model's own tensors (the same objects under the same names: what the optimizer
    updates is what the model's modules read), with every tensor of the model but the other
    stages' layers on the stage's device; else None (the traced program, bound to the live
    tensors). The ranks agree on the choice before any message (:mod:`.agreement`).

    Example:
        >>> eager_on_stages(pipe, sched.stages)  # doctest: +SKIP
    """
    program = eager_program(pipe)
    if program is None:
        return None
    model = named_tensors(program.model)
    here = {st.stage_index for st in stages}
    elsewhere = tuple(f"{program.layer_prefix}{j}." for s, (a, b) in enumerate(program.ranges) if s not in here
                      for j in range(a, b))
    for st in stages:
        if any(model.get(name) is not t for name, t in named_tensors(st.module).items()):
            return None
        if any(t.device != st.device for name, t in model.items() if not name.startswith(elsewhere)):
            return None
    return program
