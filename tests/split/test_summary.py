"""What ``print(pipe)``, ``rich.print(pipe)`` and ``pipe._repr_html_()`` show.

Pure tier (no process group).
"""

from __future__ import annotations

import io
import re

import pytest
import rich.console
from torch.export import Dim

import pippy_split as ps
from pippy_split import zoo
from pippy_split.split.summary import imbalance_warning


@pytest.fixture(scope="module")
def unet_pipe() -> ps.Pipe:
    e = zoo.get("tiny_unet")
    return ps.pipeline(e.model, e.split_spec, e.args)


@pytest.fixture(scope="module")
def mlp_pipe() -> ps.Pipe:
    e = zoo.get("mlp_stack")
    return ps.pipeline(e.model, e.split_spec, e.args)


def _stage_rows(text: str) -> dict[int, str]:
    """Stage table rows by stage index (first cell is the index)."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"│ (\d+)\s+│", line)
        if m and int(m.group(1)) not in rows:
            rows[int(m.group(1))] = line
    return rows


def test_text_lists_every_stage_with_its_modules(unet_pipe):
    text = str(unet_pipe)
    assert text == repr(unet_pipe)
    assert "Pipe of TinyUNet: 4 stages" in text
    rows = _stage_rows(text)
    assert sorted(rows) == [0, 1, 2, 3]
    for s, first_module in enumerate(["stem", "down2", "up2", "up1"]):
        assert first_module in rows[s]


def test_text_shows_peers_and_marks_skip_edges(unet_pipe):
    rows = _stage_rows(str(unet_pipe))
    # stage 0 sends to 1, and skips to 2 and 3; stage 3 receives a skip from 0
    assert "1, 2*, 3*" in rows[0]
    assert "0*, 2" in rows[3]
    edge_lines = [line for line in str(unet_pipe).splitlines() if "stage 0[" in line]
    assert sum("*" in line for line in edge_lines) == 2  # the two skips out of stage 0
    assert len(edge_lines) == 4


def test_text_lists_every_edge(unet_pipe):
    text = str(unet_pipe)
    for e in unet_pipe.edges:
        assert re.search(rf"stage {e.dst_stage}\[{e.dst_input}\].*{e.name}", text), e


def test_imbalance_warning_when_a_stage_costs_over_one_and_a_half_times_another(unet_pipe, mlp_pipe):
    flops = [st.flops for st in unet_pipe.stages]
    assert max(flops) > 1.5 * min(flops)
    assert "warning: imbalanced" in str(unet_pipe)
    assert imbalance_warning(unet_pipe).startswith(f"imbalanced: stage {flops.index(max(flops))} costs")
    assert imbalance_warning(mlp_pipe) is None
    assert "warning" not in str(mlp_pipe)


def test_shared_parameters_are_shown():
    e = zoo.get("tied_lm")
    text = str(ps.pipeline(e.model, e.split_spec, e.args))
    assert "Shared parameters" in text
    assert "stage 0: tok_emb.weight; stage 1: head.weight" in text


def test_rich_print(unet_pipe):
    console = rich.console.Console(file=io.StringIO(), width=120, color_system=None)
    console.print(unet_pipe)
    assert console.file.getvalue().rstrip() == str(unet_pipe)


def test_html(unet_pipe):
    html = unet_pipe._repr_html_()
    assert html.lstrip().startswith("<pre") and "</html>" not in html  # one cell's fragment, not a page
    assert "TinyUNet" in html and "imbalanced" in html


def test_modules_column_names_only_real_modules():
    """Export's placeholder stack for module-less nodes (sym_size under dynamic shapes)
    must not show up as a module."""
    e = zoo.get("tiny_gpt")
    pipe = ps.pipeline(e.model, e.split_spec, e.args, dynamic_shapes={"idx": {1: Dim("T", min=2, max=64)}})
    real = {name for name, _ in e.model.named_modules()}
    for st in pipe.stages:
        assert set(st.modules) <= real, st.modules
    assert pipe.stages[0].modules[0] == "tok_emb"
    assert "_empty_nn_module_stack" not in str(pipe)
