"""Python state a forward writes on a module (issue 29 item 3): a module whose state is set
by glue code is never called as the user's object, so no microbatch reads what the previous
one left (one process; HF RecurrentGemma is in the real-architecture matrix)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pippy_split as ps
from pippy_split.split.python_effects import StateWrite
from pippy_split.split.trace import trace_model


class Recurrent(nn.Module):
    """A linear recurrence over time that starts from ``self.state`` and leaves its last state there."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.rand(d))
        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (mb, T, d)
        h = torch.zeros_like(x[:, 0]) if self.state is None else self.state
        outs = []
        for t in range(x.shape[1]):
            h = self.gate * h + x[:, t]
            outs.append(h)
        self.state = h
        return torch.stack(outs, 1)


class Block(nn.Module):
    """HF RecurrentGemma's recurrent block without a cache: it resets its child's state first."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.inp, self.rec, self.out = nn.Linear(d, d), Recurrent(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rec.state = None
        return x + self.out(self.rec(self.inp(x)))


class Model(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).mean((1, 2))


def _data():
    torch.manual_seed(0)
    return Model(), torch.randn(8, 5, 8), torch.randn(8)


def _loss(out, y):
    return ((out - y) ** 2).sum()


@pytest.mark.parametrize("strict", [False, True])
def test_the_trace_names_the_child_whose_state_its_parent_sets(strict):
    model, x, _ = _data()
    traced = trace_model(model, (x[:2],), strict=strict)
    assert traced.kept_traced == {f"blocks.{i}.rec": StateWrite(f"blocks.{i}", f"blocks.{i}.rec", "state")
                                  for i in range(2)}
    assert model.blocks[0].rec.state is None  # the trace's values are not left on the user's modules


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_a_cut_inside_the_parent_keeps_the_child_traced_and_gradients_exact(schedule):
    model, x, y = _data()
    for xm, ym in zip(x.chunk(4), y.chunk(4)):
        (_loss(model(xm), ym) / 4).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    pipe = ps.pipeline(model, ["blocks.0.out"], (x[:2],))  # stage 0: blocks.0.inp and blocks.0.rec, whole
    first, second = pipe.get_stage_module(0), pipe.get_stage_module(1)
    assert not any(n.op == "call_module" and str(n.target) == "blocks.0.rec" for n in first.graph.nodes)
    assert second.get_submodule("blocks.1") is model.blocks[1]  # whole in one stage: the user's own
    sched = ps.build_schedule(pipe, schedule, 4, loss_fn=_loss)
    sched.step(x, target=y)  # before: "Trying to backward through the graph a second time"
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-6, rtol=1e-5, msg=n)


class Capturing(nn.Module):
    """HF's output capturing: hooks installed on the first call, a flag saying so."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp, self.fc = nn.Linear(d, d), nn.Linear(d, d)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "_hooks_installed", False):
            self.fc.register_forward_hook(lambda m, a, out: self.seen.append(out))
            self._hooks_installed = True
        self.seen.clear()
        return self.fc(self.inp(x)) + len(self.seen)


def test_a_flag_set_with_work_done_once_is_left_as_the_forward_set_it():
    model, x = Capturing(), torch.randn(2, 8)
    for _ in range(2):  # a second trace of the same model (the autocast retrace, another pipeline())
        pipe = ps.pipeline(model, ["fc"], (x,))
        torch.testing.assert_close(pipe(x), model(x))
    assert len(model.fc._forward_hooks) == 1  # the hooks were installed once, as in the model's own runs
