"""Building schedules leaves the user's model as it was: no hooks piling up, no ``forward``
replaced on its modules, and the unsplit model computes and trains as before (issue 29, item 7)."""

from __future__ import annotations

import gc
import warnings

import torch

import pippy_split as ps
from pippy_split import zoo


def _hooks(model: torch.nn.Module) -> dict[str, int]:
    return {n: len(m._forward_hooks) + len(m._forward_pre_hooks) for n, m in model.named_modules()
            if m._forward_hooks or m._forward_pre_hooks}


def _instance_forwards(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if "forward" in m.__dict__]


def _step_all(model, x, y, loss_fn, kinds):
    scheds = []
    for schedule, ac in kinds:
        pipe = ps.pipeline(model, ["layers.2"], (x[:2],))
        sched = ps.build_schedule(pipe, schedule, 4, loss_fn=loss_fn, activation_checkpoint=ac)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sched.step(x, target=y)
        scheds.append(sched)
    return scheds


def test_three_schedules_leave_no_hook_and_no_forward_on_the_users_modules():
    entry = zoo.get("mlp_stack", d=16)
    model, x, y, loss_fn = entry.model, entry.args[0], entry.target, entry.loss_fn
    fresh = zoo.get("mlp_stack", d=16).model
    fresh.load_state_dict(model.state_dict())
    kinds = [("ZBVZeroBubble", None), ("ZBVZeroBubble", ["layers.*"]), ("Interleaved1F1B", ["layers.*"])]
    scheds = _step_all(model, x, y, loss_fn, kinds)
    # while they live: at most one hook per module (shared by every stage), no forward replaced
    assert all(n <= 1 for n in _hooks(model).values()), _hooks(model)
    assert _instance_forwards(model) == []
    del scheds
    gc.collect()
    assert _hooks(model) == {}  # the last stage gone: the model carries nothing of ours
    # the unsplit model computes and trains as a model no schedule ever touched
    model.zero_grad(set_to_none=True)
    model.load_state_dict(fresh.state_dict())
    for m in (model, fresh):
        loss_fn(m(x), y).backward()
    torch.testing.assert_close(model(x), fresh(x), atol=0, rtol=0)
    for (n, p), q in zip(model.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0, msg=n)


def test_selective_checkpointing_still_checkpoints_the_users_modules_in_the_stage():
    entry = zoo.get("mlp_stack", d=16)
    pipe = ps.pipeline(entry.model, ["layers.2"], (entry.args[0][:2],))
    sched = ps.build_schedule(pipe, "Interleaved1F1B", 4, loss_fn=entry.loss_fn, activation_checkpoint=["layers.*"])
    sched.step(entry.args[0], target=entry.target)
    calls, recomputes = sched.stages[0].region_counts
    assert calls > 0 and recomputes == calls
    assert _instance_forwards(entry.model) == []
