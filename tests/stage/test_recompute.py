"""Selective activation checkpointing in one process: what a region keeps, hand-built
stages, and the errors for patterns that cannot work."""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps
from pippy_split import zoo


def _tiny_gpt_pipe():
    entry = zoo.get("tiny_gpt")
    (args, kwargs), *_ = ps.split_args_kwargs(entry.args, entry.kwargs, 4)
    return entry, ps.pipeline(entry.model, entry.split_spec, *args, **kwargs)


def _activation_bytes_saved(pipe, entry, patterns) -> tuple[int, float]:
    """Bytes autograd keeps outside checkpointed regions in one step (parameters excluded), and the loss."""
    params = {id(p) for p in entry.model.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        if id(t) not in params:
            total += t.numel() * t.element_size()
        return t

    sched = ps.build_schedule(pipe, "Interleaved1F1B", 4, loss_fn=entry.loss_fn, activation_checkpoint=patterns)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sched.step(*entry.args, target=entry.target, **entry.kwargs)
    for st in sched.stages:
        for p in st.module.parameters():
            p.grad = None
    return total, float(sched.loss)


def test_a_checkpointed_region_keeps_none_of_what_autograd_saves_inside_it():
    entry, pipe = _tiny_gpt_pipe()
    plain, loss = _activation_bytes_saved(pipe, entry, None)
    selective, loss_ac = _activation_bytes_saved(pipe, entry, ["blocks.*"])
    assert loss_ac == loss
    assert 0 < selective < 0.25 * plain, (selective, plain)  # outside the blocks: embeddings, ln_f, head


def test_a_hand_built_stage_checkpoints_matching_submodules():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()),
                                torch.nn.Linear(6, 2))
    x, y = torch.randn(8, 6), torch.randn(8, 2)
    torch.nn.functional.mse_loss(model(x), y).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    stage = ps.PipelineStage(model, 0, 1, activation_checkpoint=["1"])
    stage.forward(0, [x], target=y, loss=ps.stage.LossRule(torch.nn.functional.mse_loss))
    stage.backward(0, {}, 1.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], atol=1e-6, rtol=0, msg=n)
    assert stage.region_counts == (1, 1)


def test_a_pattern_that_matches_no_module_names_the_closest():
    entry, pipe = _tiny_gpt_pipe()
    with pytest.raises(ValueError, match=r"pattern 'block\.\*' matches no module of the model; closest module "
                                         r"names: \[.*'blocks\.\*'"):
        pipe.build_stage(1, activation_checkpoint=["block.*"])


def test_a_bare_string_other_than_full_says_to_pass_a_list():
    entry, pipe = _tiny_gpt_pipe()
    with pytest.raises(ValueError, match=r"a string must be 'full'.*pass a list of module FQN patterns, "
                                         r"e\.g\. \['blocks\.\*'\]"):
        pipe.build_stage(1, activation_checkpoint="blocks.*")


def test_selective_checkpointing_under_compile_is_refused_with_what_works():
    entry, pipe = _tiny_gpt_pipe()
    with pytest.raises(ValueError, match=r"compile=True with selective activation_checkpoint=\['blocks\.\*'\] is "
                                         r"not supported.*use activation_checkpoint='full' with compile=True"):
        pipe.build_stage(1, activation_checkpoint=["blocks.*"], compile=True)
