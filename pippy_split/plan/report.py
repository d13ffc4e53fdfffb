"""The planner's result: :class:`Plan` (every candidate, ranked, with ties) and
:class:`PlanError`; its tables for print, rich and notebooks.

Sits at the end of the planner (:mod:`.search` fills these); each candidate is a
:class:`~.candidate.Candidate` (:mod:`.candidate`, re-exported here), whose
``build_schedule`` hands the choice to the schedule layer (:func:`pippy_split.build_schedule`).
"""

from __future__ import annotations

import collections
import html
import io
from dataclasses import dataclass, field
from typing import Any, Callable

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .candidate import Candidate, peaks_text
from .costs import CommModel
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
                 "full" if c.activation_checkpoint else "off", c.step_label(), peaks_text(c.peak_bytes),
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


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
