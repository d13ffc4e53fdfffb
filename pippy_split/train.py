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
import dataclasses
import os
import re
import shlex
import sys

from .schedule.orders import ORDERS
from .training.config import TrainConfig, build_train_parser, config_from_namespace, load_toml
from .training.errors import JobError, RankFailed, failure_line, rank_traceback, report  # noqa: F401  (importable from here)
from .training.factory import load_factory, unpack_entry  # noqa: F401  (importable from here, as before)
from .training.inputs import check_inputs
from .training.launch import Interrupted, launch
from .training.loop import TRAIN_STATE_DIR, restart_count, worker  # noqa: F401  (importable from here, as before)
from .training.run_dir import newest_step
from .training.setup import CHECKPOINT_FILE, DEFAULT_N_LAYER, SUM_MAX, Prepared, gpt_split, parse_split, prepare  # noqa: F401

__all__ = ["train_main", "train", "worker", "load_factory", "failure_line", "DEFAULT_CHECKPOINT",
           "TrainConfig", "resume_command"]

DEFAULT_CHECKPOINT = os.path.join("checkpoints", "tiny_gpt")  # the built-in model's run directory


def train_main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m pippy_split.train``; returns the exit status."""
    return train(build_train_parser().parse_args(argv))


def train(options: argparse.Namespace | TrainConfig) -> int:
    """Train with parsed options (flags, or a :class:`TrainConfig`): run the worker under torchrun,
    else launch ``cfg.ranks`` local ranks. Every mistake found is reported in one place (:func:`report`)."""
    try:
        return _run(options)
    except JobError as e:
        return report("train", e)


def _run(options: argparse.Namespace | TrainConfig) -> int:
    try:
        cfg = options if isinstance(options, TrainConfig) else config_from_namespace(options)
    except (TypeError, ValueError, OSError) as e:
        raise JobError(str(e)) from None
    problem = _check_options(cfg) or check_inputs(cfg, restarted=restart_count() > 0)
    if problem:
        raise JobError(problem)
    config_file = None if isinstance(options, TrainConfig) else getattr(options, "config", None)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is a rank
        try:
            stopped = worker(cfg)
        except JobError as e:  # this rank's one line (torchrun reports the exit status)
            raise RankFailed(f"rank {os.environ['RANK']} failed: {e.line}", e.frames) from None
        if stopped is not None and int(os.environ["RANK"]) == 0:
            print(_interrupted_line(cfg, config_file, stopped), file=sys.stderr, flush=True)
        return 0
    try:
        launch(launched_worker, (cfg,), ranks=cfg.ranks, name="pippy-split", max_restarts=cfg.max_restarts)
    except Interrupted as e:
        print(_interrupted_line(cfg, config_file, newest_step(cfg.checkpoint)), file=sys.stderr, flush=True)
        return 128 + e.signum
    except RankFailed:
        with contextlib.suppress(OSError):  # a run that failed before writing anything leaves no directory
            os.rmdir(cfg.checkpoint)
        raise
    if not cfg.model or cfg.data:  # a run on text (a factory's own batch has no vocabulary to prompt with)
        print(f"next: pippy-split generate {shlex.quote(cfg.checkpoint)} --prompt "
              f"{shlex.quote(_example_prompt(cfg))}", flush=True)
    return 0


def launched_worker(cfg: TrainConfig) -> None:
    """One rank under this command's launcher: :func:`worker`; a rank that stopped on a signal ends its process
    at once (its state is saved): the launcher, stopping too, no longer collects what ranks return, and the
    process would wait for it (torch's spawned ranks also take ``sys.exit(0)`` as a return)."""
    if worker(cfg) is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _interrupted_line(cfg: TrainConfig, config_file: str | None, step: int | None) -> str:
    """The one line an interrupted run ends with: where it stopped and the command that continues it."""
    if step is None:
        return (f"pippy-split train: interrupted before a state was saved in {cfg.checkpoint}; nothing to resume: "
                "train it again")
    return f"pippy-split train: interrupted at step {step}; resume with: {resume_command(cfg, config_file)}"


def resume_command(cfg: TrainConfig, config_file: str | None = None) -> str:
    """The ``pippy-split train`` command that continues ``cfg``'s run: ``--config`` and the options that differ
    from it (or from the defaults), then ``--resume``.

    Example:
        >>> resume_command(TrainConfig(steps=40, checkpoint="runs/a b"))
        "pippy-split train --steps 40 --checkpoint 'runs/a b' --resume"
    """
    base_values = load_toml(config_file) if config_file else {}
    base = TrainConfig(**{**base_values, "model": cfg.model, "data": cfg.data})
    words = ["--config", config_file] if config_file else []
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.name in ("resume", "simulate_failure") or value == getattr(base, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            words += [flag, str(value)]
    return " ".join(["pippy-split", "train", *map(shlex.quote, words), "--resume"])


def _example_prompt(cfg: TrainConfig) -> str:
    """A prompt to try the trained model with: a sum for the built-in task, else a placeholder for the user's text."""
    return "07+45=" if not cfg.data and not cfg.model else "TEXT TO CONTINUE"


def _check_options(cfg: TrainConfig) -> str:
    """What is wrong with the options, before any rank starts ("" if nothing)."""
    if cfg.schedule not in ORDERS:
        return f"unknown schedule {cfg.schedule!r}; choose from {', '.join(ORDERS)}"
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
    return _stage_count(cfg)


def _stage_count(cfg: TrainConfig) -> str:
    """A ``--split`` the schedule cannot place on the pipeline's ranks, or a built-in model with too few blocks
    for the schedule's stages: what is wrong and what works ("" if nothing)."""
    if cfg.plan:  # the plan chooses the split
        return ""
    spec, pp = ORDERS[cfg.schedule], cfg.ranks // (cfg.dp * cfg.tp)
    given = parse_split(cfg.split)
    if given:
        n = len(dict.fromkeys(given)) + 1
        if spec.fits(n, pp):
            return ""
        per = spec.default_stages_per_rank()
        works = [f"{per * pp - 1} split points ({per * pp} stages)"]
        works += [f"--ranks {r * cfg.dp * cfg.tp} for these {n} stages" for r in range(1, n + 1)
                  if spec.fits(n, r)][:1]
        works += [f"--schedule {name}" for name, other in ORDERS.items() if other.fits(n, pp)][:2]
        return (f"--split {cfg.split} makes {n} stages, which {cfg.schedule} cannot place on {pp} pipeline rank"
                f"{'s' if pp != 1 else ''} (it needs {spec.stage_rule()}); what works: {'; or '.join(works)}")
    if cfg.model is None:
        try:
            gpt_split(cfg.n_layer or DEFAULT_N_LAYER, pp * spec.default_stages_per_rank(), cfg.schedule)
        except JobError as e:
            return e.line
    return ""


if __name__ == "__main__":
    sys.exit(train_main())
