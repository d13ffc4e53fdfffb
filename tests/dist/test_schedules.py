"""Every schedule x zoo model on gloo ranks: losses and grads equal the unsplit model's."""

from __future__ import annotations

import pytest
import torch

from pippy_split import zoo
from pippy_split.schedule.orders import ORDERS
from pippy_split.testing import run_ranks

from .bodies import eval_then_step, reference, train_step

MODELS = ["tiny_gpt", "fan_out_skip", "tiny_llama", "tied_lm", "tiny_unet"]
N_MB = 4


def _cases():
    for name in MODELS:
        stages = zoo.get(name).num_stages
        for sched, spec in ORDERS.items():
            per_rank = spec.default_stages_per_rank()
            if stages % per_rank:
                continue
            yield pytest.param(name, sched, stages // per_rank, id=f"{name}-{sched}")


def _assert_matches(results, name, n_mb=N_MB):
    ref_loss, ref_grads = reference(name, n_mb)
    seen = set()
    for r in results:
        assert abs(r["loss"] - ref_loss) < 1e-5, (r["loss"], ref_loss)
        for fqn, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[fqn], atol=1e-5, rtol=0, msg=lambda m, f=fqn: f"{f}: {m}")
            seen.add(fqn)
    assert seen == set(ref_grads), set(ref_grads) ^ seen


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name,schedule,world", list(_cases()))
def test_schedule_matches_unsplit_model(name, schedule, world):
    results = run_ranks(train_step, world, name, schedule, N_MB, timeout=150)
    _assert_matches(results, name)
    last = [r for r in results if r["out_shape"] is not None]
    assert len(last) == 1 and last[0]["n_losses"] == N_MB


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_eval_before_step_then_step():
    results = run_ranks(eval_then_step, 2, "tiny_gpt", "ZBVZeroBubble", N_MB, timeout=150)
    outs = [r["eval"] for r in results if r["eval"] is not None]
    entry = zoo.get("tiny_gpt")
    with torch.no_grad():
        expected = entry.model(*entry.args)
    assert len(outs) == 1
    torch.testing.assert_close(outs[0], expected, atol=1e-5, rtol=0)
    _assert_matches(results, "tiny_gpt")


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["tiny_unet", "tiny_gpt"])
def test_looped_bfs_in_v_placement_matches_unsplit_model(name):
    from .bodies import train_step_placed

    results = run_ranks(train_step_placed, 2, name, "LoopedBFS", N_MB, "v", timeout=150)
    assert [r["stages"] for r in results] == [[0, 3], [1, 2]]  # first and last stage share rank 0
    _assert_matches(results, name)
