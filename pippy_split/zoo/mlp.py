"""MLP reference models: a plain chain (`MLPStack`) and a minimal fan-out skip (`FanOutSkip`).

Part of the model zoo (see `pippy_split.zoo`). `MLPStack` is the simplest pipeline:
each stage hands one tensor to the next. `FanOutSkip` is the smallest model in which
one value goes to two later stages:

    stage 0: stem   a = stem(x)            a goes to stages 1 and 2
    stage 1: mid    b = mid(a)             b goes to stage 2
    stage 2: tail   out = tail(b, a)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pippy_split.zoo.entry import ZooEntry, layer_split

__all__ = ["FanOutSkip", "MLPStack", "fan_out_skip", "mlp_stack"]


class MLPLayer(nn.Module):
    """Residual layer: x + tanh(fc(x)), (B, d) -> (B, d)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class MLPStack(nn.Module):
    """`n_layer` residual layers `layers.{i}`: (B, d) -> (B, d)."""

    def __init__(self, d: int = 32, n_layer: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPLayer(d) for _ in range(n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)  # (B, d)
        return x


class Tail(nn.Module):
    """Last block of FanOutSkip: fc(tanh(h + skip)), reading the stem's output again."""

    def __init__(self, d: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d_out)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(h + skip))  # (B, d_out)


class FanOutSkip(nn.Module):
    """stem -> mid -> tail, with the stem's output also fed to tail: (B, d_in) -> (B, d_out)."""

    def __init__(self, d_in: int = 16, d: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(d_in, d), nn.Tanh())
        self.mid = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.tail = Tail(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)  # (B, d), consumed by mid (stage 1) and tail (stage 2)
        b = self.mid(a)  # (B, d)
        return self.tail(b, a)  # (B, d_out)


def mlp_stack(
    seed: int = 0, d: int = 32, n_layer: int = 8, num_stages: int = 4, batch_size: int = 8
) -> ZooEntry:
    """MLPStack regressing random targets, split evenly over its layers (4 stages)."""
    torch.manual_seed(seed)
    model = MLPStack(d, n_layer)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, d, generator=g)  # (B, d)
    target = torch.randn(batch_size, d, generator=g)  # (B, d)
    return ZooEntry(
        model=model,
        args=(x,),
        kwargs={},
        split_spec=layer_split("layers", n_layer, num_stages),
        num_stages=num_stages,
        loss_fn=F.mse_loss,
        target=target,
        description="plain chain of residual MLP layers",
    )


def fan_out_skip(
    seed: int = 0, d_in: int = 16, d: int = 32, d_out: int = 8, batch_size: int = 8
) -> ZooEntry:
    """FanOutSkip: the stem's output goes to stage 1 and stage 2 (3 stages)."""
    torch.manual_seed(seed)
    model = FanOutSkip(d_in, d, d_out)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, d_in, generator=g)  # (B, d_in)
    target = torch.randn(batch_size, d_out, generator=g)  # (B, d_out)
    return ZooEntry(
        model=model,
        args=(x,),
        kwargs={},
        split_spec=["mid", "tail"],
        num_stages=3,
        loss_fn=F.mse_loss,
        target=target,
        description="minimal fan-out skip: stem output consumed by stages 1 and 2",
    )
