"""Models built on the meta device: each stage materialises only its own tensors."""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps
from pippy_split.zoo.gpt import TinyGPT

SIZES = dict(vocab_size=64, d_model=32, n_layer=4, n_head=4, block_size=64)


def _meta_pipe(tie: bool = False):
    with torch.device("meta"):
        model = TinyGPT(**SIZES, tie_weights=tie)
    return model, ps.pipeline(model, ["blocks.1", "blocks.2", "blocks.3"], (torch.randint(0, 64, (2, 16)),))


def _bytes(module):
    seen = {id(p): p for p in module.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values())


def test_stages_materialise_from_a_state_dict_and_match_the_full_model():
    torch.manual_seed(0)
    full = TinyGPT(**SIZES)
    sd = full.state_dict()
    _, pipe = _meta_pipe()
    for i in range(pipe.num_stages):
        before = sum(p.numel() for p in pipe.get_stage_module(i).parameters())
        stage = pipe.build_stage(i, "cpu", state_dict=sd)
        params = list(stage.module.parameters())
        assert all(p.device.type == "cpu" for p in params)
        # Only this stage's tensors were allocated.
        assert _bytes(stage.module) == before * 4
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(pipe(x), full(x), atol=1e-5, rtol=0)


def test_only_the_built_stage_leaves_meta():
    model, pipe = _meta_pipe()
    pipe.build_stage(1, "cpu")  # modules' own reset_parameters
    assert all(not p.is_meta for p in pipe.get_stage_module(1).parameters())
    for i in (0, 2, 3):
        assert all(p.is_meta for p in pipe.get_stage_module(i).parameters())
    # the stage holds the model's own modules: exactly the stage's tensors are allocated in the model too
    allocated = {id(p) for p in model.parameters() if not p.is_meta}
    assert allocated == {id(p) for p in pipe.get_stage_module(1).parameters()}


def test_tied_weight_is_initialised_identically_in_both_stages():
    _, pipe = _meta_pipe(tie=True)
    first = pipe.build_stage(0, "cpu").module.get_parameter("tok_emb.weight")
    last = pipe.build_stage(3, "cpu").module.get_parameter("head.weight")
    torch.testing.assert_close(first, last)


def test_a_tensor_nobody_can_initialise_is_a_clear_error():
    _, pipe = _meta_pipe()
    with pytest.raises(ps.SplitError, match="state_dict lacks"):
        pipe.build_stage(0, "cpu", state_dict={})
