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


def test_stage_count_rule_in_docstrings_and_errors():
    import pytest

    assert "Stages: exactly 2 stages per rank" in ps.ScheduleZBVZeroBubble.__doc__
    assert "Stages: 2 or more stages per rank" in ps.ScheduleInterleaved1F1B.__doc__
    entry = zoo.get("fan_out_skip")  # 3 stages, one process
    mb = ps.split_args_kwargs(entry.args, entry.kwargs, 4)[0][0]
    pipe = ps.pipeline(entry.model, entry.split_spec, mb)
    with pytest.raises(ValueError, match=r"3 stages on 1 rank: ScheduleGPipe needs exactly 1 stage per rank.*What "
                                         r"would work: 1 stage on 1 rank .*3 stages on 3 ranks.*another schedule: "
                                         r"Interleaved1F1B, LoopedBFS, InterleavedZeroBubble"):
        ps.build_schedule(pipe, "GPipe", 4, loss_fn=entry.loss_fn)
    with pytest.raises(ValueError, match=r"ScheduleZBVZeroBubble needs exactly 2 stages per rank.*What would work"):
        ps.build_schedule(pipe, "ZBVZeroBubble", 4, loss_fn=entry.loss_fn)


def test_eval_of_a_train_mode_trace_is_refused_and_an_eval_trace_matches():
    import pytest

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 2))
    x = torch.randn(8, 4)
    pipe = ps.pipeline(model, ["2"], (x[:4],))
    sched = ps.build_schedule(pipe, "Interleaved1F1B", 2, loss_fn=torch.nn.functional.mse_loss)
    stats = model[2].running_mean.clone()
    with pytest.raises(ps.PipelineError, match=r"eval\(\): stage 0 calls module '1' in training mode"
                                               r".*Call model.eval\(\) first.*ps.pipeline\(model.eval\(\), ...\)"):
        sched.eval(x)
    torch.testing.assert_close(model[2].running_mean, stats)  # nothing ran
    model.eval()
    with torch.no_grad():  # the stages call the model's own modules: their eval() applies
        torch.testing.assert_close(sched.eval(x), model(x))
    eval_pipe = ps.pipeline(model, ["2"], (x[:4],))
    eval_sched = ps.build_schedule(eval_pipe, "Interleaved1F1B", 2, loss_fn=torch.nn.functional.mse_loss)
    with torch.no_grad():
        torch.testing.assert_close(eval_sched.eval(x), model(x))


def test_a_whole_batch_through_a_microbatch_trace_says_so():
    import pytest

    entry = zoo.get("tied_lm")
    mb = ps.split_args_kwargs(entry.args, entry.kwargs, 4)[0][0]
    pipe = ps.pipeline(entry.model, entry.split_spec, mb)
    with pytest.raises(ValueError, match=r"traced for shape \(2, \d+\) torch.int64; it looks like a batch of 4 "
                                         r"microbatches: trace on ONE microbatch") as info:
        pipe(entry.args[0])
    assert "* = dynamic" not in str(info.value)
