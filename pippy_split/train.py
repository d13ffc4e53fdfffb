"""`pippy-split train`: train a model pipelined over local ranks.

Where this sits: on top of the whole flow split → Pipe → stage → schedule → runtime.
Every rank has the same model (same seed), traced and split with `ps.pipeline`
(each rank itself; ranks are spawned, never forked), keeps only its own
stages via `ps.build_schedule`, and steps an AdamW over those stages' parameters.
At the end every rank saves its stages and AdamW state with :mod:`pippy_split.checkpoint`
(keyed by the original FQNs); rank 0 loads that into a fresh unsplit model, samples
from it, and saves its state dict as ``model.pt``.

With no arguments it trains a character-level TinyGPT on written-out additions
(``07+45=25``: operands zero-padded, the answer's digits backwards, see
:mod:`pippy_split.training.corpus`) over 4 stages on 2 local ranks with ZBVZeroBubble:
400 steps of 128 line-aligned windows of 16 characters in 4 microbatches, under
a minute on 2 idle CPU cores, after which the sampled sums are right. It launches
its own ranks with torch's elastic launcher; under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set) it runs the worker directly:

    python -m pippy_split.train --steps 100
    torchrun --nproc-per-node 2 -m pippy_split.train --steps 100

With ``--checkpoint-every N`` the run survives a rank's death: under
``--max-restarts K`` (here) or ``torchrun --max-restarts=K`` the launcher restarts
the whole group, and every rank resumes on its own from the last complete
checkpoint (weights, AdamW state, step, data order), finishing with the same
weights as an uninterrupted run:

    torchrun --nproc-per-node 2 --max-restarts=1 -m pippy_split.train --checkpoint-every 50

The parts live in :mod:`pippy_split.training` (setup, loop, finish).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from .testing import free_port
from .training.config import TrainConfig, build_train_parser, config_from_namespace
from .training.factory import load_factory, unpack_entry  # noqa: F401  (importable from here, as before)
from .training.inputs import JobError, check_inputs
from .training.loop import TRAIN_STATE_DIR, worker  # noqa: F401  (importable from here, as before)
from .training.setup import CHECKPOINT_FILE, SUM_MAX, Prepared, parse_split, prepare  # noqa: F401

__all__ = ["build_parser", "main", "run", "worker", "load_factory", "failure_line", "DEFAULT_CHECKPOINT",
           "TrainConfig"]

DEFAULT_CHECKPOINT = os.path.join("checkpoints", "tiny_gpt")  # the built-in model's run directory


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """``pippy-split train``'s flags: one per :class:`~pippy_split.training.config.TrainConfig` field, plus ``--config``."""
    return build_train_parser(parser or argparse.ArgumentParser(prog="pippy-split train",
                                                                 description=__doc__.split("\n\n")[0]))


def failure_line(error: Any) -> str:
    """One line naming the failed rank and its root cause, from the launcher's ``ChildFailedError``.

    The launcher reports the first rank it saw fail; its cause is the exception that
    rank raised (type and the first line of its message; an error the job found, a
    :class:`~pippy_split.training.inputs.JobError`, by its message alone), the signal
    that killed it, or its exit status. For example
    ``pippy-split train: rank 1 failed: RuntimeError: Numpy is not available``.
    """
    rank, failure = error.get_first_failure()
    message = failure.message
    if isinstance(message, Mapping):  # the error file's {"message": "Type: text", "extraInfo": ...}
        message = message.get("message", "")
    lines = [ln.strip() for ln in str(message or "").splitlines() if ln.strip()]
    recorded = failure.error_file_data.get("message") not in (None, "<NONE>")  # an exception, in its file
    if lines and (recorded or failure.exitcode < 0):  # < 0: killed by a signal, which the message names
        cause = lines[0].removeprefix(f"{JobError.__name__}: ") + (" ..." if len(lines) > 1 else "")
    else:  # e.g. SystemExit: the launcher's message would only be a link to its docs
        cause = f"exit status {failure.exitcode} (its own output above says why)"
    return f"pippy-split train: rank {rank} failed: {cause}"


