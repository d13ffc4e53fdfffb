"""What goes wrong in generation (every layer of ``pippy_split.generate`` raises these)."""

from __future__ import annotations

__all__ = ["GenerationError"]


class GenerationError(ValueError):
    """A generate() call that cannot run as asked: bad arguments, or a model or split that
    cannot decode step by step exactly. The message says what works instead."""
