"""Where parameters and buffers go: aliased modules, a module called from two stages,
a buffer read by two stages, lifted constants.

Pure tier (no process group). The rule: a tensor goes to every stage that uses it,
under the names the model uses there; one Parameter held by several stages is listed
in ``pipe.shared_parameters`` (its gradients must be summed); buffers never are.
"""

from __future__ import annotations

import torch
from torch import nn

import pippy_split as ps
from tests.split.helpers import assert_same_grads, assert_same_outputs, assert_state_dict_partition, stage_keys


class AliasedModule(nn.Module):
    """``alias`` is ``mid`` under a second name (both in the state dict); only ``mid`` is called."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.mid = nn.Linear(4, 4)
        self.alias = self.mid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mid(torch.tanh(self.pre(x)))


def test_alias_of_a_module_stays_with_the_module():
    """Export gives ``alias.*`` its own (unused) graph input; it must still land in
    ``mid``'s stage, not be parked in stage 0 as an unlisted second holder."""
    torch.manual_seed(0)
    model, x = AliasedModule(), torch.randn(3, 4)
    pipe = ps.pipeline(model, ["mid"], (x,))
    assert [sorted(k) for k in stage_keys(pipe)] == [
        ["pre.bias", "pre.weight"], ["alias.bias", "alias.weight", "mid.bias", "mid.weight"]]
    assert pipe.shared_parameters == {}
    assert_state_dict_partition(pipe, model)
    assert_same_outputs(pipe(x), model(x))


class ReusedLayer(nn.Module):
    """``shared`` runs at the start (stage 0) and at the end (stage 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.mid = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        return self.shared(torch.tanh(self.mid(h)))


def test_module_called_from_two_stages_is_shared():
    torch.manual_seed(0)
    model, x = ReusedLayer(), torch.randn(3, 4)
    pipe = ps.pipeline(model, ["mid"], (x,))
    assert pipe.shared_parameters == {
        "shared.weight": [(0, ["shared.weight"]), (1, ["shared.weight"])],
        "shared.bias": [(0, ["shared.bias"]), (1, ["shared.bias"])],
    }
    assert pipe.get_stage_module(0).shared.weight is pipe.get_stage_module(1).shared.weight is model.shared.weight
    assert_same_outputs(pipe(x), model(x))
    assert_same_grads(pipe, model, (x,), {})  # in one process the two uses accumulate into one .grad


class SharedBuffer(nn.Module):
    """A persistent buffer read by both stages."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x * self.scale))
        return self.b(h) * self.scale  # after b: in stage 1


def test_buffer_used_by_two_stages_is_in_both_but_not_a_shared_parameter():
    """shared_parameters is for gradient summing; a buffer has no gradient (and the
    runtime looks each entry up with ``get_parameter``)."""
    torch.manual_seed(0)
    model, x = SharedBuffer(), torch.randn(3, 4)
    pipe = ps.pipeline(model, ["b"], (x,))
    assert pipe.shared_parameters == {}
    assert all("scale" in keys for keys in stage_keys(pipe))
    assert_same_outputs(pipe(x), model(x))


class WithConstant(nn.Module):
    """A plain tensor attribute (neither parameter nor buffer): export lifts it as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.offset = torch.tensor([0.25])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) + self.offset)


def test_lifted_constant_stays_out_of_the_state_dict():
    torch.manual_seed(0)
    model, x = WithConstant(), torch.randn(3, 4)
    pipe = ps.pipeline(model, ["b"], (x,))
    assert_state_dict_partition(pipe, model)
    assert_same_outputs(pipe(x), model(x))
    assert_same_grads(pipe, model, (x,), {})


class FrozenFirst(nn.Module):
    """The first layer is frozen, so stage 0's output needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4).requires_grad_(False)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_frozen_parameters_give_edges_without_grad():
    torch.manual_seed(0)
    model, x = FrozenFirst(), torch.randn(3, 4)
    pipe = ps.pipeline(model, ["b"], (x,))
    assert [e.spec.carries_grad for e in pipe.edges] == [False]
    x_grad = x.clone().requires_grad_(True)  # ... unless the input needs grad
    pipe = ps.pipeline(model, ["b"], (x_grad,))
    assert [e.spec.carries_grad for e in pipe.edges] == [True]
    assert_same_grads(pipe, model, (x_grad,), {})


def test_tied_weight_in_one_stage_keeps_both_names():
    """Embedding and head in the same stage: the stage holds the one Parameter under
    both FQNs (as the model does), and nothing is shared across stages."""
    from pippy_split import zoo

    e = zoo.get("tied_lm")
    pipe = ps.pipeline(e.model, 1, e.args)
    module = pipe.get_stage_module(0)
    assert set(module.state_dict()) == set(e.model.state_dict())
    params = dict(module.named_parameters(remove_duplicate=False))
    assert params["head.weight"] is params["tok_emb.weight"] is e.model.tok_emb.weight
    assert pipe.shared_parameters == {}
    assert_same_outputs(pipe(*e.args), e.model(*e.args))
