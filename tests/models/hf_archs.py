"""Tiny Hugging Face architectures for the real-architecture matrix: built from configs, nothing downloaded.

Each builder returns an :class:`Arch`: the model (seeded, eval mode: no dropout, so every
run is deterministic), one whole batch of ``N_MB`` microbatches whose keywords carry
``labels=`` (the model computes its own loss, ``out.loss``), the selective-checkpointing
pattern of its repeated blocks, and, where a per-item loss exists (tokens, images), the
target and the *sum* loss that ``loss_count=`` divides by the batch's valid items.

The labels of token models hold ``-100`` (ignored) at the end of most samples, a
different number in each microbatch, so that a mean over microbatches and a mean over
the batch's tokens differ. Sizes: hidden 32, 4 blocks (2 for a few, so that 4 stages
also cut inside a block; 2 + 2 for encoder-decoders), vocab 128, seq 8, 4 microbatches
of 2 samples.

Used by ``tests/models/arch_bodies.py`` (rank bodies and references),
``tests/models/test_real_archs.py`` and ``benchmarks/real_archs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

VOCAB = 128
LAYERS = 4  # 4 stages cut between blocks
FEW = 2  # Qwen3, OPT, DistilBERT, Mamba: 4 stages cut inside blocks too
N_MB, MB, SEQ = 4, 2, 8
BATCH = N_MB * MB
IGNORE = -100


@dataclass
class Arch:
    """One architecture's model and batch (see the module docstring)."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict[str, Any]  # the whole batch, labels= included
    selective: list[str]  # activation_checkpoint patterns: the repeated blocks' sub-modules
    target: torch.Tensor | None = None  # what sum_loss compares with (None: no per-item loss)
    sum_loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    notes: list[str] = field(default_factory=list)


def model_loss(out: Any, _target: Any) -> torch.Tensor:
    """The model's own loss (it was given ``labels=``)."""
    return out.loss


def valid_items(target: torch.Tensor) -> torch.Tensor:
    return (target != IGNORE).sum()


def causal_sum_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, summed over the valid tokens (HF shifts the same way)."""
    logits = out.logits[:, :-1].float()
    return F.cross_entropy(logits.flatten(0, 1), target[:, 1:].flatten(), ignore_index=IGNORE, reduction="sum")


def token_sum_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of aligned tokens (masked LM, seq2seq decoder), summed over the valid ones."""
    logits = out.logits.float()
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum")


def class_sum_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.float(), target, ignore_index=IGNORE, reduction="sum")


def causal_count(target: torch.Tensor) -> torch.Tensor:
    """Valid next-token targets (the first position predicts nothing)."""
    return (target[:, 1:] != IGNORE).sum()


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _ids(g: torch.Generator, low: int = 0) -> torch.Tensor:
    return torch.randint(low, VOCAB, (BATCH, SEQ), generator=g)


def _padded(labels: torch.Tensor) -> torch.Tensor:
    """``-100`` after each sample's valid length: microbatches hold 16, 9, 13 and 3 valid tokens."""
    labels = labels.clone()
    for i, n in enumerate([8, 8, 4, 5, 6, 7, 2, 1]):
        labels[i, n:] = IGNORE
    return labels


def _causal(model: torch.nn.Module, selective: list[str], low: int = 0) -> Arch:
    g = _gen()
    ids = _ids(g, low)
    labels = _padded(ids)
    return Arch(model, (ids,), {"labels": labels}, selective, labels, causal_sum_loss)


def _masked(model: torch.nn.Module, selective: list[str], low: int = 0) -> Arch:
    g = _gen()
    ids = _ids(g, low)
    labels = _padded(_ids(g, low))
    return Arch(model, (ids,), {"labels": labels}, selective, labels, token_sum_loss)


def _images(model: torch.nn.Module, selective: list[str], size: int, labels: int = 4) -> Arch:
    g = _gen()
    pixels = torch.randn(BATCH, 3, size, size, generator=g)
    target = torch.randint(0, labels, (BATCH,), generator=g)
    return Arch(model, (pixels,), {"labels": target}, selective, target, class_sum_loss)


