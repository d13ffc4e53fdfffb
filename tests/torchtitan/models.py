"""torchtitan 0.3.0's own model classes at tiny sizes, on CPU.

Built with torchtitan's own config builders (Llama 3, Qwen3, DeepSeek-V3: MoE + MLA); the
attention of every layer is switched to torchtitan's ``ScaledDotProductAttention`` (flex has no
CPU backward, varlen needs CUDA). Imported only where torchtitan is installed.
"""

from __future__ import annotations

from typing import Any

import torchtitan.models.deepseek_v3 as dsv3
import torchtitan.models.llama3 as llama3
import torchtitan.models.qwen3 as qwen3
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3 import DeepSeekV3Model
from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
from torchtitan.models.llama3 import Llama3Model
from torchtitan.models.llama3.sharding import set_llama3_sharding_config
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

VOCAB = 64
DIM = 32
NAMES = ("llama3", "qwen3", "deepseek_v3")
SHARDING = {"llama3": set_llama3_sharding_config, "qwen3": set_qwen3_sharding_config,
            "deepseek_v3": set_deepseek_v3_sharding_config}


def _sdpa(layers: list[Any]) -> list[Any]:
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def _common(n_layers: int) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, dim=DIM,
                tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                                param_init=llama3._EMBEDDING_INIT),
                norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
                lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._LINEAR_INIT))


def config(name: str, n_layers: int = 4, sequence_parallel: bool = True) -> Any:
    """The tiny config of torchtitan model ``name`` (one of :data:`NAMES`), its sharding configs
    filled as the Trainer's ``update_from_config`` fills them (used only under TP)."""
    cfg = _config(name, n_layers)
    SHARDING[name](cfg, enable_sp=sequence_parallel, **({} if name == "llama3" else {"enable_ep": False}))
    return cfg


def _config(name: str, n_layers: int) -> Any:
    if name == "llama3":
        layers = llama3._build_llama3_layers(
            n_layers=n_layers, dim=DIM, n_heads=4, n_kv_heads=2, hidden_dim=64, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=DIM // 4, max_seq_len=64, theta=500000, scaling="llama"))
        return Llama3Model.Config(**_common(n_layers), layers=_sdpa(layers))
    if name == "qwen3":
        layers = qwen3._build_qwen3_layers(
            n_layers=n_layers, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64, attn_backend="flex",
            rope=CosSinRoPE.Config(dim=8, max_seq_len=64, theta=1000000.0))
        return Qwen3Model.Config(**_common(n_layers), layers=_sdpa(layers))
    if name == "deepseek_v3":
        layers = dsv3._build_dsv3_layers(
            n_layers=n_layers, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, mscale=0.70, dense_hidden_dim=64,
            moe_hidden_dim=16, num_experts=4, num_shared_experts=1, router_top_k=2, router_score_func="softmax",
            attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                    beta_fast=32.0, beta_slow=1.0, original_seq_len=32))
        return DeepSeekV3Model.Config(**_common(n_layers), layers=_sdpa(layers))
    raise ValueError(f"unknown model {name!r}; one of {NAMES}")
