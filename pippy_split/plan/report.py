"""The planner's result: :class:`Candidate` (one configuration and its prediction),
:class:`Plan` (all of them, ranked) and :class:`PlanError`; tables for print/rich.

Sits at the end of the planner (:mod:`.search` fills these); ``Candidate.build_schedule``
hands the choice to the schedule layer (:func:`pippy_split.build_schedule`).
"""

from __future__ import annotations

import collections
import io
from dataclasses import dataclass, field
from typing import Any, Callable

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ..schedule.simulate import Simulation
from .costs import CommModel, SplitCosts

__all__ = ["Candidate", "Plan", "PlanError", "human_bytes", "human_time", "rank_with_ties"]


def rank_with_ties(candidates: list[Candidate], resolution: float) -> list[Candidate]:
    """Fitting candidates first, by predicted step time; each run of candidates within
    ``resolution`` of the run's fastest is a tie: they share a ``rank`` (kept in time order).

    Example:
        >>> [(c.schedule, c.rank) for c in rank_with_ties(cands, 0.02)]  # doctest: +SKIP
        [('ZBVZeroBubble', 1), ('DualPipeV', 1), ('1F1B', 2)]
    """
    by_time = sorted(candidates, key=lambda c: (not c.fits, c.step_time, c.peak))
    out: list[Candidate] = []
    place = 0
    while by_time:
        head = by_time[0]
        run = [c for c in by_time if c.fits == head.fits and c.step_time <= head.step_time * (1 + resolution)]
        place += 1
        for c in run:
            c.rank = place if c.fits else 0
            out.append(c)
        taken = {id(c) for c in run}
        by_time = [c for c in by_time if id(c) not in taken]
    return out


class PlanError(ValueError):
    """No candidate fits the memory budget (or none could be built); the message says
    the smallest predicted peak and what to change."""


def human_bytes(n: float) -> str:
    """``1.5e9`` -> ``"1.50 GB"``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _short_bytes(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}T"


def human_time(t: float) -> str:
    """``0.0123`` -> ``"12.3 ms"``."""
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


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
    """1-based place among the fitting candidates; candidates predicted within the plan's
    ``resolution`` of each other share it (a tie: the prediction cannot tell them apart)."""

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
    def split_label(self) -> str:
        shares = "/".join(f"{s:.0%}" for s in self.split.shares)
        return f"{self.split.num_stages} by {self.split.metric} ({shares})"

    def build_schedule(self, loss_fn: Callable | None = None, group: Any = None, device: Any = None,
                       **kwargs: Any) -> Any:
        """This rank's schedule for the candidate (:func:`pippy_split.build_schedule`):
        its pipe, family, ``n_microbatches`` and checkpointing; ``loss_fn`` defaults to
        the one given to :func:`~pippy_split.plan`.

        Example:
            >>> sched = plan.best.build_schedule(group=group)  # doctest: +SKIP
            >>> sched.step(x, target=y)  # doctest: +SKIP
        """
        from ..schedule.schedules import build_schedule

        return build_schedule(self.pipe, self.schedule, self.n_microbatches,
                              loss_fn=loss_fn if loss_fn is not None else self.loss_fn, group=group, device=device,
                              activation_checkpoint="full" if self.activation_checkpoint else None, **kwargs)

    def to_svg(self, path: str | None = None) -> str:
        """The predicted timeline (seconds), one row per rank; also written to ``path``."""
        return self.simulation.to_svg(path)

    def __str__(self) -> str:
        return (f"{self.schedule} x{self.stages_per_rank}/rank, split {self.split_label}, m={self.n_microbatches}, "
                f"AC={'full' if self.activation_checkpoint else 'off'}: step {human_time(self.step_time)}, "
                f"peak {human_bytes(self.peak)}, bubble {self.bubble:.0%}")

    def __rich__(self) -> Text:
        return Text(str(self))


@dataclass
class Plan:
    """Every candidate the planner simulated; ``fitting`` ranked by predicted step time,
    candidates within ``resolution`` of each other marked as tied."""

    candidates: list[Candidate]
    budget: float
    comm: CommModel
    loss_fn: Callable | None
    num_ranks: int
    global_batch: int
    notes: list[str] = field(default_factory=list)
    resolution: float = 0.01
    """Relative step-time difference the prediction can tell apart (the measurement's
    timing noise, at least 1%)."""

    def __post_init__(self) -> None:
        for c in self.candidates:
            c.loss_fn = self.loss_fn
        self.candidates = rank_with_ties(self.candidates, self.resolution)

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
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("#", "schedule", "split", "m", "AC", "step time", "peak memory per rank", "bubble"):
            t.add_column(col, justify="right" if col in ("#", "m", "step time", "bubble") else "left",
                         no_wrap=col in ("schedule", "step time"))
        shared = collections.Counter(c.rank for c in self.fitting)
        for c in self.fitting[:top]:
            peaks = " ".join(_short_bytes(c.peak_bytes[r]) for r in sorted(c.peak_bytes))
            t.add_row(f"{c.rank}{'=' if shared[c.rank] > 1 else ''}", c.schedule, f"{c.split.num_stages} {c.split.metric}", str(c.n_microbatches),
                      "full" if c.activation_checkpoint else "off", human_time(c.step_time), peaks, f"{c.bubble:.0%}")
        t.caption = (f"comm: {human_bytes(self.comm.bandwidth)}/s, {human_time(self.comm.latency)} per message "
                     f"({self.comm.source}); '=': within {self.resolution:.0%} of each other, a tie the "
                     "prediction cannot resolve")
        measured = any(c.split.measured is not None for c in self.candidates)
        t.caption += ("; action times: each split's stages run and timed" if measured
                      else "; action times: sums of the profiled ops")
        if self.fitting:
            best = self.fitting[0]
            t.caption += ("; best split's stage shares of F+B time: "
                          + "/".join(f"{x:.0%}" for x in best.split.shares))
        t.caption_justify = "left"
        return t

    def __rich__(self) -> Group:
        return Group(self.table())

    def __str__(self) -> str:
        buffer = io.StringIO()
        Console(file=buffer, width=140, color_system=None, force_jupyter=False).print(self.table())
        return buffer.getvalue().rstrip()

    def __repr__(self) -> str:
        return f"Plan({len(self.candidates)} candidates, best: {self.best if self.fitting else 'none fits'})"
