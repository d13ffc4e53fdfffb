"""TinyGPT: a character-level causal GPT in the style of nanoGPT, small enough for CPU tests.

Part of the model zoo (see `pippy_split.zoo`). Layout, with the names the split spec uses:

    tok_emb, pos_emb             stage 0
    blocks.{i}: ln1, attn (attn.qkv, attn.proj), ln2, mlp (mlp.fc, mlp.proj)
    ln_f, head                   last stage

Positions are made with `torch.arange` inside `forward`, so the sequence length can
be dynamic up to `block_size`. With `tie_weights=True`, `head.weight` is the same
Parameter as `tok_emb.weight`, so one weight is shared by the first and last stages.

Also here: a small built-in text and `text_batch` to make (input, target) character
batches, and `generate` for greedy sampling.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pippy_split.zoo.entry import ZooEntry, layer_split

__all__ = ["TinyGPT", "generate", "lm_loss", "text_batch", "tied_lm", "tiny_gpt", "TEXT"]

TEXT = (
    "the quick brown fox jumps over the lazy dog. "
    "a pipeline cuts a model into stages; each stage runs on its own rank, "
    "and microbatches flow through them like water through pipes. "
    "skip connections jump over stages, and every value that crosses a cut is an edge. "
    "forward, backward for inputs, backward for weights: three kinds of work, one schedule. "
)
"""A short built-in corpus for character-level demos (fewer than 64 distinct characters)."""

_CHARS = sorted(set(TEXT))


def padded_causal_mask(attention_mask: torch.Tensor | None, T: int, device: torch.device) -> torch.Tensor | None:
    """(B, 1, T, S) bool for the last ``T`` of ``S`` slots: a query attends to the slots up to its
    own whose ``attention_mask`` is 1, and always to itself (a left pad attends to itself only,
    so no row of the softmax is empty). None without a mask (plain causal attention)."""
    if attention_mask is None:
        return None
    S = attention_mask.shape[1]
    slots = torch.arange(S, device=device)  # (S,)
    query = slots[S - T:]  # (T,)
    causal = slots[None, :] <= query[:, None]  # (T, S)
    own = slots[None, :] == query[:, None]  # (T, S)
    real = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
    return (causal & real) | own  # (B, 1, T, S)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused qkv projection."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: Any = None,
                layer_idx: int = 0) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, H, T, C/H)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is not None:  # generation: keys and values of the earlier tokens too
            k, v = cache.update(k, v, layer_idx)  # (B, H, P + T, C/H)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, C/H)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward: fc -> GELU -> proj, 4x wide."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: Any = None,
                layer_idx: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask, cache, layer_idx)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Character-level causal GPT. forward(idx (B, T) int64) -> logits (B, T, vocab_size)."""

    def __init__(
        self,
        vocab_size: int = 64,
        d_model: int = 32,
        n_layer: int = 4,
        n_head: int = 4,
        block_size: int = 64,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.max_positions = block_size  # what generation may reach (pos_emb's rows)
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(_init_weights)
        if tie_weights:
            self.head.weight = self.tok_emb.weight  # one Parameter, used by first and last stage

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Any = None) -> torch.Tensor:
        """Training: ``forward(idx)``. Generation (``pipe.generate``) also passes left-padded
        rows' ``attention_mask`` (B, P + T), their ``position_ids`` (B, T) and a cache whose
        ``update(k, v, layer_idx)`` returns the keys and values so far (Hugging Face's protocol)."""
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device) if position_ids is None else position_ids  # (T,) or (B, T)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        if attention_mask is None and past_key_values is None:
            for block in self.blocks:
                x = block(x)  # (B, T, C)
        else:
            mask = padded_causal_mask(attention_mask, T, idx.device)  # (B, 1, T, P + T)
            for i, block in enumerate(self.blocks):
                x = block(x, mask, past_key_values, i)  # (B, T, C)
        return self.head(self.ln_f(x))  # (B, T, V)


def _init_weights(m: nn.Module) -> None:
    # nanoGPT's init: small normal weights keep the initial loss near log(vocab_size),
    # also when the head shares the embedding table.
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of logits (B, T, V) against integer targets (B, T), mean over tokens."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def text_batch(
    batch_size: int, seq_len: int, vocab_size: int = 64, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `TEXT` as (idx, target), both (batch_size, seq_len) int64.

    target is idx shifted left by one character. Characters map to ids by their rank
    in the sorted character set (modulo vocab_size, should the vocabulary be smaller).

    Example:
        >>> idx, target = text_batch(8, 32)
        >>> bool((idx[:, 1:] == target[:, :-1]).all())
        True
    """
    ids = torch.tensor([_CHARS.index(c) % vocab_size for c in TEXT])  # (N,)
    if seq_len + 1 > len(ids):
        raise ValueError(f"seq_len={seq_len} is longer than the built-in text ({len(ids) - 1})")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=g)  # (B,)
    windows = torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])  # (B, T+1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


@torch.no_grad()
def generate(model: TinyGPT, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding: append the most likely next token `max_new_tokens` times.

    Args:
        model: a TinyGPT (or anything mapping (B, T) ids to (B, T, V) logits with a
            `block_size` attribute).
        idx: (B, T) int64 prompt.
        max_new_tokens: how many tokens to append.

    Returns:
        (B, T + max_new_tokens) int64.

    Example:
        >>> out = generate(TinyGPT(), torch.zeros(1, 1, dtype=torch.long), 5)
        >>> out.shape
        torch.Size([1, 6])
    """
    for _ in range(max_new_tokens):
        context = idx[:, -model.block_size :]  # (B, <=block_size)
        logits = model(context)[:, -1, :]  # (B, V)
        idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return idx


def tiny_gpt(
    seed: int = 0,
    vocab_size: int = 64,
    d_model: int = 32,
    n_layer: int = 4,
    n_head: int = 4,
    block_size: int = 64,
    num_stages: int = 4,
    batch_size: int = 8,
    seq_len: int = 32,
    tie_weights: bool = False,
) -> ZooEntry:
    """TinyGPT on windows of the built-in text, split evenly over its blocks (4 stages)."""
    torch.manual_seed(seed)
    model = TinyGPT(vocab_size, d_model, n_layer, n_head, block_size, tie_weights)
    idx, target = text_batch(batch_size, seq_len, vocab_size, seed)
    return ZooEntry(
        model=model,
        args=(idx,),
        kwargs={},
        split_spec=layer_split("blocks", n_layer, num_stages),
        num_stages=num_stages,
        loss_fn=lm_loss,
        target=target,
        description="character-level causal GPT, split evenly over its blocks",
    )


def tied_lm(seed: int = 0, n_layer: int = 4, num_stages: int = 2, **kw) -> ZooEntry:
    """TinyGPT whose head shares tok_emb's weight, so stage 0 and the last stage share it."""
    entry = tiny_gpt(seed=seed, n_layer=n_layer, num_stages=num_stages, tie_weights=True, **kw)
    return dataclasses.replace(entry, description="TinyGPT with head.weight tied to tok_emb.weight")
