"""Bad input to ``ps.pipeline`` and to a Pipe: each a clear exception that names the culprit.

Pure tier (no process group).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import pippy_split as ps
from pippy_split import zoo


@pytest.fixture(scope="module")
def mlp() -> zoo.ZooEntry:
    return zoo.get("mlp_stack", n_layer=8)


# ---- split specs -------------------------------------------------------------------------

def test_unknown_fqn_is_named_with_close_suggestions(mlp):
    with pytest.raises(ps.SplitError) as info:
        ps.pipeline(mlp.model, ["layer.3"], mlp.args)
    msg = str(info.value)
    assert "'layer.3'" in msg and "MLPStack" in msg
    assert "did you mean" in msg and "'layers.3'" in msg


def test_unknown_fqn_in_dict_spec(mlp):
    with pytest.raises(ps.SplitError, match=r"'layers\.3\.fcc'.*'layers\.3\.fc'"):
        ps.pipeline(mlp.model, {"layers.3.fcc": ps.SplitPoint.END}, mlp.args)


@pytest.mark.parametrize("spec, stage", [
    (["layers.0"], 0),                                                          # nothing before layers.0
    ({"layers.7": ps.SplitPoint.END}, 1),                                       # nothing after layers.7
    ({"layers.3": ps.SplitPoint.END, "layers.4": ps.SplitPoint.BEGINNING}, 1),  # two cuts at one place
    (["layers.3", "layers.3"], 1),
])
def test_empty_stage_is_named(mlp, spec, stage):
    with pytest.raises(ps.SplitError, match=rf"stage {stage} would be empty"):
        ps.pipeline(mlp.model, spec, mlp.args)


def test_more_stages_than_the_graph_can_give(mlp):
    with pytest.raises(ps.SplitError, match="cannot balance into 100 stages"):
        ps.pipeline(mlp.model, 100, mlp.args)


@pytest.mark.parametrize("n", [0, -2])
def test_int_spec_below_one(mlp, n):
    with pytest.raises(ps.SplitError, match=">= 1"):
        ps.pipeline(mlp.model, n, mlp.args)


@pytest.mark.parametrize("spec", ["layers.3", True, 2.5, {"layers.3": "middle"}, {"layers.3": 1}])
def test_spec_of_the_wrong_kind(mlp, spec):
    with pytest.raises(ps.SplitError):
        ps.pipeline(mlp.model, spec, mlp.args)


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.a(x)))


def test_fqn_never_called_cannot_be_cut_at():
    with pytest.raises(ps.SplitError, match="'never'.*never called"):
        ps.pipeline(Unused(), ["never"], (torch.randn(2, 4),))


def test_uncalled_module_still_lands_in_a_stage():
    model = Unused()
    pipe = ps.pipeline(model, ["c"], (torch.randn(2, 4),))
    assert set().union(*(pipe.get_stage_module(s).state_dict() for s in range(2))) == set(model.state_dict())


# ---- untraceable models ---------------------------------------------------------------------

class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Python control flow on a tensor value
            return self.a(x)
        return self.b(x)


def test_untraceable_model_raises_trace_error_with_reason_and_advice():
    with pytest.raises(ps.TraceError) as info, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ps.pipeline(DataDependent(), ["b"], (torch.randn(2, 4),))
    assert not [w for w in caught if "could not keep" in str(w.message)]  # no warning before the error
    msg = str(info.value)
    assert "DataDependent" in msg
    assert "data-dependent" in msg  # export's own reason is carried
    assert "torch._check" in msg and "strict=True" in msg and "PipelineStage" in msg  # ... and what helps
    assert "pipe_split" not in msg  # the whole model is traced before any cut: markers do not help (issue 39)
    assert info.value.__cause__ is not None


# ---- calling a Pipe with inputs unlike the example ----------------------------------------------

@pytest.fixture(scope="module")
def kw_pipe():
    e = zoo.get("kwargs_buffers")
    return e, ps.pipeline(e.model, e.split_spec, e.args, e.kwargs)


def test_call_with_another_batch_size_is_refused(kw_pipe):
    """The trace baked in the example's shapes; a different batch must not run silently."""
    e, pipe = kw_pipe
    with pytest.raises(ValueError, match=r"input 'x' has shape \(4, 16\).*\(8, 16\).*dynamic_shapes"):
        pipe(e.args[0][:4], **e.kwargs)


def test_call_with_another_dtype_is_refused(kw_pipe):
    e, pipe = kw_pipe
    with pytest.raises(ValueError, match="input 'x'.*float64"):
        pipe(e.args[0].double(), **e.kwargs)


def test_call_with_another_baked_in_value_is_refused(kw_pipe):
    """``scale`` (a float) was specialised by export: another value would be silently ignored."""
    e, pipe = kw_pipe
    with pytest.raises(ValueError, match="input 'scale' is 2.0.*traced with 0.5"):
        pipe(e.args[0], scale=2.0, mask=e.kwargs["mask"])


def test_call_missing_an_input_is_refused(kw_pipe):
    e, pipe = kw_pipe
    with pytest.raises(TypeError, match="missing model input.*'scale'"):
        pipe(e.args[0], mask=e.kwargs["mask"])


def test_call_with_unknown_keyword_is_refused(kw_pipe):
    e, pipe = kw_pipe
    with pytest.raises(TypeError, match="do not fit the model's forward"):
        pipe(e.args[0], scale=0.5, mask=e.kwargs["mask"], bogus=1)


def test_stage_index_out_of_range(kw_pipe):
    _, pipe = kw_pipe
    with pytest.raises(IndexError, match="stage index 3 out of range: this pipe has 3 stages"):
        pipe.get_stage_module(3)


def test_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        ps.pipeline(lambda x: x, None, (torch.randn(2),))
