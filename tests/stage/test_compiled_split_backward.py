"""A compiled stage under the I/W split: its I computes the weight gradients too (W could
only rerun the compiled region's whole backward), and the result is the unsplit model's."""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps
from pippy_split import zoo
from pippy_split.schedule import Action, ActionKind

N_MB = 4


def _order(num_stages: int) -> dict[int, list[Action | None]]:
    acts: list[Action | None] = []
    for mb in range(N_MB):
        acts += [Action(s, ActionKind.F, mb) for s in range(num_stages)]
        acts += [Action(s, k, mb) for s in reversed(range(num_stages)) for k in (ActionKind.I, ActionKind.W)]
    return {0: acts}


@pytest.mark.timeout(300)
def test_compiled_stage_accumulates_weight_grads_in_I_and_matches_the_model() -> None:
    entry = zoo.get("mlp_stack", d=16)
    pipe = ps.pipeline(entry.model, 2, entry.args[0][: entry.args[0].shape[0] // N_MB])
    stages = [pipe.build_stage(s, compile={"backend": "aot_eager"}) for s in range(2)]
    sched = ps.ScheduleFromOrder(stages, N_MB, entry.loss_fn, order=_order(2))

    def grad_total() -> float:
        return sum(float(p.grad.abs().sum()) for st in stages for p in st.module.parameters() if p.grad is not None)

    with sched.timed_actions(probe=grad_total) as times:
        sched.step(*entry.args, target=entry.target)
    for t in times:
        if t.action.kind is ActionKind.I:
            assert t.after > t.before, t.action  # weight gradients accumulated by I
        if t.action.kind is ActionKind.W:
            assert t.after == t.before, t.action  # nothing left for W
    got = {n: p.grad.clone() for st in stages for n, p in st.module.named_parameters()}

    entry.model.zero_grad(set_to_none=True)
    for xs, ys in zip(entry.args[0].chunk(N_MB), entry.target.chunk(N_MB)):
        (entry.loss_fn(entry.model(xs), ys) / N_MB).backward()
    for fqn, p in entry.model.named_parameters():
        torch.testing.assert_close(got[fqn], p.grad, atol=1e-5, rtol=0)
