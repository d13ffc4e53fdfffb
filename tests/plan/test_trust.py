"""A plan you can trust and run (issue 23, item 2): ties only where two candidates' own
measured spreads overlap, "too noisy" said plainly instead of tying everything, the
split named by FQNs with the `pippy-split train` command and the Python that run the
best, and an SVG whose title carries the schedule, the split and the time unit.

The noise logic is decided from injected samples (a fake measurement, a fake clock):
nothing here asserts on how fast this machine runs.
"""

from __future__ import annotations

import dataclasses
import re
import shlex

import pytest
import torch

import pippy_split as ps
from pippy_split import zoo
from pippy_split.cli import main
from pippy_split.plan import CommModel, search
from pippy_split.plan.measure import SplitMeasure, StageMeasure, half_gap, measure_split, repeat_until_steady
from pippy_split.plan.report import Candidate, Plan, rank_with_ties, ties
from pippy_split.schedule import get_schedule_class, simulate
from pippy_split.schedule.render import render_svg

# ----------------------------------------------------------------- repeating until steady


def test_half_gap_weighs_the_least_times_of_each_half() -> None:
    # F's halves: least 1.0 and 1.02; B's: 2.0 and 2.0 -> 0.02 apart over 3.0 in all
    assert half_gap({"F": ([1.0, 1.3], [1.02]), "B": ([2.0], [2.0, 5.0])}) == pytest.approx(0.02 / 3)
    assert half_gap({"F": ([1.0], [])}) == float("inf")  # a half without samples says nothing yet


class FakeClock:
    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        return self.now

    def tick(self, record: bool) -> None:
        self.now += self.step_s


def test_repeats_until_the_halves_agree() -> None:
    clock, gaps = FakeClock(0.1), iter([0.4, 0.05, 0.008, 0.0])
    steps: list[bool] = []

    def step(record: bool) -> None:
        steps.append(record)
        clock.tick(record)

    n = repeat_until_steady(step, lambda: next(gaps), warmup=2, least=2, most=24, target=0.01, budget_s=60,
                            clock=clock)
    assert n == 4 and steps == [False, False, True, True, True, True]  # gaps 0.4, 0.05, 0.008: stop


def test_stops_when_the_budget_runs_out_or_at_most_steps() -> None:
    clock = FakeClock(1.0)
    n = repeat_until_steady(clock.tick, lambda: 0.5, warmup=2, least=2, most=24, target=0.01, budget_s=5.0,
                            clock=clock)
    assert n == 3 and clock.now == 5.0  # 2 warm-up + 3 recorded seconds
    clock = FakeClock(0.0)
    assert repeat_until_steady(clock.tick, lambda: 0.5, least=2, most=6, budget_s=60, clock=clock) == 6
    # the least steps run even with no budget at all
    assert repeat_until_steady(FakeClock(1.0).tick, lambda: 0.5, least=2, budget_s=0.0, clock=FakeClock(1.0)) == 2


def test_a_measurement_keeps_both_halves_of_its_samples() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    from pippy_split.plan.costs import price_split
    from pippy_split.split.trace import trace_model

    traced = trace_model(model, (x,))
    costs = price_split(traced, model, traced.flatten_inputs((x,), {}), 2, "flops", example=((x,), {}), batch=4)
    m = measure_split(costs, activation_checkpoint=(False,), passes=2, budget_s=0.0)
    assert m.passes == 2 and len(m.halves) == 2 and m.noise >= 0
    for half in (m.half(0), m.half(1)):
        assert set(half.stages) == set(m.stages) == {(False, False), (False, True)}
    for key, stages in m.stages.items():  # each half's least time, the least of both is the measurement's
        for s, st in enumerate(stages):
            h0, h1 = m.halves[0][key][s], m.halves[1][key][s]
            for kind in st.kinds:
                assert st.points[kind] == tuple((b, min(t0, t1)) for (b, t0), (_, t1)
                                                in zip(h0.points[kind], h1.points[kind]))


# ----------------------------------------------------------------- ties and too noisy


