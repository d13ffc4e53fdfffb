"""What an edge is called: ``Edge.label`` names the value in the model's terms (the module
call returning it), ``Edge.name`` stays the traced graph's node name (one per value), and
``print(pipe)`` and ``pippy-split inspect --json`` show the label.

Pure tier (no process group).
"""

from __future__ import annotations

import torch
from torch import nn

import pippy_split as ps
from pippy_split import zoo
from pippy_split.cli import pipe_to_json


def _pipe(name: str, split=None) -> ps.Pipe:
    e = zoo.get(name)
    return ps.pipeline(e.model, e.split_spec if split is None else split, e.args, e.kwargs)


def test_a_block_output_is_named_after_its_block_and_keeps_its_graph_name():
    pipe = _pipe("tiny_gpt")  # cut before blocks.1, blocks.2, blocks.3
    assert [e.label for e in pipe.edges] == ["blocks.0", "blocks.1", "blocks.2"]
    nodes = {n.name for n in pipe.graph.nodes}
    for e in pipe.edges:
        assert e.name in nodes and e.name != e.label  # the graph's node name, as before
        assert e.display_name == f"{e.label} ({e.name})"
        assert e.display_name in str(e)


def test_skip_edges_name_the_module_that_produced_them():
    pipe = _pipe("tiny_unet")
    skips = {(e.src_stage, e.dst_stage): e.label for e in pipe.edges if e.is_skip}
    assert skips == {(0, 2): "down1", (0, 3): "stem"}


def test_model_inputs_keep_their_name():
    pipe = _pipe("input_read_late")
    (pos,) = [e for e in pipe.edges if e.from_input]
    assert pos.label == pos.name == pos.display_name == "pos"


def test_a_value_inside_a_module_says_which_module():
    pipe = _pipe("tiny_gpt", split=["blocks.1.mlp"])  # the cut enters blocks.1
    inside = [e.label for e in pipe.edges if e.label.endswith(" in blocks.1")]
    assert len(inside) == 1  # the residual stream inside the block ("add_3 in blocks.1")
    assert {e.label for e in pipe.edges} == {"blocks.1.ln2", inside[0]}  # and the MLP's input: ln2's output


def test_a_module_called_twice_names_the_call():
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(4):
                x = self.block(x)
            return self.head(x)

    pipe = ps.pipeline(Shared(), 2, (torch.randn(2, 4),))
    (edge,) = pipe.edges
    assert edge.label.startswith("block@")  # block@1: its second call


def test_print_and_json_show_the_label():
    pipe = _pipe("fan_out_skip")
    text = str(pipe)
    data = pipe_to_json(pipe)
    for e, row in zip(pipe.edges, data["edges"]):
        assert e.display_name in text
        assert row["label"] == e.label and row["name"] == e.name


def test_hand_built_edges_have_no_label():
    e = ps.Edge(0, 0, 1, 0, ps.TensorSpec((2,), torch.float32, True))
    assert e.label == "" and e.display_name == ""
