"""Mixed precision runs the model's own bf16 computation: the split is traced under the
same autocast, so dtype-derived constants and the model's own upcasts are kept (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pippy_split as ps


class RMSNorm(nn.Module):
    """Llama's norm: computes in fp32 whatever comes in, then casts back."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))

    def forward(self, h):
        dtype = h.dtype
        h = h.to(torch.float32)  # a no-op in an fp32 trace
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(dtype)


class MaskedAttn(nn.Module):
    """DeBERTa's mask: the most negative value of the scores' own dtype."""

    def __init__(self, d: int):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h):
        s = self.q(h) @ self.k(h).transpose(-1, -2)
        mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not()
        s = s.masked_fill(mask, torch.finfo(s.dtype).min)
        return s.softmax(-1).to(torch.float32).to(h.dtype) @ self.v(h)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.attn, self.fc = RMSNorm(d), MaskedAttn(d), nn.Linear(d, d)

    def forward(self, h):
        return h + self.fc(torch.tanh(self.attn(self.norm(h))))


class Model(nn.Module):
    def __init__(self, d: int = 16, n: int = 4):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = RMSNorm(d)
        self.out = nn.Linear(d, 8)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(self.norm(h))


def _loss(out, y):
    return ((out.float() - y) ** 2).mean()


def _reference(model, x, y, n_mb, dtype):
    for xm, ym in zip(x.chunk(n_mb), y.chunk(n_mb)):
        with torch.autocast("cpu", dtype=dtype):
            out = model(xm)
        (_loss(out, ym) / n_mb).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("schedule", ["GPipe", "Interleaved1F1B", "ZBVZeroBubble"])
def test_mixed_precision_gradients_are_the_models_under_the_same_autocast(schedule, dtype):
    torch.manual_seed(0)
    model = Model()
    x, y = torch.randn(8, 6, 8), torch.randn(8, 6, 8)
    expected = _reference(model, x, y, 4, dtype)
    split = ["blocks.2"] if schedule != "GPipe" else []
    pipe = ps.pipeline(model, split, (x[:2],))
    sched = ps.build_schedule(pipe, schedule, 4, loss_fn=_loss, mixed_precision=dtype)
    sched.step(x, target=y)
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, expected[n], atol=1e-5, rtol=1e-4, msg=n)


def test_pipe_inside_a_users_autocast_is_the_model_inside_it():
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, 6, 8)
    pipe = ps.pipeline(model, ["blocks.1", "blocks.3"], (x,))
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            expected, got = model(x), pipe(x)
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    torch.testing.assert_close(pipe(x), model(x))  # outside autocast: the fp32 trace
    assert pipe.under_autocast(torch.bfloat16).autocast == ("cpu", torch.bfloat16)
    assert pipe.under_autocast(torch.bfloat16) is pipe.under_autocast(torch.bfloat16)  # traced once


def test_balanced_split_is_cut_at_the_same_places_under_autocast():
    torch.manual_seed(0)
    model = Model(n=6)
    x = torch.randn(2, 6, 8)
    pipe = ps.pipeline(model, 3, (x,))
    bf16 = pipe.under_autocast(torch.bfloat16)
    for a, b in zip(pipe.stages, bf16.stages):
        assert sorted(a.module.state_dict()) == sorted(b.module.state_dict())
        for name, p in a.module.named_parameters():
            assert b.module.get_parameter(name) is p  # the model's own parameters in both


class FanOut(nn.Module):
    """An fp32 activation crossing the cut is read by two linears of the next stage (a cut
    between an attention's q and k projections, in HF models)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x)).float() * 3.0  # fp32 under autocast
        return self.v(torch.tanh(self.q(h)) * torch.sigmoid(self.k(h)))


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_a_received_activation_read_twice_sums_its_gradients_like_the_model(schedule):
    """autocast caches the bf16 copy of a leaf that requires grad, so two reads of a received
    activation shared one copy and their gradients were summed in bf16 (off by ~1e-3)."""
    torch.manual_seed(0)
    model = FanOut()
    x, y = torch.randn(8, 6, 16), torch.randn(8, 6, 8)
    expected = _reference(model, x, y, 4, torch.bfloat16)
    pipe = ps.pipeline(model, ["q"], (x[:2],))
    sched = ps.build_schedule(pipe, schedule, 4, loss_fn=_loss, mixed_precision=torch.bfloat16)
    sched.step(x, target=y)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], atol=1e-5, rtol=1e-4, msg=n)
