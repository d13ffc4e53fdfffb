"""Sampling that does not depend on the layout, Hugging Face's warpers, EOS padding, and bad
calls refused by name before anything runs."""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps
from pippy_split import zoo
from pippy_split.generate import GenerateOptions, GenerationError
from pippy_split.generate.sampling import _processed

from .models import hf_model, prompts


@pytest.fixture(scope="module")
def gpt_pipe() -> ps.Pipe:
    entry = zoo.get("tiny_gpt")
    return ps.pipeline(entry.model, entry.split_spec, entry.args)


def test_sampling_is_layout_invariant(gpt_pipe: ps.Pipe) -> None:
    ids, mask = prompts(True, batch=5)
    ids = ids % 64
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, seed=3, top_k=20, top_p=0.9, temperature=0.8,
              return_logprobs=True)
    outs = [gpt_pipe.generate(ids, lanes=lanes, **kw) for lanes in (1, 2, 5)]
    for o in outs[1:]:
        assert torch.equal(o.sequences, outs[0].sequences)
        torch.testing.assert_close(o.logprobs, outs[0].logprobs, atol=1e-6, rtol=0)
    # a row's tokens do not depend on its batch-mates either
    alone = gpt_pipe.generate(ids[3:4], **{**kw, "attention_mask": mask[3:4]})
    other = gpt_pipe.generate(ids, **{**kw, "seed": 4})
    assert not torch.equal(other.sequences, outs[0].sequences)
    assert alone.sequences.shape == (1, 12)


def test_warpers_match_hugging_face() -> None:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_k, top_p in [(0.7, 5, None), (1.0, None, 0.8), (1.3, 10, 0.5), (1.0, 1, None)]:
        ref = scores.clone()
        if temperature != 1.0:
            ref = TemperatureLogitsWarper(temperature)(None, ref)
        if top_k is not None:
            ref = TopKLogitsWarper(top_k)(None, ref)
        if top_p is not None:
            ref = TopPLogitsWarper(top_p)(None, ref)
        opts = GenerateOptions(max_new_tokens=1, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
        assert torch.equal(_processed(scores, opts), ref)


@pytest.mark.timeout(600)
def test_eos_pads_like_hugging_face() -> None:
    model, spec = hf_model("llama")
    ids, mask = prompts(True)
    pipe = ps.pipeline(model, spec, (ids[:2],))
    free = pipe.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=999, pad_token_id=0)
    eos = int(free.sequences[0, ids.shape[1] + 2])  # row 0's third new token
    out = pipe.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=1,
                        return_logprobs=True)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=eos,
                         pad_token_id=1)
    full = torch.full_like(out.sequences, 1)
    full[:, : ref.shape[1]] = ref
    assert torch.equal(out.sequences, full)
    assert (out.sequences[0, ids.shape[1] + 3:] == 1).all()
    assert (out.logprobs[0, 3:] == 0).all() and (out.logprobs[0, :3] < 0).all()


@pytest.mark.parametrize("kwargs,match", [
    ({"max_new_tokens": -1}, "max_new_tokens must be an int >= 0"),
    ({"max_new_tokens": 60}, r"6 \+ max_new_tokens 60 = 66 positions, beyond the model's 64 "
                             r"\(TinyGPT.max_positions\)"),
    ({"max_new_tokens": 2, "do_sample": True, "temperature": 0.0}, "temperature must be"),
    ({"max_new_tokens": 2, "do_sample": True, "top_p": 1.5}, "top_p must be"),
    ({"max_new_tokens": 2, "do_sample": True, "top_k": 0}, "top_k must be"),
    ({"max_new_tokens": 2, "lanes": 0}, "lanes must be"),
])
def test_bad_calls_are_refused(gpt_pipe: ps.Pipe, kwargs: dict, match: str) -> None:
    ids, mask = prompts(True, batch=3)
    with pytest.raises(GenerationError, match=match):
        gpt_pipe.generate(ids % 64, attention_mask=mask, **kwargs)


def test_right_padding_is_refused(gpt_pipe: ps.Pipe) -> None:
    ids, mask = prompts(True, batch=3)
    with pytest.raises(GenerationError, match="left-padded"):
        gpt_pipe.generate(ids % 64, attention_mask=mask.flip(1), max_new_tokens=2)


def test_a_model_without_a_cache_is_refused() -> None:
    entry = zoo.get("mlp_stack")
    pipe = ps.pipeline(entry.model, entry.split_spec, entry.args)
    with pytest.raises(GenerationError, match="cannot take a KV cache.*What works: a causal LM whose layers keep keys and values"):
        pipe.generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=2)
