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

RWKV takes its whole state as ``forward(state=)``: five tensors ``(B, hidden, layers)`` that each
layer reads and writes at its own column in place. :func:`state_columns` gives it one
:class:`StateColumns` per state, whose columns are the flat list's tensors (layer after layer,
each layer's five states), so each layer reads and replaces its own tensors in the stage that
holds it, and :func:`state_tensors` reads them back. A fresh state is not zeros (RWKV's running
maximum starts at -1e30): :class:`FixedState` carries each state's fresh value and dtype, read
from the model's own fresh state (:class:`FreshStateSeen`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from .errors import GenerationError

__all__ = ["FixedState", "recurrent_cache", "filled_cache", "cache_tensors", "state_rows_reset", "StateColumns",
           "state_columns", "state_tensors", "state_layout", "FreshStateSeen"]


@dataclass(frozen=True)
class FixedState:
    """A cache tensor whose size does not grow with the tokens: ``(batch, *shape)``.

    Example:
        >>> FixedState((64, 4)).full_shape(3)
        (3, 64, 4)
        >>> FixedState((2,), fill=-1e30).fresh(1, "cpu", torch.float32).tolist()
        [[-1.0000000150474662e+30, -1.0000000150474662e+30]]
    """

    shape: tuple[int, ...]
    fill: float = 0.0
    """What a fresh row holds (RWKV's running maximum starts at -1e30; every other state at 0)."""
    dtype: torch.dtype | None = None
    """The state's dtype where the model keeps it in another than its parameters' (RWKV's fp32 sums)."""

    def full_shape(self, batch: int) -> tuple[int, ...]:
        return (batch, *self.shape)

    def fresh(self, batch: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """The state of ``batch`` rows before any token (``dtype`` where the state has none of its own)."""
        return torch.full(self.full_shape(batch), self.fill, dtype=self.dtype or dtype, device=device)


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


def state_rows_reset(state: torch.Tensor, mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``state`` with the rows set to ``fill`` (a fresh row's value) whose mask hides every earlier
    column: a slot that took a new prompt (continuous batching) starts from a fresh state, as its
    own prefill would.

    Example:
        >>> s = torch.ones(2, 3)
        >>> state_rows_reset(s, torch.tensor([[1, 1, 1], [0, 0, 1]])).tolist()
        [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    """
    keep = mask[:, :-1].any(-1)  # (b,)
    return torch.where(keep.view(-1, *([1] * (state.dim() - 1))), state, fill)


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


TOKEN_SHIFT_STATES: dict[str, frozenset[int]] = {"RwkvForCausalLM": frozenset({0, 1})}
"""The states a model's one-token step reads as the previous token's hidden ``(batch, hidden)``
beside the token's own ``(batch, 1, hidden)``. Hugging Face's RWKV mixes them as
``hidden * mix + shifted * (1 - mix)``, which broadcasts to ``(batch, batch, hidden)``: for more
than one row, each row's step reads every row's shift state (its batched ``generate`` is not
each prompt's). The step is given these as ``(batch, 1, hidden)``, the shape that broadcast has
for a batch of one, so each row steps as it would alone."""


class StateColumns:
    """One tensor of a state passed whole as ``forward(state=)`` (Hugging Face's RWKV: five
    tensors ``(batch, hidden, layers)``) as one tensor per layer: ``[:, :, j]`` reads layer
    ``j``'s column and assigning to it replaces the column. Each layer reads and writes its own
    tensor where it runs, so no state tensor of all layers crosses a cut, and a stage keeps its
    own layers' columns. ``token_shift``: a read gives ``(batch, 1, *)`` (a one-token step's
    token-shift state, :data:`TOKEN_SHIFT_STATES`).

    Example:
        >>> cols = StateColumns([torch.zeros(2, 3), torch.ones(2, 3)])
        >>> cols[:, :, 1] = cols[:, :, 1] + 1
        >>> cols[:, :, 1][0].tolist()
        [2.0, 2.0, 2.0]
    """

    def __init__(self, columns: list[torch.Tensor], token_shift: bool = False) -> None:
        self.columns = list(columns)
        self.token_shift = token_shift

    def _layer(self, key: Any) -> int:
        if (isinstance(key, tuple) and len(key) == 3 and key[0] == slice(None) and key[1] == slice(None)
                and isinstance(key[2], int)):
            return key[2]
        raise GenerationError(f"the model indexes its state with [{key!r}]; pippy_split carries a state each layer "
                              "reads and writes as state[k][:, :, layer] (Hugging Face's RWKV)")

    def __getitem__(self, key: Any) -> torch.Tensor:
        column = self.columns[self._layer(key)]
        return column[:, None] if self.token_shift else column

    def __setitem__(self, key: Any, value: torch.Tensor) -> None:
        self.columns[self._layer(key)] = value


def state_columns(past: list[torch.Tensor], layers: int, token_shift: frozenset[int] = frozenset()
                  ) -> list[StateColumns] | None:
    """The ``state=`` argument holding ``past`` (layer after layer, each layer's states in the
    model's order), the states in ``token_shift`` read as a one-token step's (:class:`StateColumns`);
    None where ``past`` is empty (the model makes its own fresh state)."""
    if not past:
        return None
    n = len(past) // layers
    return [StateColumns([past[j * n + k] for j in range(layers)], k in token_shift) for k in range(n)]


def state_tensors(state: list[Any]) -> list[torch.Tensor]:
    """The state the model returns (the :class:`StateColumns` it was given, or the tensors
    ``(batch, *, layers)`` it made) as :func:`state_columns` orders ``past``."""
    if all(isinstance(s, StateColumns) for s in state):
        return [s.columns[j] for j in range(len(state[0].columns)) for s in state]
    return [s[..., j] for j in range(int(state[0].shape[-1])) for s in state]


class FreshStateSeen:
    """While open, records the first ``state=`` list of tensors a submodule of ``model`` is
    called with (the fresh state the model made, before any layer wrote it), cloned."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.seen: list[torch.Tensor] = []

    def _pre(self, _m: Any, _args: Any, kwargs: dict) -> None:
        state = kwargs.get("state")
        if not self.seen and isinstance(state, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in state):
            self.seen.extend(t.detach().clone() for t in state)

    def __enter__(self) -> list[torch.Tensor]:
        self.handles = [m.register_forward_pre_hook(self._pre, with_kwargs=True)
                        for name, m in self.model.named_modules() if name]
        return self.seen

    def __exit__(self, *_: Any) -> None:
        for h in self.handles:
            h.remove()


def state_layout(kv: list[torch.Tensor], fresh: list[torch.Tensor]) -> list[FixedState]:
    """Each state column's :class:`FixedState` (its shape, dtype and fresh value, read from
    ``fresh``: the model's own state before its first layer), in :func:`state_tensors`' order."""
    fills = []
    for k, t in enumerate(fresh):
        first = t.flatten()[0]
        if not bool((t == first).all()):
            raise GenerationError(f"the model's fresh state {k} is not one value in every place; pippy_split starts "
                                  "a state=-passed state from one value per tensor (Hugging Face's RWKV)")
        fills.append(float(first))
    if not fills:
        raise GenerationError("the model took state= but passed no fresh state to its layers")
    return [FixedState(tuple(int(n) for n in t.shape[1:]), fills[i % len(fills)], t.dtype) for i, t in enumerate(kv)]
