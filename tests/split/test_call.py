"""Calling a Pipe: the forms of ``forward`` signatures it accepts, and inputs it refuses.

Pure tier (no process group). A Pipe takes the model's own call (positional or by
keyword, ``*args``, ``**kwargs``); inputs the example did not pass were baked in by
export as their defaults, so passing them later is refused instead of ignored.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pippy_split as ps
from tests.split.helpers import assert_same_grads, assert_same_outputs


class VarArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(xs[0] + 2 * xs[1])))


class VarKwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * kwargs["gate"])


class OptionalMask(nn.Module):
    """Like an HF model: ``mask`` is optional and the example leaves it out."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h if mask is None else h * mask)


@pytest.fixture
def xy():
    torch.manual_seed(0)
    return torch.randn(2, 4), torch.randn(2, 4)


def test_var_positional_forward(xy):
    x, y = xy
    model = VarArgs()
    pipe = ps.pipeline(model, ["b"], (x, y))
    assert_same_outputs(pipe(x, y), model(x, y))
    assert_same_grads(pipe, model, (x, y), {})
    with pytest.raises(TypeError, match=r"\*xs \(3 values, traced with 2\)"):
        pipe(x, y, y)


def test_var_keyword_forward(xy):
    x, y = xy
    model = VarKwargs()
    pipe = ps.pipeline(model, ["b"], (x,), {"gate": y})
    assert_same_outputs(pipe(x, gate=y), model(x, gate=y))
    assert_same_outputs(pipe(gate=y, x=x), model(x, gate=y))
    with pytest.raises(TypeError, match="missing model input.*'gate'"):
        pipe(x)
    with pytest.raises(TypeError, match="'other'"):
        pipe(x, gate=y, other=y)


def test_keyword_example_accepts_positional_call(xy):
    x, _ = xy
    model = OptionalMask()
    pipe = ps.pipeline(model, ["b"], (), {"x": x})
    assert_same_outputs(pipe(x), model(x))


def test_input_left_out_of_the_example_is_refused(xy):
    """The mask was not traced: the graph has no use of it, so it must not be dropped silently."""
    x, y = xy
    model = OptionalMask()
    pipe = ps.pipeline(model, ["b"], (x,))
    assert_same_outputs(pipe(x), model(x))
    with pytest.raises(TypeError, match=r"\['mask'\].*baked in as their defaults"):
        pipe(x, mask=y)
    with pytest.raises(TypeError, match=r"\['mask'\]"):
        pipe(x, y)
