"""Dead ends a new user hit in the first hour (issue 13, part 3): meta-device
models, notebooks, the tutorials and ``pippy-split simulate``."""

from __future__ import annotations

import re

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


# ---- models built on meta ----------------------------------------------------------
class _ConvBN(torch.nn.Module):
    """A resnet-like stem and two blocks: conv, BatchNorm (buffers), ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.block = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.block(self.stem(x)).mean((2, 3)))


def test_a_meta_conv_batchnorm_model_initialises_without_a_state_dict():
    """BatchNorm's reset_parameters() also resets its running stats (buffers): no state_dict needed."""
    with torch.device("meta"):
        model = _ConvBN()
    pipe = ps.pipeline(model.eval(), ["block"], (torch.randn(2, 3, 8, 8, device="meta"),))
    for i in range(pipe.num_stages):
        pipe.build_stage(i, "cpu", seed=3)
    bn = pipe.get_stage_module(0).get_submodule("stem.1")
    assert torch.equal(bn.running_mean, torch.zeros(8)) and torch.equal(bn.running_var, torch.ones(8))
    assert int(bn.num_batches_tracked) == 0
    assert pipe(torch.randn(2, 3, 8, 8)).isfinite().all()


def test_a_buffer_no_initialiser_writes_is_still_refused():
    class Scaled(torch.nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.register_buffer("scale", torch.full((4,), 2.0))  # computed in __init__, not in reset_parameters

        def forward(self, x):
            return super().forward(x) * self.scale

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Scaled(), Scaled()

        def forward(self, x):
            return self.b(self.a(x))

    with torch.device("meta"):
        model = Two()
    pipe = ps.pipeline(model, ["b"], (torch.randn(2, 4, device="meta"),))
    with pytest.raises(ps.SplitError, match=r"cannot initialise \['a.scale'\]"):
        pipe.build_stage(0, "cpu")


@pytest.mark.parametrize("with_state_dict", [True, False])
def test_a_meta_hf_llama_builds_its_stages(with_state_dict):
    """Export lifts the empty tensors of the KV cache as constants, rotary inv_freq is a
    non-persistent buffer, and the graph names device=meta: none of that is the user's job."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    full = transformers.LlamaForCausalLM(cfg).eval()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    x = torch.randint(0, 64, (2, 8))
    pipe = ps.pipeline(model, ["model.layers.1"], (x,))  # use_cache on: lifted constants
    assert pipe._traced.constants
    for i in range(pipe.num_stages):
        pipe.build_stage(i, "cpu", state_dict=full.state_dict() if with_state_dict else None)
    got = pipe(x).logits
    if with_state_dict:
        torch.testing.assert_close(got, full(x).logits)
    else:
        torch.testing.assert_close(pipe.get_stage_module(0).get_buffer("model.rotary_emb.inv_freq"),
                                   full.model.rotary_emb.inv_freq)
        assert got.isfinite().all()


# ---- tutorials as notebooks ----------------------------------------------------------
def test_tutorial_04_runs_as_a_notebook(tmp_path):
    """A notebook's cells run in ``__main__`` with no file behind it, from the notebook's
    folder: a rank body defined in a cell cannot be unpickled by a fresh rank process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    jupytext = pytest.importorskip("jupytext")
    tutorials = Path(__file__).resolve().parent.parent / "tutorials"
    nb = jupytext.read(tutorials / "04_training_with_torchrun.py")
    code = "\n\n".join(c.source for c in nb.cells if c.cell_type == "code")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tutorials), os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    # python -c: __main__ has no file, as in a kernel; the notebook's folder is on the path.
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=110)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "losses:" in r.stdout


def test_tutorial_03_says_what_a_notebook_shows():
    """It said "evaluate `zbv`" on a line that prints; the simulation is displayed (SVG in a notebook)."""
    from pathlib import Path

    from pippy_split.schedule import get_schedule_class, simulate

    text = (Path(__file__).resolve().parent.parent / "tutorials" / "03_schedules_and_placement.py").read_text()
    assert "just evaluate `zbv`" not in text and "display(zbv)" in text
    assert "<svg" in simulate(get_schedule_class("ZBVZeroBubble").compute_order(2, 4))._repr_html_()


# ---- pippy-split simulate --compare --------------------------------------------------
def _simulate_at_80(*argv: str) -> str:
    import io

    from rich.console import Console

    from pippy_split.cli import build_parser
    from pippy_split.commands.simulate import simulate_cmd

    console = Console(file=io.StringIO(), width=80, color_system=None)
    assert simulate_cmd(build_parser().parse_args(["simulate", *argv]), console) == 0
    return console.file.getvalue()


def _table_rows(out: str) -> dict[str, list[str]]:
    from pippy_split.schedule.orders import ORDERS

    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] in ORDERS:
            rows[cells[0]] = cells
    return rows


def test_simulate_compare_agrees_with_tutorial_03():
    """Same stage counts as tutorial 03 (LoopedBFS/InterleavedZeroBubble on 2 per rank),
    every name whole at 80 columns, and the run on top is its own row."""
    from pippy_split.schedule import get_schedule_class, simulate

    out = _simulate_at_80("--ranks", "4", "--microbatches", "8", "--compare")
    rows = _table_rows(out)
    assert len(rows) == 7, out
    for name, cells in rows.items():  # tutorial 03's comparison
        spr = 1 if name in ("GPipe", "1F1B") else 2
        sim = simulate(get_schedule_class(name).compute_order(4, 8, spr), costs={k: 1 / spr for k in "FIW"})
        assert cells[2] == str(spr) and float(cells[4]) == sim.makespan, (name, cells)
    top = re.search(r"makespan ([\d.]+)   bubble", out).group(1)
    assert top == rows["ZBVZeroBubble"][4]
    assert "…" not in out and all(len(line) <= 80 for line in out.splitlines())


def test_simulate_timeline_labels_stage_and_microbatch_at_80_columns(tmp_path):
    svg = tmp_path / "t.svg"
    out = _simulate_at_80("--schedule", "1F1B", "--ranks", "4", "--microbatches", "8", "--svg", str(svg))
    assert "0F0" in out and "3B7" in out
    assert ">1F1B: 4 ranks, 8 microbatches: 4 ranks, makespan" in svg.read_text()
    assert '<g class="axis">' in svg.read_text()
