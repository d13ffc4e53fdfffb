"""The decode step as a module: what generation traces (generate → split, once per Pipe).

:class:`DecodeRoot` shares the user's model's submodules, parameters and buffers (same
objects, same FQNs) and has one ``forward``: extend each row by ``T`` tokens given the
KV cache so far as explicit tensors (``past``, two per attention layer: keys, values of
shape ``(B, H, P, D)``), returning the last position's logits and the cache after the
step. Inside, the cache is the model's own kind (a Hugging Face ``DynamicCache``, or
:class:`KVCache` for models that are not Hugging Face's), filled from ``past``, so the
model's attention runs its own ``cache.update`` code: nothing of the model is rewritten.

The cache protocol (what a model must accept to generate): ``forward(input_ids,
attention_mask=, <cache>=)`` where ``<cache>`` is ``cache`` or ``past_key_values`` (Hugging
Face's names), with ``position_ids=`` passed where the forward takes it (as Hugging Face
generate does) and a MoE's router logits switched off (``output_router_logits=False``) and each attention layer calls
``<cache>.update(keys, values, layer_idx)`` and attends over what it returns; the
output is the logits ``(B, T, V)`` or an object with ``.logits``. A recurrent state is the
model's cache too (:mod:`.recurrent`): Hugging Face's cache layers (Mamba, Jamba, Zamba), its
blocks (RecurrentGemma), or ``forward(state=)`` (RWKV: no mask, so prompts of one length).
A model that keeps no cache at all (torchtitan's ``Decoder``: ``forward(tokens)``) decodes by
recomputation (:mod:`.recompute`): its cache is the tokens so far, and each step runs its
forward over the whole prefix (no mask either, so prompts of one length).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .errors import GenerationError
from .recompute import RECOMPUTE_WORKS, TokenPrefix, prefix_layout, prefix_step, recompute_refusal
from .recurrent import (
    TOKEN_SHIFT_STATES,
    FixedState,
    FreshStateSeen,
    cache_tensors,
    filled_cache,
    grows,
    has_kv_layers,
    state_columns,
    state_layout,
    state_tensors,
)

__all__ = ["DecodeRoot", "DecodeSignature", "KVCache", "decode_signature", "kv_layout", "LayoutEntry", "is_hf_model",
           "logits_of", "router_loss_off", "step_kwargs"]

LayoutEntry = tuple[int, int] | FixedState | TokenPrefix
"""One cache tensor's sizes: ``(heads, head_dim)`` of keys or values ``(B, heads, P, head_dim)``,
a :class:`~.recurrent.FixedState` (a recurrent layer's conv or SSM state), or the
:class:`~.recompute.TokenPrefix` of a model decoded by recomputation (the tokens ``(B, P)``)."""


class KVCache:
    """The smallest cache the protocol needs, for models that are not Hugging Face's:
    ``update(keys, values, layer_idx)`` appends along the sequence dim (2) and returns the
    layer's keys and values so far; ``get_seq_length(layer_idx=0)`` is the length so far."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *_: Any, **__: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx < len(self.keys):
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], keys], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], values], dim=2)
        elif layer_idx == len(self.keys):
            self.keys.append(keys)
            self.values.append(values)
        else:
            raise GenerationError(f"KVCache: layer {layer_idx} updated before layer {len(self.keys)}")
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if layer_idx >= len(self.keys) else int(self.keys[layer_idx].shape[2])

    def layer_tensors(self) -> list[torch.Tensor]:
        return [t for k, v in zip(self.keys, self.values) for t in (k, v)]


def is_hf_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model, without importing transformers (seconds): no
    ``PreTrainedModel`` exists before the module defining it is loaded."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