# ---- decoder LMs ---------------------------------------------------------------------


def qwen3() -> Arch:
    import transformers as t

    cfg = t.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=FEW,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                        use_cache=False)
    return _causal(t.Qwen3ForCausalLM(cfg), ["model.layers.*.mlp"])


def qwen2_moe() -> Arch:
    import transformers as t

    # Router logits of every layer feed the load-balancing aux loss inside out.loss.
    cfg = t.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                           shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                           decoder_sparse_step=1, num_hidden_layers=LAYERS, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=64, output_router_logits=True,
                           router_aux_loss_coef=0.1, use_cache=False)
    return _causal(t.Qwen2MoeForCausalLM(cfg), ["model.layers.*.mlp"])


def phi3() -> Arch:
    import transformers as t

    cfg = t.Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       original_max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       use_cache=False)
    return _causal(t.Phi3ForCausalLM(cfg), ["model.layers.*.mlp"])


def mistral_tied() -> Arch:
    import transformers as t

    cfg = t.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                          sliding_window=4, tie_word_embeddings=True, use_cache=False)
    return _causal(t.MistralForCausalLM(cfg), ["model.layers.*.self_attn"])


def gpt_neox() -> Arch:
    import transformers as t

    cfg = t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                          num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5, use_cache=False,
                          hidden_dropout=0.0, attention_dropout=0.0)
    return _causal(t.GPTNeoXForCausalLM(cfg), ["gpt_neox.layers.*.mlp"])


def opt() -> Arch:
    import transformers as t

    cfg = t.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=FEW, num_attention_heads=4,
                      max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=2,
                      eos_token_id=2, dropout=0.0, attention_dropout=0.0, use_cache=False)
    return _causal(t.OPTForCausalLM(cfg), ["model.decoder.layers.*"], low=3)  # no pad tokens


def bloom() -> Arch:
    import transformers as t

    cfg = t.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=LAYERS, n_head=4, use_cache=False,
                        hidden_dropout=0.0, attention_dropout=0.0)
    return _causal(t.BloomForCausalLM(cfg), ["transformer.h.*.mlp"])


def falcon() -> Arch:
    import transformers as t

    cfg = t.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                         max_position_embeddings=64, use_cache=False, hidden_dropout=0.0, attention_dropout=0.0)
    return _causal(t.FalconForCausalLM(cfg), ["transformer.h.*.mlp"])


def mamba() -> Arch:
    import transformers as t

    # FEW blocks: 4 stages cut inside a mixer, where the parameter D (``self.D.float()``) reaches a
    # stage output with no op between (it lost its gradient under the I/W split, e04e134).
    cfg = t.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=FEW, expand=2,
                        conv_kernel=4, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _causal(t.MambaForCausalLM(cfg), ["backbone.layers.*.mixer"])


def mamba6() -> Arch:
    import transformers as t

    # 6 blocks: a stage holds whole mixers, whose forward reads conv1d's and dt_proj's weights without
    # calling them (they had no gradient under the I/W split, issue 29).
    cfg = t.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=6, expand=2,
                        conv_kernel=4, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _causal(t.MambaForCausalLM(cfg), ["backbone.layers.*.mixer"])


def jamba() -> Arch:
    import transformers as t

    # Mamba mixers (their weights read without a call, as in mamba6), attention every 3rd layer, MoE every 2nd.
    cfg = t.JambaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=3, attn_layer_offset=1,
                        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False,
                        use_cache=False, max_position_embeddings=64)
    return _causal(t.JambaForCausalLM(cfg), ["model.layers.*.mamba"])


def granite() -> Arch:
    import transformers as t

    cfg = t.GraniteConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                          attention_multiplier=0.125, use_cache=False)
    return _causal(t.GraniteForCausalLM(cfg), ["model.layers.*.mlp"])


