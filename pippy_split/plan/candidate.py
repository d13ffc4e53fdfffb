"""One planner candidate: :class:`Candidate`, a configuration (split, schedule family,
stages per rank, microbatches, checkpointing) and what the simulator predicts for it,
with what a user does with it: build its schedule, the Python or ``pippy-split train``
command that builds it, its timeline and its line in a table.

Made by :func:`~.predict.predict_candidate`, ranked in a :class:`~.report.Plan` (:mod:`.report`);
``Candidate.build_schedule`` hands the choice to the schedule layer
(:func:`pippy_split.build_schedule`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from rich.text import Text

from ..schedule.simulate import Simulation
from ..stage.groups import GroupArg
from .costs import SplitCosts
from .units import human_bytes, human_time, percent, short_bytes

__all__ = ["Candidate", "peaks_text"]


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
    apart share it (a tie, :func:`~.ranking.ties`)."""
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
                ("step time", self.step_label()), ("peak memory per rank", peaks_text(self.peak_bytes)),
                ("bubble", f"{self.bubble:.0%}"), ("fits the budget", "yes" if self.fits else "no")]
        return f'<div class="pippy-split-candidate">{html_table(rows)}{self.to_svg()}</div>'


def peaks_text(peak_bytes: dict[int, float]) -> str:
    """Per-rank peaks in rank order, as in the table: ``"1.2G 1.1G"``."""
    return " ".join(short_bytes(peak_bytes[r]) for r in sorted(peak_bytes))
