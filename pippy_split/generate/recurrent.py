"""A Hugging Face cache with recurrent layers as flat tensors (generate → split, once per Pipe).

Mamba-style layers (Mamba, Jamba's and Zamba's mixers) keep a fixed-size state instead of
keys and values: a conv state ``(B, C, K)`` and an SSM state (``(B, C, N)``, or ``(B, H, C,
N)``) per layer, replaced at every step rather than grown. Transformers keeps them in the
layers of ``DynamicCache(config=...)`` (``LinearAttentionCacheLayerMixin``), beside the keys
and values of the model's attention layers (Jamba, Zamba).

The decode step sees every cache tensor as one flat list, layer after layer: a layer's keys
and values (where it attends), then for each of its states its conv state and its recurrent
state. :func:`filled_cache` builds the model's own cache from that list (an empty list: a
fresh cache, the prefill) and :func:`cache_tensors` reads it back after the step, so the
model's own mixers run their own prefill and step code (nothing of the model is rewritten).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from .errors import GenerationError

__all__ = ["FixedState", "recurrent_cache", "filled_cache", "cache_tensors", "state_rows_reset"]


@dataclass(frozen=True)
class FixedState:
    """A cache tensor whose size does not grow with the tokens: ``(batch, *shape)``.

    Example:
        >>> FixedState((64, 4)).full_shape(3)
        (3, 64, 4)
    """

    shape: tuple[int, ...]

    def full_shape(self, batch: int) -> tuple[int, ...]:
        return (batch, *self.shape)


def _layer_classes() -> tuple[Any, Any]:
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    return DynamicLayer, LinearAttentionCacheLayerMixin


def recurrent_cache(model: torch.nn.Module) -> Any | None:
    """A fresh ``DynamicCache(config=model.config)`` where one of its layers keeps a recurrent
    state (a Mamba-style model), else None."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    modeling = sys.modules.get("transformers.modeling_utils")  # no HF model exists before it is loaded
    if modeling is None or not isinstance(model, modeling.PreTrainedModel):
        return None
    from transformers.cache_utils import DynamicCache  # loaded with the model's own transformers

    try:
        cache = DynamicCache(config=config)
    except Exception:  # a config the cache cannot read: its layers are plain KV layers
        return None
    _, linear = _layer_classes()
    return cache if any(isinstance(layer, linear) for layer in cache.layers) else None


def has_kv_layers(cache: Any) -> bool:
    """Whether a layer of ``cache`` attends over keys and values (Jamba, Zamba; not Mamba)."""
    held = getattr(cache, "pippy_held", None)
    if held is not None:
        return bool(held.kv_layers)
    dynamic, _ = _layer_classes()
    return any(isinstance(layer, dynamic) for layer in cache.layers)


