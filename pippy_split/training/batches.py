"""The batches of ``pippy-split train``: what each step feeds the pipeline, and the held-out batch.

Where this sits: between the data of :mod:`pippy_split.training.setup` and the loop of
:mod:`pippy_split.training.loop`. Every rank draws the same batch from the same
generator (only the ranks holding the first and last stages use it), so the data
order needs no messages; with ``--pack`` a step's microbatches are whole lines packed
by :mod:`pippy_split.packing`, each its own length.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ..microbatch import Microbatches
from ..packing import pack_documents, step_inputs
from .config import TrainConfig
from .nd import Layout
from .setup import Prepared, pack_budget

__all__ = ["train_batch", "heldout_batch", "to_device", "count_tokens"]


def train_batch(cfg: TrainConfig, prep: Prepared, gen: torch.Generator,
                layout: Layout | None = None) -> tuple[tuple, dict, Any]:
    """``(args, kwargs, target)`` of one pipeline step: with ``--dp``, this replica's slice of the step's rows."""
    if prep.corpus is None:
        return prep.args, prep.kwargs, prep.target
    if prep.documents is not None:
        return _packed(cfg, prep.documents, gen)
    return _windows(prep.corpus, prep.batch_size, cfg.seq_len, gen, layout)


def _windows(corpus: Any, batch: int, seq_len: int, gen: torch.Generator, layout: Layout | None) -> tuple:
    dp = 1 if layout is None else layout.dp
    x, y = corpus.batch(batch * dp, seq_len, gen)
    if layout is not None and dp > 1:
        rows = layout.replica_rows(batch)
        x, y = x[rows], y[rows]
    return (x,), {}, y


def heldout_batch(cfg: TrainConfig, prep: Prepared, layout: Layout | None = None) -> tuple[tuple, dict, Any] | None:
    """The same held-out batch at every evaluation (None without held-out data); each replica its slice."""
    gen = torch.Generator().manual_seed(cfg.seed + 7)
    if prep.heldout_documents is not None:
        return _packed(cfg, prep.heldout_documents, gen)
    if prep.heldout is None:
        return None
    return _windows(prep.heldout, prep.batch_size, cfg.seq_len, gen, layout)


def _packed(cfg: TrainConfig, documents: list[torch.Tensor], gen: torch.Generator) -> tuple:
    """--pack: whole lines from a random place in the text, packed into ``--microbatches`` rows."""
    start = int(torch.randint(len(documents), (1,), generator=gen))
    stream = (documents[(start + i) % len(documents)] for i in itertools.count())
    packed = pack_documents(stream, pack_budget(cfg))
    mbs = [next(packed) for _ in range(cfg.microbatches)]
    x, y = step_inputs(mbs, "input_ids", "targets")
    return (x,), {}, Microbatches(y)


def to_device(v: Any, device: torch.device) -> Any:
    if isinstance(v, Microbatches):
        return Microbatches(to_device(t, device) for t in v)
    return v.to(device) if isinstance(v, torch.Tensor) else v


def count_tokens(v: Any) -> int:
    """Tokens in an input (a tensor, or Microbatches of them)."""
    if isinstance(v, list):
        return sum(count_tokens(t) for t in v)
    return v.numel() if isinstance(v, torch.Tensor) else 0
