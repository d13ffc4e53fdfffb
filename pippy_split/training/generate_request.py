"""What ``pippy-split generate`` asks of every rank: the request, and the finished run it names read the same way on both sides.

Where this sits: between the command's launching process
(:mod:`pippy_split.training.generate_run`, which checks the arguments and builds the request
before any rank starts) and each rank (:mod:`pippy_split.training.generate_rank`, which rebuilds
the run's stages and generates). Both read the run's ``model.pt`` (:func:`read_run`) and its
recorded :class:`~pippy_split.training.config.TrainConfig` (:func:`run_config`); the request
carries the prompts as ids and how to choose tokens. Nothing here imports model, split or
schedule code, so the launcher stays light.

Example:
    >>> req = GenerateRequest(run_dir="/runs/sums", input_ids=[[3, 1, 4]], attention_mask=[[1, 1, 1]],
    ...                       options=GenerateOptions(max_new_tokens=3, temperature=0.7))
    >>> req.sampling()["max_new_tokens"], req.sampling()["temperature"], req.eos_token_id
    (3, 0.7, None)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ..generate.options import GenerateOptions
from .config import TrainConfig
from .errors import JobError
from .run_dir import CHECKPOINT_FILE, TRAIN_STATE_DIR, load_model_file, runs_in

__all__ = ["GenerateRequest", "run_config", "read_run"]


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """What every rank is asked: the run, the prompts as ids (left-padded), how to choose tokens
    (``options``, checked by the launching process; its stop and pad fields are left to generate's defaults)."""

    run_dir: str
    input_ids: list[list[int]]
    attention_mask: list[list[int]]
    options: GenerateOptions
    eos_token_id: int | None = None
    """Where a row stops (the task's end: the built-in sums' newline); None: the model's own EOS."""

    def sampling(self) -> dict[str, Any]:
        """The token-choice arguments of ``generate``, from :attr:`options`."""
        return {f: getattr(self.options, f) for f in SAMPLING}


SAMPLING = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed")
"""The fields of :class:`GenerateOptions` the command's flags set."""


# --------------------------------------------------------------------------- the run directory


def run_config(meta: dict, run_dir: str) -> TrainConfig:
    """The run's :class:`TrainConfig` from its ``model.pt``'s ``meta``, its relative paths resolved
    from the directory the run ran in, ``checkpoint`` the run directory as found now.

    A ``model.pt`` from before the config was recorded still serves the built-in TinyGPT (its
    schedule, ranks and split are recorded); other models need the config.

    Example:
        >>> meta = {"config": {"model": "hf:tiny.json", "schedule": "1F1B"}, "cwd": "/runs"}
        >>> cfg = run_config(meta, "/runs/checkpoints/tiny"); cfg.model, cfg.schedule, cfg.checkpoint
        ('hf:/runs/tiny.json', '1F1B', '/runs/checkpoints/tiny')
    """
    raw = meta.get("config")
    if not isinstance(raw, dict):
        if not (meta.get("chars") and meta.get("gpt_config") and meta.get("split")):
            raise JobError(f"{os.path.join(run_dir, 'model.pt')} records no run configuration (it was written before "
                           "pippy-split recorded one): train the run again to generate from it")
        raw = {"schedule": meta["schedule"], "ranks": meta["ranks"],
               "split": ",".join(stage[0] for stage in meta["split"][1:])}
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in raw.items() if k in names})
    here = meta.get("cwd")

    def resolved(path: str | None) -> str | None:
        return path if not path or os.path.isabs(path) or not isinstance(here, str) else os.path.join(here, path)

    model = cfg.model
    if model and model.startswith("hf:"):
        model = "hf:" + str(resolved(model[3:]))
    return dataclasses.replace(cfg, model=model, tokenizer=resolved(cfg.tokenizer), data=resolved(cfg.data),
                               checkpoint=run_dir, resume=False, plan=None)


def read_run(run_dir: str) -> dict:
    """``RUN_DIR/model.pt`` (weights and meta), or a :class:`JobError` saying what is missing."""
    if not os.path.isdir(run_dir):
        raise JobError(f"{run_dir}: no such run directory (the --checkpoint directory of a pippy-split train run)")
    inside = runs_in(run_dir)
    if inside:
        first = os.path.join(run_dir, next(iter(inside)))
        raise JobError(f"{run_dir} holds runs, not one ({', '.join(inside)}): name one, e.g. pippy-split generate "
                       f"{first} --prompt TEXT")
    if not os.path.isfile(os.path.join(run_dir, CHECKPOINT_FILE)):
        unfinished = os.path.isdir(os.path.join(run_dir, TRAIN_STATE_DIR))
        why = (f"the run has not finished (train writes {CHECKPOINT_FILE} at its end; its {TRAIN_STATE_DIR}/ is a "
               "checkpoint to continue with train --resume)") if unfinished else "it is not a pippy-split train run"
        raise JobError(f"{run_dir} holds no trained weights ({CHECKPOINT_FILE}): {why}")
    return load_model_file(run_dir, advice="point generate at the directory of a run train finished, or train "
                           "it again")
