"""Dead ends a new user hit in the first hour (issue 13, part 3): meta-device
models, notebooks, the tutorials and ``pippy-split simulate``."""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _pipe():
    return ps.pipeline(_MLP(), ["layers.1"], (torch.randn(2, 8),))


# ---- notebooks -----------------------------------------------------------------------
def test_a_notebook_shows_the_pipe_once(monkeypatch):
    """In a notebook, IPython asks for text/plain and text/html and shows the HTML one.
    Neither may display anything itself (rich's Jupyter detection did: two extra
    copies), and the HTML is a fragment for one cell, not a whole page."""
    import rich.console
    import rich.jupyter

    shown = []
    monkeypatch.setattr(rich.console, "_is_jupyter", lambda: True)
    monkeypatch.setattr(rich.jupyter, "display", lambda *a, **k: shown.append(a))
    pipe = _pipe()
    text, html = repr(pipe), pipe._repr_html_()
    assert shown == [], "a repr displayed the table by itself"
    assert "Pipe of _MLP: 2 stages" in text
    assert html.count("Pipe of _MLP: 2 stages") == 1
    low = html.lower()
    assert "<!doctype" not in low and "<html" not in low and "<body" not in low and "<head" not in low
    assert low.lstrip().startswith("<pre")