def recurrent_gemma() -> Arch:
    import transformers as t

    # Its recurrent block resets ``rg_lru.recurrent_states`` in Python before calling it: where
    # a cut falls inside a block (2 stages: inside layers.2's temporal block; 4 stages keep whole
    # blocks since split/balance's BLOCK_SLACK), the rg_lru stays traced with it (issue 29 item 3).
    cfg = t.RecurrentGemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                 num_attention_heads=4, num_key_value_heads=1, lru_width=32, attention_window_size=16,
                                 conv1d_width=4, block_types=["recurrent", "recurrent", "attention"], use_cache=False)
    return _causal(t.RecurrentGemmaForCausalLM(cfg), ["model.layers.*.mlp_block"])


def reformer() -> Arch:
    import transformers as t

    # Reversible layers: one torch.autograd.Function, applied by the encoder, runs every layer under
    # torch.no_grad() and recomputes them in its own backward. Stages call the encoder whole, so no
    # cut enters it: 2 and 4 stages hold it in stage 0 (issue 29 item 2). Its layers run inside the
    # Function's no-grad forward, where there is nothing to checkpoint: selective AC takes the embeddings.
    cfg = t.ReformerConfig(vocab_size=VOCAB, hidden_size=32, attention_head_size=8, num_attention_heads=4,
                           attn_layers=["local"] * LAYERS, axial_pos_shape=[2, 4], axial_pos_embds_dim=[16, 16],
                           feed_forward_size=64, local_attn_chunk_length=4, local_num_chunks_before=1,
                           local_num_chunks_after=0, max_position_embeddings=SEQ, is_decoder=True,
                           hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, use_cache=False,
                           pad_token_id=0, eos_token_id=2)
    return _causal(t.ReformerModelWithLMHead(cfg), ["reformer.embeddings"])


def deepseek_v3() -> Arch:
    import transformers as t

    # MLA attention, a dense first layer, then MoE layers (8 routed experts in 2 groups, top-2, one shared
    # expert). Under bf16 its experts' matmuls once failed a fake-tensor run (issue 29 item 4).
    cfg = t.DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                             n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                             first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                             v_head_dim=8, qk_nope_head_dim=8, max_position_embeddings=64, use_cache=False,
                             pad_token_id=0)
    return _causal(t.DeepseekV3ForCausalLM(cfg), ["model.layers.*.mlp"])


# ---- encoders (masked LM) ------------------------------------------------------------


def deberta_v2() -> Arch:
    import transformers as t

    cfg = t.DebertaV2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                            num_attention_heads=4, max_position_embeddings=64, relative_attention=True,
                            position_buckets=16, max_relative_positions=-1, pos_att_type=["p2c", "c2p"],
                            norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _masked(t.DebertaV2ForMaskedLM(cfg), ["deberta.encoder.layer.*.intermediate"])


def mobilebert() -> Arch:
    import transformers as t

    # Its head multiplies by cat([decoder.weight.t(), dense.weight]): weights read by an op that is
    # no module call (dense.weight had no gradient under the I/W split, issue 29); decoder tied to the embedding.
    cfg = t.MobileBertConfig(vocab_size=VOCAB, hidden_size=32, embedding_size=16, num_hidden_layers=LAYERS,
                             num_attention_heads=4, intermediate_size=32, intra_bottleneck_size=16,
                             true_hidden_size=16, num_feedforward_networks=2, max_position_embeddings=64,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _masked(t.MobileBertForMaskedLM(cfg), ["mobilebert.encoder.layer.*.intermediate"])


def distilbert() -> Arch:
    import transformers as t

    cfg = t.DistilBertConfig(vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=FEW, n_heads=4,
                             max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)
    return _masked(t.DistilBertForMaskedLM(cfg), ["distilbert.transformer.layer.*.ffn"])


def electra() -> Arch:
    import transformers as t

    cfg = t.ElectraConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=64,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _masked(t.ElectraForMaskedLM(cfg), ["electra.encoder.layer.*.intermediate"])


# ---- encoder-decoders ----------------------------------------------------------------


def bart() -> Arch:
    import transformers as t

    # labels= only: the model makes decoder_input_ids by shifting them right.
    cfg = t.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                       pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.0,
                       attention_dropout=0.0, activation_dropout=0.0, use_cache=False)
    return _masked(t.BartForConditionalGeneration(cfg), ["model.decoder.layers.*"], low=3)


