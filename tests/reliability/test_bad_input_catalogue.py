"""The bad-input catalogue: each mistake a user can make gets one clear exception
that names what is wrong and where (stage, microbatch, argument, key). In one process;
the cross-rank cases live in tests/dist/test_reliability.py and test_runtime.py."""

from __future__ import annotations

import warnings

import pytest
import torch

import pippy_split as ps
from pippy_split import zoo
from pippy_split.microbatch import MicrobatchError


@pytest.fixture(scope="module")
def gpt():
    entry = zoo.get("tiny_gpt")
    mb = ps.split_args_kwargs(entry.args, entry.kwargs, 4)[0]
    return entry, ps.pipeline(entry.model, entry.split_spec, *mb)


@pytest.fixture(scope="module")
def tied():
    entry = zoo.get("tied_lm")
    mb = ps.split_args_kwargs(entry.args, entry.kwargs, 4)[0]
    return entry, ps.pipeline(entry.model, entry.split_spec, *mb)


def test_01_unknown_split_fqn():
    e = zoo.get("tiny_gpt")
    with pytest.raises(ps.SplitError, match=r"'blocks\.9'.*did you mean"):
        ps.pipeline(e.model, ["blocks.9"], (e.args[0][:2],))


def test_02_split_leaving_an_empty_stage():
    e = zoo.get("tiny_gpt")
    spec = {"blocks.1": ps.SplitPoint.BEGINNING, "blocks.0": ps.SplitPoint.END}
    with pytest.raises(ps.SplitError, match="stage 1 would be empty"):
        ps.pipeline(e.model, spec, (e.args[0][:2],))


def test_03_more_split_points_than_the_graph_allows():
    e = zoo.get("mlp_stack")
    with pytest.raises(ps.SplitError, match="cannot balance into 500 stages"):
        ps.pipeline(e.model, 500, (e.args[0][:2],))


def test_04_v_schedule_with_one_stage_per_rank(gpt):
    _, pipe = gpt
    with pytest.raises(ValueError, match="exactly 2 stage"):
        ps.ScheduleZBVZeroBubble(pipe.build_stage(0), 4)


def test_05_stage_count_not_ranks_times_stages_per_rank(gpt):
    _, pipe = gpt
    with pytest.raises(ValueError, match=r"4 stages do not match 1 ranks x 3 stages"):
        ps.ScheduleLoopedBFS([pipe.build_stage(i) for i in range(3)], 4)


def test_06_too_few_microbatches_for_the_schedule(tied):
    _, pipe = tied
    with pytest.raises(ValueError, match="DualPipeV"):
        ps.build_schedule(pipe, "DualPipeV", 0)


def test_07_batch_not_divisible_into_microbatches(gpt):
    entry, pipe = gpt
    sched = ps.build_schedule(pipe, "LoopedBFS", 4, loss_fn=entry.loss_fn)
    with pytest.raises(MicrobatchError, match=r"'idx' has batch size 6 .* not divisible into 4"):
        sched.step(entry.args[0][:6], target=entry.target[:6])


def test_08_arguments_with_different_batch_sizes():
    with pytest.raises(MicrobatchError, match=r"args\[0\].*8.*args\[1\].*6|args\[1\].*6.*args\[0\].*8"):
        ps.split_args_kwargs((torch.zeros(8, 2), torch.zeros(6, 2)), {}, 2)


def test_09_wrong_shape_at_run_time_names_the_input(gpt):
    entry, pipe = gpt
    sched = ps.build_schedule(pipe, "LoopedBFS", 4, loss_fn=entry.loss_fn)
    with pytest.raises(ValueError, match=r"input 'idx'.*dynamic_shapes"):
        sched.step(entry.args[0][:, :16], target=entry.target[:, :16])


def test_10_wrong_dtype_at_run_time(gpt):
    entry, pipe = gpt
    sched = ps.build_schedule(pipe, "LoopedBFS", 4, loss_fn=entry.loss_fn)
    with pytest.raises(ValueError, match=r"input 'idx'.*int32"):
        sched.step(entry.args[0].to(torch.int32), target=entry.target)


def test_11_missing_target_where_the_last_stage_lives(gpt):
    entry, pipe = gpt
    sched = ps.build_schedule(pipe, "LoopedBFS", 4, loss_fn=entry.loss_fn)
    with pytest.raises(ps.PipelineError, match=r"last stage \(3\) and needs target="):
        sched.step(*entry.args)


def test_12_missing_input_where_stage_0_lives(gpt):
    entry, pipe = gpt
    sched = ps.build_schedule(pipe, "LoopedBFS", 4, loss_fn=entry.loss_fn)
    with pytest.raises(ps.PipelineError, match="holds stage 0 which reads the model inputs"):
        sched.step(target=entry.target)