@dataclasses.dataclass
class FakeSplit:
    """What the report reads of a split: two stages cut at layers.4, measured in 3 s."""

    measured: SplitMeasure = dataclasses.field(default_factory=lambda: SplitMeasure({}, (4,), 3.0, 0.4, (), 6))
    cut_fqns: tuple = ("layers.4",)
    cut_label: str = "layers.4"
    num_stages: int = 2
    metric: str = "time"
    shares: tuple = (0.5, 0.5)


def _cand(name: str, t: float, spread: float | None, fits: bool = True) -> Candidate:
    return Candidate(name, 1, FakeSplit(), 4, 4, False, t, {0: 1.0}, 0.0, fits, None,  # type: ignore[arg-type]
                     spread=spread)


def test_ties_only_where_the_spreads_overlap() -> None:
    quiet, busy = (_cand("a", 1.00, 0.01), _cand("b", 1.05, 0.01)), (_cand("a", 1.00, 0.03), _cand("b", 1.05, 0.03))
    assert not ties(*quiet, 0.01) and ties(*busy, 0.01)
    assert ties(_cand("a", 1.0, None), _cand("b", 1.009, None), 0.01)  # op sums: the resolution alone
    ranked = rank_with_ties([_cand("c", 1.2, 0.01), _cand("a", 1.0, 0.02), _cand("b", 1.03, 0.02)], 0.01)
    assert [(c.schedule, c.rank) for c in ranked] == [("a", 1), ("b", 1), ("c", 2)]


def _plan(cands: list[Candidate]) -> Plan:
    return Plan(cands, 1e9, CommModel(), None, 2, 8)


def test_a_busy_machine_is_called_too_noisy_not_one_big_tie() -> None:
    plan = _plan([_cand(n, t, 0.4) for n, t in (("a", 1.0), ("b", 1.1), ("c", 1.3), ("d", 1.6))])
    assert plan.too_noisy and plan.noisiest == pytest.approx(0.4)
    assert [c.rank for c in plan.fitting] == [1, 2, 3, 4]  # not four rows tied
    assert "too noisy to rank" in plan.noise_message and "measure_budget" in plan.noise_message
    assert str(plan).startswith("too noisy to rank")
    quiet = _plan([_cand(n, t, 0.004) for n, t in (("a", 1.0), ("b", 1.1))])
    assert not quiet.too_noisy and quiet.noise_message is None and "too noisy" not in str(quiet)


def _stage(st, batch: int, ac: bool, scale: float) -> StageMeasure:
    f, i, w = st.times(1.0)
    b = i + w + (f if ac else 0.0)
    return StageMeasure({k: ((batch, t * scale),) for k, t in (("F", f), ("I", i), ("W", w), ("B", b))})


def _fake_measure(slower_half: float, noise: float):
    """A stand-in for measure_split: the op sums as measured times; the second half of the
    samples ``slower_half`` slower than the first."""
    def measure(split, *, only, **_):
        def table(scale: float) -> dict:
            return {(ac, sb): [_stage(st, split.batch, ac, scale) for st in split.stages] for ac, sb in only}

        return SplitMeasure(table(1.0), (split.batch,), 0.5, noise, (table(1.0), table(1.0 + slower_half)), 24)

    return measure


def _mlp_plan(monkeypatch, slower_half: float, noise: float) -> Plan:
    monkeypatch.setattr(search, "measure_split", _fake_measure(slower_half, noise))
    entry = zoo.get("mlp_stack", d=16)
    return ps.plan(entry.model, (entry.args[0][:2],), num_ranks=2, memory_budget="1GB", loss_fn=entry.loss_fn,
                   global_batch=8, microbatches=(2, 4, 8), schedules=["1F1B", "GPipe"], balance=("params",),
                   activation_checkpoint=(False,), comm=CommModel(bandwidth=1e30, latency=0.0))


def test_one_noisy_figure_no_longer_ties_every_candidate(monkeypatch) -> None:
    """The issue: a measurement's single noise figure (737% on a busy machine) tied all
    rows. Samples whose halves agree give each candidate a spread of 0: distinct ranks."""
    plan = _mlp_plan(monkeypatch, slower_half=0.0, noise=7.37)
    measured = [c for c in plan.fitting if c.spread is not None]
    assert measured and all(c.spread == pytest.approx(0.0, abs=1e-9) for c in measured)
    assert not plan.too_noisy
    assert len({c.rank for c in plan.fitting}) >= 3
    assert "737%" not in str(plan)


