"""The inputs of ``pippy-split train``, checked before any rank is launched.

Where this sits: in :func:`pippy_split.train.run`, after the options' own checks and
before the launcher starts ranks. A file that is missing or unreadable, a factory that
does not import, a ``config.json`` that does not parse, a run directory that cannot be
made: each is one line naming the input and what is wrong, found here in a second
rather than inside every rank after the launcher has started them. What only a built
model can tell (a split, the tokens against its vocabulary) is still found in the
ranks, and reported there in one line too (:func:`pippy_split.train.failure_line`).

Example:
    >>> check_inputs(TrainConfig(data="no/such/file.txt", checkpoint="/dev/null/run"))
    "--data no/such/file.txt: no such file or directory (a text file, a .jsonl file, or a directory saved by datasets' save_to_disk)"
"""

from __future__ import annotations

import importlib.util
import json
import os

from ..checkpoint.layout import CheckpointError
from .config import TrainConfig
from .metrics import make_run_dir

__all__ = ["check_inputs", "JobError", "as_job_error"]


class JobError(Exception):
    """An error the job found inside a rank (a bad input, a refused split, ...): its message, one line first,
    is what the user reads; the launcher's side prints no traceback for it."""


def as_job_error(e: BaseException) -> JobError | None:
    """The :class:`JobError` for an error the job or the library raised on purpose: ``SystemExit`` with a
    message, an error class of ``pippy_split`` (named in the text), an ``OSError``; None for anything else
    (a bug, whose traceback the user needs)."""
    if isinstance(e, JobError):
        return e
    if isinstance(e, SystemExit):
        return JobError(e.code) if isinstance(e.code, str) else None
    if type(e).__module__.startswith("pippy_split.") or isinstance(e, OSError):
        return JobError(f"{type(e).__name__}: {e}")
    return None


def check_inputs(cfg: TrainConfig) -> str:
    """What is wrong with the run's files, factory and run directory ("" if nothing); makes the run directory."""
    for check in (_data, _model, _tokenizer, _run_dir, _resume):
        problem = check(cfg)
        if problem:
            return problem
    return ""


def _data(cfg: TrainConfig) -> str:
    path = cfg.data
    if not path or os.path.isdir(path):
        return ""
    if not os.path.isfile(path):
        return (f"--data {path}: no such file or directory (a text file, a .jsonl file, or a directory saved by "
                "datasets' save_to_disk)")
    return _unreadable("--data", path)


def _model(cfg: TrainConfig) -> str:
    spec = cfg.model
    if not spec:
        return ""
    if spec.startswith("hf:"):
        return _hf_config(spec)
    if spec.startswith("zoo:"):
        from ..zoo import ZOO

        name = spec[4:]
        return "" if name in ZOO else f"--model {spec}: no zoo model {name!r} (the zoo has: {', '.join(ZOO)})"
    return _factory(spec)


def _factory(spec: str) -> str:
    """``module:factory`` imports and names an attribute (importing the module runs its top level once here)."""
    from .factory import load_factory

    try:
        factory = load_factory(spec)
    except ValueError as e:
        return f"--model {spec}: {e}"
    except ImportError as e:
        return f"--model {spec}: cannot import {spec.split(':', 1)[0]} ({type(e).__name__}: {e})"
    except AttributeError:
        module, attr = spec.split(":", 1)
        return f"--model {spec}: module {module} has no {attr}"
    if not callable(factory):
        return f"--model {spec}: {spec.split(':', 1)[1]} is a {type(factory).__name__}, not a callable factory"
    return ""


def _hf_config(spec: str) -> str:
    path = spec.split(":", 1)[1]
    config = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(config):
        return f"--model {spec}: {path} is neither a config.json file nor a directory holding one"
    problem = _unreadable("--model", config)
    if problem:
        return problem
    try:
        with open(config, encoding="utf-8") as f:
            values = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        return f"--model {spec}: {config} is not JSON ({e})"
    if not isinstance(values, dict) or "model_type" not in values:
        return f"--model {spec}: {config} has no model_type (e.g. \"qwen2\", \"llama\")"
    if importlib.util.find_spec("transformers") is None:
        return "--model hf:... needs transformers: pip install 'pippy-split[job]' (or pip install transformers)"
    return ""


def _tokenizer(cfg: TrainConfig) -> str:
    if cfg.tokenizer and not os.path.isdir(cfg.tokenizer):
        return f"--tokenizer {cfg.tokenizer}: not a directory (a local tokenizer directory: tokenizer.json ...)"
    return ""


def _run_dir(cfg: TrainConfig) -> str:
    try:
        make_run_dir(cfg.checkpoint)
    except CheckpointError as e:
        return str(e)
    return ""


def _resume(cfg: TrainConfig) -> str:
    from .setup import CHECKPOINT_FILE

    path = os.path.join(cfg.checkpoint, CHECKPOINT_FILE)
    if not cfg.resume:
        return ""
    if not os.path.isfile(path):
        return f"--resume: {path} does not exist (--checkpoint names the directory of the run to continue)"
    from .loop import TRAIN_STATE_DIR, saved_position

    done = (saved_position(os.path.join(cfg.checkpoint, TRAIN_STATE_DIR)) or {}).get("step")
    if isinstance(done, int) and done >= cfg.steps:
        return (f"--resume: the run in {cfg.checkpoint} has trained {done} steps and --steps {cfg.steps} is the "
                f"total, not more steps: pass --steps above {done} to train on")
    return _unreadable("--resume", path)


def _unreadable(flag: str, path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        return f"{flag} {path}: cannot be read ({e.strerror or e})"
    return ""
