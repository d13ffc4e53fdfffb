"""Small vision models with the module structure of torchvision's, for the balance matrix.

torchvision's PyPI wheel for torch 2.13 (0.28.0) is built against CUDA torch: its
``_C.so`` needs ``libc10_cuda.so``, so ``import torchvision`` fails with the CPU torch
this project tests on (``operator torchvision::nms does not exist``). These models keep
what matters to the balancer: the same nesting of containers and blocks, module
names (``features``, ``encoder.layers.encoder_layer_0``, ``layer1.0``) and op kinds
(convolutions, batch norm, depthwise convs, squeeze-excitation, windowed attention),
at widths of 8-64 on 32x32 images.

Each builder returns ``(model, args, kwargs, blocks)`` like ``hf.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

BATCH, IMAGE = 2, 32


def _image() -> torch.Tensor:
    return torch.randn(BATCH, 3, IMAGE, IMAGE)


class ConvNormAct(nn.Sequential):
    """torchvision.ops.Conv2dNormActivation: conv, batch norm, optional activation."""

    def __init__(self, cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1,
                 act: type[nn.Module] | None = nn.ReLU) -> None:
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                                   nn.BatchNorm2d(cout)]
        if act is not None:
            layers.append(act())
        super().__init__(*layers)


# ---- ResNet-18: stem, layer1..layer4 of two BasicBlocks each, avgpool, fc --------------

class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    # Half of resnet18's widths: much narrower would make the 7x7 stem a third of the FLOPs (6% in the real model).
    def __init__(self, widths: tuple[int, ...] = (32, 64, 128, 256), num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w, 1)))
            cin = w
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18() -> tuple:
    return ResNet(), (_image(),), {}, 8


# ---- ViT-B/16: conv patches, class token, encoder.layers = nn.Sequential of blocks ------

class MLPBlock(nn.Sequential):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__(nn.Linear(d, hidden), nn.GELU(), nn.Dropout(0.0), nn.Linear(hidden, d), nn.Dropout(0.0))


class EncoderBlock(nn.Module):
    def __init__(self, heads: int, d: int, hidden: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.self_attention = nn.MultiheadAttention(d, heads, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLPBlock(d, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + self.dropout(y)
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(self, seq: int, layers: int, heads: int, d: int, hidden: int) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, d).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential(OrderedDict(
            (f"encoder_layer_{i}", EncoderBlock(heads, d, hidden)) for i in range(layers)))
        self.ln = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class VisionTransformer(nn.Module):
    def __init__(self, image: int = IMAGE, patch: int = 8, layers: int = 8, heads: int = 4, d: int = 32,
                 hidden: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.patch, self.d = patch, d
        self.conv_proj = nn.Conv2d(3, d, patch, patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, d))
        self.encoder = Encoder((image // patch) ** 2 + 1, layers, heads, d, hidden)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(d, num_classes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = self.conv_proj(x).reshape(n, self.d, -1).permute(0, 2, 1)  # (n, patches, d)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


def vit_b_16() -> tuple:
    return VisionTransformer(), (_image(),), {}, 8


# ---- Swin-T: features = [patch embed, stage, PatchMerging, stage, ...], shifted windows ----

class Permute(nn.Module):
    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.permute(x, self.dims)


class ShiftedWindowAttention(nn.Module):
    def __init__(self, d: int, window: int, shift: int, heads: int) -> None:
        super().__init__()
        self.window, self.shift, self.heads = window, shift, heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, W, C)
        b, h, w, c = x.shape
        ws = min(self.window, h)  # as torchvision: a window no larger than the feature map
        shift = self.shift if h > ws else 0
        if shift:
            x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
        x = x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
        q, k, v = self.qkv(x).reshape(x.shape[0], ws * ws, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, ws * ws, c)
        x = self.proj(x).view(b, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        if shift:
            x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
        return x


class SwinTransformerBlock(nn.Module):
    def __init__(self, d: int, heads: int, shift: int, window: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = ShiftedWindowAttention(d, window, shift, heads)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = MLPBlock(d, 4 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.reduction = nn.Linear(4 * d, 2 * d, bias=False)
        self.norm = nn.LayerNorm(4 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0, x1, x2, x3 = x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]
        return self.reduction(self.norm(torch.cat([x0, x1, x2, x3], -1)))


class SwinTransformer(nn.Module):
    def __init__(self, d: int = 16, depths: tuple[int, ...] = (2, 2, 4, 2), heads: tuple[int, ...] = (1, 2, 4, 8),
                 num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, d, 4, 4), Permute([0, 2, 3, 1]), nn.LayerNorm(d))]
        for i, (depth, h) in enumerate(zip(depths, heads)):
            dim = d * 2 ** i
            layers.append(nn.Sequential(*[SwinTransformerBlock(dim, h, 0 if k % 2 == 0 else 1) for k in range(depth)]))
            if i < len(depths) - 1:
                layers.append(PatchMerging(dim))
        self.features = nn.Sequential(*layers)
        dim = d * 2 ** (len(depths) - 1)
        self.norm = nn.LayerNorm(dim)
        self.permute = Permute([0, 3, 1, 2])
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.permute(self.norm(self.features(x)))
        return self.head(self.flatten(self.avgpool(x)))


def swin_t() -> tuple:
    return SwinTransformer(), (_image(),), {}, 10


# ---- EfficientNet-B0: features = [stem, 7 stages of MBConv, head conv], classifier ------

class SqueezeExcitation(nn.Module):
    def __init__(self, c: int, squeeze: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, c, 1)
        self.activation = nn.SiLU()
        self.scale_activation = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))


class MBConv(nn.Module):
    def __init__(self, cin: int, cout: int, expand: int, k: int, stride: int) -> None:
        super().__init__()
        mid = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(ConvNormAct(cin, mid, 1, act=nn.SiLU))
        layers += [ConvNormAct(mid, mid, k, stride, groups=mid, act=nn.SiLU),
                   SqueezeExcitation(mid, max(1, cin // 4)), ConvNormAct(mid, cout, 1, act=None)]
        self.block = nn.Sequential(*layers)
        self.use_res_connect = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out + x if self.use_res_connect else out


class EfficientNet(nn.Module):
    # (expand, kernel, stride, out channels, repeats) per stage, as B0 (channels / 4)
    STAGES = [(1, 3, 1, 4, 1), (6, 3, 2, 6, 2), (6, 5, 2, 10, 2), (6, 3, 2, 20, 3), (6, 5, 1, 28, 3),
              (6, 5, 2, 48, 4), (6, 3, 1, 80, 1)]

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [ConvNormAct(3, 8, 3, 2, act=nn.SiLU)]
        cin = 8
        for expand, k, stride, cout, repeats in self.STAGES:
            stage = [MBConv(cin if r == 0 else cout, cout, expand, k, stride if r == 0 else 1) for r in range(repeats)]
            layers.append(nn.Sequential(*stage))
            cin = cout
        layers.append(ConvNormAct(cin, 4 * cin, 1, act=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(4 * cin, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def efficientnet_b0() -> tuple:
    return EfficientNet(), (_image(),), {}, 16


# ---- MobileNetV3-Small: 11 InvertedResidual blocks straight in `features` ---------------

class InvertedResidual(nn.Module):
    def __init__(self, cin: int, k: int, mid: int, cout: int, se: bool, act: type[nn.Module], stride: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if mid != cin:
            layers.append(ConvNormAct(cin, mid, 1, act=act))
        layers.append(ConvNormAct(mid, mid, k, stride, groups=mid, act=act))
        if se:
            layers.append(SqueezeExcitation(mid, max(1, mid // 4)))
        layers.append(ConvNormAct(mid, cout, 1, act=None))
        self.block = nn.Sequential(*layers)
        self.use_res_connect = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out + x if self.use_res_connect else out


class MobileNetV3(nn.Module):
    # (kernel, expanded, out, SE, activation, stride), as V3-Small with channels / 4
    CONFIG = [(3, 4, 4, True, nn.ReLU, 2), (3, 18, 6, False, nn.ReLU, 2), (3, 22, 6, False, nn.ReLU, 1),
              (5, 24, 10, True, nn.Hardswish, 2), (5, 60, 10, True, nn.Hardswish, 1),
              (5, 60, 10, True, nn.Hardswish, 1), (5, 30, 12, True, nn.Hardswish, 1),
              (5, 36, 12, True, nn.Hardswish, 1), (5, 72, 24, True, nn.Hardswish, 2),
              (5, 144, 24, True, nn.Hardswish, 1), (5, 144, 24, True, nn.Hardswish, 1)]

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [ConvNormAct(3, 4, 3, 2, act=nn.Hardswish)]
        cin = 4
        for k, mid, cout, se, act, stride in self.CONFIG:
            layers.append(InvertedResidual(cin, k, mid, cout, se, act, stride))
            cin = cout
        layers.append(ConvNormAct(cin, 6 * cin, 1, act=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(6 * cin, 64), nn.Hardswish(), nn.Dropout(0.2),
                                        nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def mobilenet_v3_small() -> tuple:
    return MobileNetV3(), (_image(),), {}, 11


# ---- ConvNeXt-T: features = [stem, stage, downsample, stage, ...] of CNBlocks -----------

class LayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(d, d, 7, padding=3, groups=d), Permute([0, 2, 3, 1]), nn.LayerNorm(d),
                                   nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), Permute([0, 3, 1, 2]))
        self.layer_scale = nn.Parameter(torch.full((d, 1, 1), 1e-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layer_scale * self.block(x)


class ConvNeXt(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (8, 16, 32, 64), depths: tuple[int, ...] = (2, 2, 4, 2),
                 num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0]))]
        for i, (d, depth) in enumerate(zip(dims, depths)):
            layers.append(nn.Sequential(*[CNBlock(d) for _ in range(depth)]))
            if i < len(dims) - 1:
                layers.append(nn.Sequential(LayerNorm2d(d), nn.Conv2d(d, dims[i + 1], 2, 2)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(LayerNorm2d(dims[-1]), nn.Flatten(1), nn.Linear(dims[-1], num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.avgpool(self.features(x)))


def convnext_tiny() -> tuple:
    return ConvNeXt(), (_image(),), {}, 10


BUILDERS: dict[str, Callable[[], tuple[nn.Module, tuple, dict[str, Any], int]]] = {
    "resnet18": resnet18, "vit_b_16": vit_b_16, "swin_t": swin_t, "efficientnet_b0": efficientnet_b0,
    "mobilenet_v3_small": mobilenet_v3_small, "convnext_tiny": convnext_tiny,
}


def build(name: str) -> tuple[nn.Module, tuple, dict[str, Any], int]:
    """The named model (seeded, eval mode) with its inputs and block count."""
    torch.manual_seed(0)
    model, args, kwargs, blocks = BUILDERS[name]()
    return model.eval(), args, kwargs, blocks
