"""Turn a stream of tokenized documents into microbatches for a token budget.

Where this sits: before the flow, with the data. Plain PyTorch, no framework.
Two ways to fill a microbatch of at most ``max_tokens`` tokens:

- :func:`pack_documents`: whole documents end to end in one row, in stream order;
  each microbatch has its own length (the sum of its documents'), positions restart
  at every document, and :meth:`TokenBatch.attention_mask` keeps each token's
  attention inside its own document. No padding at all.
- :func:`bucket_by_length`: documents of similar length side by side, each padded
  to the longest of its microbatch (rows x longest <= ``max_tokens``).

Either gives microbatches of different shapes: trace the pipe with the varying dims
declared dynamic and hand a step's microbatches over with :func:`step_inputs`
(``ps.Microbatches`` per field). Targets are next tokens within a document, -100
where there is none (a document's last token, padding), for a loss with
``ignore_index=-100`` and ``loss_count=lambda t: (t != -100).sum()``.

Example:
    >>> mbs = list(pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_tokens=6))
    >>> [mb.input_ids.tolist() for mb in mbs]
    [[[1, 2, 3, 4, 5]], [[6, 7, 8, 9]]]
    >>> mbs[0].position_ids.tolist(), mbs[0].targets.tolist()
    ([[0, 1, 2, 0, 1]], [[2, 3, -100, 5, -100]])
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .microbatch import Microbatches

__all__ = ["TokenBatch", "pack_documents", "bucket_by_length", "step_inputs"]

IGNORE = -100


@dataclass(frozen=True)
class TokenBatch:
    """One microbatch of token rows, all ``(rows, length)`` int64."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    """The next token of the same document; -100 at a document's last token and on padding."""
    position_ids: torch.Tensor
    """Each token's position inside its own document (restarts at every document)."""
    document_ids: torch.Tensor
    """Which document of its row a token belongs to (0, 1, ...); -1 on padding."""

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.input_ids.shape[0]), int(self.input_ids.shape[1]))

    @property
    def n_tokens(self) -> int:
        """Real tokens (not padding)."""
        return int((self.document_ids >= 0).sum())

    def attention_mask(self) -> torch.Tensor:
        """``(rows, 1, length, length)`` bool: query t may attend to key s iff both are in the same
        document and s <= t (causal, no attention across packed documents or onto padding)."""
        doc = self.document_ids
        same = (doc[:, :, None] == doc[:, None, :]) & (doc[:, None, :] >= 0)
        length = doc.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        mask = same & causal
        mask |= torch.eye(length, dtype=torch.bool)  # a padding row attends to itself (no NaN rows)
        return mask.unsqueeze(1)

    def cu_seqlens(self) -> torch.Tensor:
        """Offsets of the documents in the flattened microbatch (flash-attention's ``cu_seqlens``)."""
        starts = [0]
        for row in self.document_ids.tolist():
            counts: dict[int, int] = {}
            for d in row:
                if d >= 0:
                    counts[d] = counts.get(d, 0) + 1
            for d in sorted(counts):
                starts.append(starts[-1] + counts[d])
        return torch.tensor(starts, dtype=torch.int32)


def _row(docs: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[list[int], ...]:
    ids, tgt, pos, doc = [], [], [], []
    for k, d in enumerate(docs):
        d = list(d)
        ids += d
        tgt += d[1:] + [IGNORE]
        pos += list(range(len(d)))
        doc += [k] * len(d)
    pad = length - len(ids)
    return ids + [pad_id] * pad, tgt + [IGNORE] * pad, pos + [0] * pad, doc + [-1] * pad


def _batch(rows: list[tuple[list[int], ...]]) -> TokenBatch:
    ids, tgt, pos, doc = (torch.tensor([r[i] for r in rows], dtype=torch.int64) for i in range(4))
    return TokenBatch(ids, tgt, pos, doc)


def _tokens(documents: Iterable[Sequence[int] | torch.Tensor], max_tokens: int) -> Iterator[list[int]]:
    """Each document as a list, split into pieces of at most ``max_tokens``; empty ones dropped."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    for d in documents:
        d = d.tolist() if isinstance(d, torch.Tensor) else list(d)
        for i in range(0, len(d), max_tokens):
            yield d[i:i + max_tokens]


def pack_documents(documents: Iterable[Sequence[int] | torch.Tensor], max_tokens: int,
                   min_tokens: int = 2) -> Iterator[TokenBatch]:
    """Whole documents end to end, in stream order, one row of at most ``max_tokens`` per
    microbatch (a longer document is cut into pieces). A microbatch shorter than
    ``min_tokens`` (a traced ``Dim``'s min) is merged into the next one or dropped at the end."""
    current: list[list[int]] = []
    used = 0
    for d in _tokens(documents, max_tokens):
        if used + len(d) > max_tokens and used >= min_tokens:
            yield _batch([_row(current, used, 0)])
            current, used = [], 0
        if used + len(d) > max_tokens:  # too short to stand alone and the next does not fit: cut it
            head, d = d[: max_tokens - used], d[max_tokens - used:]
            yield _batch([_row([*current, head], max_tokens, 0)])
            current, used = [], 0
        current.append(d)
        used += len(d)
    if used >= min_tokens:
        yield _batch([_row(current, used, 0)])


def bucket_by_length(documents: Iterable[Sequence[int] | torch.Tensor], max_tokens: int, pad_id: int = 0,
                     window: int = 256) -> Iterator[TokenBatch]:
    """Documents of similar length side by side, padded to the longest of their microbatch,
    with rows x longest <= ``max_tokens``. Sorting happens inside windows of ``window``
    documents of the stream (bounded memory, and the order across windows is kept)."""
    buffer: list[list[int]] = []
    for d in _tokens(documents, max_tokens):
        buffer.append(d)
        if len(buffer) == window:
            yield from _buckets(buffer, max_tokens, pad_id)
            buffer = []
    yield from _buckets(buffer, max_tokens, pad_id)


def _buckets(docs: list[list[int]], max_tokens: int, pad_id: int) -> Iterator[TokenBatch]:
    group: list[list[int]] = []
    for d in sorted(docs, key=len, reverse=True):
        longest = len(group[0]) if group else len(d)
        if group and (len(group) + 1) * longest > max_tokens:
            yield _batch([_row([g], longest, pad_id) for g in group])
            group = []
        group.append(d)
    if group:
        yield _batch([_row([g], len(group[0]), pad_id) for g in group])


def step_inputs(batches: Sequence[TokenBatch], *fields: str) -> tuple[Microbatches, ...]:
    """One step's microbatches, one ``ps.Microbatches`` per field, e.g.
    ``ids, pos, tgt = step_inputs(mbs, "input_ids", "position_ids", "targets")``.

    Example:
        >>> ids, tgt = step_inputs(list(pack_documents([[1, 2], [3, 4, 5]], 2)), "input_ids", "targets")
        >>> [t.shape[1] for t in ids], len(tgt)
        ([2, 2], 2)
    """
    return tuple(Microbatches(getattr(b, f) for b in batches) for f in fields)
