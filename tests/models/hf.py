"""Tiny Hugging Face models for the balance matrix: built from configs, nothing downloaded.

Each builder returns ``(model, args, kwargs, blocks)``: the model in eval mode (no
dropout, so ``pipe(x) == model(x)`` holds exactly), one microbatch of inputs, and the
number of repeated blocks the model runs (what the balance target is conditioned on).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

VOCAB = 128
LAYERS = 8
BATCH, SEQ = 2, 16


def _ids(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ))


def llama() -> tuple:
    import transformers as t

    cfg = t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return t.LlamaForCausalLM(cfg), (_ids(),), {}, LAYERS


def gpt2() -> tuple:
    import transformers as t

    cfg = t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64,
                       bos_token_id=0, eos_token_id=0, use_cache=False)
    return t.GPT2LMHeadModel(cfg), (_ids(),), {}, LAYERS


def bert() -> tuple:
    import transformers as t

    cfg = t.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                       num_attention_heads=4, max_position_embeddings=64)
    return t.BertForMaskedLM(cfg), (_ids(),), {}, LAYERS


def roberta() -> tuple:
    import transformers as t

    cfg = t.RobertaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                          num_attention_heads=4, max_position_embeddings=64, pad_token_id=1)
    ids = _ids().clamp(min=2)  # no padding tokens: position ids count from pad_token_id + 1
    return t.RobertaForMaskedLM(cfg), (ids,), {}, LAYERS


def t5() -> tuple:
    import transformers as t

    cfg = t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=LAYERS // 2,
                     num_decoder_layers=LAYERS // 2, num_heads=4, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    ids = _ids()
    return t.T5ForConditionalGeneration(cfg), (ids,), {"decoder_input_ids": _ids()}, LAYERS


def vit() -> tuple:
    import transformers as t

    cfg = t.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=LAYERS, num_attention_heads=4, num_labels=10)
    return t.ViTForImageClassification(cfg), (torch.randn(BATCH, 3, 32, 32),), {}, LAYERS


def gemma2() -> tuple:
    import transformers as t

    cfg = t.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         sliding_window=8, use_cache=False)
    return t.Gemma2ForCausalLM(cfg), (_ids(),), {}, LAYERS


def albert() -> tuple:
    import transformers as t

    # One layer module, called LAYERS times: the blocks share their parameters.
    cfg = t.AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=64)
    return t.AlbertForMaskedLM(cfg), (_ids(),), {}, LAYERS


def mixtral() -> tuple:
    import transformers as t

    cfg = t.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          num_local_experts=4, num_experts_per_tok=2, use_cache=False)
    return t.MixtralForCausalLM(cfg), (_ids(),), {}, LAYERS


BUILDERS: dict[str, Callable[[], tuple[torch.nn.Module, tuple, dict[str, Any], int]]] = {
    "llama": llama, "gpt2": gpt2, "bert": bert, "roberta": roberta, "t5": t5, "vit": vit, "gemma2": gemma2,
    "albert": albert, "mixtral": mixtral,
}


def build(name: str) -> tuple[torch.nn.Module, tuple, dict[str, Any], int]:
    """The named model (seeded, eval mode) with its inputs and block count."""
    torch.manual_seed(0)
    model, args, kwargs, blocks = BUILDERS[name]()
    return model.eval(), args, kwargs, blocks
