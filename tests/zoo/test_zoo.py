"""Tests for the model zoo: every entry builds, trains a step, is deterministic, exports.

Pure tier: no process group. Each registry entry is checked for forward + backward on
its example inputs, identical weights from two builds with one seed, a torch.export
(strict=False) trace whose module matches eager output, and a split spec whose names
are real submodules called once each, in order.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.export import Dim

from pippy_split import zoo
from pippy_split.zoo.gpt import TinyGPT, generate, text_batch

NAMES = sorted(zoo.ZOO)


@pytest.fixture(scope="module", params=NAMES)
def entry(request) -> tuple[str, zoo.ZooEntry]:
    return request.param, zoo.get(request.param)


def _call(e: zoo.ZooEntry, model: nn.Module | None = None) -> torch.Tensor:
    return (model or e.model)(*e.args, **e.kwargs)


def test_forward_backward(entry):
    name, e = entry
    e.model.zero_grad()
    out = _call(e)
    assert torch.isfinite(out).all(), name
    loss = e.loss_fn(out, e.target)
    assert loss.dim() == 0 and torch.isfinite(loss), name
    loss.backward()
    missing = [n for n, p in e.model.named_parameters() if p.grad is None]
    assert not missing, f"{name}: parameters without grad: {missing}"


def test_deterministic_across_builds(entry):
    name, e = entry
    again = zoo.get(name)
    sd1, sd2 = e.model.state_dict(), again.model.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), f"{name}: {k} differs between builds"
    for a, b in zip(e.args, again.args):
        assert torch.equal(a, b)
    assert torch.equal(e.target, again.target)
    other = zoo.get(name, seed=1).model.state_dict()
    assert any(not torch.equal(sd1[k], other[k]) for k in sd1), f"{name}: seed ignored"


def test_export_matches_eager(entry):
    name, e = entry
    ep = torch.export.export(e.model, e.args, e.kwargs, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(_call(e, ep.module()), _call(e), atol=1e-5, rtol=1e-5)


def test_split_spec_names_real_submodules_called_in_order(entry):
    name, e = entry
    assert isinstance(e.split_spec, list) and len(e.split_spec) + 1 == e.num_stages
    modules = dict(e.model.named_modules())
    assert all(fqn in modules for fqn in e.split_spec), f"{name}: {e.split_spec}"
    calls: list[str] = []
    hooks = [
        modules[fqn].register_forward_pre_hook(lambda m, a, fqn=fqn: calls.append(fqn))
        for fqn in e.split_spec
    ]
    try:
        with torch.no_grad():
            _call(e)
    finally:
        for h in hooks:
            h.remove()
    assert calls == e.split_spec, f"{name}: split modules called as {calls}"


def test_get_unknown_name_lists_available():
    with pytest.raises(KeyError, match="tiny_gpt"):
        zoo.get("no_such_model")


def test_entry_checks_stage_count():
    e = zoo.get("mlp_stack")
    with pytest.raises(ValueError, match="num_stages"):
        zoo.ZooEntry(**{**e.__dict__, "num_stages": 3})


def test_layer_split():
    assert zoo.layer_split("blocks", 4, 4) == ["blocks.1", "blocks.2", "blocks.3"]
    assert zoo.layer_split("layers", 8, 4) == ["layers.2", "layers.4", "layers.6"]
    assert zoo.layer_split("layers", 8, 1) == []
    with pytest.raises(ValueError):
        zoo.layer_split("layers", 2, 3)


def test_tied_lm_shares_one_parameter():
    m = zoo.get("tied_lm").model
    assert m.head.weight is m.tok_emb.weight
    untied = zoo.get("tiny_gpt").model
    assert untied.head.weight is not untied.tok_emb.weight


def test_gpt_dynamic_seq_len_export():
    e = zoo.get("tiny_gpt")
    ep = torch.export.export(
        e.model, e.args, dynamic_shapes=({1: Dim("T", min=2, max=64)},), strict=False
    )
    idx, _ = text_batch(8, 20, seed=1)  # batch is static, T is not
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(idx), e.model(idx), atol=1e-5, rtol=1e-5)


def test_text_batch_and_generate():
    idx, target = text_batch(8, 32)
    assert idx.shape == target.shape == (8, 32) and idx.dtype == torch.long
    assert torch.equal(idx[:, 1:], target[:, :-1])
    out = generate(TinyGPT(block_size=8), idx[:2, :4], max_new_tokens=10)
    assert out.shape == (2, 14) and torch.equal(out[:, :4], idx[:2, :4])


def test_llama_carries_complex_and_int_to_every_layer():
    e = zoo.get("tiny_llama")
    seen = []
    hooks = [
        layer.register_forward_pre_hook(lambda m, a: seen.append((a[1].dtype, a[2].dtype)))
        for layer in e.model.layers
    ]
    with torch.no_grad():
        _call(e)
    for h in hooks:
        h.remove()
    assert seen == [(torch.complex64, torch.int64)] * len(e.model.layers)
    assert "freqs_cis" not in e.model.state_dict()


@pytest.mark.parametrize(
    "name, producer, consumers",
    [
        ("tiny_unet", "stem", ["mid", "up1"]),
        ("tiny_unet", "down1", ["down2", "up2"]),
        ("fan_out_skip", "stem", ["mid", "tail"]),
    ],
)
def test_fan_out(name, producer, consumers):
    e = zoo.get(name)
    modules = dict(e.model.named_modules())
    produced, received = [], {}
    hooks = [modules[producer].register_forward_hook(lambda m, a, out: produced.append(out))]
    for c in consumers:
        hook = modules[c].register_forward_pre_hook(lambda m, a, c=c: received.update({c: a}))
        hooks.append(hook)
    with torch.no_grad():
        _call(e)
    for h in hooks:
        h.remove()
    for c in consumers:
        assert any(x is produced[0] for x in received[c]), f"{c} does not read {producer}"


def test_kwargs_buffers_mask_applies():
    e = zoo.get("kwargs_buffers")
    out = _call(e)
    assert (out[~e.kwargs["mask"]] == 0).all()
    assert "body.window" not in e.model.state_dict()
    assert "norm.running_mean" in e.model.state_dict()