def whisper() -> Arch:
    import transformers as t

    cfg = t.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2, d_model=32,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None,
                          begin_suppress_tokens=None, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                          use_cache=False)
    g = _gen()
    features = torch.randn(BATCH, 8, 16, generator=g)  # 2 x max_source_positions frames
    labels = _padded(_ids(g, low=3))
    return Arch(t.WhisperForConditionalGeneration(cfg), (features,), {"labels": labels},
                ["model.encoder.layers.*"], labels, token_sum_loss)


# ---- vision and vision-text ----------------------------------------------------------


def clip() -> Arch:
    import transformers as t

    # The contrastive loss (return_loss=True) pairs the samples of a microbatch: no per-item loss.
    cfg = t.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=8),
        projection_dim=16)
    g = _gen()
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    ids[:, -1] = 2  # eos: the text embedding is taken there
    pixels = torch.randn(BATCH, 3, 16, 16, generator=g)
    return Arch(t.CLIPModel(cfg), (), {"input_ids": ids, "pixel_values": pixels, "return_loss": True},
                ["vision_model.encoder.layers.*.mlp", "text_model.encoder.layers.*.mlp"])


def swin() -> Arch:
    import transformers as t

    cfg = t.SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[2, 2],
                       num_heads=[2, 4], window_size=4, mlp_ratio=2.0, num_labels=4, drop_path_rate=0.0,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _images(t.SwinForImageClassification(cfg), ["swin.encoder.layers.*.blocks.*.attention"], 32)


def convnext() -> Arch:
    import transformers as t

    cfg = t.ConvNextConfig(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[16, 32], depths=[2, 2],
                           layer_scale_init_value=1.0, drop_path_rate=0.0, num_labels=4)
    return _images(t.ConvNextForImageClassification(cfg), ["convnext.encoder.stages.*.layers.*"], 32)


def dinov2() -> Arch:
    import transformers as t

    cfg = t.Dinov2Config(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=LAYERS,
                         num_attention_heads=4, mlp_ratio=2, num_labels=4, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return _images(t.Dinov2ForImageClassification(cfg), ["dinov2.encoder.layer.*.mlp"], 16)


def llava() -> Arch:
    import transformers as t

    # A CLIP vision tower's 2x2 patches (CLS dropped) projected and scattered into the token embeddings at
    # 4 image tokens per sample; its check of image tokens against features is a traced .item() (issue 29
    # item 4: a fake-tensor run could not pass it).
    image_token = VOCAB - 1
    cfg = t.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=16, patch_size=8, projection_dim=16),
        text_config=dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, use_cache=False, pad_token_id=0),
        image_token_index=image_token, image_seq_length=4, vision_feature_layer=-1,
        vision_feature_select_strategy="default")
    g = _gen()
    ids = torch.randint(3, image_token, (BATCH, SEQ), generator=g)
    ids[:, 4:] = image_token  # the image after 4 text tokens: every microbatch keeps a next-token target
    pixels = torch.randn(BATCH, 3, 16, 16, generator=g)
    labels = _padded(ids)
    labels[:, 4:] = IGNORE
    return Arch(t.LlavaForConditionalGeneration(cfg), (), {"input_ids": ids, "pixel_values": pixels, "labels": labels},
                ["model.language_model.layers.*.mlp"], labels, causal_sum_loss)


