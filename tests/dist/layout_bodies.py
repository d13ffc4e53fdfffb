"""Rank bodies for ``test_layout.py``: a value that crosses a cut keeps its memory layout."""

from __future__ import annotations

import torch

import pippy_split as ps

N_MB = 2


class ChannelsLastNet(torch.nn.Module):
    """A convolution whose output goes on channels-last (as ConvNeXt's blocks leave it), then a
    depthwise convolution that reads it: the cut between them crosses a channels-last tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.dw = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        return self.head(self.dw(h).mean((2, 3)))


def build() -> tuple[ChannelsLastNet, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return ChannelsLastNet(), torch.randn(4, 3, 6, 6), torch.randn(4, 2)


def reference() -> dict:
    """The unsplit model: the strides ``dw`` reads, the loss and every gradient."""
    model, x, y = build()
    strides: list[tuple[int, ...]] = []
    model.dw.register_forward_pre_hook(lambda m, args: strides.append(args[0].stride()))
    total = 0.0
    for xm, ym in zip(x.chunk(N_MB), y.chunk(N_MB)):
        loss = torch.nn.functional.mse_loss(model(xm), ym) / N_MB
        loss.backward()
        total += loss.item()
    return {"strides": strides, "loss": total, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def channels_last_step(rank: int, world: int) -> dict:
    """1F1B over 2 ranks cut before ``dw``: the strides ``dw`` reads on rank 1, loss and grads."""
    model, x, y = build()
    pipe = ps.pipeline(model, ["dw"], (x[:2],))
    sched = ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=torch.nn.functional.mse_loss)
    strides: list[tuple[int, ...]] = []  # the stage calls the model's own dw: the hook sees each microbatch
    model.dw.register_forward_pre_hook(lambda m, args: strides.append(args[0].stride()))
    sched.step(x, target=y)
    grads = {n: p.grad.clone() for st in sched.stages for n, p in st.module.named_parameters()}
    return {"strides": strides, "loss": float(sched.loss), "grads": grads,
            "dim_order": getattr(pipe.edges[0].spec, "dim_order", None)}
