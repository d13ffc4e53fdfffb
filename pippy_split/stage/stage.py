"""``PipelineStage``: one stage's module plus who it talks to, by stage index.

Sits between the Pipe (which knows every edge) and the runtime (which runs a
schedule's actions). A stage knows stage indices only; the schedule binds ranks
later. It runs forward for a microbatch and keeps what backward needs; its backward
half, whole (B) or split into input-grad (I) then weight-grad (W), is
:class:`~.stage_backward.StageBackward`.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils._pytree import tree_map_only

from ..split.spec import Edge, StageInput
from .backward import WeightGradPlan, capturing, weight_captures
from .errors import PipelineError
from .groups import GroupArg, process_group
from .loss import LossRule
from .mixed_precision import autocast_edge_specs
from .model_io import ModelOutputs
from .options import StageOptions
from .pipe_view import PipeView
from .recompute import (
    RegionRecorder,
    check_patterns_match,
    checkpoint_called_modules,
    checkpoint_submodules,
    checkpointed_graph_module,
    graph_module_paths,
    restored_rng,
    rng_state,
    unchanged,
)
from .saved import (
    LastStageResult,
    Recompute,
    SavedMicrobatch,
    WeightCaptures,
    edge_if_checkpointed,
    module_device,
    recording_saved,
)
from .stage_backward import StageBackward

__all__ = ["PipelineStage", "LossRule"]


class PipelineStage(StageBackward):
    """One pipeline stage on this rank.

    Args:
        module: the stage's ``nn.Module``.
        stage_index: this stage's index in the pipeline.
        num_stages: total number of stages.
        device: where the module runs (default: where its parameters are).
        group: the pipeline's process group (a ``torch.distributed`` group or a
            DeviceMesh dimension's group); default the world.
        inputs_from: ``{input_idx: (stage, output_idx)}`` for inputs that do not come
            from the previous stage (skip connections). Others take the previous
            stage's remaining outputs in order.
        outputs_to: ``{output_idx: [(stage, input_idx), ...]}`` for outputs that go
            elsewhere than the next stage.
        activation_checkpoint: ``None`` (keep every activation); ``"full"``: the
            forward keeps only the stage's inputs, and the stage is recomputed (same
            RNG state) right before its backward; or a list of module FQN patterns
            (``["blocks.*"]``, fnmatch): only the calls of the original modules whose
            names match drop what autograd saves inside them and rerun from their
            inputs when the backward first needs it. Either way each microbatch is
            recomputed once, also under the zero-bubble I/W split (W reuses what I
            recomputed). A pattern that matches no module is a ``ValueError`` naming
            the closest module names. On a hand-built stage the patterns name
            submodules of ``module``, whose ``forward`` is wrapped on the instance.
        mixed_precision: ``None``, ``torch.bfloat16`` or ``torch.float16``: forward (and
            recompute) under ``torch.autocast``, the loss in fp32; for a stage of a Pipe
            the edges' specs say the dtype autocast gives them (``pipe.build_stage``).
        compile: run the stage's forward (and so its backward) through
            ``torch.compile``; a dict gives ``torch.compile``'s options. A compiled
            stage is one autograd node, so under the I/W split its I runs the whole
            backward (weight gradients included) and its W does nothing.

    Shapes of hand-built stages are inferred on the first step from the real first
    microbatch: each stage, in index order, runs a fake (FakeTensor) forward, and its
    rank broadcasts the outputs' shapes (one small collective per stage, then cached).

    Example:
        >>> stage = PipelineStage(torch.nn.Linear(4, 4), stage_index=1, num_stages=4, device="cpu",
        ...                       outputs_to={0: [(3, 1)]})   # output 0 also skips to stage 3, its input 1
        >>> stage.links()  # (sender, receiver, carries grad): the next stage and the skip
        [(1, 2, True), (1, 3, True)]
    """

    def __init__(self, module: torch.nn.Module, stage_index: int, num_stages: int,
                 device: torch.device | str | None = None, group: GroupArg = None,
                 inputs_from: Mapping[int, tuple[int, int]] | None = None,
                 outputs_to: Mapping[int, Sequence[tuple[int, int]]] | None = None,
                 activation_checkpoint: str | Sequence[str] | None = None,
                 mixed_precision: torch.dtype | None = None,
                 compile: bool | Mapping[str, Any] = False, *, options: StageOptions | None = None) -> None:
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} out of range for {num_stages} stages")
        self.options = _options(options, activation_checkpoint, mixed_precision, compile, f"stage {stage_index}")
        self.module = module
        self._call = self.options.compiled(module)  # self.module stays the plain module
        # A compiled stage is one autograd node: W could only run its whole backward again.
        # Its I computes the weight gradients too; W is empty.
        self.weight_grads_in_input = bool(self.options.compile)
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.device = torch.device(device) if device is not None else module_device(module)
        self._regions = RegionRecorder(self.device)
        self._region_call: torch.nn.Module | None = None  # the stage graph with its regions checkpointed, built lazily
        self.group = process_group(group, f"stage {stage_index}")  # a 1-D DeviceMesh: its process group
        self.pipe: PipeView | None = None  # set by from_pipe; None for a hand-built stage
        self._outputs: ModelOutputs | None = None  # from_pipe: the model's output structure, kept for steps
        self.inputs_from = dict(inputs_from or {})
        self.outputs_to = {k: list(v) for k, v in (outputs_to or {}).items()}
        for idx, (src, _) in self.inputs_from.items():
            if not 0 <= src < stage_index:
                raise ValueError(f"stage {stage_index}: input {idx} comes from stage {src}, which is not an earlier stage")
        for idx, dsts in self.outputs_to.items():
            for dst, _ in dsts:
                if not stage_index < dst < num_stages:
                    raise ValueError(f"stage {stage_index}: output {idx} goes to stage {dst}, which is not a later stage")
        self.in_slots: list[StageInput] | None = None if stage_index > 0 else []
        # Its outgoing edges (dst_input -1: the next free chain input); a hand-built stage's are
        # filled by the first step's shape pass.
        self.routes: list[Edge] = []
        self._saved: dict[int, SavedMicrobatch] = {}
        self.results: dict[int, LastStageResult] = {}  # last stage: per microbatch, kept for the whole step
        self.peak_held_microbatches = 0  # most microbatches held at once during the last step
        self._wplan: WeightGradPlan | None = None
        # set by the runtime for stages whose outputs go to other ranks (see may_release)
        self.track_saved_storages = False

    @property
    def activation_checkpoint(self) -> str | tuple[str, ...] | None:
        """``None``, ``"full"`` or the module patterns of selective checkpointing (:class:`StageOptions`)."""
        return self.options.activation_checkpoint

    @property
    def mixed_precision(self) -> torch.dtype | None:
        """The autocast dtype the stage runs under, or None (:class:`StageOptions`)."""
        return self.options.mixed_precision

    # ---- construction from a Pipe ------------------------------------------------
    @classmethod
    def from_pipe(cls, pipe: PipeView, stage_index: int, device: torch.device | str | None = None,
                  group: GroupArg = None, *,
                  state_dict: Any = None, seed: int = 0, strict: bool = True,
                  activation_checkpoint: str | Sequence[str] | None = None,
                  mixed_precision: torch.dtype | None = None,
                  compile: bool | Mapping[str, Any] = False, options: StageOptions | None = None) -> "PipelineStage":
        """The stage ``stage_index`` of ``pipe``, its module filled (``pipe.fill_stage_module``) and
        moved to ``device``, its inputs and outgoing edges from the pipe. ``pipe.build_stage`` is
        the documented entry; the arguments are the same.

        Example:
            >>> import pippy_split as ps
            >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
            >>> pipe = ps.pipeline(model, ["2"], (torch.randn(2, 4),))
            >>> stage = PipelineStage.from_pipe(pipe, 1, "cpu")
            >>> stage.is_last, [(e.src_stage, e.dst_stage) for e in pipe.edges if e.dst_stage == 1]
            (True, [(0, 1)])
        """
        options = _options(options, activation_checkpoint, mixed_precision, compile, f"stage {stage_index}")
        mixed_precision = options.mixed_precision
        if mixed_precision is not None:  # the split traced under the same autocast: the model's own casts and constants
            pipe = pipe.under_autocast(mixed_precision, torch.device(device).type if device is not None else "cpu")
        module = pipe.fill_stage_module(stage_index, device, state_dict=state_dict, seed=seed, strict=strict)
        if device is not None:
            module = module.to(device)
        stage = cls(module, stage_index, pipe.num_stages, device=device, group=group, options=options)
        stage.pipe = pipe
        stage._outputs = pipe.model_outputs
        if options.selective is not None:
            check_patterns_match(options.selective,
                                 {p for st in pipe.stages for p in graph_module_paths(st.module)},
                                 f"stage {stage_index}")
        specs = None if mixed_precision is None else autocast_edge_specs(pipe, mixed_precision, stage.device.type)

        def retyped(e: Edge) -> Edge:  # the edge with the dtype autocast gives it
            return e if specs is None else replace(e, spec=specs[id(e)])

        stage.in_slots = [slot if slot.edge is None else replace(slot, edge=retyped(slot.edge))
                          for slot in pipe.stages[stage_index].inputs]
        stage.routes = [retyped(e) for e in pipe.edges if e.sender_stage == stage_index]
        return stage

    def set_links(self, in_slots: Sequence[StageInput] | None = None, routes: Sequence[Edge] | None = None) -> None:
        """A hand-built stage learns where its inputs come from and where its outputs go
        (the runtime's shape pass on the first step); a stage of a Pipe knows from the start."""
        if in_slots is not None:
            self.in_slots = list(in_slots)
        if routes is not None:
            self.routes = list(routes)

    def links(self) -> list[tuple[int, int, bool]]:
        """(sender stage, receiver stage, carries grad) for every value a hand-built stage sends
        (a Pipe's stages: the schedule reads ``pipe.edges``)."""
        dsts = {d for v in self.outputs_to.values() for d, _ in v}
        if not self.is_last:
            dsts.add(self.stage_index + 1)
        return [(self.stage_index, d, True) for d in sorted(dsts)]

    @property
    def held_microbatches(self) -> int:
        """Microbatches whose activations this stage still holds (for memory checks)."""
        return len(self._saved)

    # ---- forward -------------------------------------------------------------------
    def forward(self, mb: int, args: list[Any], kwargs: Mapping[str, Any] | None = None, *, train: bool = True,
                target: Any = None, loss: LossRule | None = None) -> tuple:
        """Run the module on one microbatch; keep what backward needs when ``train``. Returns
        the stage's outputs. The last stage keeps, for the step, the model's output (its
        structure rebuilt once, detached) and, with ``target`` and ``loss``, the microbatch's
        loss (:attr:`results`)."""
        graph_storages: set[int] = set()
        patterns, precision = self.options.activation_checkpoint, self.options.mixed_precision
        recompute = train and patterns == "full"
        rng = rng_state(self.device) if recompute else None
        tracking = train and self.track_saved_storages
        call = self._forward_call() if isinstance(patterns, tuple) else self._call
        call_args = args if precision is None else self._not_leaves(args)
        try:
            # full checkpointing: forward without a graph now, again with one right before backward
            with contextlib.ExitStack() as hooks:
                hooks.enter_context(torch.set_grad_enabled(train and not recompute))
                hooks.enter_context(torch.autocast(self.device.type, dtype=precision, enabled=precision is not None))
                sink = hooks.enter_context(capturing(self._wplan)) if self._wplan is not None else None
                if tracking:
                    hooks.enter_context(recording_saved(graph_storages, True))
                if isinstance(patterns, tuple):
                    hooks.enter_context(self._regions.recording(train, graph_storages if tracking else None))
                out = call(*call_args, **(kwargs or {}))
        except Exception as e:
            raise PipelineError(f"stage {self.stage_index}, microbatch {mb}: forward raised {type(e).__name__}: {e}") from e
        outputs = tuple(out) if isinstance(out, tuple) or (isinstance(out, list) and self.pipe is not None) else (out,)
        saved = SavedMicrobatch(list(args), outputs, graph_storages=graph_storages, rule=loss) if train else None
        if saved is not None and recompute:
            saved.recompute = Recompute(dict(kwargs or {}), target, rng, loss)
        elif saved is not None and self._wplan is not None and sink is not None:
            # Under selective checkpointing an op output inside a region is kept as its autograd edge only,
            # so its storage can go.
            caps, params, whole_now = weight_captures(self._wplan, sink)
            saved.weight_work = WeightCaptures([edge_if_checkpointed(c, self._region_call is not None) for c in caps],
                                               params, whole_now)
        if self.is_last:
            output = self.model_output(outputs)
            result = self.results[mb] = LastStageResult(tree_map_only(torch.Tensor, torch.Tensor.detach, output))
            if saved is not None and loss is not None and target is not None:
                saved.loss = loss.loss(output, target, precision, self.device.type,
                                       f"stage {self.stage_index}, microbatch {mb}")
                result.loss = saved.loss.detach()
        if saved is not None:
            self._saved[mb] = saved
            self.peak_held_microbatches = max(self.peak_held_microbatches, len(self._saved))
        return outputs

    def _forward_call(self) -> Callable:
        """The module to run: the stage's own, or (selective checkpointing) one whose
        matching regions run checkpointed, built on first use after the I/W instrumentation."""
        patterns = self.activation_checkpoint
        if not isinstance(patterns, tuple):
            return self._call
        if self._region_call is None:
            if isinstance(self.module, torch.fx.GraphModule):
                checkpoint_called_modules(self.module, patterns, self._regions)
                self._region_call = checkpointed_graph_module(self.module, patterns, self._regions)
            else:
                if not checkpoint_submodules(self.module, patterns, self._regions):
                    check_patterns_match(patterns, (n for n, _ in self.module.named_modules() if n),
                                         f"stage {self.stage_index}")
                self._region_call = self.module
        return self._region_call

    @property
    def region_counts(self) -> tuple[int, int]:
        """Selective activation checkpointing: (region calls run checkpointed, region
        recomputes) since the stage was built; each region call is recomputed once."""
        return self._regions.region_calls, self._regions.recomputes

    def _not_leaves(self, args: Sequence[Any]) -> list[Any]:
        """Under mixed precision, each received value as a view: autocast caches its low-precision
        copy of a leaf that requires grad (meant for weights) and sums the gradients of every op
        that read the copy in low precision. A received activation is such a leaf here but never
        in the unsplit model, where each op casts it anew and the gradients add up in its own
        dtype; the view keeps that. Gradients still reach the received tensor."""
        slots = self.in_slots or []
        edge = {sl.index for sl in slots if sl.edge is not None}
        return [a.view_as(a) if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad
                and (i in edge or (not slots and not self.is_first)) else a for i, a in enumerate(args)]

    def _recompute(self, mb: int, saved: SavedMicrobatch) -> None:
        """Activation checkpointing: rebuild microbatch ``mb``'s graph from its saved inputs
        (same RNG state as its forward), once, before its backward (B, or I; W reuses it)."""
        state, saved.recompute = saved.recompute, None
        assert state is not None
        inputs = saved.inputs if self.mixed_precision is None else self._not_leaves(saved.inputs)
        try:
            with restored_rng(self.device, state.rng), unchanged(list(self.module.buffers())), torch.enable_grad(), \
                    capturing(self._wplan) as sink, torch.autocast(self.device.type, dtype=self.mixed_precision,
                                                                   enabled=self.mixed_precision is not None):
                out = self._call(*inputs, **state.kwargs)
        except Exception as e:
            raise PipelineError(f"stage {self.stage_index}, microbatch {mb}: recomputing the forward for activation "
                                f"checkpointing raised {type(e).__name__}: {e}") from e
        saved.outputs = tuple(out) if isinstance(out, tuple) or (isinstance(out, list) and self.pipe is not None) \
            else (out,)
        if self._wplan is not None:
            saved.weight_work = WeightCaptures(*weight_captures(self._wplan, sink))
        if self.is_last and saved.loss is not None and state.loss is not None:
            saved.loss = state.loss.loss(self.model_output(saved.outputs), state.target, self.mixed_precision,
                                         self.device.type, f"stage {self.stage_index}, microbatch {mb}")

    def may_release(self, mb: int, value: torch.Tensor) -> bool:
        """Whether ``value`` (an output of microbatch ``mb`` sent elsewhere) can drop its
        storage: autograd did not save that storage for this stage's backward."""
        saved = self._saved.get(mb)
        return (saved is not None and self.track_saved_storages
                and value.untyped_storage().data_ptr() not in saved.graph_storages)

    def model_output(self, outputs: tuple) -> Any:
        """The last stage's outputs in the structure the model returns."""
        if self._outputs is not None:
            return self._outputs(outputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def clear(self) -> None:
        """Drop every saved microbatch (after a failed step)."""
        self._saved.clear()
        self.results.clear()

    def __repr__(self) -> str:
        return f"PipelineStage(stage {self.stage_index} of {self.num_stages}, device={self.device})"


def _options(options: StageOptions | None, activation_checkpoint: Any, mixed_precision: Any, compile: Any,
             where: str) -> StageOptions:
    """``options=``, or the three keywords checked into one :class:`StageOptions` (not both)."""
    if options is None:
        return StageOptions.of(activation_checkpoint, mixed_precision, compile, where=where)
    if activation_checkpoint is not None or mixed_precision is not None or compile:
        raise ValueError(f"{where}: pass options= or activation_checkpoint=/mixed_precision=/compile=, not both")
    return options