def test_13_loss_fn_returning_a_non_scalar(tied):
    entry, pipe = tied
    sched = ps.build_schedule(pipe, "ZBVZeroBubble", 4, loss_fn=lambda out, tgt: out.mean(-1))
    with pytest.raises(ps.PipelineError, match=r"stage 1, microbatch 0: loss_fn must return a scalar"):
        sched.step(*entry.args, target=entry.target)


def test_14_non_finite_loss_warns_or_raises(tied):
    entry, pipe = tied

    def nan_loss(out, tgt):
        return entry.loss_fn(out, tgt) * float("inf")

    sched = ps.build_schedule(pipe, "ZBVZeroBubble", 4, loss_fn=nan_loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step(*entry.args, target=entry.target)
        assert not any("the loss is" in str(w.message) for w in caught)  # no host read inside the step ...
        sched.loss  # noqa: B018  # ... the first read of the step's loss checks it
    assert any("stage 1, microbatch 0: the loss is inf (and in 3 more microbatches)" in str(w.message) for w in caught)
    strict = ps.build_schedule(pipe, "ZBVZeroBubble", 4, loss_fn=nan_loss, on_nonfinite="raise")
    with pytest.raises(ps.PipelineError, match="stage 1, microbatch 0: the loss is inf"):
        strict.step(*entry.args, target=entry.target)


def test_15_exception_inside_a_stage_forward(gpt):
    entry, pipe = gpt
    sched = ps.build_schedule(pipe, "LoopedBFS", 4, loss_fn=entry.loss_fn)
    handle = sched.stages[2].module.register_forward_hook(lambda m, a, o: 1 / 0)
    try:
        with pytest.raises(ps.PipelineError, match="stage 2, microbatch 0: forward raised ZeroDivisionError"):
            sched.step(*entry.args, target=entry.target)
    finally:
        handle.remove()


def test_16_checkpoint_from_another_model(tmp_path, gpt):
    _, pipe = gpt
    other = zoo.get("mlp_stack").model
    ps.checkpoint.save(tmp_path / "ckpt", other, no_dist=True)
    with pytest.raises(ps.checkpoint.CheckpointError, match="missing") as info:
        ps.checkpoint.load(tmp_path / "ckpt", [pipe.get_stage_module(i) for i in range(4)], no_dist=True)
    assert "unexpected" in str(info.value)


def test_17_checkpoint_directory_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ps.checkpoint.CheckpointError, match="a_file"):
        ps.checkpoint.save(blocker / "ckpt", zoo.get("mlp_stack").model, no_dist=True)


def test_18_unknown_schedule_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid names.*ZBVZeroBubble"):
        ps.get_schedule_class("ZeroBubbleV2")


def test_19_hand_written_order_that_deadlocks_is_rejected_before_running(tied):
    entry, pipe = tied
    order = ps.schedule.order_from_csv("0F0,1F0,1B0,0B0,0F1,1F1,1B1,0B1\n")
    order[0] = [ps.Action(1, "B", 0)] + [a for a in order[0] if str(a) != "1B0"]
    with pytest.raises(ps.ScheduleError) as info:
        ps.ScheduleFromOrder([pipe.build_stage(0), pipe.build_stage(1)], 2, entry.loss_fn, order=order)
    assert info.value.rank == 0 and info.value.step == 0


def test_20_state_dict_with_a_prefix_names_missing_and_unexpected_keys(gpt):
    entry, pipe = gpt
    prefixed = {"module." + k: v for k, v in entry.model.state_dict().items()}
    with pytest.raises(ps.SplitError, match=r"lacks 12 key\(s\) stage 1 needs: blocks\.1\.attn\.proj\.bias "
                                            r"\(did you mean 'module\.blocks\.1\.attn\.proj\.bias'\?\)") as info:
        pipe.build_stage(1, state_dict=prefixed)
    assert "name no parameter or buffer of the model" in str(info.value)
    assert "strict=False" in str(info.value)


def test_21_state_dict_with_a_misnamed_key_keeps_nothing_silently(gpt):
    entry, pipe = gpt
    sd = dict(entry.model.state_dict())
    sd["blocks.1.ln1.wieght"] = sd.pop("blocks.1.ln1.weight")
    with pytest.raises(ps.SplitError, match=r"blocks\.1\.ln1\.weight \(did you mean 'blocks\.1\.ln1\.wieght'\?\)"):
        pipe.build_stage(1, state_dict=sd)
    before = pipe.get_stage_module(1).get_parameter("blocks.1.ln1.weight").detach().clone()
    sd["blocks.1.ln1.bias"] = sd["blocks.1.ln1.bias"] + 1
    stage = pipe.build_stage(1, state_dict=sd, strict=False)  # the explicit opt-out: matching keys only
    torch.testing.assert_close(stage.module.get_parameter("blocks.1.ln1.weight"), before)
    torch.testing.assert_close(stage.module.get_parameter("blocks.1.ln1.bias"), sd["blocks.1.ln1.bias"])


