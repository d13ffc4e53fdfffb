"""The split_spec forms: dict with BEGINNING/END, list, int N (balanced), None (pipe_split() marks),
plus dynamic shapes and the mb_args/mb_kwargs aliases.

Pure tier (no process group).
"""

from __future__ import annotations

import pytest
import sympy
import torch
from torch import nn
from torch.export import Dim

import pippy_split as ps
from pippy_split import zoo
from tests.split.helpers import (assert_edges_describe_values, assert_same_grads, assert_same_outputs,
                                 assert_state_dict_partition, stage_keys)


@pytest.fixture(scope="module")
def mlp8() -> zoo.ZooEntry:
    return zoo.get("mlp_stack", n_layer=8)


def _layers_per_stage(pipe: ps.Pipe) -> list[list[int]]:
    return [sorted({int(k.split(".")[1]) for k in keys}) for keys in stage_keys(pipe)]


# ---- dict and list -------------------------------------------------------------------

def test_dict_spec_beginning_and_end(mlp8):
    spec = {"layers.1": ps.SplitPoint.END, "layers.4": ps.SplitPoint.BEGINNING, "layers.5": ps.SplitPoint.END}
    pipe = ps.pipeline(mlp8.model, spec, mlp8.args)
    assert _layers_per_stage(pipe) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert_same_outputs(pipe(*mlp8.args), mlp8.model(*mlp8.args))
    assert_state_dict_partition(pipe, mlp8.model)


def test_dict_spec_accepts_point_names(mlp8):
    pipe = ps.pipeline(mlp8.model, {"layers.2": "end", "layers.6": "BEGINNING"}, mlp8.args)
    assert _layers_per_stage(pipe) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_list_spec_splits_at_the_beginning(mlp8):
    pipe = ps.pipeline(mlp8.model, ["layers.3", "layers.5"], mlp8.args)
    assert _layers_per_stage(pipe) == [[0, 1, 2], [3, 4], [5, 6, 7]]
    as_dict = ps.pipeline(mlp8.model, {"layers.5": ps.SplitPoint.BEGINNING, "layers.3": ps.SplitPoint.BEGINNING},
                          mlp8.args)
    assert _layers_per_stage(as_dict) == _layers_per_stage(pipe)  # order of the spec does not matter


def test_split_at_a_nested_module(mlp8):
    # The cut falls inside layers.3, after its fc: layers.3's input and fc's output cross.
    pipe = ps.pipeline(mlp8.model, {"layers.3.fc": ps.SplitPoint.END}, mlp8.args)
    assert _layers_per_stage(pipe) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [(e.src_stage, e.dst_stage) for e in pipe.edges] == [(0, 1), (0, 1)]
    assert_same_outputs(pipe(*mlp8.args), mlp8.model(*mlp8.args))
    assert_same_grads(pipe, mlp8.model, mlp8.args, {})


# ---- int N: balance by cost -------------------------------------------------------------

@pytest.mark.parametrize("name", ["mlp_stack", "tiny_gpt"])
def test_int_balances_eight_blocks_into_four(name):
    e = zoo.get(name, n_layer=8)
    pipe = ps.pipeline(e.model, 4, e.args, e.kwargs)
    assert pipe.num_stages == 4
    flops = [st.flops for st in pipe.stages]
    assert all(f > 0 for f in flops) and all(st.modules for st in pipe.stages), flops
    assert max(flops) <= 2 * min(flops), f"stage FLOPs {flops} differ by more than 2x"
    assert_same_outputs(pipe(*e.args, **e.kwargs), e.model(*e.args, **e.kwargs))
    assert_state_dict_partition(pipe, e.model)


def test_int_one_is_one_stage(mlp8):
    pipe = ps.pipeline(mlp8.model, 1, mlp8.args)
    assert pipe.num_stages == 1 and pipe.edges == []
    assert_same_outputs(pipe(*mlp8.args), mlp8.model(*mlp8.args))


def test_int_as_many_stages_as_layers(mlp8):
    pipe = ps.pipeline(mlp8.model, 8, mlp8.args)
    assert _layers_per_stage(pipe) == [[i] for i in range(8)]


# ---- None: pipe_split() marks ------------------------------------------------------------

class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        ps.pipe_split()  # inside a nested submodule
        return self.b(x)


class Marked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = Inner()
        self.post = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.pre(x))
        ps.pipe_split()
        x = self.inner(x)
        ps.pipe_split()
        return self.post(x)


def test_pipe_split_is_a_no_op_eagerly():
    torch.manual_seed(0)
    model, x = Marked(), torch.randn(3, 4)
    assert ps.pipe_split() is None
    want = model.post(model.inner.b(torch.tanh(model.inner.a(torch.tanh(model.pre(x))))))
    torch.testing.assert_close(model(x), want)


@pytest.mark.parametrize("strict", [False, True])
def test_pipe_split_marks_with_spec_none(strict):
    torch.manual_seed(0)
    model, x = Marked(), torch.randn(3, 4)
    pipe = ps.pipeline(model, None, (x,), strict=strict)
    assert pipe.num_stages == 4
    assert [sorted(k) for k in stage_keys(pipe)] == [
        ["pre.bias", "pre.weight"], ["inner.a.bias", "inner.a.weight"], ["inner.b.bias", "inner.b.weight"],
        ["post.bias", "post.weight"]]
    assert_same_outputs(pipe(x), model(x))
    assert_same_grads(pipe, model, (x,), {})


