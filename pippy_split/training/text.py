"""The text ``pippy-split train`` learns: documents from ``--data``, held-out documents, token ids.

Where this sits: the data half of :mod:`pippy_split.training.setup`, for every model
source. ``--data`` is one of:

- a text file: each line a document;
- a JSONL file (``.jsonl``): each line a JSON object whose ``--data-field`` (``text``)
  is a document;
- a directory written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a
  ``DatasetDict`` whose ``train`` split is trained on and whose ``validation`` or
  ``test`` split is held out), its ``--data-field`` column.

Without a held-out split the last tenth of the documents is held out (from 10 documents
on). Every document ends with a newline. Token models read tokens with a local
tokenizer directory (``--tokenizer``) or as the text's UTF-8 bytes (:func:`token_corpora`).

Example:
    >>> docs = documents_of_lines(["a\\n", "b"]); docs
    ['a\\n', 'b\\n']
    >>> held_out_tail([str(i) for i in range(10)])
    (['0', '1', '2', '3', '4', '5', '6', '7', '8'], ['9'])
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import TrainConfig
from .errors import JobError
from .hf import load_tokenizer

__all__ = ["read_documents", "documents_of_lines", "held_out_tail", "TokenCorpus", "tokenize", "token_corpora"]

_HELD_OUT_SPLITS = ("validation", "test")


def documents_of_lines(lines: list[str]) -> list[str]:
    """Each document with exactly one trailing newline (empty documents dropped)."""
    return [d if d.endswith("\n") else d + "\n" for d in lines if d.strip()]


def held_out_tail(docs: list[str]) -> tuple[list[str], list[str]]:
    """(training, held-out): the last tenth of the documents held out, from 10 documents on."""
    if len(docs) < 10:
        return docs, []
    cut = len(docs) - len(docs) // 10
    return docs[:cut], docs[cut:]


def read_documents(cfg: TrainConfig) -> tuple[list[str], list[str]]:
    """``--data``'s (training, held-out) documents; a missing file or field says which."""
    path = cfg.data
    assert path is not None
    if os.path.isdir(path):
        return _dataset_documents(path, cfg.data_field)
    if not os.path.isfile(path):
        raise JobError(f"--data {path}: no such file or directory (a text file, a .jsonl file, or a "
                         "directory saved by datasets' save_to_disk)")
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            docs = [_jsonl_field(line, cfg.data_field, path, n) for n, line in enumerate(f, 1) if line.strip()]
        else:
            docs = f.read().splitlines(keepends=True)
    return held_out_tail(documents_of_lines(docs))


def _jsonl_field(line: str, name: str, path: str, n: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise JobError(f"--data {path}: line {n} is not JSON ({e.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get(name), str):
        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise JobError(f"--data {path}: line {n} has no string field {name!r} (it has: {keys}); "
                         "choose the field with --data-field")
    return record[name]


def _dataset_documents(path: str, name: str) -> tuple[list[str], list[str]]:
    try:
        import datasets  # the job extra's, optional: only a saved dataset's directory needs it
    except ImportError:
        raise JobError(f"--data {path} is a directory: reading a saved dataset needs `datasets` "
                         "(pip install 'pippy-split[job]')") from None
    try:
        loaded: Any = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise JobError(f"--data {path}: not a dataset saved by datasets' save_to_disk ({e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise JobError(f"--data {path}: its splits are {', '.join(loaded)}; training reads the 'train' split")
        held_name = next((s for s in _HELD_OUT_SPLITS if s in loaded), None)
        train = documents_of_lines(_column(loaded["train"], name, path))
        if held_name is None:
            return held_out_tail(train)
        return train, documents_of_lines(_column(loaded[held_name], name, path))
    return held_out_tail(documents_of_lines(_column(loaded, name, path)))


def _column(dataset: Any, name: str, path: str) -> list[str]:
    if name not in dataset.column_names:
        raise JobError(f"--data {path} has no column {name!r} (it has: {', '.join(dataset.column_names)}); "
                         "choose it with --data-field")
    return list(dataset[name])


@dataclass
class TokenCorpus:
    """Token ids of a text (``ids``, int64) with :meth:`batch` drawing next-token windows."""

    ids: torch.Tensor
    text: str = field(default="", repr=False)

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows ``(x, y)``, both ``(batch_size, seq_len)``, y is x shifted left by one."""
        if seq_len + 1 > len(self.ids):
            raise ValueError(f"seq_len={seq_len} needs more than {seq_len + 1} tokens, the text has {len(self.ids)}")
        starts = torch.randint(0, len(self.ids) - seq_len, (batch_size,), generator=generator)
        windows = self.ids[starts[:, None] + torch.arange(seq_len + 1)]
        return windows[:, :-1].contiguous(), windows[:, 1:].clone()


def tokenize(cfg: TrainConfig, text: str, vocab_size: int) -> torch.Tensor:
    """``text``'s ids by ``--tokenizer`` (a local directory) or its UTF-8 bytes, checked against the model's
    vocabulary."""
    if cfg.tokenizer:
        ids = load_tokenizer(cfg.tokenizer)(text, add_special_tokens=False)["input_ids"]
    else:
        ids = list(text.encode("utf-8"))
    out = torch.tensor(ids, dtype=torch.int64)
    if len(out) and int(out.max()) >= vocab_size:
        how = "its tokenizer" if cfg.tokenizer else "UTF-8 bytes (ids up to 255; pass --tokenizer DIR)"
        raise JobError(f"--data {cfg.data} tokenized by {how} has id {int(out.max())}, beyond the model's "
                         f"vocab_size {vocab_size}")
    return out


def token_corpora(cfg: TrainConfig, vocab_size: int) -> tuple[TokenCorpus, TokenCorpus | None]:
    """(training, held-out) token corpora of ``--data`` (held-out None when it holds one window or less)."""
    train_docs, held_docs = read_documents(cfg)
    train_text, held_text = "".join(train_docs), "".join(held_docs)
    train = TokenCorpus(tokenize(cfg, train_text, vocab_size), train_text)
    held_ids = tokenize(cfg, held_text, vocab_size) if held_text else torch.zeros(0, dtype=torch.int64)
    return train, (TokenCorpus(held_ids, held_text) if len(held_ids) > cfg.seq_len + 1 else None)
