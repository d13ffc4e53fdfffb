"""``pipe.generate`` runs the model's own modules stage by stage where it can (generate/eager.py):
no trace of the decode step, HF generate's tokens, the model left as it was, and the traced
program wherever the model or the cut does not qualify.

Before, every first ``pipe.generate`` traced the decode step with dynamic shapes: one
``torch.export`` costing about twice ``ps.pipeline()`` on a tiny Llama."""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps
from pippy_split.generate.eager import EagerProgram, eager_program

from .models import hf_model, hf_reference, prompts
from .test_generate_local import _live

N_NEW = 8


def _assert_hf(model: torch.nn.Module, out, ids: torch.Tensor, mask: torch.Tensor) -> None:
    ref, ref_logprobs = hf_reference(model, ids, mask, N_NEW)
    assert torch.equal(out.sequences[:, : ref.shape[1]], ref)
    n = ref.shape[1] - ids.shape[1]
    live = _live(ref[:, ids.shape[1]:], model.generation_config.eos_token_id)
    torch.testing.assert_close(out.logprobs[:, :n][live], ref_logprobs[live], atol=1e-5, rtol=0)


@pytest.mark.timeout(300)
def test_pipe_generate_decodes_without_a_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    model, spec = hf_model("llama")
    ids, mask = prompts(True)
    pipe = ps.pipeline(model, spec, (ids[:2],))
    calls = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(k) or real(*a, **k))
    out = pipe.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, return_logprobs=True)
    assert calls == [] and isinstance(pipe.derived["eager_program"], EagerProgram)
    _assert_hf(model, out, ids, mask)
    pipe.derived["eager_program"] = None  # the traced program, as sched.generate runs it: the same tokens
    traced = pipe.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, return_logprobs=True)
    assert len(calls) == 1
    assert torch.equal(traced.sequences, out.sequences)
    torch.testing.assert_close(traced.logprobs, out.logprobs, atol=1e-5, rtol=0)


@pytest.mark.timeout(300)
def test_four_stages_with_lanes_and_slots_tied_and_sliding() -> None:
    """Mistral with tied embeddings (the first and last stage read one weight) and a sliding window
    shorter than the generation, on 4 stages, 3 lanes, then one slot refilled row after row."""
    model, spec = hf_model("mistral_tied")
    ids, mask = prompts(True)
    pipe = ps.pipeline(model, spec, (ids[:2],))
    program = eager_program(pipe)
    assert program is not None and program.ranges == [(0, 1), (1, 2), (2, 3), (3, 4)]
    _assert_hf(model, pipe.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, return_logprobs=True,
                                    lanes=3), ids, mask)
    _assert_hf(model, pipe.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, return_logprobs=True,
                                    lanes=1, slots=2), ids, mask)


def _left_as_it_was(model: torch.nn.Module) -> bool:
    layers = model.base_model.layers
    return all("forward" not in vars(layer) and not layer._forward_hooks and not layer._forward_pre_hooks
               for layer in layers)


@pytest.mark.timeout(300)
def test_the_model_is_left_as_it_was_after_a_call_and_after_a_failure() -> None:
    """Each stage swaps the other stages' layers for a pass-through and hooks its own first and
    last layer for the call only: after it, and after a layer raised inside it, the model's
    layers are its own again (a forward of the unsplit model gives its logits)."""
    model, spec = hf_model("llama")
    ids, mask = prompts(True)
    before = model(ids, attention_mask=mask).logits
    pipe = ps.pipeline(model, spec, (ids[:2],))
    pipe.generate(ids, attention_mask=mask, max_new_tokens=2)
    assert _left_as_it_was(model)
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, before, atol=0, rtol=0)

    def fail(*_):
        raise RuntimeError("a layer failed")

    handle = model.model.layers[3].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="a layer failed"):
        pipe.generate(ids, attention_mask=mask, max_new_tokens=2)
    handle.remove()
    assert _left_as_it_was(model)
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, before, atol=0, rtol=0)


@pytest.mark.timeout(300)
def test_what_the_traced_program_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not eager, so traced: a cut inside a layer, a model that is not Hugging Face's (the zoo's),
    a Hugging Face model whose config declares no layer chain (GPT-2), and a model with a tensor
    left on meta."""
    from pippy_split import zoo

    model, _ = hf_model("llama")
    ids, mask = prompts(True)
    monkeypatch.setattr("pippy_split.split.balance.BLOCK_SLACK", 0.0)
    inside = ps.pipeline(model, 3, (ids,))
    assert any("in model.layers.1" in e.display_name for e in inside.edges)
    assert eager_program(inside) is None
    e = zoo.get("tiny_gpt")
    assert eager_program(ps.pipeline(e.model, e.split_spec, e.args)) is None
    gpt2, spec = hf_model("gpt2")
    assert eager_program(ps.pipeline(gpt2, spec, (ids[:2],))) is None
    model, spec = hf_model("llama")
    pipe = ps.pipeline(model, spec, (ids[:2],))
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.to("meta")
    assert eager_program(pipe) is None
