"""``pippy-split train --model module:factory``: your own model, on its example batch or on ``--data``.

Where this sits: one of the model sources of :mod:`pippy_split.training.setup` (beside the
built-in TinyGPT and ``hf:``). A factory is a zero-argument callable returning one of

- a ZooEntry-like object: ``model`` and ``args`` (one batch), optionally ``kwargs``,
  ``split_spec``, ``loss_fn`` and ``target``;
- a tuple ``(model, args[, kwargs])``;
- a plain ``nn.Module``.

Without ``--data`` the job trains on the factory's own batch, so the factory must give
``loss_fn`` and ``target``. With ``--data`` the model is a language model called as
``model(input_ids)`` on windows of the file's tokens (``--tokenizer DIR`` or UTF-8 bytes),
its loss the factory's ``loss_fn`` against the next tokens, or, when the model's
``forward`` takes ``labels=`` (a causal LM, as Hugging Face's are), the causal LM loss
(next-token cross entropy of ``.logits``, what the model computes itself given ``labels``).

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    >>> vocab_size_of(model), takes_labels(model)
    (10, False)
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Callable

import torch

from .. import zoo
from .config import TrainConfig
from .errors import JobError
from .hf import causal_lm_loss

__all__ = ["load_factory", "unpack_entry", "vocab_size_of", "takes_labels", "factory_loss"]

_FIELDS = "model, args (one batch), loss_fn and target (optionally kwargs, split_spec)"


def load_factory(spec: str) -> Callable[[], Any]:
    """``module:factory`` or ``zoo:NAME`` -> a zero-argument callable.

    Example:
        >>> load_factory("zoo:mlp_stack")().model.__class__.__name__
        'MLPStack'
    """
    if spec.startswith("zoo:"):
        name = spec[4:]
        return lambda: zoo.get(name)
    if ":" not in spec:
        raise ValueError(f"expected module:factory or zoo:NAME, got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def unpack_entry(entry: Any) -> tuple[torch.nn.Module, tuple, dict, Any, Any, Any]:
    """(model, args, kwargs, split_spec, loss_fn, target) from a ZooEntry-like, a tuple or a module."""
    if isinstance(entry, torch.nn.Module):
        return entry, (), {}, None, None, None
    if hasattr(entry, "model") and hasattr(entry, "args"):
        return (entry.model, tuple(entry.args), dict(getattr(entry, "kwargs", None) or {}),
                getattr(entry, "split_spec", None), getattr(entry, "loss_fn", None), getattr(entry, "target", None))
    if isinstance(entry, tuple) and len(entry) in (2, 3) and isinstance(entry[0], torch.nn.Module):
        args = entry[1] if isinstance(entry[1], tuple) else (entry[1],)
        kwargs = entry[2] if len(entry) == 3 else {}
        return entry[0], args, dict(kwargs or {}), None, None, None
    raise TypeError("a factory returns an nn.Module, a tuple (model, args[, kwargs]), or an object with the fields "
                    f"{_FIELDS}; got {type(entry).__name__}")


def takes_labels(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` takes ``labels=`` (a causal LM whose loss the job can derive)."""
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def vocab_size_of(model: torch.nn.Module) -> int | None:
    """The model's vocabulary: ``config.vocab_size``, else its first ``nn.Embedding``'s rows (None: neither)."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return None if emb is None else emb.num_embeddings


def factory_loss(cfg: TrainConfig, model: torch.nn.Module, loss_fn: Any, target: Any) -> Callable:
    """The loss to train with: the factory's, or the causal LM loss derived for a model taking ``labels=``
    on ``--data``; otherwise a JobError that says which fields to give."""
    if cfg.data:
        if loss_fn is not None:
            return loss_fn
        if takes_labels(model):
            return causal_lm_loss
        raise JobError(f"--model {cfg.model} --data: {type(model).__name__} gives no loss_fn and its forward takes no "
                         "labels= (so it is not known to be a causal LM); return an object with a loss_fn(output, "
                         "next_tokens) field beside model and args")
    if loss_fn is None or target is None:
        missing = " and ".join(n for n, v in (("loss_fn", loss_fn), ("target", target)) if v is None)
        raise JobError(f"--model {cfg.model} gives no {missing}: without --data the job trains on the factory's own "
                         f"batch, so return an object with the fields {_FIELDS}; or pass --data FILE to train a "
                         "language model on a text (its loss derived when its forward takes labels=)")
    return loss_fn


def data_example(cfg: TrainConfig, model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """The microbatch a model trained on ``--data`` is traced with (zeros: the same trace on every rank);
    refuses a factory whose example takes more than the token ids."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if len(tensors) > 1:
        raise JobError(f"--model {cfg.model} --data: the model is called as model(input_ids) on the file's tokens, "
                         f"but the factory's example has {len(tensors)} tensors; return (model, (input_ids,)) or the "
                         "model alone")
    if vocab_size_of(model) is None:
        raise JobError(f"--model {cfg.model} --data: cannot tell {type(model).__name__}'s vocabulary (no "
                         "config.vocab_size, no nn.Embedding)")
    return torch.zeros(cfg.batch_size // cfg.microbatches, cfg.seq_len, dtype=torch.long)
