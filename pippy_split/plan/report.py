"""The planner's result: :class:`Candidate` (one configuration and its prediction),
:class:`Plan` (all of them, ranked) and :class:`PlanError`; tables for print/rich.

Sits at the end of the planner (:mod:`.search` fills these); ``Candidate.build_schedule``
hands the choice to the schedule layer (:func:`pippy_split.build_schedule`).
"""

from __future__ import annotations

import collections
import html
import io
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ..schedule.simulate import Simulation
from ..stage.groups import GroupArg
from .costs import CommModel, SplitCosts
from .ranking import rank_with_ties, ties
from .units import human_bytes, human_time, percent, short_bytes

__all__ = ["Candidate", "Plan", "PlanError", "human_bytes", "human_time", "rank_with_ties", "ties", "TOO_NOISY"]

TOO_NOISY = 0.05
"""A plan whose fastest candidates' predictions move more than this with timing noise
(:attr:`Candidate.spread`) is too noisy to rank: :attr:`Plan.too_noisy`."""


class PlanError(ValueError):
    """No candidate fits the memory budget (or none could be built); the message says
    the smallest predicted peak and what to change."""


@dataclass
class Candidate:
    """One configuration and what the simulator predicts for it."""

    schedule: str
    """Schedule family (a :func:`~pippy_split.schedule.get_schedule_class` name)."""
    stages_per_rank: int
    split: SplitCosts
    """The split (its ``pipe``, each stage's measured costs)."""
    n_microbatches: int
    microbatch_size: int
    """Samples per microbatch (``global_batch / n_microbatches``)."""
    activation_checkpoint: bool
    step_time: float
    """Predicted seconds per step (the simulated makespan)."""
    peak_bytes: dict[int, float]
    """Predicted peak bytes per rank (parameters, gradients, optimizer state, activations)."""
    bubble: float
    fits: bool
    simulation: Simulation = field(repr=False)
    loss_fn: Callable | None = field(default=None, repr=False)
    rank: int = 0
    """1-based place among the fitting candidates; candidates the prediction cannot tell
    apart share it (a tie, :func:`ties`)."""
    spread: float | None = None
    """How far the prediction moves with timing noise, relative to ``step_time``: the
    candidate simulated with each half of the measured samples (:mod:`.measure`), the two
    step times' difference over ``step_time``. None: simulated from op sums."""

    @property
    def key(self) -> tuple:
        return (self.schedule, self.stages_per_rank, self.split.metric, self.n_microbatches,
                self.activation_checkpoint)

    @property
    def pipe(self) -> Any:
        """The split traced on a microbatch of this candidate's size (built on first use)."""
        return self.split.pipe_for(self.microbatch_size)

    @property
    def peak(self) -> float:
        """The largest per-rank peak."""
        return max(self.peak_bytes.values())

    @property
    def num_ranks(self) -> int:
        return self.split.num_stages // self.stages_per_rank

    @property
    def split_label(self) -> str:
        """Where the cuts are, then how the split was made: ``"blocks.2 (2 stages by time, 51%/49%)"``."""
        shares = "/".join(f"{s:.0%}" for s in self.split.shares)
        return f"{self.split.cut_label} ({self.split.num_stages} stages by {self.split.metric}, {shares})"

    def _unnamed_cut(self) -> str | None:
        """Why ``ps.pipeline(model, [FQN, ...])`` cannot make this split (None if it can)."""
        names = self.split.cut_fqns
        missing = [k for k, fqn in enumerate(names) if fqn is None]
        if not missing:
            return None
        where = self.split.cut_label.split(", ")[missing[0]]
        return (f"cut {missing[0] + 1} of this split falls {where}, where no module begins, so no list of "
                "module FQNs makes it")

    def python_call(self) -> str:
        """The Python that builds this candidate's schedule on every rank.

        Example:
            >>> import pippy_split as ps
            >>> from pippy_split import zoo
            >>> entry = zoo.get("mlp_stack", d=8, n_layer=4); mb = entry.args[0][:2]  # 4 residual layers; batch 8
            >>> plan = ps.plan(entry.model, (mb,), num_ranks=2, memory_budget="1GB", loss_fn=entry.loss_fn,
            ...                global_batch=8, schedules=["1F1B"], microbatches=[4], balance=["flops"], measure=False)
            >>> print(plan.best.python_call())
            # example_args: one microbatch (2 samples) of the model's inputs
            pipe = ps.pipeline(model, ["layers.2"], example_args)
            sched = ps.build_schedule(pipe, "1F1B", 4, loss_fn=loss_fn, group=group)
        """
        problem = self._unnamed_cut()
        if problem is not None:
            return (f"# {problem}: build the planned split itself\n"
                    "sched = plan.best.build_schedule(group=group)")
        ac = ', activation_checkpoint="full"' if self.activation_checkpoint else ""
        build = f'"{self.schedule}", {self.n_microbatches}, loss_fn=loss_fn, group=group{ac}'
        fqns = ", ".join(f'"{f}"' for f in self.split.cut_fqns)
        samples = f"{self.microbatch_size} sample{'s' if self.microbatch_size != 1 else ''}"
        return (f"# example_args: one microbatch ({samples}) of the model's inputs\n"
                f"pipe = ps.pipeline(model, [{fqns}], example_args)\n"
                f"sched = ps.build_schedule(pipe, {build})")

    def train_command(self, model: str) -> str:
        """The ``pippy-split train`` command that trains this candidate on ``model``
        (``module:factory`` or ``zoo:NAME``, whose example batch is the global batch).

        Raises:
            ValueError: a cut falls where no module begins (``--split`` takes module FQNs),
                or there is no cut (one stage).

        Example:
            >>> import pippy_split as ps
            >>> from pippy_split import zoo
            >>> entry = zoo.get("mlp_stack"); mb = entry.args[0][:2]  # 8 layers, batch 8: what zoo:mlp_stack trains
            >>> plan = ps.plan(entry.model, (mb,), num_ranks=2, memory_budget="1GB", loss_fn=entry.loss_fn,
            ...                global_batch=8, schedules=["1F1B"], microbatches=[4], balance=["flops"], measure=False)
            >>> plan.best.train_command("zoo:mlp_stack")
            'pippy-split train --model zoo:mlp_stack --ranks 2 --schedule 1F1B --microbatches 4 --split layers.4'
        """
        problem = self._unnamed_cut()
        if problem is not None:
            raise ValueError(f"{problem}; `pippy-split train --split` takes module FQNs. Build it in Python with "
                             "plan.best.build_schedule(group=group)")
        if not self.split.cut_fqns:
            raise ValueError("a single stage has no cut for `pippy-split train --split` to name (without --split "
                             "train splits the model its own way); build it in Python with "
                             "plan.best.build_schedule(group=group)")
        words = ["pippy-split", "train", "--model", model, "--ranks", str(self.num_ranks), "--schedule",
                 self.schedule, "--microbatches", str(self.n_microbatches),
                 "--split", ",".join(f for f in self.split.cut_fqns if f is not None)]
        if self.activation_checkpoint:
            words.append("--activation-checkpoint")
        return shlex.join(words)

    def build_schedule(self, loss_fn: Callable | None = None, group: GroupArg = None,
                       device: torch.device | str | None = None,
                       **kwargs: Any) -> Any:
        """This rank's schedule for the candidate (:func:`pippy_split.build_schedule`):
        its pipe, family, ``n_microbatches`` and checkpointing; ``loss_fn`` defaults to
        the one given to :func:`~pippy_split.plan`.

        Example (one rank, so this process runs every stage; on several, each passes ``group=``):
            >>> import pippy_split as ps
            >>> from pippy_split import zoo
            >>> entry = zoo.get("mlp_stack", d=8, n_layer=4); x, y = entry.args[0], entry.target
            >>> plan = ps.plan(entry.model, (x[:2],), num_ranks=1, memory_budget="1GB", loss_fn=entry.loss_fn,
            ...                global_batch=8, schedules=["Interleaved1F1B"], stages_per_rank=[2], microbatches=[4],
            ...                balance=["flops"], measure=False)
            >>> sched = plan.best.build_schedule()
            >>> out = sched.step(x, target=y)
            >>> torch.testing.assert_close(sched.loss, entry.loss_fn(entry.model(x), y))  # the model's own loss
        """
        from ..schedule.schedules import build_schedule

        return build_schedule(self.pipe, self.schedule, self.n_microbatches,
                              loss_fn=loss_fn if loss_fn is not None else self.loss_fn, group=group, device=device,
                              activation_checkpoint="full" if self.activation_checkpoint else None, **kwargs)

    @property
    def title(self) -> str:
        """What the candidate is, in a line: ``"1F1B (1 stage/rank), split at blocks.2, m=8,
        AC off"``."""
        return (f"{self.schedule} ({self.stages_per_rank} stage{'s' if self.stages_per_rank > 1 else ''}/rank), "
                f"split at {self.split.cut_label}, "
                f"m={self.n_microbatches}, AC {'full' if self.activation_checkpoint else 'off'}")

    def to_svg(self, path: str | None = None) -> str:
        """The predicted timeline, one row per rank, under :attr:`title` (times in ms or s);
        also written to ``path``.

        Example:
            >>> import pippy_split as ps
            >>> from pippy_split import zoo
            >>> entry = zoo.get("mlp_stack", d=8, n_layer=4); mb = entry.args[0][:2]  # 4 residual layers; batch 8
            >>> plan = ps.plan(entry.model, (mb,), num_ranks=2, memory_budget="1GB", loss_fn=entry.loss_fn,
            ...                global_batch=8, schedules=["1F1B"], microbatches=[4], balance=["flops"], measure=False)
            >>> plan.best.to_svg()[:4]  # to_svg("plan.svg") also writes the file
            '<svg'
        """
        from ..schedule.render_web import render_svg

        return render_svg(self.simulation, path, title=f"predicted: {self.title}", time_unit="s")

    def step_label(self) -> str:
        """``"7.95 ms"``, with ``" ±3%"`` where the step time was measured (:attr:`spread`)."""
        return human_time(self.step_time) + (f" ±{percent(self.spread)}" if self.spread is not None else "")

    def __str__(self) -> str:
        return (f"{self.schedule} x{self.stages_per_rank}/rank, split {self.split_label}, m={self.n_microbatches}, "
                f"AC={'full' if self.activation_checkpoint else 'off'}: step {self.step_label()}, "
                f"peak {human_bytes(self.peak)}, bubble {self.bubble:.0%}")

    def __rich__(self) -> Text:
        return Text(str(self))

    def _repr_html_(self) -> str:
        """A notebook's view: this candidate's prediction as a table, then its timeline (SVG)."""
        from ..schedule.render_web import html_table

        rows = [("schedule", f"{self.schedule}, {self.stages_per_rank} stage(s) per rank"),
                ("split", self.split_label), ("microbatches", f"{self.n_microbatches} of {self.microbatch_size} samples"),
                ("activation checkpointing", "full" if self.activation_checkpoint else "off"),
                ("step time", self.step_label()), ("peak memory per rank", _peaks_text(self.peak_bytes)),
                ("bubble", f"{self.bubble:.0%}"), ("fits the budget", "yes" if self.fits else "no")]
        return f'<div class="pippy-split-candidate">{html_table(rows)}{self.to_svg()}</div>'


