"""compat.pipeline / Pipe in one process, next to torch.distributed.pipelining's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.pipelining as peer

import pippy_split as ps
from pippy_split import compat

from .bodies import BATCH, D, MLP, WithKwargs


class TwoOutputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.b = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.a(x)
        compat.pipe_split()
        return {"out": self.b(h), "h": h}


class TorchMarked(torch.nn.Module):
    """A model marked with torch's own pipe_split."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(D, D)
        self.b = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        peer.pipe_split()
        return self.b(h)


def _model(cls, seed: int = 0):
    torch.manual_seed(seed)
    return cls()


def test_positional_order_mb_args_mb_kwargs_split_spec():
    model = _model(WithKwargs)
    x, y = torch.randn(2, D), torch.randn(2, D)
    pipe = compat.pipeline(model, (x,), {"y": y}, {"b": compat.SplitPoint.BEGINNING})
    assert pipe.num_stages == 2
    out = pipe(x, y=y)
    assert isinstance(out, tuple) and len(out) == 1
    torch.testing.assert_close(out[0], model(x, y=y))
    theirs = peer.pipeline(_model(WithKwargs), (x,), {"y": y}, {"b": peer.SplitPoint.BEGINNING})
    torch.testing.assert_close(theirs(x, y=y), out)


def test_call_returns_the_peers_flat_tuple():
    x = torch.randn(2, D)
    ours = compat.pipeline(_model(TwoOutputs), (x,))
    theirs = peer.pipeline(_model(TwoOutputs), (x,))
    got, want = ours(x), theirs(x)
    assert isinstance(got, tuple) and len(got) == len(want) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_pipe_is_a_module_with_the_peers_parts():
    model = _model(MLP)
    x = torch.randn(2, D)
    pipe = compat.pipeline(model, (x,), split_spec={"layers.2": compat.SplitPoint.BEGINNING})
    theirs = peer.pipeline(_model(MLP), (x,), split_spec={"layers.2": peer.SplitPoint.BEGINNING})
    assert isinstance(pipe, torch.nn.Module)
    assert [n for n, _ in pipe.split_gm.named_children()] == [n for n, _ in theirs.split_gm.named_children()]
    assert pipe.to("cpu") is pipe
    assert sum(p.numel() for p in pipe.parameters()) == sum(p.numel() for p in model.parameters())
    names = set(model.state_dict())
    for i in range(pipe.num_stages):
        assert set(pipe.get_stage_module(i).state_dict()) <= names
        assert set(pipe.get_stage_module(i).state_dict()) == set(theirs.get_stage_module(i).state_dict())
    info = pipe.info()
    assert (info.num_stages, info.has_loss_and_backward) == (2, False)
    assert isinstance(info.graph, torch.fx.Graph)
    assert isinstance(pipe.core_pipe, ps.Pipe) and "stage" in repr(pipe).lower()


def test_stage_index_out_of_range_is_a_value_error():
    pipe = compat.pipeline(_model(MLP), (torch.randn(2, D),), split_spec={"layers.2": compat.SplitPoint.BEGINNING})
    with pytest.raises(ValueError, match="Invalid stage index 2"):
        pipe.get_stage_module(2)
    with pytest.raises(ValueError, match="Invalid stage index -1"):
        pipe.build_stage(-1, torch.device("cpu"))
    with pytest.raises(ValueError, match="Invalid stage index 5"):
        compat.build_stage(pipe.get_stage_module(0), 5, pipe.info(), torch.device("cpu"))


def test_build_stage_without_a_process_group():
    pipe = compat.pipeline(_model(MLP), (torch.randn(2, D),), split_spec={"layers.2": compat.SplitPoint.BEGINNING})
    for stage in (pipe.build_stage(1, torch.device("cpu")),
                  compat.build_stage(pipe.get_stage_module(1), 1, pipe.info(), torch.device("cpu"))):
        assert isinstance(stage, compat.PipelineStage)
        assert stage.submod is pipe.get_stage_module(1)
        assert (stage.stage_index, stage.num_stages, stage.is_last) == (1, 2, True)
        assert (stage.group_rank, stage.group_size) == (0, 1)


def test_torch_split_point_and_a_bare_tensor_example():
    x = torch.randn(2, D)
    ours = compat.pipeline(_model(MLP), x, split_spec={"layers.1": peer.SplitPoint.BEGINNING,
                                                       "layers.2": peer.SplitPoint.END})
    assert ours.num_stages == 3
    torch.testing.assert_close(ours(x)[0], _model(MLP)(x))


def test_split_policy_is_refused_with_the_alternative():
    with pytest.raises(NotImplementedError, match="split_spec"):
        compat.pipeline(_model(MLP), (torch.randn(2, D),), split_policy=lambda gm: gm)


def test_torch_pipe_split_marks_a_stage():
    x = torch.randn(BATCH, D)
    pipe = compat.pipeline(_model(TorchMarked), (x,))
    assert pipe.num_stages == 2
    torch.testing.assert_close(pipe(x)[0], _model(TorchMarked)(x))


def test_pipe_runs_the_full_batch_when_traced_on_a_microbatch():
    model = _model(MLP)
    x = torch.randn(BATCH, D)
    pipe = compat.pipeline(copy.deepcopy(model), (x[:2],), split_spec={"layers.2": compat.SplitPoint.BEGINNING})
    torch.testing.assert_close(pipe(x)[0], model(x))
