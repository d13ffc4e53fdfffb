"""The base of every schedule class, :class:`PipelineSchedule`: this rank's stages + an order -> ``step()``.

Sits at the top of the schedule layer, under the written-out classes of
:mod:`.schedules`. At construction the family's compute order (:mod:`.orders`) is
generated for the stages' placement (:mod:`.placement`), lowered with their links
(:mod:`.lower`), checked (:mod:`.validate`) and agreed on by every rank
(:mod:`.collectives`); each ``step()`` splits the inputs into microbatches, shares what
the ranks need to know before any message (:mod:`.agree`, :mod:`.dynamic_sizes`), and
runs this rank's actions on the one :class:`.runtime.Interpreter`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import torch

from ..microbatch import Microbatches, merge_chunks
from ..split.hand_over import Generation, driver
from ..stage.data_parallel import sync_data_parallel
from ..stage.groups import PipelineGroup
from ..stage.loss import LossRule
from ..stage.stage import PipelineStage
from ..stage.transport import P2P
from .actions import Action, Order
from .agree import FailureChannel, StepGuard
from .collectives import agree_on_order, share_loss, sync_shared_grads
from .orders import get_order_spec
from .runtime import Interpreter, StepContext
from .schedule_plan import SchedulePlan, stage_links
from .simulate import simulate
from .step_inputs import Chunking, StepCallReader
from .step_start import StepStart
from .timing import ActionTiming, recorded
from .train_mode import refuse_train_mode_graph

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


__all__ = ["PipelineSchedule"]


class _ScheduleClass(type):
    """The type of the schedule classes. Read on a class, ``placement`` is its
    ``placement_style`` (how the style was read before it had a name of its own:
    ``get_schedule_class("1F1B").placement == "loop"``); on an instance ``placement`` is
    the ``{stage: rank}`` map it runs under, a plain attribute."""

    placement_style: str

    @property
    def placement(cls) -> str:
        return cls.placement_style


class PipelineSchedule(metaclass=_ScheduleClass):
    """Base of every schedule class; a subclass names its family (``order_name``) and the
    placement that family needs (``placement_style``), nothing else. Besides the step, the
    runtime's probe and memory knob: ``timed_actions``, ``release_sent_outputs``.

    Args:
        stage_or_stages: this rank's stage, or its stages (any order).
        n_microbatches: microbatches per step.
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage.
        scale_grads: divide each microbatch's loss by ``n_microbatches`` so gradients
            equal those of a mean loss over the whole batch (turn off for sum losses).
        loss_count: ``loss_count(target_mb) -> number of items`` (e.g. valid tokens,
            ``lambda t: (t != -100).sum()``). With it, ``loss_fn`` returns each
            microbatch's loss *sum*, and the step's loss is the sum over all
            microbatches divided by the items of the whole batch (counted before the
            first backward), so gradients equal the unsplit model's mean over all
            items even when microbatches hold different numbers of them. Gradients
            of several ``step()`` calls without ``zero_grad`` add up (each step
            normalised by its own count), as with ``loss.backward()`` per batch.
        timeout: seconds any blocking wait may take before a named error.
        args_chunk_spec / kwargs_chunk_spec: how to split ``step()``'s inputs.
        output_merge_spec: how to merge the last stage's outputs.
        on_nonfinite: what a NaN/inf loss does: "warn" (default; names stage and
            microbatch), "raise" (a PipelineError), or "ignore".
        placement: "loop" or "v" to run the family's order on the other placement
            (each rank keeps its sequence of stage chunks); checked by ``validate``.
    """

    order_name: str = ""
    """The order family this class runs, a name in :data:`.orders.ORDERS` ("" for the base
    and for :class:`~pippy_split.schedule.ScheduleFromOrder`)."""
    placement_style: ClassVar[str] = ""
    """Where the family puts stages, by name: ``"loop"`` (stage ``s`` on rank ``s % p``) or
    ``"v"`` (zig-zag), as :data:`.orders.ORDERS` states it; an instance's ``placement`` is
    the ``{stage: rank}`` map it runs under."""

    def __init__(self, stage_or_stages: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, *, scale_grads: bool = True, timeout: float = 300.0,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None, output_merge_spec: Any = None,
                 on_nonfinite: str = "warn", placement: str | None = None,
                 loss_count: Callable[[Any], Any] | None = None) -> None:
        self._placement_override = placement
        self.loss_count = loss_count
        self.loss_scale = 1.0  # the loss is multiplied by this in backward (set by PipelineGradScaler)
        if on_nonfinite not in ("warn", "raise", "ignore"):
            raise ValueError(f"on_nonfinite must be 'warn', 'raise' or 'ignore', got {on_nonfinite!r}")
        stages = [stage_or_stages] if isinstance(stage_or_stages, PipelineStage) else list(stage_or_stages)
        if not stages:
            raise ValueError("a schedule needs at least one stage")
        self.stages = sorted(stages, key=lambda s: s.stage_index)
        self._last = next((s for s in self.stages if s.is_last), None)  # where this rank holds it
        self.n_microbatches = int(n_microbatches)
        self.loss_fn = loss_fn
        self.on_nonfinite = on_nonfinite  # handed to the last stage with each step (LossRule)
        self.scale_grads = scale_grads
        self.args_chunk_spec, self.kwargs_chunk_spec = args_chunk_spec, kwargs_chunk_spec
        self.output_merge_spec = output_merge_spec
        self.pipeline_group = PipelineGroup.of(self.stages[0].group, self.stages[0].device)
        self.num_stages = self.stages[0].num_stages
        if len({s.stage_index for s in self.stages}) != len(self.stages):
            raise ValueError(f"{type(self).__name__}: the same stage was given twice: "
                             f"{[s.stage_index for s in self.stages]}")
        if self.n_microbatches < 1:
            raise ValueError(f"{type(self).__name__}: n_microbatches must be >= 1, got {self.n_microbatches}")
        self.links = stage_links(self.stages, self.pipeline_group)
        self.schedule_plan = self._make_plan()
        self.placement = self.schedule_plan.placement
        self.schedule_plan.check_holds(self.rank, [st.stage_index for st in self.stages], type(self).__name__)
        self._splits_backward = self.schedule_plan.splits_backward  # read by every step: asked once
        if self._splits_backward:
            for st in self.stages:
                st.enable_split_backward()
        self.order: Order = self.schedule_plan.order
        self.lowered: Order = self.schedule_plan.lowered
        self.actions: list[Action] = self.schedule_plan.actions(self.rank)
        self._eval_actions = self.schedule_plan.forward_only(self.rank, self.n_microbatches)
        self._runtime = Interpreter({s.stage_index: s for s in self.stages}, self.placement, self.rank,
                                    P2P(self.group, timeout) if self.world > 1 else None)
        if self.world > 1:
            agree_on_order(type(self).__name__, self.lowered, self.n_microbatches, self.num_stages, self.links,
                           self.pipeline_group)
        # last: a schedule whose construction failed on some rank takes no key (see FailureChannel)
        self._failures = FailureChannel(self.pipeline_group, self._runtime.p2p, owner=self)
        self._start = StepStart(self.stages, StepCallReader(self.stages, self.rank), self.pipeline_group,
                                f"stage {self.num_stages - 1} (rank {self.placement[self.num_stages - 1]})",
                                self._splits_backward)  # a step's checks and agreement, made once
        self._loss: torch.Tensor | None = None
        self.agree_every_step = False
        """Start every step with the agreement (one small all-reduce), not only the first ones and those
        that share something: a rank's failed check then leaves the schedule usable (see :mod:`.step_start`)."""
        self._unchecked: tuple[LossRule | None, list] = (None, [])  # the step's rule and losses, until checked

    # ---- set-up checks ----------------------------------------------------------
    def _make_plan(self) -> SchedulePlan:
        """The family's order for these stages, lowered and validated (a subclass given its own order overrides this)."""
        return SchedulePlan.of_family(self.order_name, num_stages=self.num_stages, world=self.world,
                                      n_microbatches=self.n_microbatches, links=self.links, owner=type(self).__name__,
                                      stages_per_rank=len(self.stages), placement=self._placement_override,
                                      held=[s.stage_index for s in self.stages])

    @classmethod
    def stage_placement(cls, num_stages: int, num_ranks: int, placement: str | None = None) -> dict[int, int]:
        """``{stage: rank}`` this schedule class runs ``num_stages`` stages under: its family's
        placement, or ``placement`` (an override). The one rule ``build_schedule`` and the
        constructor both use (from :mod:`.placement`), e.g.
        ``ScheduleZBVZeroBubble.stage_placement(4, 2) == {0: 0, 1: 1, 2: 1, 3: 0}``.
        """
        return get_order_spec(cls.order_name).stage_placement(num_stages, num_ranks, placement)

    @classmethod
    def compute_order(cls, num_ranks: int, n_microbatches: int, stages_per_rank: int | None = None) -> Order:
        """This family's compute order (F, B, I, W per rank; no process group, no stage):
        ``stages_per_rank`` defaults to the family's fixed count, else its minimum."""
        spec = get_order_spec(cls.order_name)
        return spec.compute_order(num_ranks, n_microbatches, stages_per_rank or spec.default_stages_per_rank())

    # ---- running ---------------------------------------------------------------------
    def _context(self, args: tuple, kwargs: dict, target: Any, train: bool, n: int, guard: StepGuard) -> StepContext:
        """This step's inputs, checked and agreed on (:class:`.step_start.StepStart`), and its loss rule."""
        ctx, items = self._start.context(args, kwargs, target, train=train, n=n, guard=guard,
                                         chunking=Chunking(self.args_chunk_spec, self.kwargs_chunk_spec),
                                         loss_fn=self.loss_fn, loss_count=self.loss_count,
                                         every_step=self.agree_every_step)
        if self.loss_fn is not None:
            ctx.loss = LossRule.for_step(self.loss_fn, n_microbatches=self.n_microbatches, scale_grads=self.scale_grads,
                                         items=items, scale=self.loss_scale, on_nonfinite=self.on_nonfinite)
        return ctx

    def step(self, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> Any:
        """One training step over ``n_microbatches``; the same call on every rank.

        Returns the merged model outputs where the last stage lives (None elsewhere);
        ``losses`` (a list) is replaced by this step's per-microbatch losses there;
        ``self.loss`` is the step's mean loss on every rank.
        """
        with self._failures.guard("step()") as guard:
            ctx = self._context(args, kwargs, target, True, self.n_microbatches, guard)
            for st in self.stages:
                st.peak_held_microbatches = 0
            self._run(self.actions, ctx, guard)
            self._start.ran.add(True)
            sync_shared_grads(self.stages[0].pipe, self.stages, self.pipeline_group)
            for st in self.stages:
                sync_data_parallel(st.module)
            last = self._last
            mb_losses = [last.results[mb].loss for mb in range(self.n_microbatches)] if last else []
            out = self._merge(ctx, last) if last is not None else None
            for st in self.stages:
                st.clear()
            if last is not None and losses is not None:
                losses[:] = mb_losses  # replaced, not appended: a list reused every step holds this step's
            self._loss = share_loss(mb_losses, ctx.loss, self.pipeline_group, self.placement[self.num_stages - 1],
                                    self._runtime.p2p)
        # NaN/inf: checked with one host read for the whole step, now where the schedule raises on it,
        # else when the caller first reads ``loss``
        self._unchecked = (ctx.loss, mb_losses if last is not None else [self._loss])
        if ctx.loss is not None and ctx.loss.on_nonfinite == "raise":
            self._check_loss()
        return out

    def _check_loss(self) -> None:
        rule, mb_losses = self._unchecked
        self._unchecked = (None, [])
        if rule is None:
            return
        last, rank = self.num_stages - 1, self.placement[self.num_stages - 1]
        rule.check_finite(mb_losses, (lambda mb: f"stage {last}, microbatch {mb}") if self._last is not None
                          else (lambda _: f"the step's loss (from stage {last} on rank {rank})"))

    def _run(self, actions: list[Action], ctx: StepContext, guard: StepGuard) -> None:
        """This rank's actions: from the first message on, a failure stops every rank (:mod:`.agree`)."""
        guard.communicating()
        try:
            self._runtime.run(actions, ctx)
        except BaseException:
            guard.where = self._runtime.failed_at or guard.where
            self._runtime.reset()
            raise
        guard.where = "after its actions (merging outputs, sharing the loss or tied gradients)"

    def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, lanes: int | None = None, slots: int | None = None,
                 return_logprobs: bool = False) -> Generation:
        """Generate on these stages and ranks, with the training parameters as they are now
        (no copy): a KV cache per stage and lane, ``lanes`` groups of rows in flight (default:
        one per stage), decoded in an order built, lowered and validated like a training order.
        The same call on every rank; the result is the same on every rank.

        Args:
            input_ids: ``(batch, prompt_len)`` prompts, left-padded (Hugging Face's convention).
            max_new_tokens: tokens to add to every row.
            attention_mask: ``(batch, prompt_len)`` 1 for real tokens (None: all real).
            do_sample / temperature / top_k / top_p: Hugging Face's meanings; row ``r``'s
                token at step ``t`` is drawn from a generator seeded from ``(seed, r, t)``.
            eos_token_id / pad_token_id: a row stops at EOS and is padded after it (None: the
                model's ``generation_config``'s, as Hugging Face does).
            lanes: groups of rows in flight (default: one per stage).
            slots: rows in flight per lane (default: all the lane's rows at once). With fewer
                slots than rows, a row that finishes (EOS or ``max_new_tokens``) hands its
                slot to the lane's next waiting prompt (continuous batching); the tokens are
                the same as with every row in flight.
            return_logprobs: also return each chosen token's log-probability.

        Returns:
            A :class:`pippy_split.Generation` (``sequences``, ``logprobs``).

        Example::

            sched = ps.build_schedule(pipe, "1F1B", 4, loss_fn=loss_fn)
            out = sched.generate(ids, max_new_tokens=32, attention_mask=mask)   # every rank
            out.sequences  # (batch, prompt_len + 32), the same on every rank
        """
        return driver("schedule")(self, self._runtime, self._failures, input_ids,
                                    max_new_tokens=max_new_tokens, attention_mask=attention_mask,
                                    do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                                    seed=seed, eos_token_id=eos_token_id, pad_token_id=pad_token_id, lanes=lanes,
                                    slots=slots, return_logprobs=return_logprobs)

    def eval(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, no gradients; works before the first ``step()``.

        The stages run the graph they were traced with: a pipe traced in train mode
        whose graph uses dropout or batch statistics is refused here (on every rank),
        since it would not give the model's eval behaviour; trace an eval pipe with
        ``ps.pipeline(model.eval(), ...)`` for it.
        """
        refuse_train_mode_graph(self.stages[0].pipe)
        with self._failures.guard("eval()") as guard:
            ctx = self._context(args, kwargs, None, False, self.n_microbatches, guard)
            with torch.no_grad():
                self._run(self._eval_actions, ctx, guard)
            self._start.ran.add(False)
            if self._last is None:
                return None
            out = self._merge(ctx, self._last)
            self._last.results.clear()
        return out

    def _merge(self, ctx: StepContext, last: PipelineStage) -> Any:
        """The last stage's outputs of the step, merged (or kept per microbatch)."""
        outputs = [last.results[mb].output for mb in range(ctx.n_microbatches)]
        if ctx.per_microbatch:  # given Microbatches: unequal shapes do not concatenate
            return Microbatches(outputs)
        return merge_chunks(outputs, self.output_merge_spec)

    @property
    def loss(self) -> torch.Tensor | None:
        """The last step's loss, on every rank (None before the first step): the mean over
        microbatches, or with ``loss_count`` the loss sum over the batch's item count. The first
        read after a step checks it (``on_nonfinite="warn"``): a NaN/inf warns, naming the microbatch."""
        if self._unchecked[0] is not None:
            self._check_loss()
        return self._loss

    # ---- the runtime's probe and memory knob ------------------------------------------
    def timed_actions(self, probe: Callable[[], Any] | None = None, messages: bool = False
                      ) -> AbstractContextManager[list[ActionTiming]]:
        """Record every compute action this rank runs inside the block: its start and end
        (``time.perf_counter()`` seconds) and, with ``probe``, what ``probe()`` returns right
        before and right after it (e.g. ``torch.cuda.memory_allocated``); with ``messages``,
        every comm action too, from its batch's post to the runtime going on. A time includes
        waiting for the action's received inputs; on an accelerator the device is
        synchronised around each action (which slows the run: for measuring, not training).

        Example:
            >>> import pippy_split as ps; from torch.nn import Linear, ReLU, Sequential
            >>> pipe = ps.pipeline(Sequential(Linear(4, 8), ReLU(), Linear(8, 2)), ["2"], (torch.randn(2, 4),))
            >>> sched = ps.build_schedule(pipe, "ZBVZeroBubble", 4, loss_fn=torch.nn.functional.mse_loss)
            >>> with sched.timed_actions() as times: _ = sched.step(torch.randn(8, 4), target=torch.randn(8, 2))
            >>> [str(t.action) for t in times][:4], all(t.seconds >= 0 for t in times)
            (['0F0', '1F0', '1I0', '1W0'], True)
        """
        return recorded(self._runtime, self.stages[0].device, probe, messages)

    @property
    def release_sent_outputs(self) -> bool | None:
        """Free the memory of a forward output once it is sent to another rank.

        Backward needs only the output's autograd node and shape, so its values are
        dropped unless autograd saved them. ``None`` (default): on accelerators
        (CUDA's caching allocator makes it free), not on CPU, where handing the pages
        back costs more time than it saves (see docs/performance.md). ``True`` /
        ``False`` force it.

        Example:
            >>> import pippy_split as ps
            >>> sched = ps.build_schedule(ps.pipeline(torch.nn.Linear(4, 2), None, (torch.randn(2, 4),)), "GPipe", 2)
            >>> sched.release_sent_outputs is None  # the default: released on accelerators, kept on CPU
            True
            >>> sched.release_sent_outputs = True   # also on CPU: less memory, slower steps
        """
        return self._runtime.release_sent

    @release_sent_outputs.setter
    def release_sent_outputs(self, on: bool | None) -> None:
        self._runtime.set_release_sent(on)

    # ---- summaries ---------------------------------------------------------------
    @property
    def group(self) -> ProcessGroup | None:
        """The pipeline's process group (``None``: the default group); ``pipeline_group.group``."""
        return self.pipeline_group.group

    @property
    def rank(self) -> int:
        """This process's rank in the pipeline's group."""
        return self.pipeline_group.rank

    @property
    def world(self) -> int:
        """The number of ranks in the pipeline's group."""
        return self.pipeline_group.world

    @property
    def placement_name(self) -> str:
        """The placement this schedule runs under, by name: ``"loop"`` or ``"v"`` (its
        family's, or the ``placement=`` it was given)."""
        return self._placement_override or self.placement_style

    def __repr__(self) -> str:
        """One line: class, this rank's stages, ranks, microbatches, placement.

        Example (on rank 0 of 2, ``"1F1B"`` gives ``Schedule1F1B(stages [0] on rank 0 of 2, ...)``):
            >>> import pippy_split as ps; from torch.nn import Linear, ReLU, Sequential
            >>> pipe = ps.pipeline(Sequential(Linear(4, 8), ReLU(), Linear(8, 2)), ["2"], (torch.randn(2, 4),))
            >>> ps.build_schedule(pipe, "ZBVZeroBubble", n_microbatches=4)
            ScheduleZBVZeroBubble(stages [0, 1] on rank 0 of 1, n_microbatches=4, placement='v')
        """
        return (f"{type(self).__name__}(stages {[s.stage_index for s in self.stages]} on rank {self.rank} of "
                f"{self.world}, n_microbatches={self.n_microbatches}, placement={self.placement_name!r})")

    def _repr_html_(self) -> str:
        """A notebook's view: a table of the above and the order's simulated timeline (SVG)."""
        from . import render  # imports rich, which nothing but a picture needs (no cycle: render imports no schedule)

        small = sum(a is not None for acts in self.order.values() for a in acts) <= render.SVG_MAX_ACTIONS
        return render.render_schedule_html(self, simulate(self.order, links=self.links) if small else None)
