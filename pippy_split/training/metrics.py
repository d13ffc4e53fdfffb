"""What rank 0 of ``pippy-split train`` records each step: a JSONL file, plain lines, TensorBoard.

Where this sits: beside the loop in :mod:`pippy_split.training.loop`, on rank 0 only.
Every step goes to ``<run dir>/metrics.jsonl`` (one JSON object per line: step, loss,
lr, grad norm, tokens/s, peak memory; held-out loss on evaluation steps). When the
output is not a terminal (a file, SLURM, CI) a plain line is printed every
``log_every`` steps, where a terminal shows the progress bar instead; TensorBoard
scalars go to ``<run dir>/tensorboard`` when ``tensorboard`` is installed.

Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> log = RunLog(d, log_every=2, tensorboard=False, plain=True, print_fn=print)
    >>> log.step(1, loss=2.0, lr=1e-3, grad_norm=0.5, tokens_per_s=100.0, peak_mib=10.0)
    >>> log.step(2, loss=1.5, lr=1e-3, grad_norm=0.4, tokens_per_s=120.0, peak_mib=10.0)
    step 2  loss 1.5000  lr 1.00e-03  grad norm 0.400  120 tok/s  peak 10 MiB
    >>> log.close()
    >>> [json.loads(line)["loss"] for line in open(os.path.join(d, METRICS_FILE))]
    [2.0, 1.5]
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any, Callable

import torch

from ..checkpoint.files import check_ancestors, failure_reason
from ..checkpoint.layout import CheckpointError
from .run_dir import METRICS_FILE

__all__ = ["RunLog", "METRICS_FILE", "peak_memory_mib"]


def peak_memory_mib(device: torch.device) -> float:
    """The most memory this process has held: the accelerator's allocator peak, or on CPU the
    peak resident set size (which includes torch itself)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


class RunLog:
    """Rank 0's record of one run (see the module docstring). ``append`` keeps an earlier
    run's lines (a resumed or restarted run continues its file)."""

    def __init__(self, directory: str, *, log_every: int, tensorboard: bool, plain: bool,
                 print_fn: Callable[[str], Any], append: bool = False) -> None:
        make_run_dir(directory)
        self.path = os.path.join(directory, METRICS_FILE)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.log_every, self.plain, self.print = log_every, plain, print_fn
        self.writer = _tensorboard(os.path.join(directory, "tensorboard")) if tensorboard else None
        self.tensorboard_missing = tensorboard and self.writer is None

    def step(self, step: int, *, last: bool = False, **metrics: float | None) -> None:
        """Record one optimizer step; a plain line every ``log_every`` steps (and the last) when not a terminal."""
        self._write({"step": step, **metrics})
        if self.writer is not None:
            for name, value in metrics.items():
                if value is not None:
                    self.writer.add_scalar(f"train/{name}", value, step)
        if self.plain and (step % self.log_every == 0 or last):
            self.print(_line(step, metrics))

    def eval(self, step: int, loss: float) -> None:
        """Record the held-out loss at ``step`` (always printed: evaluations are rare)."""
        self._write({"step": step, "eval_loss": loss})
        if self.writer is not None:
            self.writer.add_scalar("eval/loss", loss, step)
        self.print(f"step {step}  held-out loss {loss:.4f}")

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a killed run keeps every step it finished

    def close(self) -> None:
        self._file.close()
        if self.writer is not None:
            self.writer.close()


def make_run_dir(directory: str) -> None:
    """The run's directory, or a CheckpointError naming what is in the way (before any step runs)."""
    try:
        check_ancestors(os.path.abspath(directory))
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot write the run directory {directory}: {failure_reason(directory, e)}",
                              directory) from e


def _line(step: int, m: dict) -> str:
    parts = [f"step {step}"]
    if m.get("loss") is not None:
        parts.append(f"loss {m['loss']:.4f}")
    if m.get("lr") is not None:
        parts.append(f"lr {m['lr']:.2e}")
    if m.get("grad_norm") is not None:
        parts.append(f"grad norm {m['grad_norm']:.3f}")
    if m.get("tokens_per_s") is not None:
        parts.append(f"{m['tokens_per_s']:,.0f} tok/s")
    if m.get("peak_mib") is not None:
        parts.append(f"peak {m['peak_mib']:,.0f} MiB")
    return "  ".join(parts)


def _tensorboard(directory: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter  # local: tensorboard is the job extra's, optional
    except ImportError:
        return None
    return SummaryWriter(directory)
