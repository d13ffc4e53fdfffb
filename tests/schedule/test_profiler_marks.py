"""Every action of a step shows in a ``torch.profiler`` trace under a readable name (issue 31):
compute actions one by one, each batch of comm actions as one mark, in the order the rank ran them."""

from __future__ import annotations

import warnings

import pytest
import torch

import pippy_split as ps
from pippy_split import zoo
from pippy_split.schedule.runtime import profiler_label
from pippy_split.testing import run_ranks


def _profiled_step(sched, entry):
    sched.step(*entry.args, target=entry.target)  # warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sched.step(*entry.args, target=entry.target)
    return [ev.name for ev in prof.events() if ev.name.startswith("pippy_split")]


def _expected(actions) -> list[str]:
    labels, batch = [], []
    for a in actions:
        if a.kind.is_compute:
            if batch:
                labels.append(profiler_label(batch))
                batch = []
            labels.append(profiler_label(a))
        else:
            batch.append(a)
    return labels + ([profiler_label(batch)] if batch else [])


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "Interleaved1F1B"])
def test_every_compute_action_is_a_profiler_mark_in_order(schedule):
    entry = zoo.get("tiny_gpt")
    pipe = ps.pipeline(entry.model, 2, (entry.args[0][:2],))
    sched = ps.build_schedule(pipe, schedule, 4, loss_fn=entry.loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = _profiled_step(sched, entry)
    assert names == _expected(sched.actions)
    assert "pippy_split 1W3: stage 1 backward weight, mb 3" in names or schedule != "ZBVZeroBubble"


def profiled_ranks(rank: int, world: int):
    entry = zoo.get("tiny_gpt")
    pipe = ps.pipeline(entry.model, 2, (entry.args[0][:2],))
    sched = ps.build_schedule(pipe, "1F1B", 4, loss_fn=entry.loss_fn)
    return _profiled_step(sched, entry), _expected(sched.actions)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_comm_batches_are_marks_too_on_two_ranks():
    for names, expected in run_ranks(profiled_ranks, 2, timeout=150):
        assert names == expected
        assert any(n.startswith("pippy_split comm ") for n in names)
