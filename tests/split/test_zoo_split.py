"""Every zoo model through ``ps.pipeline``: stages, outputs, state dicts, gradients, edges.

Pure tier (no process group). One Pipe per zoo entry, shared by the module (export
costs ~0.3-1.5 s a model). Hand-written edge lists pin down the interesting models:
fan-out skips sent straight from the producer, complex and integer values without
gradients, inputs read late, kwargs, argument order, and a tied weight.
"""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps
from pippy_split import zoo
from tests.split.helpers import (assert_edges_describe_values, assert_same_grads, assert_same_outputs,
                                 assert_state_dict_partition, stage_keys)

NAMES = sorted(zoo.ZOO)
F32, I64, C64, BOOL = torch.float32, torch.int64, torch.complex64, torch.bool


@pytest.fixture(scope="module")
def built() -> dict[str, tuple[zoo.ZooEntry, ps.Pipe]]:
    """Lazily built (entry, pipe) per zoo name, shared by every test of this module."""
    cache: dict[str, tuple[zoo.ZooEntry, ps.Pipe]] = {}

    class Lazy(dict):
        def __missing__(self, name: str):
            e = zoo.get(name)
            cache[name] = (e, ps.pipeline(e.model, e.split_spec, e.args, e.kwargs))
            return cache[name]

    return Lazy()


def _edges(pipe: ps.Pipe) -> list[tuple]:
    """Edges as (src, src_out, dst, dst_in, shape, dtype, carries_grad), in pipe order."""
    return [(e.src_stage, e.src_output, e.dst_stage, e.dst_input, e.spec.shape, e.spec.dtype, e.spec.carries_grad)
            for e in pipe.edges]


# ---- every zoo entry ------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_stage_count(built, name):
    e, pipe = built[name]
    assert pipe.num_stages == e.num_stages


@pytest.mark.parametrize("name", NAMES)
def test_outputs_match_model(built, name):
    e, pipe = built[name]
    assert_same_outputs(pipe(*e.args, **e.kwargs), e.model(*e.args, **e.kwargs))


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_keys_are_the_models(built, name):
    e, pipe = built[name]
    assert_state_dict_partition(pipe, e.model)


@pytest.mark.parametrize("name", NAMES)
def test_stage_parameters_are_the_models_own(built, name):
    e, pipe = built[name]
    model_params = dict(e.model.named_parameters(remove_duplicate=False))
    for s in range(pipe.num_stages):
        for fqn, p in pipe.get_stage_module(s).named_parameters(remove_duplicate=False):
            assert p is model_params[fqn], f"stage {s}: {fqn} is a copy, not the model's Parameter"


