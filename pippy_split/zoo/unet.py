"""TinyUNet: a 2-D U-Net whose skip connections cross stages, one of them fanning out.

Part of the model zoo (see `pippy_split.zoo`). Shapes for the defaults, with c = 8
base channels and a (B, 3, 16, 16) input:

    stem   x          -> s0  (B, c, 16, 16)
    down1  s0         -> s1  (B, 2c, 8, 8)
    down2  s1         -> s2  (B, 4c, 4, 4)
    mid    s2, s0     -> m   (B, 4c, 4, 4)   s0 pooled to a global context vector
    up2    m, s1      -> u2  (B, 2c, 8, 8)
    up1    u2, s0     -> u1  (B, c, 16, 16)
    head   u1         -> out (B, 3, 16, 16)

With the default split spec ["down2", "up2", "up1"] the four stages are:

    stage 0: stem, down1   produces s0, s1
    stage 1: down2, mid    consumes s1 (from 0), s0 (from 0)
    stage 2: up2           consumes m (from 1), s1 (from 0, skips stage 1)
    stage 3: up1, head     consumes u2 (from 2), s0 (from 0, skips stages 1-2)

So the stem output s0 fans out to stages 1 and 3, and s1 fans out to stages 1 and 2.
Every skip is consumed inside a module's forward (mid, up2, up1 take two inputs), so
the stage that reads it is fixed by the split spec alone. GroupNorm, not BatchNorm:
microbatching must not change the result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pippy_split.zoo.entry import ZooEntry

__all__ = ["TinyUNet", "tiny_unet"]

_GROUPS = 4  # GroupNorm groups; channel counts must be multiples of this


class ConvBlock(nn.Module):
    """3x3 conv -> GroupNorm -> SiLU, keeping the spatial size unless stride=2."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1)
        self.norm = nn.GroupNorm(_GROUPS, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(self.conv(x)))


class Down(nn.Module):
    """Halve H and W (strided conv), then refine: (B, c_in, H, W) -> (B, c_out, H/2, W/2)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.reduce = ConvBlock(c_in, c_out, stride=2)
        self.block = ConvBlock(c_out, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.reduce(x))


class Mid(nn.Module):
    """Bottleneck block, conditioned on a global context vector pooled from the stem."""

    def __init__(self, c: int, c_ctx: int) -> None:
        super().__init__()
        self.block = ConvBlock(c, c)
        self.ctx = nn.Linear(c_ctx, c)

    def forward(self, x: torch.Tensor, stem: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx(stem.mean(dim=(2, 3)))  # (B, c_ctx, H, W) -> (B, c)
        return self.block(x) + ctx[:, :, None, None]  # (B, c, h, w)


class Up(nn.Module):
    """Double H and W, concatenate the encoder skip, and fuse: -> (B, c_out, 2h, 2w)."""

    def __init__(self, c_in: int, c_skip: int, c_out: int) -> None:
        super().__init__()
        self.block = ConvBlock(c_in + c_skip, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")  # (B, c_in, 2h, 2w)
        return self.block(torch.cat([x, skip], dim=1))  # (B, c_out, 2h, 2w)


class TinyUNet(nn.Module):
    """forward(x (B, in_channels, H, W) float) -> (B, in_channels, H, W); H, W divisible by 4."""

    def __init__(self, in_channels: int = 3, channels: int = 8) -> None:
        super().__init__()
        if channels % _GROUPS:
            raise ValueError(f"channels={channels} must be a multiple of {_GROUPS}")
        c = channels
        self.stem = ConvBlock(in_channels, c)
        self.down1 = Down(c, 2 * c)
        self.down2 = Down(2 * c, 4 * c)
        self.mid = Mid(4 * c, c_ctx=c)
        self.up2 = Up(4 * c, 2 * c, 2 * c)
        self.up1 = Up(2 * c, c, c)
        self.head = nn.Conv2d(c, in_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s0 = self.stem(x)  # (B, c, H, W)
        s1 = self.down1(s0)  # (B, 2c, H/2, W/2)
        s2 = self.down2(s1)  # (B, 4c, H/4, W/4)
        m = self.mid(s2, s0)  # (B, 4c, H/4, W/4)
        u2 = self.up2(m, s1)  # (B, 2c, H/2, W/2)
        u1 = self.up1(u2, s0)  # (B, c, H, W)
        return self.head(u1)  # (B, in_channels, H, W)


def tiny_unet(
    seed: int = 0,
    in_channels: int = 3,
    channels: int = 8,
    size: int = 16,
    batch_size: int = 8,
    noise: float = 0.1,
) -> ZooEntry:
    """TinyUNet as a denoiser: input = target + noise, MSE loss, 4 stages."""
    if size % 4:
        raise ValueError(f"size={size} must be divisible by 4")
    torch.manual_seed(seed)
    model = TinyUNet(in_channels, channels)
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch_size, in_channels, size, size, generator=g)  # (B, C, H, W)
    x = target + noise * torch.randn(target.shape, generator=g)  # (B, C, H, W)
    return ZooEntry(
        model=model,
        args=(x,),
        kwargs={},
        split_spec=["down2", "up2", "up1"],
        num_stages=4,
        loss_fn=F.mse_loss,
        target=target,
        description="2-D U-Net: skips cross stages; the stem output fans out to stages 1 and 3",
    )
