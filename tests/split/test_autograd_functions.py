"""Custom autograd Functions (issue 29 item 2): a stage calls the module that applies one,
so the Function's own backward runs, or the split is refused by name (one process; HF
Reformer is in the real-architecture matrix)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import pippy_split as ps
from pippy_split.split.errors import SplitError


class Reversible(torch.autograd.Function):
    """A reversible residual pair (RevNet, Reformer): the forward keeps no activations, the
    backward rebuilds its input from its output and accumulates the parameters' gradients."""

    @staticmethod
    def forward(ctx, x, f, g):
        with torch.no_grad():
            x1, x2 = x.chunk(2, -1)
            y1 = x1 + f(x2)
            y2 = x2 + g(y1)
        ctx.f, ctx.g = f, g
        ctx.save_for_backward(y1, y2)
        return torch.cat([y1, y2], -1)

    @staticmethod
    def backward(ctx, dy):
        y1, y2 = ctx.saved_tensors
        dy1, dy2 = dy.chunk(2, -1)
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            gy1 = ctx.g(y1)
            torch.autograd.backward(gy1, dy2)
        with torch.no_grad():
            x2 = y2 - gy1
            dy1 = dy1 + y1.grad
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_()
            torch.autograd.backward(ctx.f(x2), dy1)
        return torch.cat([dy1, dy2 + x2.grad], -1), None, None


class RevBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.f, self.g, self.post = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(2 * d, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(Reversible.apply(x, self.f, self.g))


class RevModel(nn.Module):
    def __init__(self, d: int = 4, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(2 * d, 2 * d)
        self.blocks = nn.ModuleList(RevBlock(d) for _ in range(n))
        self.head = nn.Linear(2 * d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).sum(-1)


class OwnForward(nn.Module):
    """The model's own forward applies the Function: no stage can call it as a module."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.inp, self.f, self.g, self.head = nn.Linear(2 * d, 2 * d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(2 * d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(Reversible.apply(self.inp(x), self.f, self.g)).sum(-1)


def _loss(out, y):
    return ((out - y) ** 2).sum()


@pytest.mark.parametrize("schedule, split", [("ZBVZeroBubble", ["blocks.2"]), ("Interleaved1F1B", 4)])
def test_the_functions_own_backward_runs_and_gradients_are_exact(schedule, split):
    torch.manual_seed(0)
    model, x, y = RevModel(), torch.randn(8, 8), torch.randn(8)
    for xm, ym in zip(x.chunk(4), y.chunk(4)):
        (_loss(model(xm), ym) / 4).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = ps.pipeline(model, split, (x[:2],))
    for st in pipe.stages:  # every block is called whole, as the user's object
        for i in range(4):
            if f"blocks.{i}" in [str(n.target) for n in st.module.graph.nodes if n.op == "call_module"]:
                assert st.module.get_submodule(f"blocks.{i}") is model.blocks[i]
    sched = ps.build_schedule(pipe, schedule, 4, loss_fn=_loss)
    sched.step(x, target=y)  # before: "element 0 of tensors does not require grad"
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-6, rtol=1e-5, msg=n)
    assert not [w for w in caught if "could not keep" in str(w.message)]  # every block's signature kept


def test_a_cut_inside_the_module_applying_it_is_refused_by_name():
    with pytest.raises(SplitError, match=r"falls inside 'blocks.1', which applies the custom autograd Function "
                                         r"Reversible.*SplitPoint.BEGINNING"):
        ps.pipeline(RevModel(), ["blocks.1.post"], (torch.randn(2, 8),))


def test_a_function_no_stage_can_call_is_refused_naming_its_parameters():
    with pytest.raises(SplitError, match=r"the model's own forward applies the custom autograd Function Reversible, "
                                         r"whose forward runs without autograd.*4 trainable parameter\(s\) would get "
                                         r"no gradient \(f.bias, f.weight, g.bias, g.weight\)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ps.pipeline(OwnForward(), ["head"], (torch.randn(2, 8),))