class _ClonedOnUse(dict):
    """A layer's states, each cloned where the layer first reads it (the model's step updates
    them in place; cloned there, the clone runs in the stage that holds the layer, and the
    past never crosses a cut)."""

    def __init__(self, given: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self._given = given

    def __getitem__(self, k: int) -> torch.Tensor:
        if not super().__contains__(k) and k in self._given:
            super().__setitem__(k, self._given[k].clone())
        return super().__getitem__(k)


def _fill_linear(layer: Any, tensors: list[torch.Tensor]) -> None:
    """Set a linear layer's states from ``tensors`` (conv, recurrent per state), as after a
    prefill, without any op (:class:`_ClonedOnUse`)."""
    layer.conv_states = _ClonedOnUse({k: tensors[2 * k] for k in range(layer.number_of_states)})
    layer.recurrent_states = _ClonedOnUse({k: tensors[2 * k + 1] for k in range(layer.number_of_states)})
    for k in range(layer.number_of_states):
        conv = tensors[2 * k]
        layer.device, layer.dtype = conv.device, conv.dtype
        layer.conv_kernel_size[k] = int(conv.shape[-1])
        layer.is_conv_states_initialized[k] = layer.is_recurrent_states_initialized[k] = True
        layer.has_previous_state[k] = True


def state_holders(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """The ``(module, attribute)`` that hold a recurrent state outside the cache, in order:
    RecurrentGemma's recurrent blocks keep their conv state and their RG-LRU's state on
    themselves (set to None between calls)."""
    out: list[tuple[torch.nn.Module, str]] = []
    for m in model.modules():
        rg_lru = getattr(m, "rg_lru", None)
        if hasattr(m, "conv1d_state") and isinstance(rg_lru, torch.nn.Module):
            out += [(m, "conv1d_state"), (rg_lru, "recurrent_states")]
    return out


class HeldStates:
    """Where a model keeps its states on its modules (:func:`state_holders`): the cache holds the
    keys and values of its attention layers (``kv_layers``) only."""

    def __init__(self, kv_layers: list[int], holders: list[tuple[torch.nn.Module, str]]) -> None:
        self.kv_layers, self.holders = kv_layers, holders

    def fill(self, past: list[torch.Tensor]) -> Any:
        """A ``DynamicCache`` with the attention layers' keys and values, each holder's state set
        (None where ``past`` is empty: the model starts from zeros)."""
        from transformers.cache_utils import DynamicCache, DynamicLayer

        cache = DynamicCache()
        n = 2 * len(self.kv_layers)
        if past:
            for i in range(max(self.kv_layers, default=-1) + 1):
                # a recurrent layer's slot holds the first attention layer's past, read for its
                # length only (the masks are sized from layer 0, as from Hugging Face's own cache)
                j = self.kv_layers.index(i) if i in self.kv_layers else 0
                layer = DynamicLayer()
                k, v = past[2 * j], past[2 * j + 1]
                layer.device, layer.keys, layer.values, layer.is_initialized = k.device, k, v, True
                cache.layers.append(layer)
        for j, (m, attr) in enumerate(self.holders):
            setattr(m, attr, past[n + j] if past else None)
        cache.pippy_held = self  # type: ignore[attr-defined]
        return cache

    def tensors(self, cache: Any) -> list[torch.Tensor]:
        kv = [t for i in self.kv_layers for t in (cache.layers[i].keys, cache.layers[i].values)]
        return kv + [getattr(m, attr) for m, attr in self.holders]

    def release(self) -> None:
        """Each holder back to None (the user's modules as they were)."""
        for m, attr in self.holders:
            setattr(m, attr, None)


def filled_cache(model: torch.nn.Module, past: list[torch.Tensor]) -> Any:
    """The model's ``DynamicCache`` holding ``past`` (see the module docstring for the order);
    a fresh one where ``past`` is empty (the prefill)."""
    cache = recurrent_cache(model)
    assert cache is not None
    holders = state_holders(model)
    if holders:
        _, linear = _layer_classes()
        kv_layers = [i for i, layer in enumerate(cache.layers) if not isinstance(layer, linear)]
        return HeldStates(kv_layers, holders).fill(past)
    if not past:
        return cache
    dynamic, linear = _layer_classes()
    i = 0
    for layer in cache.layers:
        if isinstance(layer, dynamic):
            k, v = past[i], past[i + 1]
            layer.device, layer.keys, layer.values, layer.is_initialized = k.device, k, v, True
            i += 2
        if isinstance(layer, linear):
            _fill_linear(layer, past[i:i + 2 * layer.number_of_states])
            i += 2 * layer.number_of_states
    return cache


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """Every tensor of ``cache`` in :func:`filled_cache`'s order (a state the step left unset
    is an error: the model keeps its state somewhere else)."""
    held = getattr(cache, "pippy_held", None)
    if held is not None:
        return held.tensors(cache)
    dynamic, linear = _layer_classes()
    out: list[torch.Tensor] = []
    for j, layer in enumerate(cache.layers):
        if isinstance(layer, dynamic):
            out += [layer.keys, layer.values]
        if isinstance(layer, linear):
            for k in range(layer.number_of_states):
                conv, rec = layer.conv_states[k], layer.recurrent_states[k]
                if conv is None or rec is None:
                    raise GenerationError(f"layer {j} of the model's cache holds no conv or recurrent state after a "
                                          "step: the model keeps its recurrent state outside the cache")
                out += [conv, rec]
    return out


def state_rows_reset(state: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``state`` with the rows zeroed whose mask hides every earlier column: a slot that took a
    new prompt (continuous batching) starts from a fresh state, as its own prefill would.

    Example:
        >>> s = torch.ones(2, 3)
        >>> state_rows_reset(s, torch.tensor([[1, 1, 1], [0, 0, 1]])).tolist()
        [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    """
    keep = mask[:, :-1].any(-1).to(state.dtype)  # (b,)
    return state * keep.view(-1, *([1] * (state.dim() - 1)))


def grows(cache: Any) -> list[bool]:
    """For each tensor of :func:`cache_tensors`: True for keys and values (they grow by the new
    tokens along dim 2), False for a fixed-size state."""
    held = getattr(cache, "pippy_held", None)
    if held is not None:
        return [True, True] * len(held.kv_layers) + [False] * len(held.holders)
    dynamic, linear = _layer_classes()
    out: list[bool] = []
    for layer in cache.layers:
        if isinstance(layer, dynamic):
            out += [True, True]
        if isinstance(layer, linear):
            out += [False, False] * layer.number_of_states
    return out
