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

from .gen_bodies import case_results, cases_body, eager_body, layers_for, reference
from .models import hf_model, prompts
from .test_generate_dist import GREEDY
from .test_generate_local import assert_like_hf

N_NEW = 8


def _assert_hf(model: torch.nn.Module, out, ids: torch.Tensor, mask: torch.Tensor) -> None:
    assert_like_hf(model, out, ids, mask, N_NEW)


@pytest.mark.timeout(300)
def test_pipe_generate_decodes_without_a_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """No export for the eager program; the traced one (sched.generate's where the eager one does not
    apply) is one plain ``torch.export`` keeping no module call signature (keeping them cost a failed
    export first, on the cache objects the model's modules pass each other), with the same tokens."""
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
    assert len(calls) == 1 and not calls[0].get("preserve_module_call_signature"), calls
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


EAGER_ON_RANKS = {  # key: (body, args), one spawn of 2 ranks
    "1F1B": (eager_body, ("1F1B", 2, GREEDY)),
    "ZBVZeroBubble": (eager_body, ("ZBVZeroBubble", 4, {**GREEDY, "lanes": 3})),
    "one rank on meta": (eager_body, ("1F1B", 2, GREEDY, 1)),
}


@pytest.fixture(scope="module")
def eager_on_ranks() -> list[dict]:
    from pippy_split.testing import run_ranks

    return run_ranks(cases_body, 2, EAGER_ON_RANKS, timeout=600)


@pytest.mark.dist
@pytest.mark.timeout(700)
@pytest.mark.parametrize("schedule,stages", [("1F1B", 2), ("ZBVZeroBubble", 4)])
def test_sched_generate_on_two_ranks_runs_the_models_own_modules(eager_on_ranks, schedule: str, stages: int
                                                                  ) -> None:
    """After a training step (the stages' tensors are the model's: the updated weights are the ones
    read), no rank traces, and the tokens are HF generate's on the unsplit model after the same step."""
    results = case_results(eager_on_ranks, schedule)
    assert [r["exports"] for r in results] == [0, 0]
    for r in results:
        assert torch.equal(r["sequences"], results[0]["sequences"])
    ref, ref_logprobs = reference("llama", GREEDY, layers_for(stages), train_first=True)
    assert torch.equal(results[0]["sequences"], ref)
    torch.testing.assert_close(results[0]["logprobs"], ref_logprobs, atol=1e-5, rtol=0)


@pytest.mark.dist
@pytest.mark.timeout(700)
def test_ranks_that_would_decode_with_different_programs_all_decode_traced(eager_on_ranks) -> None:
    """Rank 1 cannot decode eagerly (a tensor on meta), rank 0 can: they learn it at the agreement,
    before any message, and both decode with the traced program (before, rank 0 would have sent
    hidden states where rank 1 waited for the traced stage's values)."""
    results = case_results(eager_on_ranks, "one rank on meta")
    assert [r["exports"] for r in results] == [1, 1]
    ref, ref_logprobs = reference("llama", GREEDY, layers_for(2), train_first=True)
    for r in results:
        assert torch.equal(r["sequences"], ref)
        torch.testing.assert_close(r["logprobs"], ref_logprobs, atol=1e-5, rtol=0)


@pytest.mark.timeout(300)
def test_a_layers_own_hooks_fire_where_it_runs_and_see_what_was_sent() -> None:
    """A counting hook on every layer fires once a lane's step, as in the unsplit model (not again
    where another stage passes the layer through), and a steering pre-hook on the first layer of
    stage 1 acts on the hidden states stage 0 sent: the tokens are HF generate's with the same hook."""
    model, spec = hf_model("llama")
    ids, mask = prompts(True)
    counts = [0] * 4

    def count(j: int):
        def hook(*_) -> None:
            counts[j] += 1
        return hook

    handles = [layer.register_forward_hook(count(j)) for j, layer in enumerate(model.model.layers)]
    pipe = ps.pipeline(model, spec, (ids[:2],))
    counts[:] = [0] * 4
    pipe.generate(ids, attention_mask=mask, max_new_tokens=3, lanes=2, eos_token_id=None)
    assert counts == [6] * 4, counts  # 2 lanes x 3 rounds, each layer
    for h in handles:
        h.remove()
    steer = model.model.layers[2].register_forward_pre_hook(lambda m, args: (args[0] + 0.5, *args[1:]))
    out = pipe.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, return_logprobs=True)
    _assert_hf(model, out, ids, mask)
    steer.remove()