@dataclass
class Plan:
    """Every candidate the planner simulated; ``fitting`` ranked by predicted step time,
    candidates the prediction cannot tell apart marked as tied (:func:`ties`).

    Example:
        >>> import pippy_split as ps
        >>> from pippy_split import zoo
        >>> entry = zoo.get("mlp_stack", d=8, n_layer=4); mb = entry.args[0][:2]  # 4 residual layers; batch 8
        >>> plan = ps.plan(entry.model, (mb,), num_ranks=2, memory_budget="1GB", loss_fn=entry.loss_fn,
        ...                global_batch=8, schedules=["1F1B"], microbatches=[4], balance=["flops"], measure=False)
        >>> plan
        Plan(2 candidates, best: 1F1B x1/rank, split layers.2 (2 stages by flops, ...), m=4, AC=off: step ...)
        >>> plan.too_noisy, [c.activation_checkpoint for c in plan.fitting]  # fastest first
        (False, [False, True])
    """

    candidates: list[Candidate]
    budget: float
    comm: CommModel
    loss_fn: Callable | None
    num_ranks: int
    global_batch: int
    notes: list[str] = field(default_factory=list)
    resolution: float = 0.01
    """Relative step-time difference always marked as a tie (candidates simulated from op
    sums have no spread of their own)."""
    noise_limit: float = TOO_NOISY
    """The most a contender's :attr:`Candidate.spread` may be for the plan to rank them."""
    too_noisy: bool = field(init=False, default=False)
    """The fastest candidates' predictions moved more than ``noise_limit`` with timing noise
    (the machine was busy): the ranking is by least times, ties only within ``resolution``,
    and :attr:`noise_message` says so."""

    def __post_init__(self) -> None:
        for c in self.candidates:
            c.loss_fn = self.loss_fn
        self.candidates = rank_with_ties(self.candidates, self.resolution)
        self.too_noisy = self.noisiest > self.noise_limit
        if self.too_noisy:  # overlapping spreads would tie nearly everything: say so instead
            self.candidates = rank_with_ties(self.candidates, self.resolution, spreads=False)

    @property
    def contenders(self) -> list[Candidate]:
        """The fitting candidates that tie with the fastest, with spreads (:func:`ties`)."""
        fit = sorted(self.fitting, key=lambda c: (c.step_time, c.peak))
        return [c for c in fit if ties(fit[0], c, self.resolution)] if fit else []

    @property
    def noisiest(self) -> float:
        """The largest :attr:`Candidate.spread` among :attr:`contenders` (0 without any)."""
        return max((c.spread for c in self.contenders if c.spread is not None), default=0.0)

    @property
    def noise_message(self) -> str | None:
        """What a too noisy plan means and what to do (None when the plan is not too noisy)."""
        if not self.too_noisy:
            return None
        measured = [c.split.measured for c in self.contenders if c.split.measured is not None]
        seconds = sum({id(m): m.seconds for m in measured}.values())
        passes = min((m.passes for m in measured), default=0)
        return (f"too noisy to rank: the fastest candidates' predicted step times moved by up to "
                f"{percent(self.noisiest)} between two halves of the timing samples, after {passes} steps of "
                f"each and {seconds:.0f} s of measuring (a ranking needs at most {percent(self.noise_limit)}); "
                "other work on this machine slows the measured steps unevenly. The order below is by least "
                f"times and '=' marks only differences under {percent(self.resolution)}: do not trust it. Plan "
                "again on an idle machine, or measure longer (ps.plan(..., measure_budget=60), "
                "pippy-split plan --measure-budget 60).")

    @property
    def fitting(self) -> list[Candidate]:
        """Candidates whose predicted per-rank peak fits the budget, fastest first."""
        return [c for c in self.candidates if c.fits]

    @property
    def best(self) -> Candidate:
        """The fastest fitting candidate (``plan.fitting`` shows what it ties with)."""
        if not self.fitting:
            raise PlanError(self.no_fit_message())
        return self.fitting[0]

    def no_fit_message(self) -> str:
        small = min(self.candidates, key=lambda c: c.peak)
        rank = max(small.peak_bytes, key=small.peak_bytes.__getitem__)
        return (f"no candidate fits memory_budget={human_bytes(self.budget)} per rank: the smallest predicted peak "
                f"is {human_bytes(small.peak)} (rank {rank}; {small}). Raise memory_budget to at least "
                f"{human_bytes(small.peak)}, or use more ranks (num_ranks > {self.num_ranks}), a smaller "
                f"global_batch (< {self.global_batch}) or more microbatches, activation_checkpoint=(True,), "
                "or optimizer_state=0 for a stateless optimizer")

    def table(self, top: int = 10) -> Table:
        """The ``top`` fitting candidates as a rich table."""
        t = Table(title=f"Plan: {len(self.fitting)} of {len(self.candidates)} candidates fit "
                        f"{human_bytes(self.budget)} per rank ({self.num_ranks} ranks, batch {self.global_batch})",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for col in ("#", "schedule", "split at", "m", "AC", "step time", "peak memory per rank", "bubble"):
            t.add_column(col, justify="right" if col in ("#", "m", "step time", "bubble") else "left",
                         no_wrap=col in ("schedule", "step time"),
                         overflow="fold" if col == "split at" else "ellipsis")  # an FQN folds, never cut short
        shared = collections.Counter(c.rank for c in self.fitting)
        for c in self.fitting[:top]:
            peaks = " ".join(short_bytes(c.peak_bytes[r]) for r in sorted(c.peak_bytes))
            t.add_row(f"{c.rank}{'=' if shared[c.rank] > 1 else ''}", c.schedule, c.split.cut_label,
                      str(c.n_microbatches), "full" if c.activation_checkpoint else "off", c.step_label(), peaks,
                      f"{c.bubble:.0%}")
        t.caption = (f"comm: {human_bytes(self.comm.bandwidth)}/s, {human_time(self.comm.latency)} per message "
                     f"({self.comm.source}); " + self._tie_note())
        measured = any(c.split.measured is not None for c in self.candidates)
        t.caption += ("; action times: each split's stages run and timed" if measured
                      else "; action times: sums of the profiled ops")
        if self.fitting:
            best = self.fitting[0]
            t.caption += (f"; best split ({best.split.num_stages} stages by {best.split.metric}): stage shares of "
                          "F+B time " + "/".join(f"{x:.0%}" for x in best.split.shares))
        t.caption_justify = "left"
        return t

    def _tie_note(self) -> str:
        if self.too_noisy:
            return f"'=': within {percent(self.resolution)} of each other (too noisy to tell more, see above)"
        return (f"'=': a tie, within {percent(self.resolution)} of each other or within their step times' "
                "spreads (±: how far the prediction moved between two halves of the timing samples)")

    def how_to_run(self) -> str:
        """The best candidate in a line, and the Python that builds it on every rank."""
        return f"best: {self.best}\nrun it in Python, on every rank:\n{_indent(self.best.python_call())}"

    def report(self, top: int = 10) -> Group:
        """:attr:`noise_message` when the plan is too noisy, then the ``top`` candidates'
        table (``print(plan)`` adds :meth:`how_to_run`)."""
        parts: list[Any] = []
        if self.noise_message:
            parts.append(Text(self.noise_message, style="bold yellow"))
        parts.append(self.table(top))
        return Group(*parts)

    def __rich__(self) -> Group:
        return Group(self.report(), *([Text(self.how_to_run())] if self.fitting else []))

    def __str__(self) -> str:
        buffer = io.StringIO()
        Console(file=buffer, width=140, color_system=None, force_jupyter=False).print(self.report())
        how = f"\n{self.how_to_run()}" if self.fitting else ""  # unwrapped: code to copy
        return buffer.getvalue().rstrip() + how

    def __repr__(self) -> str:
        return f"Plan({len(self.candidates)} candidates, best: {self.best if self.fitting else 'none fits'})"

    def _repr_html_(self, top: int = 10) -> str:
        """A notebook's view: :attr:`noise_message`, the ``top`` fitting candidates as an HTML
        table, the Python that builds the best, and its predicted timeline (SVG)."""
        from ..schedule.render_web import html_table

        shared = collections.Counter(c.rank for c in self.fitting)
        body = [(f"{c.rank}{'=' if shared[c.rank] > 1 else ''}", c.schedule, c.split.cut_label, str(c.n_microbatches),
                 "full" if c.activation_checkpoint else "off", c.step_label(), _peaks_text(c.peak_bytes),
                 f"{c.bubble:.0%}") for c in self.fitting[:top]]
        caption = (f"Plan: {len(self.fitting)} of {len(self.candidates)} candidates fit {human_bytes(self.budget)} "
                   f"per rank ({self.num_ranks} ranks, batch {self.global_batch})")
        table = html_table([], ("#", "schedule", "split at", "m", "AC", "step time", "peak memory per rank", "bubble"),
                           body, caption)
        noise = f"<p><b>{html.escape(self.noise_message)}</b></p>" if self.noise_message else ""
        if not self.fitting:
            return f'<div class="pippy-split-plan">{noise}{table}<p>{html.escape(self.no_fit_message())}</p></div>'
        how = f"<pre>{html.escape(self.how_to_run())}</pre>"
        return f'<div class="pippy-split-plan">{noise}{table}{how}{self.best.to_svg()}</div>'


def _peaks_text(peak_bytes: dict[int, float]) -> str:
    """Per-rank peaks in rank order, as in the table: ``"1.2G 1.1G"``."""
    return " ".join(short_bytes(peak_bytes[r]) for r in sorted(peak_bytes))


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
