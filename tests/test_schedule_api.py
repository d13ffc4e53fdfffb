"""Schedule API details: `losses=` is replaced, a missing process group under a launcher is named."""

from __future__ import annotations

import torch

import pippy_split as ps
from pippy_split import zoo


def test_reused_losses_list_holds_the_last_step_only():
    entry = zoo.get("tiny_gpt")
    mb = ps.split_args_kwargs(entry.args, entry.kwargs, 4)[0][0]
    pipe = ps.pipeline(entry.model, entry.split_spec, mb)
    sched = ps.build_schedule(pipe, "Interleaved1F1B", 4, loss_fn=entry.loss_fn)  # one process, 4 stages
    losses = ["stale"]
    for _ in range(2):
        sched.step(*entry.args, target=entry.target, losses=losses)
        assert len(losses) == 4
    torch.testing.assert_close(torch.stack(losses).mean(), sched.loss)


def test_launched_without_a_process_group_is_named(monkeypatch):
    import pytest

    entry = zoo.get("tied_lm")
    mb = ps.split_args_kwargs(entry.args, entry.kwargs, 4)[0][0]
    pipe = ps.pipeline(entry.model, entry.split_spec, mb)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("1F1B", "Interleaved1F1B"):
        with pytest.raises(ps.PipelineError, match=r"WORLD_SIZE=2 ranks .*init_process_group\(\)"):
            ps.build_schedule(pipe, name, 4, loss_fn=entry.loss_fn)