def test_spreads_come_from_simulating_each_half(monkeypatch) -> None:
    plan = _mlp_plan(monkeypatch, slower_half=0.3, noise=0.3)
    measured = [c for c in plan.fitting if c.spread is not None]
    assert measured and all(c.spread == pytest.approx(0.3) for c in measured)  # free links: the makespan scales
    assert plan.too_noisy and "±30%" in str(plan)
    for c in plan.fitting:  # too noisy: ties only within the resolution
        head = next(h for h in plan.fitting if h.rank == c.rank)
        assert c.step_time <= head.step_time * (1 + plan.resolution)
    assert len({c.rank for c in plan.fitting}) >= 3


# ----------------------------------------------------------------- FQNs and commands


@pytest.fixture(scope="module")
def mlp_plan():
    entry = zoo.get("mlp_stack", d=16)
    plan = ps.plan(entry.model, (entry.args[0][:2],), num_ranks=2, memory_budget="1GB", loss_fn=entry.loss_fn,
                   global_batch=8, microbatches=(2, 4), schedules=["1F1B", "Interleaved1F1B"],
                   balance=("params",), measure=False)
    return entry, plan


def test_the_table_names_the_cuts(mlp_plan) -> None:
    _, plan = mlp_plan
    cuts = {c.split.num_stages: c.split.cut_fqns for c in plan.candidates}
    assert cuts == {2: ["layers.4"], 4: ["layers.2", "layers.4", "layers.6"]}
    text = str(plan)
    assert "split at" in text and "layers.2, layers.4, layers.6" in text
    assert "split layers.4 (2 stages by params" in str(next(c for c in plan.fitting if c.split.num_stages == 2))


def test_the_python_call_builds_the_planned_split(mlp_plan) -> None:
    entry, plan = mlp_plan
    for best in (plan.best, next(c for c in plan.fitting if c.split.num_stages == 4)):
        code = best.python_call()
        assert f'ps.build_schedule(pipe, "{best.schedule}", {best.n_microbatches}, loss_fn=loss_fn' in code
        compile(code, "python_call", "exec")
        x = entry.args[0][: best.microbatch_size]
        scope = {"ps": ps, "model": entry.model, "example_args": (x,)}
        exec("\n".join(line for line in code.splitlines() if not line.startswith("sched")), scope)
        pipe = scope["pipe"]
        assert [st.param_fqns for st in pipe.stages] == [st.param_fqns for st in best.pipe.stages]
        torch.testing.assert_close(pipe(x), best.pipe(x))
    text = str(plan)
    assert "run it in Python" in text and all(f"    {line}\n" in text + "\n" for line in plan.best.python_call().splitlines())


def test_the_train_command_runs_the_best(mlp_plan) -> None:
    from pippy_split.cli import build_parser
    from pippy_split.train import parse_split

    entry, plan = mlp_plan
    best = plan.best
    words = shlex.split(best.train_command("zoo:mlp_stack"))
    assert words[0] == "pippy-split"
    args = build_parser().parse_args(words[1:])  # what the pippy-split command reads
    assert (args.command, args.model, args.ranks, args.schedule, args.microbatches) == (
        "train", "zoo:mlp_stack", 2, best.schedule, best.n_microbatches)
    assert parse_split(args.split) == best.split.cut_fqns and args.activation_checkpoint is None
    ac = dataclasses.replace(best, activation_checkpoint=True)
    assert build_parser().parse_args(shlex.split(ac.train_command("m:f"))[1:]).activation_checkpoint == "full"