@pytest.mark.parametrize("name", NAMES)
def test_gradients_match_model(built, name):
    e, pipe = built[name]
    assert_same_grads(pipe, e.model, e.args, e.kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_edge_specs_describe_what_crosses(built, name):
    e, pipe = built[name]
    assert_edges_describe_values(pipe, e.args, e.kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_values_are_never_relayed(built, name):
    """A value read by several stages leaves its producer once per reader."""
    _, pipe = built[name]
    producer: dict[str, int] = {}
    for e in pipe.edges:
        assert producer.setdefault(e.name, e.src_stage) == e.src_stage, f"{e.name} sent by two stages"
    pairs = [(e.name, e.dst_stage) for e in pipe.edges]
    assert len(pairs) == len(set(pairs)), "a stage receives one value twice"


# ---- hand-written edge lists --------------------------------------------------------

def test_fan_out_skip_edges(built):
    _, pipe = built["fan_out_skip"]
    a = ((8, 32), F32, True)
    assert sorted(_edges(pipe)) == sorted([
        (0, 0, 1, 0, *a),  # stem -> mid
        (1, 0, 2, 0, *a),  # mid -> tail
        (0, 0, 2, 1, *a),  # stem -> tail, straight from stage 0, not through stage 1
    ])
    skip = [e for e in pipe.edges if e.is_skip]
    assert len(skip) == 1 and (skip[0].src_stage, skip[0].dst_stage) == (0, 2)


def test_unet_edges(built):
    _, pipe = built["tiny_unet"]
    s0, s1, m, u2 = ((8, 8, 16, 16),), ((8, 16, 8, 8),), ((8, 32, 4, 4),), ((8, 16, 8, 8),)
    got = sorted((e.src_stage, e.dst_stage, e.spec.shape, e.spec.carries_grad) for e in pipe.edges)
    assert got == sorted([
        (0, 1, *s1, True), (0, 1, *s0, True),  # down2 reads s1, mid reads s0
        (1, 2, *m, True), (0, 2, *s1, True),   # up2 reads m and the skip s1
        (2, 3, *u2, True), (0, 3, *s0, True),  # up1 reads u2 and the skip s0
    ])
    # s0 and s1 each leave stage 0 from one output slot, whoever reads them
    by_name: dict[str, set[int]] = {}
    for e in pipe.edges:
        if e.src_stage == 0:
            by_name.setdefault(e.name, set()).add(e.src_output)
    assert all(len(v) == 1 for v in by_name.values()) and len(by_name) == 2


def test_llama_complex_and_integer_edges(built):
    """freqs (complex64, from a buffer: no grad) and positions (int64 model input) go
    straight to every layer stage; only the hidden state carries a gradient."""
    _, pipe = built["tiny_llama"]
    got = sorted((e.src_stage, e.dst_stage, e.spec.shape, e.spec.dtype, e.spec.carries_grad) for e in pipe.edges)
    want = []
    for s in (1, 2, 3):
        want += [
            (ps.MODEL_INPUT, s, (8, 32), I64, False),  # positions
            (0, s, (8, 32, 4), C64, False),            # freqs_cis[positions]
            (s - 1, s, (8, 32, 32), F32, True),        # hidden state
        ]
    assert got == sorted(want)
    freqs = [e for e in pipe.edges if e.spec.dtype == C64]
    assert all(e.spec.is_complex and not e.spec.requires_grad for e in freqs)
    assert len({e.src_output for e in freqs}) == 1  # one output of stage 0, sent three times
    positions = [e for e in pipe.edges if e.from_input]
    assert all(e.src_output == pipe.input_names.index("positions") and e.sender_stage == 0 for e in positions)


def test_input_read_late_goes_straight_to_its_reader(built):
    _, pipe = built["input_read_late"]
    assert sorted(_edges(pipe)) == sorted([
        (ps.MODEL_INPUT, 1, 1, 0, (8, 12), I64, False),  # pos: model input 1 -> stage 1
        (0, 0, 1, 1, (8, 12, 16), F32, True),
        (1, 0, 2, 0, (8, 12, 16), F32, True),
    ])
    stage0 = pipe.stages[0]
    assert [src.name for src in stage0.inputs] == ["x"]  # stage 0 does not receive pos


def test_mlp_stack_is_a_plain_chain(built):
    _, pipe = built["mlp_stack"]
    assert _edges(pipe) == [(s, 0, s + 1, 0, (8, 32), F32, True) for s in range(3)]
    assert [sorted(k) for k in stage_keys(pipe)] == [
        [f"layers.{i}.fc.{w}" for i in (a, a + 1) for w in ("bias", "weight")] for a in (0, 2, 4, 6)
    ]


# ---- argument order, kwargs, tied weights ---------------------------------------------

def test_out_of_order_args_keep_the_models_order(built):
    e, pipe = built["out_of_order_args"]
    assert pipe.input_names == ["a", "b"]
    assert [(src.kind, src.name) for src in pipe.stages[0].inputs] == [("input", "a"), ("input", "b")]
    placeholders = [n.name for n in pipe.get_stage_module(0).graph.nodes if n.op == "placeholder"]
    assert placeholders == ["a", "b"]
    a, b = e.args
    want = e.model(a, b)
    assert_same_outputs(pipe(a, b), want)
    assert_same_outputs(pipe(b=b, a=a), want)
    with pytest.raises(ValueError, match="'a'"):
        pipe(b, a)  # swapped: shapes differ, and the error says which input is wrong


def test_kwargs_model_runs_with_kwargs(built):
    e, pipe = built["kwargs_buffers"]
    x, mask = e.args[0], e.kwargs["mask"]
    assert_same_outputs(pipe(x, scale=0.5, mask=mask), e.model(x, scale=0.5, mask=mask))
    assert_same_outputs(pipe(x=x, mask=mask, scale=0.5), e.model(x, scale=0.5, mask=mask))
    assert pipe.input_names == ["x", "scale", "mask"]
    # mask is read only by the last stage and goes to it directly; scale (a float) is baked in
    assert [(x.src_stage, x.src_output, x.dst_stage, x.spec.dtype) for x in pipe.edges if x.from_input] == [
        (ps.MODEL_INPUT, 2, 2, BOOL)]


def test_kwargs_model_buffers(built):
    e, pipe = built["kwargs_buffers"]
    # persistent buffers in stage 0's state dict; the non-persistent window lives in
    # stage 1 but, as in the model, stays out of its state dict
    assert {"norm.running_mean", "norm.running_var"} <= stage_keys(pipe)[0]
    assert dict(pipe.get_stage_module(1).named_buffers())["body.window"] is e.model.body.window
    assert "body.window" not in set().union(*stage_keys(pipe))


def test_tied_lm_lists_the_shared_weight(built):
    e, pipe = built["tied_lm"]
    assert e.model.head.weight is e.model.tok_emb.weight
    assert len(pipe.shared_parameters) == 1
    ((fqn, holders),) = pipe.shared_parameters.items()
    assert fqn in ("tok_emb.weight", "head.weight")
    assert holders == [(0, ["tok_emb.weight"]), (1, ["head.weight"])]
    w0 = pipe.get_stage_module(0).get_parameter("tok_emb.weight")
    w1 = pipe.get_stage_module(1).get_parameter("head.weight")
    assert w0 is w1 is e.model.tok_emb.weight


@pytest.mark.parametrize("name", [n for n in NAMES if n != "tied_lm"])
def test_untied_models_share_nothing(built, name):
    assert built[name][1].shared_parameters == {}


# ---- the user's model is left alone ------------------------------------------------------

def _snapshot(model: torch.nn.Module) -> dict:
    return {
        name: (type(m), type(m).forward, "forward" in vars(m), len(m._forward_hooks), len(m._forward_pre_hooks),
               m.training)
        for name, m in model.named_modules()
    }


@pytest.mark.parametrize("name", ["tiny_gpt", "tiny_unet"])
def test_model_is_untouched(name):
    e = zoo.get(name)
    before = _snapshot(e.model)
    params = {n: p for n, p in e.model.named_parameters()}
    state = {k: v.clone() for k, v in e.model.state_dict().items()}
    want = e.model(*e.args, **e.kwargs)
    pipe = ps.pipeline(e.model, e.split_spec, e.args, e.kwargs)
    assert _snapshot(e.model) == before
    assert all(p is params[n] for n, p in e.model.named_parameters())
    for k, v in e.model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert_same_outputs(e.model(*e.args, **e.kwargs), want)
    # a second split of the same model works too (the peer cannot: it patches forward)
    again = ps.pipeline(e.model, e.split_spec, e.args, e.kwargs)
    assert_same_outputs(again(*e.args, **e.kwargs), pipe(*e.args, **e.kwargs))
