"""Edge-case reference models: input order, kwargs and buffers, an input read late.

Part of the model zoo (see `pippy_split.zoo`). Each model is tiny and exists to pin
down one thing that the tracer, partitioner or runtime must get right:

- `OutOfOrderArgs`: forward(a, b) whose graph reads b before a. a and b have
  different shapes, so a swap of inputs fails loudly rather than silently.
- `KwargsBuffers`: forward(x, *, scale=None, mask=None) with a persistent buffer in
  stage 0, a non-persistent buffer in stage 1, a float kwarg and a bool kwarg tensor
  read only by the last stage.
- `InputReadLate`: forward(x, pos) where the integer input pos is read only by the
  middle stage (stage 1 of 0..2), so it has to skip stage 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pippy_split.zoo.entry import ZooEntry

__all__ = [
    "InputReadLate",
    "KwargsBuffers",
    "OutOfOrderArgs",
    "input_read_late",
    "kwargs_buffers",
    "out_of_order_args",
]


class OutOfOrderArgs(nn.Module):
    """forward(a (B, d_a), b (B, d_b)) -> (B, d_out); the graph reads b first.

    Stages with split spec ["mix"]: stage 0 = proj_b, proj_a; stage 1 = mix, out.
    """

    def __init__(self, d_a: int = 12, d_b: int = 20, d: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.proj_b = nn.Linear(d_b, d)
        self.proj_a = nn.Linear(d_a, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, d_out)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = self.proj_b(b)  # (B, d), b first on purpose
        h = h + self.proj_a(a)  # (B, d)
        h = self.mix(torch.tanh(h))  # (B, d)
        return self.out(torch.tanh(h))  # (B, d_out)


class RunningNorm(nn.Module):
    """Normalise with fixed running statistics, like BatchNorm in eval mode (never updated)."""

    running_mean: torch.Tensor  # buffers (registered in __init__)
    running_var: torch.Tensor

    def __init__(self, d: int) -> None:
        super().__init__()
        # Persistent: saved in the state_dict, like BatchNorm's statistics.
        self.register_buffer("running_mean", torch.linspace(-0.5, 0.5, d))
        self.register_buffer("running_var", torch.linspace(0.5, 2.0, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.running_mean) * torch.rsqrt(self.running_var + 1e-5)


class WindowedLinear(nn.Module):
    """Linear layer whose input is multiplied by a fixed window (a non-persistent buffer)."""

    window: torch.Tensor  # buffer (registered in __init__)

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        # Non-persistent: rebuilt from d by __init__, absent from the state_dict.
        self.register_buffer("window", torch.hann_window(d, periodic=False) + 0.5, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x * self.window))


class MaskedHead(nn.Module):
    """Output projection that zeroes masked-out outputs: mask (B, d_out) bool, True = keep."""

    def __init__(self, d: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d_out)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        y = self.fc(h)  # (B, d_out)
        return y if mask is None else y.masked_fill(~mask, 0.0)


class KwargsBuffers(nn.Module):
    """forward(x (B, d), *, scale: float | None, mask: (B, d_out) bool | None) -> (B, d_out).

    Stages with split spec ["body", "head"]:
        stage 0: norm (persistent buffers running_mean, running_var), scale
        stage 1: body (non-persistent buffer body.window)
        stage 2: head, reads the kwarg mask
    """

    def __init__(self, d: int = 16, d_out: int = 8) -> None:
        super().__init__()
        self.norm = RunningNorm(d)
        self.body = WindowedLinear(d)
        self.head = MaskedHead(d, d_out)

    def forward(
        self, x: torch.Tensor, *, scale: float | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.norm(x)  # (B, d)
        if scale is not None:
            h = h * scale
        h = self.body(h)  # (B, d)
        return self.head(h, mask)  # (B, d_out)


class PositionMix(nn.Module):
    """Add a learned embedding of integer positions, then mix: (B, T, d), (B, T) -> (B, T, d)."""

    def __init__(self, d: int, n_pos: int) -> None:
        super().__init__()
        self.pos_emb = nn.Embedding(n_pos, d)
        self.fc = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(h + self.pos_emb(pos)))


class InputReadLate(nn.Module):
    """forward(x (B, T, d_in) float, pos (B, T) int64) -> (B, T, d_out).

    Stages with split spec ["mid", "out"]:
        stage 0: embed   reads x only
        stage 1: mid     reads pos (the model input) and stage 0's output
        stage 2: out
    """

    def __init__(self, d_in: int = 8, d: int = 16, d_out: int = 4, n_pos: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.mid = PositionMix(d, n_pos)
        self.out = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))  # (B, T, d)
        h = self.mid(h, pos)  # (B, T, d)
        return self.out(h)  # (B, T, d_out)


def out_of_order_args(seed: int = 0, d_a: int = 12, d_b: int = 20, batch_size: int = 8) -> ZooEntry:
    """OutOfOrderArgs, 2 stages; a is (B, d_a), b is (B, d_b) with d_a != d_b."""
    if d_a == d_b:
        raise ValueError("d_a and d_b must differ so that swapped inputs are detected")
    torch.manual_seed(seed)
    model = OutOfOrderArgs(d_a, d_b)
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(batch_size, d_a, generator=g)  # (B, d_a)
    b = torch.randn(batch_size, d_b, generator=g)  # (B, d_b)
    target = torch.randn(batch_size, 4, generator=g)  # (B, d_out)
    return ZooEntry(
        model=model,
        args=(a, b),
        kwargs={},
        split_spec=["mix"],
        num_stages=2,
        loss_fn=F.mse_loss,
        target=target,
        description="forward(a, b) reads b before a; a and b differ in shape",
    )


def kwargs_buffers(
    seed: int = 0, d: int = 16, d_out: int = 8, batch_size: int = 8, scale: float = 0.5
) -> ZooEntry:
    """KwargsBuffers, 3 stages; kwargs are a float `scale` and a bool `mask` for the last stage."""
    torch.manual_seed(seed)
    model = KwargsBuffers(d, d_out)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, d, generator=g)  # (B, d)
    mask = torch.rand(batch_size, d_out, generator=g) > 0.3  # (B, d_out) bool
    target = torch.randn(batch_size, d_out, generator=g) * mask  # (B, d_out)
    return ZooEntry(
        model=model,
        args=(x,),
        kwargs={"scale": scale, "mask": mask},
        split_spec=["body", "head"],
        num_stages=3,
        loss_fn=F.mse_loss,
        target=target,
        description="buffers (persistent, non-persistent); float kwarg; bool kwarg for last stage",
    )


def input_read_late(
    seed: int = 0,
    d_in: int = 8,
    d: int = 16,
    n_pos: int = 64,
    batch_size: int = 8,
    seq_len: int = 12,
) -> ZooEntry:
    """InputReadLate, 3 stages; the int64 input pos is read only by stage 1."""
    torch.manual_seed(seed)
    model = InputReadLate(d_in, d, 4, n_pos)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, seq_len, d_in, generator=g)  # (B, T, d_in)
    pos = torch.randint(0, n_pos, (batch_size, seq_len), generator=g)  # (B, T) int64
    target = torch.randn(batch_size, seq_len, 4, generator=g)  # (B, T, d_out)
    return ZooEntry(
        model=model,
        args=(x, pos),
        kwargs={},
        split_spec=["mid", "out"],
        num_stages=3,
        loss_fn=F.mse_loss,
        target=target,
        description="the int input pos is read only by the middle stage",
    )
