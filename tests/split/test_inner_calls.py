"""Where a block cannot be called whole, the modules inside it still are (issue 41).

A block whose gate output leaves it through a hook (as Hugging Face's output recorder takes
an MoE router's logits for the aux loss, Qwen2-MoE) cannot be swapped for a call of the
user's block: a value leaves it other than through its outputs. Its attention, gate and norm
are called instead, each the user's object. A norm that casts a float32 input to float32 (a
no-op: eager returns the input itself, which the block then reads as its residual) is called
too. Before: the whole block ran as traced ops. Pure tier.
"""

from __future__ import annotations

import torch
from torch import nn

import pippy_split as ps
from tests.split.helpers import assert_same_grads, assert_same_outputs

D = 8


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)  # HF's RMSNorm: a no-op in float32
        return self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attn, self.gate = Norm(), nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        h = self.attn(self.norm(x))
        return residual + h * torch.sigmoid(self.gate(h)).mean(-1, keepdim=True)


class Recorded(nn.Module):
    """Four blocks; every gate's output is recorded by a hook and feeds an aux loss."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(D, 1)
        self.recorded: list[torch.Tensor] = []
        for b in self.blocks:
            b.gate.register_forward_hook(lambda m, a, out: self.recorded.append(out))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.recorded.clear()
        for b in self.blocks:
            x = b(x)
        return self.head(x).squeeze(-1), torch.stack(self.recorded).pow(2).mean()


def test_a_block_with_a_side_channel_has_its_inner_modules_called():
    torch.manual_seed(0)
    model, x = Recorded(), torch.randn(2, 3, D)
    pipe = ps.pipeline(model, ["blocks.2"], (x,))
    first = pipe.get_stage_module(0)
    calls = {str(n.target) for n in first.graph.nodes if n.op == "call_module"}
    assert "blocks.0" not in calls  # its gate's output leaves it through the hook
    assert {"blocks.0.norm", "blocks.0.attn", "blocks.0.gate", "blocks.1.norm"} <= calls, sorted(calls)
    assert first.get_submodule("blocks.0.attn") is model.blocks[0].attn
    with torch.no_grad():
        assert_same_outputs(pipe(x), model(x))
    assert_same_grads(pipe, model, (x,), {})
    model.recorded.clear()
