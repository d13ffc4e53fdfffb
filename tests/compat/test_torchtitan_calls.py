"""The calls torchtitan 0.3.0's ``pipeline_parallel.py`` makes of the pipelining API, answered by
compat in one process (no torchtitan needed; tests/torchtitan runs torchtitan's own code):
``PipelineStage(..., group=, get_mesh=)``, ``stage.submod = part``, and ``ps.build_schedule``
with a compat single-stage class (which takes one stage)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pippy_split as ps
from pippy_split import compat
from pippy_split.compat import schedules as S

N_MB = 2


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_get_mesh_is_accepted_and_kept():
    def get_mesh(names, layout):  # torchtitan's _build_get_mesh_callback shape
        return None

    stage = compat.PipelineStage(_mlp(), 0, 1, torch.device("cpu"), group=None, get_mesh=get_mesh)
    assert stage.get_mesh is get_mesh
    out = S.ScheduleGPipe(stage, N_MB).eval(torch.randn(4, 4))
    assert out.shape == (4, 2)


def test_submod_is_assignable_and_the_step_runs_the_new_module():
    old, new = _mlp(), _mlp()
    with torch.no_grad():
        new[0].weight.mul_(2.0)
    stage = compat.PipelineStage(old, 0, 1, torch.device("cpu"))
    stage.submod = new  # what torchtitan does after its parallelize_fn
    assert stage.submod is new
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    losses: list = []
    S.Schedule1F1B(stage, N_MB, loss_fn=F.mse_loss).step(x, target=y, losses=losses)
    assert old[0].weight.grad is None and new[0].weight.grad is not None
    torch.testing.assert_close(sum(losses) / N_MB, F.mse_loss(new(x), y), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_build_schedule_hands_a_compat_single_stage_class_its_one_stage(name):
    model = _mlp()
    pipe = ps.pipeline(model, None, (torch.randn(2, 4),))
    sched = ps.build_schedule(pipe, S.get_schedule_class(name), N_MB, loss_fn=F.mse_loss)
    assert isinstance(sched, S.PipelineScheduleSingle)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    losses: list = []
    sched.step(arg_mbs=list((c,) for c in x.chunk(N_MB)), kwarg_mbs=[{}] * N_MB, target_mbs=list(y.chunk(N_MB)),
               losses=losses, loss_kwargs={}, return_outputs=False)  # the Trainer's call
    assert len(losses) == N_MB


def test_a_list_of_two_stages_is_still_refused_by_a_single_stage_class():
    model = _mlp()
    pipe = compat.pipeline(model, (torch.randn(2, 4),), split_spec={"2": compat.SplitPoint.BEGINNING})
    stages = [pipe.build_stage(i, torch.device("cpu")) for i in range(2)]
    with pytest.raises(TypeError, match="one PipelineStage"):
        S.Schedule1F1B(stages, N_MB)
