"""Tiny causal LMs for the generation tests: four Hugging Face architectures from configs
(nothing downloaded) and the zoo's, each with its split and a set of left-padded prompts."""

from __future__ import annotations

from typing import Any, Callable

import torch

VOCAB = 128


def llama() -> torch.nn.Module:
    import transformers as t

    cfg = t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return t.LlamaForCausalLM(cfg)


def qwen2() -> torch.nn.Module:
    import transformers as t

    cfg = t.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return t.Qwen2ForCausalLM(cfg)


def gpt2() -> torch.nn.Module:
    import transformers as t

    cfg = t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64, bos_token_id=0,
                       eos_token_id=0, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return t.GPT2LMHeadModel(cfg)


def mistral_tied() -> torch.nn.Module:
    import transformers as t

    cfg = t.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                          sliding_window=4, tie_word_embeddings=True, use_cache=False)
    return t.MistralForCausalLM(cfg)


HF: dict[str, tuple[Callable[[], torch.nn.Module], list[str]]] = {
    "llama": (llama, ["model.layers.2"]),
    "qwen2": (qwen2, ["model.layers.1", "model.layers.3"]),
    "gpt2": (gpt2, ["transformer.h.2"]),
    "mistral_tied": (mistral_tied, ["model.layers.1", "model.layers.2", "model.layers.3"]),
}


def hf_model(name: str) -> tuple[torch.nn.Module, list[str]]:
    build, spec = HF[name]
    torch.manual_seed(0)
    return build().eval(), spec


def prompts(padded: bool, batch: int = 5, length: int = 6, low: int = 3, seed: int = 1
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``: equal-length prompts, or left-padded ones of different
    lengths (1 to ``length`` real tokens; pads hold token 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        for i, n in enumerate([length, 2, length - 1, 1, 4, 3, 5, 2][:batch]):
            mask[i, : length - n] = 0
        ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def hf_reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int,
                 **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face ``generate`` greedy: (sequences padded to ``prompt + n`` with the pad it
    uses, log_softmax of the logits at each chosen token)."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kw)
    new = out.sequences[:, ids.shape[1]:]
    logprobs = torch.stack([torch.log_softmax(x.float(), -1) for x in out.logits], 1)
    logprobs = logprobs.gather(2, new[..., None])[..., 0]
    return out.sequences, logprobs