BUILDERS: dict[str, Callable[[], Arch]] = {
    "qwen3": qwen3, "qwen2_moe": qwen2_moe, "phi3": phi3, "mistral_tied": mistral_tied, "gpt_neox": gpt_neox,
    "opt": opt, "bloom": bloom, "falcon": falcon, "deberta_v2": deberta_v2, "distilbert": distilbert,
    "electra": electra, "bart": bart, "whisper": whisper, "clip": clip, "swin": swin, "convnext": convnext,
    "mamba": mamba, "dinov2": dinov2, "granite": granite,
    "mamba6": mamba6, "jamba": jamba, "mobilebert": mobilebert,
    "recurrent_gemma": recurrent_gemma, "reformer": reformer, "deepseek_v3": deepseek_v3, "llava": llava,
}
# The transformers class each builder needs (a missing one skips that architecture, named).
CLASSES = {
    "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "phi3": "Phi3ForCausalLM",
    "mistral_tied": "MistralForCausalLM", "gpt_neox": "GPTNeoXForCausalLM", "opt": "OPTForCausalLM",
    "bloom": "BloomForCausalLM", "falcon": "FalconForCausalLM", "deberta_v2": "DebertaV2ForMaskedLM",
    "distilbert": "DistilBertForMaskedLM", "electra": "ElectraForMaskedLM", "bart": "BartForConditionalGeneration",
    "whisper": "WhisperForConditionalGeneration", "clip": "CLIPModel", "swin": "SwinForImageClassification",
    "convnext": "ConvNextForImageClassification", "mamba": "MambaForCausalLM",
    "dinov2": "Dinov2ForImageClassification", "granite": "GraniteForCausalLM",
    "mamba6": "MambaForCausalLM", "jamba": "JambaForCausalLM", "mobilebert": "MobileBertForMaskedLM",
    "recurrent_gemma": "RecurrentGemmaForCausalLM", "reformer": "ReformerModelWithLMHead",
    "deepseek_v3": "DeepseekV3ForCausalLM", "llava": "LlavaForConditionalGeneration",
}
# Built in train mode (with every dropout 0): Reformer's reversible backward refuses eval mode.
TRAIN_MODE = {"reformer"}
# Which per-item sum loss an architecture's loss_count check uses: causal LMs count next tokens.
COUNTS: dict[Callable, Callable[[torch.Tensor], torch.Tensor]] = {
    causal_sum_loss: causal_count, token_sum_loss: valid_items, class_sum_loss: valid_items,
}


def missing(name: str) -> str | None:
    """Why ``name`` cannot be built with the installed transformers, or None."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    cls = CLASSES[name]
    if not hasattr(transformers, cls):
        return f"transformers {transformers.__version__} has no {cls}"
    return None


def build(name: str, eager_attention: bool = False) -> Arch:
    """The named architecture (seeded, eval mode) with its batch.

    ``eager_attention``: attention as explicit matmuls (HF's "eager") rather than SDPA. Under
    torch.export HF materializes the causal mask, so a traced model calls SDPA with that mask
    where the eager model calls it with ``is_causal=True``: a different kernel, equal to 1e-6 in
    fp32 but only to bf16 rounding under autocast. The bf16 checks compare like with like.
    DINOv2 keeps SDPA: with eager attention its eager model passes no mask while the traced one
    adds a materialized fp32 mask to the bf16 scores (promoting them), the same kind of
    tracing-time difference the other way round."""
    torch.manual_seed(0)
    arch = BUILDERS[name]()
    arch.model.train(name in TRAIN_MODE)
    if eager_attention and name not in ("dinov2",) and hasattr(arch.model, "set_attn_implementation"):
        try:
            arch.model.set_attn_implementation("eager")
        except (ValueError, AttributeError, NotImplementedError):
            pass  # no attention to choose (Mamba, ConvNeXt)
    return arch


def count_fn(arch: Arch) -> Callable[[torch.Tensor], torch.Tensor] | None:
    return None if arch.sum_loss is None else COUNTS[arch.sum_loss]
