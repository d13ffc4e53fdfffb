"""Stage inputs are described once (split.spec.StageInput, kind an InputKind enum), the same
objects in the Pipe and in its PipelineStages; a stage's routes are its outgoing Edges."""

from __future__ import annotations

import torch

import pippy_split as ps
from pippy_split.split.spec import MODEL_INPUT, Edge, InputKind, StageInput, gather_inputs, sender_of


class _Skip(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h) + h) + y  # h skips to stage 2; y is a model input read by stage 2


def test_one_description_from_pipe_to_stage() -> None:
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    pipe = ps.pipeline(_Skip(), ["b", "c"], (x, y))
    kinds = [[slot.kind for slot in info.inputs] for info in pipe.stages]
    assert all(isinstance(k, InputKind) for ks in kinds for k in ks)
    assert kinds[0] == [InputKind.MODEL]  # stage 0 reads x itself; y goes to stage 2
    forwarded = [slot for slot in pipe.stages[2].inputs if slot.src_stage == MODEL_INPUT]
    assert forwarded and all(slot.kind is InputKind.EDGE and slot.sender_stage == 0 for slot in forwarded)
    for i in range(pipe.num_stages):
        stage = pipe.build_stage(i)
        assert stage.in_slots == list(pipe.stages[i].inputs)
        assert all(isinstance(r, Edge) and r.sender_stage == i for r in stage.routes)
        assert {r for r in stage.routes} == {e for e in pipe.edges if sender_of(e.src_stage) == i}
    torch.testing.assert_close(pipe(x, y), _reference(pipe, x, y))


def _reference(pipe: ps.Pipe, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    flat = pipe.flatten_inputs((x, y), {})
    produced: dict = {(MODEL_INPUT, i): v for i, v in enumerate(flat)}
    outs: tuple = ()
    for info in pipe.stages:
        outs = info.module(*gather_inputs(info.inputs, flat, produced, {}))
        produced.update({(info.index, k): v for k, v in enumerate(outs)})
    return pipe.unflatten_outputs(outs)


def test_an_edge_input_needs_its_edge() -> None:
    try:
        StageInput(0, InputKind.EDGE)
    except ValueError as e:
        assert "needs edge=" in str(e)
    else:
        raise AssertionError("an edge input without an edge was accepted")
