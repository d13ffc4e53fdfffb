"""TinyLlama: a Llama-style decoder whose rotary table is complex and whose positions are an input.

Part of the model zoo (see `pippy_split.zoo`). Layout, with the names the split spec uses:

    tok_embeddings, freqs_cis (non-persistent complex64 buffer)     stage 0
    layers.{i}: attention_norm, attention (wq, wk, wv, wo),
                ffn_norm, feed_forward (w1, w2, w3)
    norm, output                                                    last stage

forward(tokens, positions) looks up `freqs = self.freqs_cis[positions]` once, at the
top, and hands `freqs` (complex64, (B, T, head_dim/2)) and `positions` (int64, (B, T))
to every layer. Each layer rotates q and k with `freqs` and builds its causal mask
from `positions`. So a complex tensor and an integer tensor cross every stage
boundary, as in torchtitan's Llama, where `freqs_cis` is shared by all layers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pippy_split.zoo.entry import ZooEntry, layer_split
from pippy_split.zoo.gpt import lm_loss, padded_causal_mask, text_batch

__all__ = ["TinyLlama", "apply_rotary", "precompute_freqs_cis", "tiny_llama"]


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain `weight`."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs_cis(head_dim: int, max_seq: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotary table: e^(i * pos * theta^(-2j/head_dim)), complex64 (max_seq, head_dim // 2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)  # (hd/2,)
    angles = torch.outer(torch.arange(max_seq).float(), inv_freq)  # (S, hd/2)
    return torch.polar(torch.ones_like(angles), angles)  # (S, hd/2) complex64


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (B, T, H, hd) by freqs (B, T, hd/2) complex."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, H, hd/2)
    out = torch.view_as_real(xc * freqs.unsqueeze(2)).flatten(3)  # (B, T, H, hd)
    return out.type_as(x)


class Attention(nn.Module):
    """Multi-head attention with rotary q/k and a causal mask made from positions."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)

    def forward(
        self, x: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor,
        documents: torch.Tensor | None = None, cached: tuple[torch.Tensor, Any, int] | None = None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        shape = (B, T, -1, self.head_dim)  # -1: n_head, or this rank's heads under tensor parallelism
        q = apply_rotary(self.wq(x).view(shape), freqs)  # (B, T, H, hd)
        k = apply_rotary(self.wk(x).view(shape), freqs)  # (B, T, H, hd)
        v = self.wv(x).view(shape)  # (B, T, H, hd)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        if cached is not None:  # generation: (padded causal mask (B, 1, T, P + T), cache, layer index)
            mask, cache, layer_idx = cached
            if cache is not None:
                k, v = cache.update(k, v, layer_idx)  # (B, H, P + T, hd)
        else:
            # query t may attend to key s iff positions[s] <= positions[t]
            mask = (positions[:, None, :] <= positions[:, :, None]).unsqueeze(1)  # (B, 1, T, T) bool
            if documents is not None:  # packed rows: ... and both lie in the same document
                mask = mask & (documents[:, None, :] == documents[:, :, None]).unsqueeze(1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm Llama block: h = x + attention(norm(x)); h + feed_forward(norm(h))."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(d_model)
        self.attention = Attention(d_model, n_head)
        self.ffn_norm = RMSNorm(d_model)
        self.feed_forward = FeedForward(d_model, hidden=4 * d_model)

    def forward(
        self, x: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor,
        documents: torch.Tensor | None = None, cached: tuple[torch.Tensor, Any, int] | None = None,
    ) -> torch.Tensor:
        extra: tuple = () if documents is None else (documents,)
        if cached is not None:
            extra = (documents, cached)
        h = x + self.attention(self.attention_norm(x), freqs, positions, *extra)
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    """forward(tokens (B, T) int64, positions (B, T) int64) -> logits (B, T, vocab_size).

    Packed rows (several documents per row) pass ``documents`` (B, T): each token's
    document; attention then stays inside a document, and positions restart in each."""

    freqs_cis: torch.Tensor  # buffer (registered in __init__)

    def __init__(
        self,
        vocab_size: int = 64,
        d_model: int = 32,
        n_layer: int = 4,
        n_head: int = 4,
        max_seq: int = 64,
    ) -> None:
        super().__init__()
        self.max_positions = max_seq  # what generation may reach (freqs_cis's rows)
        self.tok_embeddings = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(TransformerBlock(d_model, n_head) for _ in range(n_layer))
        self.norm = RMSNorm(d_model)
        self.output = nn.Linear(d_model, vocab_size, bias=False)
        # Derived from sizes alone, so not saved in the state_dict.
        self.register_buffer(
            "freqs_cis", precompute_freqs_cis(d_model // n_head, max_seq), persistent=False
        )

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, *, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Any = None) -> torch.Tensor:
        """Training: ``forward(tokens, positions)``. Generation (``pipe.generate``) passes
        left-padded rows' ``attention_mask`` (B, P + T), ``position_ids`` (B, T) and a cache whose
        ``update(k, v, layer_idx)`` returns the keys and values so far (Hugging Face's protocol)."""
        if positions is None:
            if position_ids is None:
                raise TypeError("TinyLlama.forward needs positions (or position_ids)")
            positions = position_ids
        freqs = self.freqs_cis[positions]  # (B, T, hd/2) complex64
        h = self.tok_embeddings(tokens)  # (B, T, C)
        if attention_mask is None and past_key_values is None:
            extra = () if documents is None else (documents,)
            for layer in self.layers:
                h = layer(h, freqs, positions, *extra)  # (B, T, C)
        else:
            mask = padded_causal_mask(attention_mask, tokens.shape[1], tokens.device)  # (B, 1, T, P + T)
            for i, layer in enumerate(self.layers):
                h = layer(h, freqs, positions, documents, (mask, past_key_values, i))  # (B, T, C)
        return self.output(self.norm(h))  # (B, T, V)


def tiny_llama(
    seed: int = 0,
    vocab_size: int = 64,
    d_model: int = 32,
    n_layer: int = 4,
    n_head: int = 4,
    max_seq: int = 64,
    num_stages: int = 4,
    batch_size: int = 8,
    seq_len: int = 32,
) -> ZooEntry:
    """TinyLlama on windows of the built-in text, split evenly over its layers (4 stages)."""
    torch.manual_seed(seed)
    model = TinyLlama(vocab_size, d_model, n_layer, n_head, max_seq)
    tokens, target = text_batch(batch_size, seq_len, vocab_size, seed)
    positions = torch.arange(seq_len).repeat(batch_size, 1)  # (B, T) int64
    return ZooEntry(
        model=model,
        args=(tokens, positions),
        kwargs={},
        split_spec=layer_split("layers", n_layer, num_stages),
        num_stages=num_stages,
        loss_fn=lm_loss,
        target=target,
        description="Llama-style decoder: complex rotary freqs and int positions cross every stage",
    )
