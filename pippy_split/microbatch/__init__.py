"""Split a step's inputs into microbatches and merge per-microbatch outputs back.

Sits at the two ends of a pipeline step: the runtime calls
:func:`split_args_kwargs` on the arguments of ``schedule.step(...)`` before the
first stage runs, and :func:`merge_chunks` on the last stage's outputs once every
microbatch has come through.

A *chunk spec* says how one value is split (or merged):

- ``TensorChunkSpec(dim)``: chunk tensors along ``dim`` (merge: concatenate);
- ``Replicate``: every microbatch gets the same value (merge: all must agree);
- a callable: custom, ``(value, n) -> list of n values`` for splitting and
  ``(list of n values) -> value`` for merging;
- ``None``: the default, i.e. tensors with at least one dimension use dim 0 and
  everything else is replicated;
- for merging only, ``"sum"`` or ``"mean"``: reduce elementwise over microbatches.

Specs follow pytree *prefix* rules: a leaf spec placed at a container applies to
everything inside it, and a container spec (tuple/list/dict, or any class that
``torch.utils._pytree`` can flatten) is matched against the value's own structure.
Errors name the offending argument by path: ``args[0]``, ``kwargs['mask']``,
``args[1][0]``, or ``input_ids`` when the model's parameter names are passed.

A round trip, four rows into two microbatches and back::

    >>> import torch
    >>> mbs = split_args_kwargs((torch.arange(4),), {}, 2)
    >>> [a[0].tolist() for a, _ in mbs]
    [[0, 1], [2, 3]]
    >>> merge_chunks([a[0] * 10 for a, _ in mbs]).tolist()
    [0, 10, 20, 30]

Every public name is importable from here. Inside: ``chunking`` (the chunk specs,
``Microbatches``, and the helpers both halves share: spec classification, one-level
flattening, error paths), ``splitting`` (:func:`split_args_kwargs`) and ``merging``
(:func:`merge_chunks`).
"""

from __future__ import annotations

from .chunking import MicrobatchError, Microbatches, Replicate, TensorChunkSpec
from .merging import merge_chunks
from .splitting import split_args_kwargs

__all__ = [
    "MicrobatchError",
    "TensorChunkSpec",
    "Replicate",
    "Microbatches",
    "split_args_kwargs",
    "merge_chunks",
]