def test_spec_none_without_marks_is_one_stage(mlp8):
    pipe = ps.pipeline(mlp8.model, None, mlp8.args)
    assert pipe.num_stages == 1
    assert_same_outputs(pipe(*mlp8.args), mlp8.model(*mlp8.args))


# ---- dynamic shapes ------------------------------------------------------------------

@pytest.fixture(scope="module")
def dynamic_gpt():
    e = zoo.get("tiny_gpt")
    pipe = ps.pipeline(e.model, e.split_spec, e.args, dynamic_shapes={"idx": {1: Dim("T", min=2, max=64)}})
    return e, pipe


def test_dynamic_seq_dim_gives_symbolic_edge_shapes(dynamic_gpt):
    _, pipe = dynamic_gpt
    assert len(pipe.symbols) == 1
    sym = pipe.symbols[0]
    assert (sym.input_index, sym.dim) == (0, 1)
    for e in pipe.edges:
        assert e.spec.is_dynamic
        batch, seq, width = e.spec.shape
        assert (batch, width) == (8, 32)
        assert isinstance(seq, sympy.Expr) and seq.free_symbols == {sym.symbol}
        assert e.spec.concrete_shape({sym.symbol: 17}) == (8, 17, 32)


@pytest.mark.parametrize("seq", [5, 32])
def test_dynamic_pipe_runs_other_lengths(dynamic_gpt, seq):
    e, pipe = dynamic_gpt
    idx = e.args[0][:, :seq]
    assert_same_outputs(pipe(idx), e.model(idx))
    assert_edges_describe_values(pipe, (idx,), {})


def test_dynamic_batch_and_seq_reach_later_stages():
    """Later stages of the Llama need B and T (for views) without the tokens: they get them as symbols."""
    e = zoo.get("tiny_llama")
    B, T = Dim("B", min=1, max=64), Dim("T", min=2, max=64)
    pipe = ps.pipeline(e.model, e.split_spec, e.args,
                       dynamic_shapes={"tokens": {0: B, 1: T}, "positions": {0: B, 1: T}})
    assert len(pipe.symbols) == 2
    for b, t in ((2, 5), (8, 32)):
        args = (e.args[0][:b, :t], e.args[1][:b, :t])
        assert_same_outputs(pipe(*args), e.model(*args))
        assert_edges_describe_values(pipe, args, {})


# ---- aliases of the torch.distributed.pipelining keywords ---------------------------------

def test_mb_args_and_mb_kwargs_aliases():
    e = zoo.get("kwargs_buffers")
    pipe = ps.pipeline(e.model, e.split_spec, mb_args=e.args, mb_kwargs=e.kwargs)
    assert pipe.num_stages == e.num_stages
    assert_same_outputs(pipe(*e.args, **e.kwargs), e.model(*e.args, **e.kwargs))
    with pytest.raises(TypeError, match="mb_args"):
        ps.pipeline(e.model, e.split_spec, e.args, mb_args=e.args)


def test_single_tensor_example_need_not_be_a_tuple(mlp8):
    pipe = ps.pipeline(mlp8.model, ["layers.4"], mlp8.args[0])
    assert_same_outputs(pipe(*mlp8.args), mlp8.model(*mlp8.args))


# ---- split points inside a torch.no_grad() region ------------------------------------------

class NoGradRegion(nn.Module):
    """``b`` runs under no_grad, which export wraps in one higher-order op with no module stack."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            g = self.b(h)
        return self.c(h) * g


def test_split_at_a_module_inside_no_grad_region():
    torch.manual_seed(0)
    model, x = NoGradRegion(), torch.randn(3, 4)
    pipe = ps.pipeline(model, ["b", "c"], (x,))
    assert [sorted(k) for k in stage_keys(pipe)] == [
        ["a.bias", "a.weight"], ["b.bias", "b.weight"], ["c.bias", "c.weight"]]
    assert pipe.stages[1].modules == ["b"]
    edges = sorted((e.src_stage, e.dst_stage, e.spec.carries_grad) for e in pipe.edges)
    assert edges == [(0, 1, True), (0, 2, True), (1, 2, False)]  # g, made under no_grad, has no gradient
    assert_same_outputs(pipe(x), model(x))
    assert_same_grads(pipe, model, (x,), {})
    assert_edges_describe_values(pipe, (x,), {})


def test_split_spec_checked_before_tracing_names_the_argument_order():
    import pippy_split as ps
    from pippy_split.split.errors import SplitError

    class Boom(torch.nn.Module):
        def forward(self, x):
            raise AssertionError("traced although the split spec was bad")

    x = torch.ones(2, 3)
    with pytest.raises(SplitError, match=r"entry 0 is a Tensor.*pipeline\(model, split_spec, example_args\)"):
        ps.pipeline(Boom(), (x,), {})  # torch.distributed.pipelining's positional order


def test_torch_split_point_enum_is_accepted():
    import pippy_split as ps
    from torch.distributed.pipelining import SplitPoint as TorchSplitPoint

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    ours = ps.pipeline(model, {"2": ps.SplitPoint.BEGINNING}, (x,))
    theirs = ps.pipeline(model, {"2": TorchSplitPoint.BEGINNING}, (x,))
    assert ours.num_stages == theirs.num_stages == 2
    torch.testing.assert_close(theirs(x), model(x))
