"""I/W split equals full backward, in one process (no process group needed)."""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps


class TwiceUsed(torch.nn.Module):
    """The same Linear applied twice inside one stage, plus tied embedding/head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.shared = torch.nn.Linear(8, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))  # param used twice in stage 0
        h = self.body(h) + h
        return self.head(h)


def _loss(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble", "LoopedBFS", "Interleaved1F1B"])
def test_split_backward_matches_unsplit_in_one_process(schedule):
    torch.manual_seed(0)
    model = TwiceUsed()
    x, y = torch.randint(0, 11, (8, 5)), torch.randint(0, 11, (8, 5))
    for xm, ym in zip(x.chunk(4), y.chunk(4)):
        (_loss(model(xm), ym) / 4).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    pipe = ps.pipeline(model, ["body"], (x[:2],))
    assert pipe.shared_parameters  # tied weight in stages 0 and 1
    sched = ps.build_schedule(pipe, schedule, 4, loss_fn=_loss)
    assert [s.stage_index for s in sched.stages] == [0, 1]
    losses = []
    sched.step(x, target=y, losses=losses)
    assert len(losses) == 4
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], atol=1e-5, rtol=0, msg=n)


def test_wrong_stage_count_is_a_clear_error():
    torch.manual_seed(0)
    model = TwiceUsed()
    pipe = ps.pipeline(model, ["body"], (torch.randint(0, 11, (2, 5)),))
    with pytest.raises(ValueError, match="exactly 2 stage"):
        ps.ScheduleZBVZeroBubble(pipe.build_stage(0), 4, loss_fn=_loss)


def test_missing_target_names_the_last_stage():
    torch.manual_seed(0)
    model = TwiceUsed()
    x = torch.randint(0, 11, (8, 5))
    pipe = ps.pipeline(model, ["body"], (x[:2],))
    sched = ps.build_schedule(pipe, "ZBVZeroBubble", 4, loss_fn=_loss)
    with pytest.raises(ps.PipelineError, match="last stage"):
        sched.step(x)


def test_forward_hooks_on_the_stage_module_fire_under_the_split_backward():
    torch.manual_seed(0)
    model = TwiceUsed()
    x, y = torch.randint(0, 11, (8, 5)), torch.randint(0, 11, (8, 5))
    pipe = ps.pipeline(model, ["body"], (x[:2],))
    sched = ps.build_schedule(pipe, "ZBVZeroBubble", 4, loss_fn=_loss)
    calls = []
    sched.stages[1].module.register_forward_hook(lambda m, a, out: calls.append(len(out)))
    sched.step(x, target=y)
    assert calls == [1] * 4  # the module's own outputs: captures travel on a side channel
    # The pipe still runs in one process with the instrumented module (captures are no-ops there).
    torch.testing.assert_close(pipe(x[:2]), model(x[:2]))