@dataclass(frozen=True)
class DecodeSignature:
    """How the decode step calls ``model.forward``: what it passes besides ``input_ids``."""

    cache_arg: str
    """``cache`` or ``past_key_values`` (Hugging Face's names), or ``state``: a state passed whole,
    a list of tensors ``(batch, *, layers)`` each layer reads and writes in place (Hugging Face's
    RWKV; no attention mask, so prompts of one length), or ``prefix``: no cache at all, the model
    decoded by recomputation over the tokens so far (:mod:`.recompute`; torchtitan's ``Decoder``)."""
    positions: bool
    """It takes ``position_ids=`` (a model without, such as ALiBi's MPT, places tokens itself)."""
    keep_last: bool
    """It takes ``logits_to_keep=``: the last position's logits only, as Hugging Face generate asks."""
    use_cache: bool
    """It takes ``use_cache=`` (passed True)."""
    router_logits: bool
    """It takes ``output_router_logits=`` (a MoE's load-balancing loss, passed False: decoding never
    needs it, and its loss reads the whole mask beside the new tokens' router logits)."""
    recurrent: bool = False
    """Some of its layers keep a recurrent state (Mamba, Jamba, Zamba in the Hugging Face cache;
    RecurrentGemma on its blocks; RWKV in ``state=``): the prefill and a step are two programs
    (:mod:`.phased`)."""


def _recurrent_layers(model: torch.nn.Module) -> list[int]:
    """The layers of a Hugging Face model whose cache is a recurrent state (Mamba, linear
    attention), read from the cache its config builds; empty for other models."""
    config = getattr(model, "config", None)
    if not is_hf_model(model) or config is None:
        return []
    from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

    try:
        cache = DynamicCache(config=config)
    except Exception:  # a config the cache cannot read: its layers are plain KV layers
        return []
    return [i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]


RECURRENT_SUPPORTED = frozenset({"MambaForCausalLM", "JambaForCausalLM", "ZambaForCausalLM",
                                 "RecurrentGemmaForCausalLM", "RwkvForCausalLM"})
"""The models with a recurrent state whose decode is checked equal to Hugging Face generate
(``tests/generate/test_generate_archs.py``; RWKV against each prompt alone); any other is
refused by name."""


def decode_signature(model: torch.nn.Module) -> DecodeSignature:
    """How the decode step calls ``model.forward``; a :class:`GenerationError` naming what is
    missing and what works where the model cannot decode step by step with a KV cache or a
    recurrent state it is checked with (a recurrent state of a model not in
    :data:`RECURRENT_SUPPORTED`), nor by recomputation (no cache argument, and no forward of
    token ids: :func:`~.recompute.recompute_refusal`).

    Example:
        >>> from pippy_split import zoo
        >>> decode_signature(zoo.get("tiny_gpt").model).cache_arg
        'past_key_values'
    """
    name = type(model).__name__
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    works = ("What works: a causal LM whose layers keep keys and values (Hugging Face's LlamaForCausalLM, "
             "GPT2LMHeadModel, MixtralForCausalLM, MptForCausalLM, ...; the zoo's tiny_gpt / tiny_llama), or a "
             "forward(input_ids, attention_mask=, past_key_values=) whose attention layers call "
             "past_key_values.update(keys, values, layer_idx) and attend over what it returns")
    works_recurrent = ("Of the models with a recurrent state, Hugging Face's " + ", ".join(sorted(RECURRENT_SUPPORTED))
                       + " generate (their conv, SSM and RWKV states kept per layer, each in its layer's stage; "
                       "RWKV from prompts of one length, no padding).")
    if "state" in params and not any(n in params for n in ("cache", "past_key_values")):
        if name not in RECURRENT_SUPPORTED or not isinstance(getattr(getattr(model, "config", None),
                                                                     "num_hidden_layers", None), int):
            raise GenerationError(f"{name} keeps a recurrent state passed whole as forward(state=), which pippy_split "
                                  f"carries only for the models it checked it on. {works_recurrent} {works}")
        return DecodeSignature("state", "position_ids" in params, "logits_to_keep" in params, "use_cache" in params,
                               "output_router_logits" in params, recurrent=True)
    cache_arg = next((n for n in ("cache", "past_key_values") if n in params), None)
    if cache_arg is None:  # no cache: decoded by recomputing the prefix, if it is a language model
        why = recompute_refusal(model, params)
        if why is not None:
            raise GenerationError(f"{name}.forward cannot take a KV cache (it has no cache= or past_key_values= "
                                  f"argument), and it cannot be decoded by recomputing its prefix either: {why}. "
                                  f"{works}; or {RECOMPUTE_WORKS}")
        return DecodeSignature("prefix", False, False, False, False)
    if "attention_mask" not in params:
        raise GenerationError(f"{name}.forward takes {cache_arg}= but not attention_mask=; generation passes the "
                              f"mask of the left-padded prompts and the cache. {works}")
    recurrent = _recurrent_layers(model)
    if recurrent and type(model).__name__ not in RECURRENT_SUPPORTED:
        raise GenerationError(f"{name}'s layers {recurrent} keep a recurrent state (Mamba / linear-attention "
                              "conv and SSM states) that pippy_split's decode step cannot carry yet (its unsplit "
                              f"generate can). {works_recurrent} {works}")
    return DecodeSignature(cache_arg, "position_ids" in params, "logits_to_keep" in params,
                           "use_cache" in params, "output_router_logits" in params, bool(recurrent))


