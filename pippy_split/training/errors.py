"""How the job's failures reach the user: one error type, one line, the user's own frames only.

Where this sits: under every part of :mod:`pippy_split.training` and the two commands
(``train``, ``generate``). A mistake the job finds (a bad file, a refused split, a factory
that raises) is a :class:`JobError` wherever it is found, in the launching process or in a
rank; :func:`report` is the one place that turns one into what the user reads: the user's
own frames where their code raised (never the launcher's or this library's), then one line.
A rank's error crosses to the launching process as text (torch's error file);
:meth:`JobError.from_text` reads it back.

Example:
    >>> e = JobError("--data x.txt: line 3 is not JSON")
    >>> e.line, e.frames
    ('--data x.txt: line 3 is not JSON', '')
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["JobError", "RankFailed", "as_job_error", "report", "user_frames", "call_user", "failure_line", "rank_traceback"]

_TRACEBACK = "Traceback (most recent call last):"
_TORCH = importlib.util.find_spec("torch")  # found, not imported: config.py (no torch) raises JobError too
_LIBRARY_DIRS = tuple(os.path.dirname(p) + os.sep for p in (os.path.dirname(__file__),  # pippy_split/
                                                             (_TORCH and _TORCH.origin) or "/nonexistent/torch"))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
T = TypeVar("T")


class JobError(Exception):
    """A user's mistake the job found: ``line`` is what the user reads; ``frames`` (optional) the user's own
    traceback, shown above it. Its text (``str(e)``) holds both, so it survives a rank's error file."""

    def __init__(self, line: str, frames: str = "") -> None:
        super().__init__(line + (f"\n{frames}" if frames else ""))
        self.line, self.frames = line, frames

    @classmethod
    def from_text(cls, text: str) -> JobError:
        """The error whose ``str`` was ``text`` (a rank's message read back in the launching process); a
        message of several lines without frames keeps its first line, marked ``...``."""
        line, sep, frames = text.partition(f"\n{_TRACEBACK}")
        lines = [ln.strip() for ln in line.splitlines() if ln.strip()] or [""]
        first = lines[0] + (" ..." if len(lines) > 1 else "")
        return cls(first, (_TRACEBACK + frames).rstrip() if sep else "")


class RankFailed(JobError):
    """A rank failed after the ranks started (its line: ``rank N failed: CAUSE``); the command exits 1, where a
    mistake found before any rank started exits 2."""


def as_job_error(e: BaseException) -> JobError | None:
    """The :class:`JobError` for an error the job or the library raised on purpose (an error class of
    ``pippy_split``, named in the text, or an ``OSError``); None for anything else (a bug, whose traceback
    the user needs)."""
    if isinstance(e, JobError):
        return e
    if type(e).__module__.startswith("pippy_split.") or isinstance(e, OSError):
        return JobError(f"{type(e).__name__}: {e}")
    return None


def user_frames(error: BaseException) -> str:
    """``error``'s traceback with only the user's own frames: none of this library's, torch's (the launcher
    included) or the standard library's; "" when no frame is the user's.

    Example:
        >>> try:  # raised in this library, called from no file of the user's
        ...     JobError.from_text(None)
        ... except AttributeError as e:
        ...     user_frames(e)
        ''
    """
    frames = [f for f in traceback.extract_tb(error.__traceback__) if _users(f.filename)]
    if not frames:
        return ""
    body = "".join(traceback.format_list(frames))
    return f"{_TRACEBACK}\n{body}{type(error).__name__}: {error}".rstrip()


def _users(filename: str) -> bool:
    path = os.path.abspath(filename)
    return not (filename.startswith("<") or path.startswith(_LIBRARY_DIRS)
                or (path.startswith(_STDLIB) and "site-packages" not in path))


def call_user(fn: Callable[[], T], what: str) -> T:
    """``fn()``, the user's own code (``what`` names it, e.g. ``--model mymodels:build``): an exception it
    raises becomes a :class:`JobError` naming ``what`` and the cause, with the user's frames only."""
    try:
        return fn()
    except Exception as e:  # the user's code: any exception is theirs to read
        raise JobError(f"{what} raised {type(e).__name__}: {e}".splitlines()[0], user_frames(e)) from None


def report(command: str, error: JobError, file: Any = None) -> int:
    """The one place a :class:`JobError` becomes what the user reads: its frames, then
    ``pippy-split COMMAND: LINE``; the command's exit status (1: a rank failed, 2: found before any started)."""
    out = file if file is not None else sys.stderr
    if error.frames:
        print(error.frames, file=out)
    print(f"pippy-split {command}: {error.line}", file=out, flush=True)
    return 1 if isinstance(error, RankFailed) else 2


def failure_line(error: Any, command: str = "train") -> str:
    """One line naming the failed rank and its root cause, from the launcher's ``ChildFailedError``.

    The launcher reports the first rank it saw fail; its cause is the exception that
    rank raised (type and the first line of its message; a :class:`JobError` by its line
    alone), the signal that killed it, or its exit status. For example
    ``pippy-split train: rank 1 failed: RuntimeError: Numpy is not available``.
    """
    rank, failure = error.get_first_failure()
    message = failure.message
    if isinstance(message, Mapping):  # the error file's {"message": "Type: text", "extraInfo": ...}
        message = message.get("message", "")
    text = str(message or "")
    recorded = failure.error_file_data.get("message") not in (None, "<NONE>")  # an exception, in its file
    if text.strip() and (recorded or failure.exitcode < 0):  # < 0: killed by a signal, which the message names
        cause = JobError.from_text(text.removeprefix(f"{JobError.__name__}: ")).line
    else:  # e.g. SystemExit: the launcher's message would only be a link to its docs
        cause = f"exit status {failure.exitcode} (its own output above says why)"
    return f"pippy-split {command}: rank {rank} failed: {cause}"


def rank_traceback(error: Any) -> str:
    """What the failed rank shows above :func:`failure_line`: a bug's own traceback; a :class:`JobError`'s
    user frames ("" if it has none); "" for a signal or an exit status."""
    _, failure = error.get_first_failure()
    data = failure.error_file_data.get("message")
    if not isinstance(data, Mapping):
        return ""
    message = str(data.get("message", ""))
    if message.startswith(f"{JobError.__name__}: "):
        return JobError.from_text(message.removeprefix(f"{JobError.__name__}: ")).frames
    extra = data.get("extraInfo")
    return str(extra.get("py_callstack", "")).rstrip() if isinstance(extra, Mapping) else ""
