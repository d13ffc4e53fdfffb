"""Hugging Face causal LMs, built from tiny configs (nothing downloaded), split out of the box.

Pure tier (no process group). Default configs, so ``use_cache`` stays on: the cache
object in the output must not break tracing (torch.distributed.pipelining 2.13
refuses these models until ``use_cache=False``). GPT-2 ties its LM head to the token
embedding, so its pipe lists a shared parameter.
"""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps
from tests.split.helpers import assert_same_grads, assert_state_dict_partition

transformers = pytest.importorskip("transformers")

VOCAB = 128


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg), "model.layers.1"


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg), "transformer.h.1"


def _qwen2():
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(cfg), "model.layers.1"


def _mistral():
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.MistralForCausalLM(cfg), "model.layers.1"


BUILDERS = {"llama": _llama, "gpt2": _gpt2, "qwen2": _qwen2, "mistral": _mistral}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def hf(request):
    """(name, model, split fqn, input_ids, pipe). GPT-2's dropout (0.1 by default) is
    switched off by eval() before tracing; the others default to no dropout."""
    torch.manual_seed(0)
    model, fqn = BUILDERS[request.param]()
    assert model.config.use_cache  # the default is kept
    if request.param == "gpt2":
        model.eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    return request.param, model, fqn, ids, ps.pipeline(model, [fqn], (ids,))


def test_splits_with_default_config(hf):
    _, model, _, _, pipe = hf
    assert pipe.num_stages == 2
    assert_state_dict_partition(pipe, model)


def test_logits_match(hf):
    _, model, _, ids, pipe = hf
    out, want = pipe(ids), model(ids)
    assert type(out) is type(want)  # the ModelOutput dataclass is rebuilt
    torch.testing.assert_close(out.logits, want.logits, atol=1e-5, rtol=1e-5)


def test_gradients_match(hf):
    _, model, _, ids, pipe = hf
    assert_same_grads(pipe, model, (ids,), {})


def test_only_gpt2_shares_a_parameter(hf):
    name, model, _, _, pipe = hf
    if name != "gpt2":
        assert pipe.shared_parameters == {}
        return
    assert model.lm_head.weight is model.transformer.wte.weight
    assert pipe.shared_parameters == {"transformer.wte.weight": [(0, ["transformer.wte.weight"]),
                                                                 (1, ["lm_head.weight"])]}


def test_hidden_state_edge_carries_grad(hf):
    _, model, _, _, pipe = hf
    width = model.config.hidden_size
    hidden = [e for e in pipe.edges if e.spec.shape == (2, 16, width) and e.spec.dtype == torch.float32]
    assert len(hidden) == 1 and hidden[0].spec.carries_grad
    assert all(not e.spec.carries_grad for e in pipe.edges if e not in hidden)  # masks, rotary tables


def test_gpt2_dropout_in_train_mode_follows_the_model():
    """Traced in train mode, the pipe draws its dropout masks in the model's order:
    the same seed gives the same logits."""
    torch.manual_seed(0)
    model, fqn = _gpt2()
    assert model.training and model.config.resid_pdrop > 0
    ids = torch.randint(0, VOCAB, (2, 16))
    pipe = ps.pipeline(model, [fqn], (ids,))
    torch.manual_seed(1)
    got = pipe(ids).logits
    torch.manual_seed(1)
    want = model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
