"""A steady-state step runs no code of ``split/`` (issue 31): what a step needs of the split
(the model's input layout and checks, each stage's arguments, output structure, edge shapes,
dynamic sizes) is made when the schedule and its stages are built.

Each case runs a warm-up step, then traces the next one and the read of ``sched.loss`` with
``sys.setprofile``, and names every function whose code lives under ``pippy_split/split/`` that
ran. Three kinds of step: plain; the kit (selective checkpointing, bf16, ``loss_count``,
``clip_grad_norm_`` traced too) on a model whose head is tied to its embedding; microbatches of
different lengths (a dynamic dim). Schedules that take two stages on one rank run in one
process; GPipe and 1F1B (one stage per rank) on 2 gloo ranks. Counts, never times.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import warnings
from typing import Callable

import pytest
import torch
from torch.export import Dim

import pippy_split as ps
import pippy_split.split
from pippy_split import zoo
from pippy_split.schedule.orders import ORDERS
from pippy_split.testing import run_ranks

SPLIT_DIR = os.path.dirname(pippy_split.split.__file__) + os.sep
ONE_PROCESS = sorted(n for n, s in ORDERS.items() if s.stages_per_rank != 1)  # two stages on one rank
TWO_RANKS = sorted(set(ORDERS) - set(ONE_PROCESS))
KINDS = ["plain", "kit", "varlen"]


def split_functions_run(fn: Callable[[], object]) -> dict[str, int]:
    """``{"file.py:line qualname": calls}`` of every function defined under ``pippy_split/split/``
    that ran while ``fn()`` ran (in this thread or one it started)."""
    seen: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(SPLIT_DIR):
            code = frame.f_code
            seen[f"{code.co_filename[len(SPLIT_DIR):]}:{code.co_firstlineno} {code.co_qualname}"] += 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return dict(seen)


def _sum_loss(out, target):
    return torch.nn.functional.cross_entropy(out.float().flatten(0, 1), target.flatten(), reduction="sum")


def _case(kind: str, num_stages: int):
    """(pipe, step inputs, target, schedule keywords, also clip and read the loss) for one kind of step."""
    if kind == "varlen":  # microbatches of different lengths in one step (a dynamic dim)
        sizes = [16, 32, 24, 8]
        entry = zoo.get("tiny_gpt", n_layer=4, batch_size=2 * len(sizes))
        x, y = entry.args[0], entry.target
        pipe = ps.pipeline(entry.model, zoo.layer_split("blocks", 4, num_stages), (x[:2],),
                           dynamic_shapes={"idx": {1: Dim("T", min=2, max=32)}})
        xs = ps.Microbatches(x[2 * k:2 * k + 2, :n] for k, n in enumerate(sizes))
        ys = ps.Microbatches(y[2 * k:2 * k + 2, :n] for k, n in enumerate(sizes))
        return pipe, (xs,), ys, {"loss_fn": entry.loss_fn}, False
    # the kit on a model whose head is tied to its embedding: a tied group across the first and last stage
    entry = zoo.get("tiny_gpt" if kind == "plain" else "tied_lm", n_layer=max(4, num_stages))
    x, y = entry.args[0], entry.target
    pipe = ps.pipeline(entry.model, num_stages, (x[:2],))
    if kind == "plain":
        return pipe, (x,), y, {"loss_fn": entry.loss_fn}, False
    assert pipe.shared_parameters
    kit = dict(loss_fn=_sum_loss, activation_checkpoint=["blocks.*"], mixed_precision=torch.bfloat16,
               loss_count=lambda t: (t >= 0).sum())
    return pipe, (x,), y, kit, True


def traced_steady_step(schedule: str, kind: str, num_ranks: int) -> dict[str, int]:
    """The split/ functions the second step of ``schedule`` ran (its clip and loss read too, with the kit)."""
    spec = ORDERS[schedule]
    pipe, inputs, target, kwargs, clip = _case(kind, num_ranks * (spec.stages_per_rank or 2))
    sched = ps.build_schedule(pipe, schedule, 4, **kwargs)

    def step() -> None:
        sched.step(*inputs, target=target)
        if clip:
            ps.clip_grad_norm_(sched, 1.0)
        float(sched.loss)
        for st in sched.stages:
            st.module.zero_grad(set_to_none=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step()  # warm-up: hand-built facts, caches and compiled plans may be made here
        return split_functions_run(step)


def _ranks_body(rank: int, world: int) -> dict:
    return {(name, kind): traced_steady_step(name, kind, world) for name in TWO_RANKS for kind in KINDS}


def _report(ran: dict[str, int]) -> str:
    return "functions of pippy_split/split/ that ran in a steady step:\n  " + "\n  ".join(
        f"{name} x{n}" for name, n in sorted(ran.items()))


def test_the_tracer_sees_split_code():
    """The check can fail: a call into the splitter is seen, by name."""
    entry = zoo.get("tiny_gpt")
    pipe = ps.pipeline(entry.model, 2, (entry.args[0][:2],))
    ran = split_functions_run(lambda: pipe(entry.args[0][:2]))
    assert any(name.startswith("pipe.py:") and name.endswith("Pipe.__call__") for name in ran), ran


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("schedule", ONE_PROCESS)
def test_a_steady_step_runs_no_split_code_in_one_process(schedule, kind):
    ran = traced_steady_step(schedule, kind, 1)
    assert not ran, f"{schedule}, {kind}: {_report(ran)}"


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_a_steady_step_runs_no_split_code_on_two_ranks():
    assert TWO_RANKS == ["1F1B", "GPipe"]
    for rank, per_case in enumerate(run_ranks(_ranks_body, 2, timeout=540)):
        ran = {f"{schedule}, {kind}": r for (schedule, kind), r in per_case.items() if r}
        assert not ran, f"rank {rank}: " + "\n".join(f"{case}: {_report(r)}" for case, r in ran.items())
