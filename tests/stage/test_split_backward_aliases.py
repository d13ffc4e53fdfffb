"""The zero-bubble I/W split when a stage output is a parameter, a view of one, a buffer,
or a view of a stage input: every gradient equals the unsplit model's (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pippy_split as ps

SPLIT_BACKWARD = ["ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"]


class Head(nn.Module):
    """Stage 0: an activation and ``kind`` of one of its own tensors, which crosses the cut."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(6, 6)
        self.D = nn.Parameter(torch.randn(6))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.kind == "param":  # HF Mamba's reference scan: D.float() is the parameter itself in fp32
            return h, self.D.float()
        if self.kind == "param_view":
            return h, self.D.view(1, 6).expand(2, 6)[0]
        if self.kind == "param_derived":  # computed from the parameter alone
            return h, self.D * 2.0 + 1.0
        if self.kind == "used_param":  # a parameter used by an op in the stage and also sent on
            return h, self.lin.bias
        if self.kind == "buffer":
            return h, self.scale
        if self.kind == "param_and_buffer":
            return h, self.D * self.scale
        raise ValueError(self.kind)


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, h, d):
        return self.lin(h * d)


class Model(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.a = Head(kind)
        self.b = Body()
        self.c = nn.Linear(6, 6)
        self.d = nn.Linear(6, 3)

    def forward(self, x):
        h, d = self.a(x)
        h = self.b(h, d)
        h = self.c(h)
        return self.d(h.view(-1, 2, 3).transpose(1, 2).reshape(-1, 6))  # views of stage inputs cross cuts too


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _expected(model, x, y, n_mb):
    for xm, ym in zip(x.chunk(n_mb), y.chunk(n_mb)):
        (_loss(model(xm), ym) / n_mb).backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


KINDS = ["param", "param_view", "param_derived", "used_param", "buffer", "param_and_buffer"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("schedule", SPLIT_BACKWARD + ["Interleaved1F1B"])
def test_a_tensor_of_the_stage_crossing_the_cut_keeps_its_gradient(schedule, kind):
    torch.manual_seed(0)
    model = Model(kind)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    expected = _expected(model, x, y, 4)
    split = ["b", "d"] if schedule == "DualPipeV" else ["b"]  # one process: DualPipeV needs 2 stages on it too
    pipe = ps.pipeline(model, split[:1], (x[:2],))
    assert any(e.src_stage == 0 and e.dst_stage == 1 for e in pipe.edges)
    sched = ps.build_schedule(pipe, schedule, 4, loss_fn=_loss)
    sched.step(x, target=y)
    for n, p in model.named_parameters():
        if expected[n] is None:  # a parameter the model does not use in this variant
            assert p.grad is None, n
            continue
        assert p.grad is not None, f"{n}: no gradient under {schedule}"
        torch.testing.assert_close(p.grad, expected[n], atol=1e-5, rtol=0, msg=n)
