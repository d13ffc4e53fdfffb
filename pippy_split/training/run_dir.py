"""What a run directory holds, and which of its states is complete: ``model.pt``, ``train_state/``, ``metrics.jsonl``.

Where this sits: read by the launching process before any rank starts (``train`` refusing to
overwrite a run, ``--resume`` finding its state, ``generate`` reading ``model.pt``) and by the
ranks (:mod:`pippy_split.training.loop`, :mod:`pippy_split.training.setup`). A run directory
holds the merged weights and the run's record (``model.pt``, written at the end of a run by
:mod:`pippy_split.training.finish`), every rank's stages and AdamW state with the run's
position (``train_state/``, written at ``--checkpoint-every``, at the end and when the run
is interrupted), and the per-step record (``metrics.jsonl``).

Example:
    >>> import tempfile
    >>> held_run_files(tempfile.mkdtemp()), newest_step(tempfile.mkdtemp())
    ([], None)
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile

import torch

from .. import checkpoint as ps_checkpoint
from .errors import JobError

__all__ = ["CHECKPOINT_FILE", "TRAIN_STATE_DIR", "METRICS_FILE", "load_model_file", "saved_position",
           "newest_step", "held_run_files", "runs_in"]

CHECKPOINT_FILE = "model.pt"
TRAIN_STATE_DIR = "train_state"  # pippy_split.checkpoint of the stages + AdamW, beside model.pt
METRICS_FILE = "metrics.jsonl"


def load_model_file(path: str, advice: str = "train the run again") -> dict:
    """``<path>/model.pt``: ``{"state_dict": {FQN: tensor}, "meta": {...plain values}}``, read with
    ``weights_only=True`` (tensors and plain containers only: a crafted file cannot run code). A file that
    holds anything else, or is cut short, is refused by a :class:`JobError` naming it and ending with
    ``advice`` (what to do); it is not loaded."""
    file = os.path.join(path, CHECKPOINT_FILE)
    incomplete = f"{file} is not a complete checkpoint this job wrote"
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # torch's text would advise weights_only=False: never, for this file
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        if found is None and not _pickled(file):
            raise JobError(f"{incomplete} (it cannot be read back: cut short, or other bytes); {advice}") from None
        holds = f"it holds {found.group(1)}" if found else "it holds pickled objects, not only tensors and plain values"
        raise JobError(f"{file} is not a checkpoint this job wrote ({holds}); a pickled object could run code when "
                       "loaded, so it will not be loaded") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, KeyError, ValueError):
        raise JobError(f"{incomplete} (it cannot be read back: cut short, or other bytes); {advice}") from None
    if not (isinstance(state, dict) and isinstance(state.get("state_dict"), dict)):
        raise JobError(f"{file} is not a checkpoint this job wrote (no \"state_dict\" of tensors by FQN); it "
                       "will not be loaded")
    return state


def _pickled(file: str) -> bool:
    """A torch.save archive, or a plain pickle (its protocol header): objects, where other bytes are damage."""
    if zipfile.is_zipfile(file):
        return True
    with open(file, "rb") as f:
        head = f.read(2)
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def saved_position(dcp_dir: str) -> dict | None:
    """The ``extra`` a run saved with its stages (step, data order, losses, steps, seed, run id), read
    without a process group or the model; None where there is no complete checkpoint."""
    if not os.path.isfile(os.path.join(dcp_dir, ".metadata")):
        return None
    probe = torch.nn.Module()  # no keys: reads only ``extra``
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # every key of the checkpoint is "unexpected" to the probe
        try:
            extra = ps_checkpoint.load(dcp_dir, probe, strict=False, no_dist=True)
        except Exception:  # a torn or foreign checkpoint is not a complete one of this job
            return None
    return extra if isinstance(extra, dict) else None


def newest_step(run_dir: str) -> int | None:
    """The step of the run's newest complete ``train_state/`` (None: there is none)."""
    step = (saved_position(os.path.join(run_dir, TRAIN_STATE_DIR)) or {}).get("step")
    return step if isinstance(step, int) else None


def held_run_files(run_dir: str) -> list[str]:
    """The run's own files already in ``run_dir`` (a run another ``train`` would overwrite)."""
    return [name for name in (METRICS_FILE, CHECKPOINT_FILE, TRAIN_STATE_DIR)
            if os.path.exists(os.path.join(run_dir, name))]


def runs_in(folder: str) -> dict[str, str]:
    """The runs directly inside ``folder`` (e.g. ``checkpoints/``): ``{name: state in words}``, sorted; {} when
    ``folder`` is itself a run or holds none.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); os.makedirs(os.path.join(d, "a", TRAIN_STATE_DIR))
        >>> runs_in(d)
        {'a': 'not finished (train_state/ only: continue it with train --resume)'}
    """
    if not os.path.isdir(folder) or held_run_files(folder):
        return {}
    found = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isdir(path) or not held_run_files(path):
            continue
        if os.path.isfile(os.path.join(path, CHECKPOINT_FILE)):
            found[name] = "finished (model.pt)"
        elif os.path.isdir(os.path.join(path, TRAIN_STATE_DIR)):
            found[name] = f"not finished ({TRAIN_STATE_DIR}/ only: continue it with train --resume)"
        else:
            found[name] = "no weights (metrics.jsonl only)"
    return found
