"""Shared checks for the split-layer tests (pure tier: no process group).

Every helper compares a Pipe against the unsplit model it came from: outputs leaf by
leaf, the stages' state-dict keys, gradients, and what actually flows along each edge.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

import pippy_split as ps

ATOL = 1e-5


def assert_same_outputs(got: Any, want: Any, atol: float = ATOL) -> None:
    """Same structure, and every tensor leaf close (fp32, atol); other leaves equal."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec, f"output structure differs:\n  pipe  {got_spec}\n  model {want_spec}"
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w, atol=atol, rtol=1e-5, msg=lambda m, i=i: f"output leaf {i}: {m}")
        else:
            assert g == w, f"output leaf {i}: {g!r} != {w!r}"


def stage_keys(pipe: ps.Pipe) -> list[set[str]]:
    return [set(pipe.get_stage_module(s).state_dict()) for s in range(pipe.num_stages)]


def assert_state_dict_partition(pipe: ps.Pipe, model: nn.Module) -> None:
    """Each stage's keys are model keys, and together they are all of them."""
    model_keys = set(model.state_dict())
    keys = stage_keys(pipe)
    for s, k in enumerate(keys):
        assert k <= model_keys, f"stage {s} has keys the model lacks: {sorted(k - model_keys)}"
    union = set().union(*keys)
    assert union == model_keys, f"missing from every stage: {sorted(model_keys - union)}"


def grads_of(model: nn.Module, fn: Callable[[], Any]) -> dict[str, torch.Tensor | None]:
    """Gradients of the sum of every differentiable output leaf of ``fn()``, by FQN."""
    model.zero_grad(set_to_none=True)
    out = fn()
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    assert leaves, "no output leaf needs grad"
    torch.stack([t.float().sum() for t in leaves]).sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def assert_same_grads(pipe: ps.Pipe, model: nn.Module, args: tuple, kwargs: dict) -> None:
    """The stages hold the model's own Parameters, so ``.grad`` can be compared directly."""
    want = grads_of(model, lambda: model(*args, **kwargs))
    got = grads_of(model, lambda: pipe(*args, **kwargs))
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, f"{name}: pipe gives a gradient where the model gives none"
            continue
        assert got[name] is not None, f"{name}: no gradient through the pipe"
        torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def run_recording_edges(pipe: ps.Pipe, args: tuple, kwargs: dict) -> dict[ps.Edge, Any]:
    """Run the pipe stage by stage (as ``Pipe.__call__`` does) and return the value sent on each edge."""
    flat = pipe.flatten_inputs(args, kwargs)
    bindings = pipe.bind_symbols(flat)
    values: dict[tuple[int, int], Any] = {}
    sent: dict[ps.Edge, Any] = {}
    for stage in pipe.stages:
        inputs = pipe.stage_inputs(stage.index, flat, values, bindings)
        for src, value in zip(stage.inputs, inputs):
            if src.edge is not None:
                sent[src.edge] = value
        for i, v in enumerate(stage.module(*inputs)):
            values[(stage.index, i)] = v
    return sent


def assert_edges_describe_values(pipe: ps.Pipe, args: tuple, kwargs: dict) -> None:
    """Every edge's spec (shape, dtype, needs-grad) is what really crosses it, and the
    stage inputs refer to their edges consistently."""
    assert {e for st in pipe.stages for e in (src.edge for src in st.inputs) if e is not None} == set(pipe.edges)
    for e in pipe.edges:
        src = pipe.stages[e.dst_stage].inputs[e.dst_input]
        assert src.edge == e, f"stage {e.dst_stage} input {e.dst_input} is {src}, not {e}"
        assert e.dst_stage > e.src_stage, e
        if not e.from_input:
            assert pipe.stages[e.src_stage].output_names[e.src_output] == e.name, e
    sent = run_recording_edges(pipe, args, kwargs)
    bindings = pipe.bind_symbols(pipe.flatten_inputs(args, kwargs))
    for e, value in sent.items():
        assert isinstance(value, torch.Tensor), f"{e}: a non-tensor crosses a stage: {value!r}"
        assert tuple(value.shape) == e.spec.concrete_shape(bindings), f"{e}: real shape {tuple(value.shape)}"
        assert value.dtype == e.spec.dtype, f"{e}: real dtype {value.dtype}"
        assert value.requires_grad == e.spec.carries_grad, f"{e}: real requires_grad {value.requires_grad}"
