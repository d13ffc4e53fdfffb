"""compat schedules with every stage in this process (no process group): step/eval as the
peer has them, checked against the unsplit model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pippy_split as ps
from pippy_split import compat
from pippy_split.compat import schedules as S

from .bodies import N_MB, grads_of, make, reference

ATOL = 1e-5
MULTI = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def close(a, b) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def _stages(n_stages: int):
    model, x, target = make()
    cuts = {1: None, 2: {"layers.2": compat.SplitPoint.BEGINNING}}[n_stages]
    pipe = compat.pipeline(model, (x.chunk(N_MB)[0],), split_spec=cuts)
    return model, x, target, [pipe.build_stage(i, torch.device("cpu")) for i in range(n_stages)]


def _schedule(name: str, stages: list, **kwargs):
    cls = S.get_schedule_class(name)
    return cls(stages[0], N_MB, **kwargs) if issubclass(cls, S.PipelineScheduleSingle) else cls(stages, N_MB, **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, n_stages", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 1)] +
                         [(m, 2) for m in MULTI])
def test_step_losses_outputs_and_grads(name, n_stages):
    model, x, target, stages = _stages(n_stages)
    sched = _schedule(name, stages, loss_fn=F.mse_loss)
    ref_losses, ref_out, ref_grads = reference(model, x, target)
    losses = ["stale", "stale"]
    for _ in range(2):
        for st in stages:
            st.submod.zero_grad()
        out = sched.step(x, target=target, losses=losses)
    assert len(losses) == N_MB
    for got, want in zip(losses, ref_losses):
        close(got, want)
    close(out, ref_out)
    grads = grads_of([st.submod for st in stages])
    assert set(grads) == set(ref_grads)
    for k in ref_grads:
        close(grads[k], ref_grads[k])
    assert sched.step(x, target=target, return_outputs=False) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_eval_with_target_fills_losses_and_leaves_grads(name):
    model, x, target, stages = _stages(2)
    sched = _schedule(name, stages, loss_fn=F.mse_loss)
    ref_losses, ref_out, _ = reference(model, x, target)
    losses = [0.0] * 9
    out = sched.eval(x, target=target, losses=losses)  # before any step()
    close(out, ref_out)
    assert len(losses) == N_MB
    for got, want in zip(losses, ref_losses):
        close(got, want)
    assert all(p.grad is None for st in stages for p in st.submod.parameters())
    close(sched.eval(x), ref_out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, n_stages", [("GPipe", 1), ("ZBVZeroBubble", 2)])
def test_no_loss_fn_means_forward_only(name, n_stages):
    model, x, _, stages = _stages(n_stages)
    sched = _schedule(name, stages)
    close(sched.step(x), model(x))
    assert all(p.grad is None for st in stages for p in st.submod.parameters())
    with pytest.raises(RuntimeError, match="no loss_fn"):
        sched.step(x, losses=[])


@pytest.mark.timeout(60)
def test_loss_kwargs_reach_the_loss_fn():
    model, x, target, stages = _stages(2)
    sched = S.ScheduleInterleaved1F1B(stages, N_MB, loss_fn=lambda out, tgt, scale=1.0: F.mse_loss(out, tgt) * scale)
    ref_losses, _, _ = reference(model, x, target)
    losses = []
    sched.step(x, target=target, losses=losses, loss_kwargs={"scale": 3.0})
    for got, want in zip(losses, ref_losses):
        close(got, 3 * want)
    sched.step(x, target=target, losses=losses)  # and only for that step
    for got, want in zip(losses, ref_losses):
        close(got, want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, expected", [("Interleaved1F1B", "B"), ("ZBVZeroBubble", "W")])
def test_dw_builder_runs_once_per_microbatch(name, expected):
    model, x, target = make(2)
    runs = []
    stages = [compat.PipelineStage(model.layers[i], i, 2, torch.device("cpu"),
                                   dw_builder=lambda i=i: (lambda: runs.append(i))) for i in range(2)]
    sched = S.get_schedule_class(name)(stages, N_MB, loss_fn=F.mse_loss)
    assert expected in {str(a)[1] for acts in sched.pipeline_order.values() for a in acts if a is not None}
    sched.step(x, target=target)
    assert sorted(runs) == [0] * N_MB + [1] * N_MB
    _, _, ref_grads = reference(model, x, target)
    grads = grads_of([st.submod for st in stages], ["layers.0", "layers.1"])
    for k in ref_grads:
        close(grads[k], ref_grads[k])


def test_schedules_are_ours_and_report_their_order():
    _, _, _, stages = _stages(2)
    sched = S.ScheduleZBVZeroBubble(stages, N_MB, loss_fn=F.mse_loss)
    assert isinstance(sched, ps.ScheduleZBVZeroBubble) and isinstance(sched, S.PipelineScheduleMulti)
    assert sched.stage_index_to_group_rank == {0: 0, 1: 0}
    kinds = {str(a)[1] for a in sched.pipeline_order[0] if a is not None}
    assert kinds == {"F", "I", "W"}
    _, _, _, one = _stages(1)
    single = S.Schedule1F1B(one[0], N_MB, loss_fn=F.mse_loss)
    assert isinstance(single, ps.Schedule1F1B) and isinstance(single, S.PipelineScheduleSingle)


def test_misuse_is_a_type_error_that_says_what_to_pass():
    _, _, _, stages = _stages(2)
    with pytest.raises(TypeError, match="one PipelineStage"):
        S.ScheduleGPipe(stages, N_MB)
    with pytest.raises(TypeError, match=r"pass \[stage\]"):
        S.ScheduleInterleaved1F1B(stages[0], N_MB)
    with pytest.raises(TypeError, match="base class"):
        S.PipelineScheduleSingle(stages[0], N_MB)
    with pytest.raises(TypeError, match="base class"):
        S.PipelineScheduleMulti(stages, N_MB)
    with pytest.raises(ValueError, match="exactly 2"):
        S.ScheduleZBVZeroBubble(stages[:1], N_MB)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, n_stages", [("1F1B", 1), ("ZBVZeroBubble", 2)])
def test_step_and_eval_take_microbatches_already_split(name, n_stages):
    """ps.Microbatches through the peer-shaped step/eval: same losses and grads as the batch."""
    model, x, target, stages = _stages(n_stages)
    sched = _schedule(name, stages, loss_fn=F.mse_loss)
    ref_losses, ref_out, ref_grads = reference(model, x, target)
    xs, ys = ps.Microbatches(x.chunk(N_MB)), ps.Microbatches(target.chunk(N_MB))
    losses: list = []
    out = sched.step(xs, target=ys, losses=losses)
    assert isinstance(out, ps.Microbatches) and len(out) == N_MB
    close(torch.cat(list(out)), ref_out)
    for got, want in zip(losses, ref_losses):
        close(got, want)
    grads = grads_of([st.submod for st in stages])
    assert grads and all(torch.allclose(g, ref_grads[n], atol=ATOL) for n, g in grads.items())
    eval_losses: list = []
    sched.eval(xs, target=ys, losses=eval_losses)
    assert len(eval_losses) == N_MB
