"""The inputs of ``pippy-split train``, checked before any rank is launched.

Where this sits: in :func:`pippy_split.train.train`, after the options' own checks and
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
from ..zoo import ZOO
from .config import TrainConfig
from .errors import JobError, as_job_error, user_frames
from .factory import load_factory
from .metrics import make_run_dir
from .run_dir import CHECKPOINT_FILE, TRAIN_STATE_DIR, held_run_files, load_model_file, newest_step

__all__ = ["check_inputs", "JobError", "as_job_error"]


def check_inputs(cfg: TrainConfig, restarted: bool = False) -> str:
    """What is wrong with the run's files, factory and run directory ("" if nothing); makes the run directory.
    ``restarted``: a rank the launcher restarted (its run directory is its own)."""
    checks = (_data, _model, _tokenizer, _resume) + (() if restarted else (_not_another_run,)) + (_run_dir,)
    for check in checks:
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
        name = spec[4:]
        return "" if name in ZOO else f"--model {spec}: no zoo model {name!r} (the zoo has: {', '.join(ZOO)})"
    return _factory(spec)


def _factory(spec: str) -> str:
    """``module:factory`` imports and names an attribute (importing the module runs its top level once here)."""
    try:
        factory = load_factory(spec)
    except ValueError as e:
        return f"--model {spec}: {e}"
    except ImportError as e:
        return f"--model {spec}: cannot import {spec.split(':', 1)[0]} ({type(e).__name__}: {e})"
    except AttributeError:
        module, attr = spec.split(":", 1)
        return f"--model {spec}: module {module} has no {attr}"
    except Exception as e:  # the user's module raised while it was imported: their frames, then the cause
        raise JobError(f"--model {spec}: importing {spec.split(':', 1)[0]} raised {type(e).__name__}: {e}"
                       .splitlines()[0], user_frames(e)) from None
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


def _not_another_run(cfg: TrainConfig) -> str:
    """A run directory that already holds a run is continued (``--resume``) or left alone, never overwritten."""
    held = held_run_files(cfg.checkpoint)
    if cfg.resume or not held:
        return ""
    return (f"{cfg.checkpoint} already holds a run ({', '.join(held)}): continue it with --resume, or train a new "
            "one under another --run-name (or --checkpoint DIR)")


def _resume(cfg: TrainConfig) -> str:
    """``--resume`` continues the newest complete state: ``train_state/`` (saved at ``--checkpoint-every``, at
    the end, or when the run was interrupted) or ``model.pt``."""
    if not cfg.resume:
        return ""
    model_pt = os.path.join(cfg.checkpoint, CHECKPOINT_FILE)
    done = newest_step(cfg.checkpoint)
    if done is None and not os.path.isfile(model_pt):
        return (f"--resume: {cfg.checkpoint} holds no complete state to continue (neither {CHECKPOINT_FILE} nor "
                f"{TRAIN_STATE_DIR}/; --checkpoint or --run-name names the run)")
    if done is not None and done >= cfg.steps:
        return (f"--resume: the run in {cfg.checkpoint} has trained {done} steps and --steps {cfg.steps} is the "
                f"total, not more steps: pass --steps above {done} to train on")
    if os.path.isfile(model_pt):
        problem = _unreadable("--resume", model_pt)
        if problem:
            return problem
        load_model_file(cfg.checkpoint, advice=f"move it away: --resume then continues from {TRAIN_STATE_DIR}/ "
                        "where it is complete, else train the run again")
    return ""


def _unreadable(flag: str, path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        return f"{flag} {path}: cannot be read ({e.strerror or e})"
    return ""
