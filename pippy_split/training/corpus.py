"""Synthetic character corpus for `pippy-split train`: written-out additions.

Where this sits: outside the flow split → Pipe → stage → schedule → runtime, in the
train job's parts (:mod:`pippy_split.training`). It feeds `pippy_split.train` with a deterministic text (``"17+45=62\\n"`` lines) whose
learning is visible in samples, plus a character vocabulary and batch sampler.

    corpus = CharCorpus(addition_corpus())
    x, y = corpus.batch(32, 32, torch.Generator().manual_seed(0))

What makes the sums learnable by a tiny model in a couple of minutes (the
defaults of `pippy-split train`):

- ``reverse=True`` writes each answer least-significant digit first
  (``17+45=26`` means 62): the model then emits the digit whose carry it already
  knows, the standard trick that makes addition easy for small transformers;
- ``pad=True`` writes the operands with a fixed number of digits (``07+45=25``),
  so each digit sits at the same position in every line: matching the digits
  to add is then a fixed pattern, not a search;
- ``CharCorpus(..., prompt_end="=")`` starts every window at a line start, so the
  ``a+b=`` prompt sits where sampling puts it, and ignores (target ``-100``,
  ``F.cross_entropy``'s ``ignore_index``) the operands, which are random and
  cannot be predicted: the loss is the answer's, and falls towards zero.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import cast

import torch

__all__ = ["addition_corpus", "CharCorpus", "parse_sum", "sum_prompt", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index


def addition_corpus(n_lines: int = 20000, max_value: int = 99, seed: int = 0, reverse: bool = False,
                    pad: bool = False) -> str:
    """``n_lines`` lines ``a+b=c`` with ``0 <= a, b <= max_value``, deterministic in ``seed``.

    With ``reverse`` the answer's digits are written backwards (``17+45=26`` for 62);
    with ``pad`` the operands are zero-padded to the width of ``max_value`` (``07+45=52``).

    Example:
        >>> addition_corpus(2, seed=0).count("\\n")
        2
    """
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, max_value), rng.randint(0, max_value)
        c = str(a + b)
        lines.append(f"{sum_prompt(a, b, max_value if pad else 0)}{c[::-1] if reverse else c}\n")
    return "".join(lines)


def sum_prompt(a: int, b: int, pad_to: int = 0) -> str:
    """``"a+b="``, the operands zero-padded to the width of ``pad_to`` (0: no padding).

    Example:
        >>> sum_prompt(7, 45, 99)
        '07+45='
    """
    w = len(str(pad_to)) if pad_to else 0
    return f"{a:0{w}d}+{b:0{w}d}=" if w else f"{a}+{b}="


def parse_sum(line: str, reverse: bool = False) -> bool | None:
    """True if ``line`` (``"a+b=c..."``, up to the first newline) is a correct sum,
    False if wrong, None if it is not of that form. With ``reverse``, ``c`` is read
    backwards (as :func:`addition_corpus` writes it with ``reverse=True``)."""
    line = line.split("\n", 1)[0]
    try:
        lhs, c = line.split("=", 1)
        a, b = lhs.split("+", 1)
        if not c.isdigit():
            return False  # no answer, or not a number
        return int(a) + int(b) == int(c[::-1] if reverse else c)
    except ValueError:
        return None


@dataclass
class CharCorpus:
    """A text with its character vocabulary (sorted characters) encoded as int64 ids.

    With ``prompt_end`` (e.g. ``"="``), :meth:`batch` starts every window at a line
    start and sets the targets of each line's prompt (up to and including
    ``prompt_end``) to :data:`IGNORE_INDEX`, so only the completions are learned.
    """

    text: str
    chars: str = ""
    prompt_end: str | None = None
    ids: torch.Tensor = field(default=cast(torch.Tensor, None), repr=False)  # (N,) int64

    def __post_init__(self) -> None:
        if not self.chars:
            self.chars = "".join(sorted(set(self.text)))
        self._index = {c: i for i, c in enumerate(self.chars)}
        self.ids = self.encode(self.text)
        self.line_starts = self.learned = None
        if self.prompt_end:
            starts, learned, pos = [], torch.ones(len(self.ids), dtype=torch.bool), 0
            for line in self.text.splitlines(keepends=True):
                starts.append(pos)
                cut = line.find(self.prompt_end)
                if cut >= 0:
                    learned[pos: pos + cut + len(self.prompt_end)] = False
                pos += len(line)
            self.line_starts = torch.tensor(starts, dtype=torch.long)  # (lines,)
            self.learned = learned  # (N,) False where the character is part of a prompt

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        try:
            return torch.tensor([self._index[c] for c in s], dtype=torch.long)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary {self.chars!r}") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows as ``(x, y)``, both ``(batch_size, seq_len)``; y is x shifted left by one
        (with ``prompt_end``: windows start at line starts, prompt targets are ``IGNORE_INDEX``)."""
        if seq_len + 1 > len(self.ids):
            raise ValueError(f"seq_len={seq_len} needs a text of more than {seq_len + 1} characters, "
                             f"got {len(self.ids)}")
        if self.line_starts is not None:
            allowed = self.line_starts[: int((self.line_starts < len(self.ids) - seq_len).sum())]
            starts = allowed[torch.randint(0, len(allowed), (batch_size,), generator=generator)]  # (B,)
        else:
            starts = torch.randint(0, len(self.ids) - seq_len, (batch_size,), generator=generator)  # (B,)
        index = starts[:, None] + torch.arange(seq_len + 1)  # (B, T+1)
        windows = self.ids[index]  # (B, T+1)
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].clone()
        if self.learned is not None:
            keep = self.learned[index[:, 1:]]  # (B, T)
            keep |= ~keep.any(dim=1, keepdim=True)  # a window with no completion in it learns everything
            y[~keep] = IGNORE_INDEX
        return x, y