def _filled_cache(model: torch.nn.Module, past: list[torch.Tensor], recurrent: bool = False) -> Any:
    """The model's kind of cache holding ``past``, set without any op: the first op that reads
    layer ``j``'s past is that layer's own ``update`` (in the stage holding the layer)."""
    if recurrent:
        return filled_cache(model, past)
    pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
    if not is_hf_model(model):
        ours = KVCache()
        ours.keys = [k for k, _ in pairs]
        ours.values = [v for _, v in pairs]
        return ours
    from transformers.cache_utils import DynamicCache, DynamicLayer

    hf = DynamicCache()
    for k, v in pairs:
        layer = DynamicLayer()
        layer.device, layer.keys, layer.values, layer.is_initialized = k.device, k, v, True
        hf.layers.append(layer)
    return hf


def _cache_tensors(cache: Any) -> list[torch.Tensor]:
    if isinstance(cache, KVCache):
        return cache.layer_tensors()
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


@contextlib.contextmanager
def router_loss_off(model: torch.nn.Module) -> Iterator[None]:
    """``config.output_router_logits`` False for the call (a MoE whose forward reads it from its
    config only), put back after."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        yield
        return
    config.output_router_logits = False  # type: ignore[union-attr]
    try:
        yield
    finally:
        config.output_router_logits = True  # type: ignore[union-attr]


def logits_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def _step_options(sig: DecodeSignature, position_ids: torch.Tensor) -> dict[str, Any]:
    """What a decode step passes besides the ids, the mask and the cache."""
    kwargs: dict[str, Any] = {}
    if sig.positions:
        kwargs["position_ids"] = position_ids
    if sig.keep_last:
        kwargs["logits_to_keep"] = 1  # as HF generate: logits of the last position only
    if sig.use_cache:
        kwargs["use_cache"] = True
    if sig.router_logits:
        kwargs["output_router_logits"] = False
    return kwargs


def step_kwargs(sig: DecodeSignature, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache: object
                ) -> dict[str, Any]:
    """The keyword arguments of a decode step of a model with a KV cache: the mask, the cache
    under the model's name for it, the positions where it takes them, the last position's
    logits only, and a MoE's router logits off.

    Example:
        >>> sig = DecodeSignature("past_key_values", True, False, True, False)
        >>> sorted(step_kwargs(sig, torch.ones(1, 3), torch.arange(3)[None], None))
        ['attention_mask', 'past_key_values', 'position_ids', 'use_cache']
    """
    return {"attention_mask": attention_mask, sig.cache_arg: cache, **_step_options(sig, position_ids)}


class DecodeRoot(torch.nn.Module):
    """The model's decode step: ``forward(input_ids (B, T), attention_mask (B, P + T),
    position_ids (B, T), past [2 x layers of (B, H, P, D)]) -> (logits (B, V), [keys,
    values after the step, per layer])``. Its submodules, parameters and buffers are the
    model's own objects under the same names (no copy)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_modules", model._modules)
        object.__setattr__(self, "_parameters", model._parameters)
        object.__setattr__(self, "_buffers", model._buffers)
        object.__setattr__(self, "_non_persistent_buffers_set", model._non_persistent_buffers_set)
        self._user_model: torch.nn.Module
        object.__setattr__(self, "_user_model", model)
        self.signature = decode_signature(model)
        self._layers = int(getattr(getattr(model, "config", None), "num_hidden_layers", 0) or 0)  # a state= model's

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                past: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        sig = self.signature
        if sig.cache_arg == "prefix":  # no cache: the whole prefix again (no mask, no positions: prompts of one length)
            return prefix_step(self._user_model, input_ids, past)
        if sig.cache_arg == "state":  # RWKV: each layer's column of each state (no past: the model's own fresh one)
            shift = TOKEN_SHIFT_STATES.get(type(self._user_model).__name__, frozenset())
            cache: Any = state_columns(past, self._layers, shift if int(input_ids.shape[1]) == 1 else frozenset())
            kwargs: dict[str, Any] = {"state": cache}  # and no mask: the model reads none (prompts of one length)
        else:
            cache = _filled_cache(self._user_model, past, sig.recurrent)
            mask: torch.Tensor | None = attention_mask
            if sig.recurrent and past and not has_kv_layers(cache):
                mask = None  # as Hugging Face generate steps a model without attention (Mamba): no padding in a step
            kwargs = {"attention_mask": mask, sig.cache_arg: cache}
        kwargs.update(_step_options(sig, position_ids))
        held = getattr(cache, "pippy_held", None)  # states on the model's modules (RecurrentGemma)
        try:
            with router_loss_off(self._user_model):
                out = self._user_model.forward(input_ids, **kwargs)
            logits = logits_of(out)  # (B, T or 1, V)
            if sig.cache_arg == "state":
                return logits[:, -1], state_tensors(out.state)
            return logits[:, -1], cache_tensors(cache) if sig.recurrent else _cache_tensors(cache)
        finally:
            if held is not None:
                held.release()


