"""A decoder-only transformer's shape, read from its Hugging Face config or a meta-device
model: what :mod:`.costs` needs to price it (no weights, no GPU).

Example:
    >>> shape = ModelShape(layers=2, hidden=64, intermediate=256, heads=4, kv_heads=2, vocab=100)
    >>> shape.layer_params, shape.params
    (61568, 136000)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelShape", "model_shape"]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A Llama-style decoder: attention (grouped KV) and a gated MLP per layer, embedding
    and an untied output projection; ``gated=False`` for a GPT-style plain MLP."""

    layers: int
    """Transformer blocks."""
    hidden: int
    """Model width."""
    intermediate: int
    """MLP width (gated: three ``hidden x intermediate`` matrices)."""
    heads: int
    """Attention heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention)."""
    vocab: int
    """Vocabulary size."""
    tied: bool = False
    """Whether the output projection shares the embedding."""
    gated: bool = True
    """Whether the MLP is gated (SwiGLU: three ``hidden x intermediate`` matrices) or
    plain (GPT: up and down projections, two)."""

    @property
    def layer_params(self) -> int:
        """Parameters of one block: q, k, v, o, the MLP and two norms."""
        h, kv = self.hidden, self.hidden * self.kv_heads // self.heads
        return h * h * 2 + 2 * h * kv + (3 if self.gated else 2) * h * self.intermediate + 2 * h

    @property
    def params(self) -> int:
        """All parameters."""
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


def model_shape(source: Any) -> ModelShape:
    """A :class:`ModelShape` from ``"hf:DIR"`` / a directory or ``config.json`` path, a
    transformers config object (or dict), or a model (its ``.config``).

    Example:
        >>> model_shape({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 256,
        ...              "num_attention_heads": 4, "vocab_size": 100}).kv_heads
        4
    """
    if isinstance(source, ModelShape):
        return source
    if isinstance(source, (str, Path)):
        path = Path(str(source).removeprefix("hf:"))
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise ValueError(f"no config.json at {path}: pass a directory holding a Hugging Face config.json, "
                             "a transformers config object or a model on the meta device")
        source = json.loads(path.read_text())
    if not isinstance(source, dict):
        config = getattr(source, "config", source)
        source = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    cfg: dict[str, Any] = source
    missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                           "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"the model's config lacks {', '.join(missing)}: plan_cluster reads Llama-style "
                         "decoder configs (layers, hidden, intermediate, heads, kv heads, vocab)")
    heads = int(cfg["num_attention_heads"])
    return ModelShape(layers=int(cfg["num_hidden_layers"]), hidden=int(cfg["hidden_size"]),
                      intermediate=int(cfg["intermediate_size"]), heads=heads,
                      kv_heads=int(cfg.get("num_key_value_heads") or heads), vocab=int(cfg["vocab_size"]),
                      tied=bool(cfg.get("tie_word_embeddings", False)))