def rank_traceback(error: Any) -> str:
    """The failed rank's own traceback, where it raised something the job did not find on purpose (a bug):
    "" for a :class:`~pippy_split.training.inputs.JobError`, a signal or an exit status."""
    _, failure = error.get_first_failure()
    data = failure.error_file_data.get("message")
    if not isinstance(data, Mapping) or str(data.get("message", "")).startswith(f"{JobError.__name__}: "):
        return ""
    extra = data.get("extraInfo")
    return str(extra.get("py_callstack", "")).rstrip() if isinstance(extra, Mapping) else ""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m pippy_split.train``; returns the exit status."""
    return run(build_parser().parse_args(argv))


def run(options: argparse.Namespace | TrainConfig) -> int:
    """Train with parsed options (flags, or a :class:`TrainConfig`): run the worker under torchrun,
    else launch ``cfg.ranks`` local ranks."""
    from .schedule.orders import ORDERS

    try:
        cfg = options if isinstance(options, TrainConfig) else config_from_namespace(options)
    except (SystemExit, TypeError, ValueError, OSError) as e:
        print(f"pippy-split train: {e}", file=sys.stderr)
        return 2

    problem = _check_options(cfg, ORDERS) or check_inputs(cfg)
    if problem:
        print(f"pippy-split train: {problem}", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        try:
            worker(cfg)
        except JobError as e:  # under torchrun: this rank's one line (torchrun reports the exit status)
            print(f"pippy-split train: rank {os.environ['RANK']} failed: {e}", file=sys.stderr, flush=True)
            return 1
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Ranks are spawned, never forked: the launcher's agent runs its rendezvous store on
    # threads in this process, and a fork taken while another thread holds a lock can
    # leave a child blocked forever (seen once in CI). Each rank prepares its own run.
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.ranks, rdzv_backend="c10d",
                          rdzv_endpoint=f"localhost:{free_port()}", run_id=f"pippy-split-{os.getpid()}",
                          max_restarts=cfg.max_restarts, monitor_interval=0.1, start_method="spawn")
    try:
        with _quiet_launcher():
            elastic_launch(config, worker)(cfg, None)
    except ChildFailedError as e:
        stack = rank_traceback(e)  # a bug's own frames; an error the job found is its one line
        if stack:
            print(stack, file=sys.stderr)
        print(failure_line(e), file=sys.stderr, flush=True)
        return 1
    return 0


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    """The launcher's own reports of a failed rank (its traceback through the launcher's frames, and the
    SIGTERM of the others) are left out: :func:`failure_line` says which rank failed and why. Its warnings
    about restarting the group (``--max-restarts``) still show."""
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic.multiprocessing.api",
                                              "torch.multiprocessing.spawn")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _check_options(cfg: TrainConfig, schedules: Any) -> str:
    """What is wrong with the options, before any rank starts ("" if nothing)."""
    if cfg.schedule not in schedules:
        return f"unknown schedule {cfg.schedule!r}; choose from {', '.join(schedules)}"
    if cfg.checkpoint_every < 0 or cfg.max_restarts < 0:
        return "--checkpoint-every and --max-restarts must be >= 0"
    if cfg.grad_accum < 1 or cfg.log_every < 1 or cfg.eval_every < 0 or cfg.steps < 1:
        return "--steps, --grad-accum and --log-every must be >= 1, --eval-every >= 0"
    if cfg.weight_decay < 0:
        return f"--weight-decay must be >= 0, got {cfg.weight_decay}"
    if cfg.lr_schedule not in ("cosine", "linear", "constant"):
        return f"--lr-schedule is cosine, linear or constant, got {cfg.lr_schedule!r}"
    if cfg.model and cfg.model.startswith("hf:") and not cfg.data:
        return "--model hf:... trains on --data FILE (a text file)"
    if cfg.data and cfg.model and cfg.model.startswith("zoo:"):
        return (f"--data trains a language model (the built-in TinyGPT, hf:..., or module:factory); {cfg.model} "
                "trains on its own example batch, so --data would be ignored")
    if cfg.pack and (not cfg.data or cfg.model):
        return "--pack packs the lines of a --data text file for the built-in TinyGPT (not with --model)"
    if cfg.dp < 1 or cfg.tp < 1 or cfg.ranks % (cfg.dp * cfg.tp):
        return f"--ranks {cfg.ranks} must be a multiple of --dp {cfg.dp} x --tp {cfg.tp} (the pipeline gets the rest)"
    mixed = [flag for flag, on in (("--bf16", cfg.bf16), ("--activation-checkpoint", cfg.activation_checkpoint),
                                   ("--compile", cfg.compile), ("--grad-accum", cfg.grad_accum > 1),
                                   ("--plan", cfg.plan)) if on]
    if (cfg.dp > 1 or cfg.tp > 1) and mixed:
        return (f"--dp/--tp with {', '.join(mixed)} is not checked exact against the plain pipeline, so the job "
                "refuses it; train N-D without them, or build it in Python (ps.build_schedule, then ps.parallelize)")
    if cfg.dp > 1 and (cfg.pack or (cfg.model and not cfg.data and not cfg.model.startswith("hf:"))):
        return ("--dp splits each step's rows over the replicas: it trains on --data windows or the built-in sums, "
                "not with --pack or a factory's own batch")
    if cfg.simulate_failure and not re.fullmatch(r"\d+:\d+", cfg.simulate_failure):
        return f"--simulate-failure takes RANK:STEP (e.g. 1:5), got {cfg.simulate_failure!r}"
    return ""


if __name__ == "__main__":
    sys.exit(main())
