"""Leftovers of issue 12 part 1: the summary judges a split by the cost model it used;
BalanceReport is public."""

from __future__ import annotations

import torch
from torch import nn

import pippy_split as ps
from pippy_split.split.summary import imbalance_warning


class ConvThenLinear(nn.Module):
    """Equal parameters on both sides of the cut, FLOPs 1000x apart."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, padding=1)  # 2320 params, ~4.7M FLOPs on 32x32
        self.head = nn.Linear(16, 136)  # 2312 params, ~4.6K FLOPs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        return self.head(h.mean(dim=(2, 3)))


def test_params_balanced_split_is_not_called_imbalanced_by_flops() -> None:
    x = torch.randn(2, 16, 32, 32)
    pipe = ps.pipeline(ConvThenLinear(), 2, (x,), balance="params")
    flops = [st.flops for st in pipe.stages]
    assert max(flops) > 100 * min(flops)  # the old FLOPs rule would warn
    assert pipe.balance.ratio < 1.15
    assert imbalance_warning(pipe) is None and "warning" not in str(pipe)


def test_user_split_still_warned_by_flops() -> None:
    x = torch.randn(2, 16, 32, 32)
    pipe = ps.pipeline(ConvThenLinear(), ["head"], (x,))
    assert imbalance_warning(pipe).startswith("imbalanced: stage 0 costs") and "(flops)" in imbalance_warning(pipe)


def test_balance_report_exported() -> None:
    assert "BalanceReport" in ps.__all__ and ps.BalanceReport is ps.split.balance.BalanceReport