def test_22_state_dict_of_other_stages_only_is_fine_but_an_unknown_key_is_not(gpt):
    entry, pipe = gpt
    sd = entry.model.state_dict()
    pipe.build_stage(2, state_dict={k: v for k, v in sd.items() if k.startswith("blocks.2.")})
    with pytest.raises(ps.SplitError, match=r"1 key\(s\) of state_dict name no parameter.*blocks\.7\.ln1\.weight"):
        pipe.build_stage(2, state_dict={**sd, "blocks.7.ln1.weight": torch.zeros(3)})


def _meta_gpt():
    from pippy_split.zoo.gpt import TinyGPT

    sizes = dict(vocab_size=64, d_model=32, n_layer=4, n_head=4, block_size=64)
    with torch.device("meta"):
        model = TinyGPT(**sizes)
    torch.manual_seed(0)
    return TinyGPT(**sizes), ps.pipeline(model, ["blocks.1", "blocks.2", "blocks.3"], (torch.randint(0, 64, (2, 16)),))


def test_23_meta_stage_given_a_state_dict_with_a_typo_or_a_wrong_shape():
    full, pipe = _meta_gpt()
    sd = dict(full.state_dict())
    with pytest.raises(ps.SplitError, match=r"name no parameter or buffer of the model: blocks\.1\.ln1\.weigth"):
        pipe.build_stage(1, "cpu", state_dict={**sd, "blocks.1.ln1.weigth": sd["blocks.1.ln1.weight"]})
    sd["blocks.1.ln1.bias"] = torch.zeros(1)  # copy_ would broadcast it silently
    with pytest.raises(ps.SplitError, match=r"another shape.*blocks\.1\.ln1\.bias: \(1,\) vs \(32,\)"):
        pipe.build_stage(1, "cpu", state_dict=sd)


def test_24_loading_a_checkpoint_that_is_not_there(tmp_path):
    with pytest.raises(ps.checkpoint.CheckpointError, match=r"no checkpoint at .*nowhere: the directory does not exist"):
        ps.checkpoint.load(tmp_path / "nowhere", zoo.get("mlp_stack").model, no_dist=True)


@pytest.mark.parametrize("args,message", [
    (["--simulate-failure", "one"], "--simulate-failure takes RANK:STEP"),
    (["--checkpoint-every", "-1"], "must be >= 0"),
    (["--schedule", "Zigzag"], "unknown schedule 'Zigzag'"),
])
def test_25_train_options_refused_before_any_rank_starts(capsys, args, message):
    from pippy_split import train

    assert train.train_main(args) == 2
    assert message in capsys.readouterr().err


def test_26_step_checks_on_one_rank_raise_the_rank_s_own_error():
    from pippy_split.schedule.agree import agree_before_step
    from pippy_split.stage.groups import PipelineGroup

    with pytest.raises(KeyError, match="mask"):  # alone, the error is raised as it is
        agree_before_step(KeyError("mask"), PipelineGroup.of(None, "cpu"))


def _mlp_pipe():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    return model, ps.pipeline(model, ["2"], (torch.randn(4, 8),))


def test_27_a_target_that_does_not_fit_the_output_is_refused_before_any_stage_runs():
    model, pipe = _mlp_pipe()
    calls = []
    model[0].register_forward_hook(lambda *a: calls.append(1))
    sched = ps.build_schedule(pipe, "ZBVZeroBubble", 4, loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    with pytest.raises(ps.PipelineError, match=r"stage 1 \(the last\), microbatch 0: the target does not fit the "
                                               r"output.*\(4, 4\).*\(3, 4\)"):
        sched.step(x, target=y[:12])
    assert not calls  # refused on the shapes, before any forward
    sched.step(x, target=y)  # the schedule works on
    assert len(calls) == 4


def test_28_a_loss_fn_that_reads_values_is_not_refused_on_fake_tensors():
    _, pipe = _mlp_pipe()

    def loss_fn(out, target):  # a host read and a value-sized mask: fake tensors cannot run them
        scale = float(target.abs().max().item())
        return (out - target)[target > -scale - 1].pow(2).mean()

    sched = ps.build_schedule(pipe, "ZBVZeroBubble", 2, loss_fn=loss_fn)
    sched.step(torch.randn(8, 8), target=torch.randn(8, 4))
    assert torch.isfinite(sched.loss)
