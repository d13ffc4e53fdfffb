"""Synthetic character corpus for `pippy-split train`: written-out additions.

Where this sits: outside the flow split → Pipe → stage → schedule → runtime. It
feeds `pippy_split.train` with a deterministic text (``"317+45=362\\n"`` lines) whose
learning is visible in samples, plus a character vocabulary and batch sampler.

    corpus = CharCorpus(addition_corpus())
    x, y = corpus.batch(32, 32, torch.Generator().manual_seed(0))
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

__all__ = ["addition_corpus", "CharCorpus", "parse_sum"]

ADDITION_CHARS = "\n+0123456789="


def addition_corpus(n_lines: int = 20000, max_value: int = 99, seed: int = 0) -> str:
    """``n_lines`` lines ``a+b=c`` with ``0 <= a, b <= max_value``, deterministic in ``seed``.

    Example:
        >>> addition_corpus(2, seed=0).count("\\n")
        2
    """
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, max_value), rng.randint(0, max_value)
        lines.append(f"{a}+{b}={a + b}\n")
    return "".join(lines)


def parse_sum(line: str) -> bool | None:
    """True if ``line`` (``"a+b=c..."``, up to the first newline) is a correct sum,
    False if wrong, None if it is not of that form."""
    line = line.split("\n", 1)[0]
    try:
        lhs, c = line.split("=", 1)
        a, b = lhs.split("+", 1)
        return int(a) + int(b) == int(c)
    except ValueError:
        return None


@dataclass
class CharCorpus:
    """A text with its character vocabulary (sorted characters) encoded as int64 ids."""

    text: str
    chars: str = ""
    ids: torch.Tensor = field(default=None, repr=False)  # (N,) int64

    def __post_init__(self) -> None:
        if not self.chars:
            self.chars = "".join(sorted(set(self.text)))
        self._index = {c: i for i, c in enumerate(self.chars)}
        self.ids = self.encode(self.text)

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
        """Random windows as ``(x, y)``, both ``(batch_size, seq_len)``; y is x shifted left by one."""
        if seq_len + 1 > len(self.ids):
            raise ValueError(f"seq_len={seq_len} needs a text of more than {seq_len + 1} characters, "
                             f"got {len(self.ids)}")
        starts = torch.randint(0, len(self.ids) - seq_len, (batch_size,), generator=generator)  # (B,)
        windows = torch.stack([self.ids[s:s + seq_len + 1] for s in starts.tolist()])  # (B, T+1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
