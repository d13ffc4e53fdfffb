"""``PipelineStage``'s backward half: B, or I then W, of a microbatch the stage saved.

Part of the stage layer (… → **stage** → schedule → runtime): a base class of
:class:`~pippy_split.stage.stage.PipelineStage`, which holds the state it reads (the
saved microbatches, the I/W capture plan) and runs the forward. The runtime calls
:meth:`StageBackward.backward`, :meth:`StageBackward.backward_input` and
:meth:`StageBackward.backward_weight`; what W has left to do is a typed state of the
saved microbatch (:data:`~.saved.WeightWork`).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch.autograd.graph import GradientEdge

from .backward import WeightGradPlan, plan_weight_grads
from .coverage import uncovered_parameters
from .data_parallel import unsplittable_backward
from .errors import PipelineError
from .saved import CaptureGrads, SavedMicrobatch, WeightCaptures, WeightRoots, accumulate

if TYPE_CHECKING:
    from .pipe_view import PipeView

__all__ = ["StageBackward"]


class StageBackward:
    """B, I and W of one stage (a base of :class:`~pippy_split.stage.stage.PipelineStage`)."""

    # state the stage holds (set in PipelineStage.__init__)
    stage_index: int
    is_last: bool
    module: torch.nn.Module
    pipe: PipeView | None
    weight_grads_in_input: bool
    _saved: dict[int, SavedMicrobatch]
    _wplan: WeightGradPlan | None
    _region_call: torch.nn.Module | None

    def _recompute(self, mb: int, saved: SavedMicrobatch) -> None:  # full activation checkpointing (the stage's)
        raise NotImplementedError

    # ---- backward ------------------------------------------------------------------
    def _roots(self, mb: int, saved: SavedMicrobatch, output_grads: Mapping[int, torch.Tensor],
               loss_divisor: float | None) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        if self.is_last:
            if saved.loss is None or saved.rule is None:
                raise PipelineError(f"stage {self.stage_index}, microbatch {mb}: backward needs a loss; pass loss_fn "
                                    "to the schedule and target= to step()")
            rule = saved.rule if loss_divisor is None else replace(saved.rule, divisor=loss_divisor, scale=1.0)
            return [rule.backward_root(saved.loss)], [None]
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        for i, g in output_grads.items():
            out = saved.outputs[i]
            if isinstance(out, torch.Tensor) and out.requires_grad:
                tensors.append(out)
                grads.append(g)
        return tensors, grads

    def _grad_inputs(self, saved: SavedMicrobatch) -> list[tuple[int, torch.Tensor]]:
        return [(i, a) for i, a in enumerate(saved.inputs)
                if isinstance(a, torch.Tensor) and a.requires_grad and a.is_leaf]

    def backward(self, mb: int, output_grads: Mapping[int, torch.Tensor],
                 loss_divisor: float | None = None) -> dict[int, torch.Tensor]:
        """Full backward (B): returns ``{input_index: grad}`` and accumulates ``.grad`` on parameters.

        The last stage starts from its loss under the step's :class:`LossRule` (given to
        :meth:`forward`); ``loss_divisor`` replaces the rule's divisor and scale (a stage
        driven by hand). Other stages ignore it.
        """
        saved = self._pop(mb)
        if saved.recompute is not None:
            self._recompute(mb, saved)
        return self._full_backward(mb, saved, output_grads, loss_divisor)

    def _full_backward(self, mb: int, saved: SavedMicrobatch, output_grads: Mapping[int, torch.Tensor],
                       loss_divisor: float | None) -> dict[int, torch.Tensor]:
        tensors, grads = self._roots(mb, saved, output_grads, loss_divisor)
        if tensors:
            try:
                torch.autograd.backward(tensors, grads)
            except Exception as e:
                raise PipelineError(f"stage {self.stage_index}, microbatch {mb}: backward raised {type(e).__name__}: {e}") from e
        return {i: a.grad if a.grad is not None else torch.zeros_like(a) for i, a in self._grad_inputs(saved)}

    def backward_input(self, mb: int, output_grads: Mapping[int, torch.Tensor],
                       loss_divisor: float | None = None) -> dict[int, torch.Tensor]:
        """Input-gradient half (I) of a split backward; :meth:`backward_weight` finishes it."""
        saved = self._saved.get(mb)
        if saved is None:
            raise PipelineError(f"stage {self.stage_index}, microbatch {mb}: input-grad backward before forward")
        if saved.recompute is not None:
            self._recompute(mb, saved)
        if self.weight_grads_in_input:
            return self._backward_input_and_weights(mb, saved, output_grads, loss_divisor)
        tensors, grads = self._roots(mb, saved, output_grads, loss_divisor)
        leaves = self._grad_inputs(saved)
        plan, work = self._wplan, saved.weight_work
        groups: list[list[torch.nn.Parameter]] = []
        multi: list[torch.nn.Parameter] = []
        if plan is not None and isinstance(work, WeightCaptures):
            groups, multi = self._covering(plan, tensors, work)
        captures = [(k, c) for k, c in enumerate(work.values) if groups[k]
                    and (isinstance(c, GradientEdge) or (isinstance(c, torch.Tensor) and c.requires_grad))] \
            if isinstance(work, WeightCaptures) else []
        targets: list[Any] = [a for _, a in leaves] + [c for _, c in captures] + multi
        results: Sequence[torch.Tensor | None] = []
        if tensors and targets:
            try:
                results = torch.autograd.grad(tensors, targets, grads, retain_graph=True, allow_unused=True)
            except Exception as e:
                raise PipelineError(f"stage {self.stage_index}, microbatch {mb}: input-grad backward raised "
                                    f"{type(e).__name__}: {e}") from e
        else:
            results = [None] * len(targets)
        in_grads = {}
        for (i, a), g in zip(leaves, results[: len(leaves)]):
            in_grads[i] = g if g is not None else torch.zeros_like(a)
        if isinstance(work, WeightCaptures):
            cap_grads = results[len(leaves): len(leaves) + len(captures)]
            saved.weight_work = CaptureGrads([(c, g, groups[k]) for (k, c), g in zip(captures, cap_grads)
                                              if g is not None])
            for p, g in zip(multi, results[len(leaves) + len(captures):]):
                accumulate(p, g)
        else:
            saved.weight_work = WeightRoots(tensors, grads)  # W runs backward again, for the stage's parameters
        saved.outputs = ()
        return in_grads

    def _covering(self, plan: WeightGradPlan, roots: Sequence[torch.Tensor],
                  work: WeightCaptures) -> tuple[list[list[torch.nn.Parameter]], list[torch.nn.Parameter]]:
        """This microbatch's W groups and the parameters I computes whole, with every parameter
        B would reach covered exactly once: proven on the autograd graph the first time a
        forward hands over this set of captures (:func:`~.coverage.uncovered_parameters`);
        a parameter it cannot cover moves to I for good, with a note saying which."""
        whole_ids = {id(p) for p in plan.whole_params}
        groups = [[p for p in g if id(p) not in whole_ids] for g in work.params]
        key = tuple(tuple(id(p) for p in g) if work.values[k] is not None else None for k, g in enumerate(groups)) \
            + tuple(id(p) for p in work.whole_now)
        if key not in plan.proven:
            captures = [(c, g) for c, g in zip(work.values, groups) if c is not None and g]
            params = [p for p in self.module.parameters() if p.requires_grad]
            missed = uncovered_parameters(roots, captures, plan.whole_params + work.whole_now, params)
            if missed:
                self._cover_whole(plan, missed)
                return self._covering(plan, roots, work)
            plan.proven.add(key)
        return groups, list({id(p): p for p in plan.whole_params + work.whole_now}.values())

    def _cover_whole(self, plan: WeightGradPlan, missed: list[torch.nn.Parameter]) -> None:
        plan.whole_params = plan.whole_params + missed
        plan.proven.clear()
        names = [plan.names.get(id(p), "?") for p in missed]
        numel = sum(p.numel() for p in missed)
        warnings.warn(f"stage {self.stage_index}: the I/W split computes {len(missed)} parameter(s) whole in I "
                      f"({', '.join(names[:8])}{', ...' if len(names) > 8 else ''}; {numel} elements): each is read on "
                      "a path no captured op isolates (e.g. a module reads a child's weight without calling the child), "
                      "so W alone would miss part of its gradient. Exact; the cost is that their weight gradients run "
                      "in I instead of filling the bubble", stacklevel=4)

    def _backward_input_and_weights(self, mb: int, saved: SavedMicrobatch, output_grads: Mapping[int, torch.Tensor],
                                    loss_divisor: float | None) -> dict[int, torch.Tensor]:
        """I of a stage whose W cannot be split off (compiled): the whole backward, as B
        runs it (gradient hooks, e.g. FSDP's, fire as usual); W then has nothing to do."""
        in_grads = self._full_backward(mb, saved, output_grads, loss_divisor)
        saved.weight_work, saved.outputs = None, ()
        return in_grads

    def backward_weight(self, mb: int) -> None:
        """Weight-gradient half (W): accumulates ``.grad`` exactly as ``loss.backward()`` would."""
        saved = self._pop(mb)
        try:
            if self.weight_grads_in_input:
                return  # computed by I
            work = saved.weight_work
            if isinstance(work, CaptureGrads):
                for cap, g, params in work.grads:
                    torch.autograd.backward(cap, g, inputs=params)
            elif isinstance(work, WeightRoots):
                params = [p for p in self.module.parameters() if p.requires_grad]
                if work.tensors and params:
                    torch.autograd.backward(work.tensors, work.grads, inputs=params)
        except Exception as e:
            raise PipelineError(f"stage {self.stage_index}, microbatch {mb}: weight-grad backward raised "
                                f"{type(e).__name__}: {e}") from e

    def _pop(self, mb: int) -> SavedMicrobatch:
        saved = self._saved.pop(mb, None)
        if saved is None:
            raise PipelineError(f"stage {self.stage_index}, microbatch {mb}: backward before forward (nothing saved)")
        return saved

    def enable_split_backward(self) -> None:
        """Prepare the I/W split: capture, per parameter use, the op output whose
        gradient W needs, so W runs only the weight part of each op. Where W cannot be
        split off exactly (:meth:`check_split_backward`), I runs the whole backward."""
        if self._wplan is not None or self.check_split_backward() or self.pipe is None:
            return
        if not isinstance(self.module, torch.fx.GraphModule):
            self._fuse_backward(f"its module is a {type(self.module).__name__}, not the traced stage graph the split "
                                "is planned on")
            return
        self._region_call = None  # rebuilt from the instrumented graph
        self._wplan = plan_weight_grads(self.module)

    def check_split_backward(self) -> bool:
        """Under a split-backward schedule (at construction and before every step): where a
        separate W would miss or misplace gradients (FSDP2, parameters replaced after the
        split was planned: :func:`~pippy_split.stage.data_parallel.unsplittable_backward`),
        I runs the whole backward from now on, exact as B, and W is empty. Returns whether
        I computes the weight gradients."""
        if not self.weight_grads_in_input:
            plan = self._wplan
            if plan is not None:
                self._rebind_replaced_parameters(plan)
            planned = None if plan is None else [p for group in plan.params for p in group] + plan.whole_params
            why = unsplittable_backward(self.module, planned)
            if why is not None:
                self._fuse_backward(why)
        return self.weight_grads_in_input

    def _rebind_replaced_parameters(self, plan: WeightGradPlan) -> None:
        """Point the I/W plan at parameters replaced under the same FQN since it was made
        (``parallelize_module``'s DTensors, ``load_state_dict(assign=True)``): W then
        differentiates the ones the forward reads. FSDP2 is refused separately."""
        current = dict(self.module.named_parameters(remove_duplicate=False))
        swap = {old: current[name] for old, name in plan.names.items()
                if name in current and id(current[name]) != old}
        if not swap:
            return
        plan.params = [[swap.get(id(p), p) for p in group] for group in plan.params]
        plan.whole_params = [swap.get(id(p), p) for p in plan.whole_params]
        plan.names = {id(current[name]) if old in swap else old: name for old, name in plan.names.items()}

    def _fuse_backward(self, why: str) -> None:
        warnings.warn(f"stage {self.stage_index}: the zero-bubble I/W split cannot be exact here: {why}. Its I runs "
                      "the whole backward and W is empty (exact gradients, without the split's overlap for this "
                      "stage); GPipe, 1F1B or Interleaved1F1B run it the same way", stacklevel=3)
        self.weight_grads_in_input = True