def test_a_cut_inside_a_module_says_how_to_build_it_instead(mlp_plan) -> None:
    _, plan = mlp_plan
    best = plan.best
    inside = dataclasses.replace(best, split=dataclasses.replace(best.split, positions=[13]))  # layers.4's tanh
    assert inside.split.cut_fqns == [None] and inside.split.cut_label == "inside layers.4"
    assert "plan.best.build_schedule(group=group)" in inside.python_call()
    with pytest.raises(ValueError, match=r"cut 1 of this split falls inside layers.4, where no module begins"):
        inside.train_command("zoo:mlp_stack")
    one_stage = dataclasses.replace(best, split=dataclasses.replace(best.split, positions=[]))
    assert 'ps.pipeline(model, [], example_args)' in one_stage.python_call()
    with pytest.raises(ValueError, match="a single stage has no cut"):
        one_stage.train_command("zoo:mlp_stack")


# ----------------------------------------------------------------- the SVG


def test_svg_in_seconds_shows_its_unit() -> None:
    order = get_schedule_class("1F1B").compute_order(2, 4)
    sim = simulate(order, {"F": 0.001, "I": 0.001, "W": 0.001})  # seconds: makespan 15 ms
    svg = render_svg(sim, title="1F1B", time_unit="s")
    assert ">1F1B: 2 ranks, makespan 15 ms, bubble" in svg
    axis = re.search(r'<g class="axis">(.*?)</g>', svg).group(1)
    assert ">time/ms</text>" in axis
    assert re.findall(r'text-anchor="middle">([\d.]+)</text>', axis)[:3] == ["0", "2", "4"]
    assert "rank 0: 0F0 [0, 1) ms</title>" in svg  # tooltips too
    assert "makespan 15 ms" in render_svg(simulate(order, {"F": 1.0, "I": 1.0, "W": 1.0}), time_unit="ms")
    assert "makespan 15, bubble" in render_svg(simulate(order, {"F": 1.0, "I": 1.0, "W": 1.0}))  # costs: no unit
    with pytest.raises(ValueError, match="time_unit must be one of 's', 'ms', 'us'"):
        render_svg(sim, time_unit="seconds")


def test_the_best_candidates_svg_names_schedule_split_and_unit(mlp_plan, tmp_path) -> None:
    _, plan = mlp_plan
    best = plan.best
    svg = best.to_svg(str(tmp_path / "best.svg"))
    heading = re.search(r'font-weight="bold">(.*?)</text>', svg).group(1)
    assert heading.startswith(f"predicted: {best.schedule} ({best.stages_per_rank} stage")
    assert f"split at {', '.join(best.split.cut_fqns)}, m={best.n_microbatches}, AC off: 2 ranks" in heading
    assert re.search(r"makespan [\d.]+ (ms|s|us), bubble", heading)
    assert (tmp_path / "best.svg").read_text() == svg


# ----------------------------------------------------------------- the command line


def test_cli_prints_the_commands_that_run_the_best(tmp_path, capsys) -> None:
    svg = tmp_path / "best.svg"
    rc = main(["plan", "zoo:mlp_stack", "--ranks", "2", "--memory", "1GB", "--schedules", "1F1B,GPipe",
               "--no-measure", "--svg", str(svg)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "split at" in out and "layers." in out and "run it in Python, on every rank:" in out
    # the time-balanced cut may fall inside a layer on a busy machine: then it says why there is no command
    train = re.search(r"^    (pippy-split train .*)$", out, re.M)
    if train:
        assert train.group(1).startswith("pippy-split train --model zoo:mlp_stack --ranks 2 --schedule ")
        assert "ps.pipeline(model, [" in out
    else:
        assert "pippy-split train does not run this plan: cut 1" in out
        assert "sched = plan.best.build_schedule(group=group)" in out
    assert "makespan" in svg.read_text() and "split at" in svg.read_text()


def test_cli_says_when_train_cannot_run_the_plan(tmp_path, capsys) -> None:
    rc = main(["plan", "zoo:mlp_stack", "--ranks", "2", "--memory", "1GB", "--schedules", "1F1B",
               "--global-batch", "16", "--no-measure", "--svg", ""])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "pippy-split train does not run this plan: it trains zoo:mlp_stack's own example batch (8 samples)" in out


def test_cli_measure_budget_flag() -> None:
    from pippy_split.cli import build_parser

    args = build_parser().parse_args(["plan", "zoo:mlp_stack", "--measure-budget", "60"])
    assert args.measure_budget == 60.0