def kv_layout(model: torch.nn.Module, device: torch.device | str) -> list[LayoutEntry]:
    """``(heads, head_dim)`` of each cache tensor the model keeps (keys and values of each
    attention layer, in order; a :class:`~.recurrent.FixedState` for a recurrent layer's
    state; the :class:`~.recompute.TokenPrefix` of a model decoded by recomputation), from one
    step of two tokens (on ``meta`` when the model's tensors are)."""
    root = DecodeRoot(model)
    if root.signature.cache_arg == "prefix":
        return list(prefix_layout(model, device))
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    state = root.signature.cache_arg == "state"
    seen: contextlib.AbstractContextManager[list[torch.Tensor]] = (
        FreshStateSeen(model) if state else contextlib.nullcontext([]))  # the fresh state= (RWKV's)
    with torch.no_grad(), seen as fresh:
        _, kv = root(ids, torch.ones_like(ids), torch.arange(2, device=device)[None], [])
    if state:
        return list(state_layout(kv, fresh))
    if not kv:
        raise GenerationError(f"{type(model).__name__} called cache.update for no layer: it keeps no KV cache, "
                              "so it cannot generate step by step")
    if root.signature.recurrent:
        cache = filled_cache(model, [])  # only read for which tensors grow
        if getattr(cache, "pippy_held", None) is not None:
            cache.pippy_held.release()
        return [(int(t.shape[1]), int(t.shape[3])) if g else FixedState(tuple(int(n) for n in t.shape[1:]))
                for t, g in zip(kv, grows(cache))]
    return [(int(t.shape[1]), int(t.shape[3])) for t in kv]
