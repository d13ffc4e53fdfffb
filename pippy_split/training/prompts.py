"""The text side of ``pippy-split generate``: prompts as left-padded token ids, new tokens as text.

Where this sits: in :mod:`pippy_split.training.generate_run`, before its ranks start (the
prompts) and after they finish (the completions). The vocabulary is the run's own, read as
``pippy-split train`` read its text: the built-in TinyGPT's characters (recorded in
``model.pt``), the run's ``--tokenizer`` directory (no special tokens added, as
:func:`pippy_split.training.text.tokenize` reads ``--data``), or the text's UTF-8 bytes.
Prompts are left-padded with an attention mask (Hugging Face's convention for decoder-only
models), as ``generate`` takes them.

Example:
    >>> codec = PromptCodec.of_chars("\\n+0123456789=")
    >>> ids, mask = codec.batch(["1+2=", "10+20="])
    >>> ids.tolist()
    [[0, 0, 3, 1, 4, 12], [3, 2, 1, 4, 2, 12]]
    >>> mask.tolist()
    [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    >>> codec.decode([5, 2])
    '30'
"""

from __future__ import annotations

from typing import Any

import torch

from .config import TrainConfig
from .corpus import CharCorpus
from .errors import JobError
from .hf import load_tokenizer

__all__ = ["PromptCodec"]


class PromptCodec:
    """A run's vocabulary: :meth:`batch` reads prompts, :meth:`decode` writes token ids back as text."""

    def __init__(self, kind: str, *, chars: str = "", tokenizer: Any = None) -> None:
        self.kind, self.chars, self.tokenizer = kind, chars, tokenizer
        self._corpus = CharCorpus("", chars=chars) if kind == "chars" else None

    @classmethod
    def of_chars(cls, chars: str) -> PromptCodec:
        return cls("chars", chars=chars)

    @classmethod
    def of_run(cls, cfg: TrainConfig, meta: dict) -> PromptCodec:
        """The vocabulary the run trained with (its ``model.pt``'s ``meta`` and config); a :class:`JobError`
        for a run that trained on no text."""
        if meta.get("chars"):
            return cls.of_chars(meta["chars"])
        if cfg.model and not cfg.data:
            raise JobError(f"the run trained {cfg.model} on its own example batch, not on text, so it has no "
                           "vocabulary to read a prompt with; generate samples from runs on --data text (hf: or "
                           "module:factory models) and from the built-in TinyGPT")
        if cfg.tokenizer:
            return cls("tokenizer", tokenizer=load_tokenizer(cfg.tokenizer))
        return cls("bytes")

    def describe(self) -> str:
        """The vocabulary in words (for error messages)."""
        if self.kind == "chars":
            return f"the characters {self.chars!r} the built-in TinyGPT trained on"
        return "its tokenizer" if self.kind == "tokenizer" else "UTF-8 bytes"

    def encode(self, prompt: str) -> list[int]:
        """One prompt's ids; a :class:`JobError` naming the prompt for an empty one or a character the
        built-in model's vocabulary lacks."""
        if self._corpus is not None:
            missing = sorted({c for c in prompt if c not in self.chars})
            if missing:
                raise JobError(f"--prompt {prompt!r}: {', '.join(map(repr, missing))} not in the run's vocabulary, "
                               f"{self.describe()}")
            ids = self._corpus.encode(prompt).tolist()
        elif self.tokenizer is not None:
            ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        else:
            ids = list(prompt.encode("utf-8"))
        if not ids:
            raise JobError(f"--prompt {prompt!r} is empty: a prompt needs at least one token")
        return ids

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return pad if isinstance(pad, int) else 0

    def batch(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)``, both ``(len(prompts), longest)`` int64, left-padded."""
        rows = [self.encode(p) for p in prompts]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
        return ids, mask

    def decode(self, ids: list[int]) -> str:
        """Token ids as text (a byte model's id beyond 255, or bytes that are not UTF-8, as U+FFFD)."""
        if self._corpus is not None:
            return self._corpus.decode(ids)
        if self.tokenizer is not None:
            return str(self.tokenizer.decode(ids))
        return b"".join(bytes([i]) if 0 <= i < 256 else "\ufffd".encode() for i in ids).decode("utf-8", "replace")
