"""The end of ``pippy-split train`` on rank 0: the unsplit model, samples, ``model.pt``.

Where this sits: after every rank's :mod:`pippy_split.checkpoint` save in
:mod:`pippy_split.training.loop`. Rank 0 reads every stage's weights back into a
fresh unsplit model (no gather of state dicts: the save has returned on every
rank, so the checkpoint is complete), samples from it, and writes its state dict
as ``model.pt`` atomically (:func:`pippy_split.checkpoint.files.save_file`).

``model.pt`` holds ``{"state_dict": {FQN: tensor}, "meta": {...}}``: the unsplit model's
own keys, and plain values about the run (model, config of the built-in GPT, data,
schedule, split, losses; the whole ``TrainConfig`` as a dict and the directory the run
ran in, from which ``pippy-split generate`` rebuilds it). It loads without unpickling code::

    model.load_state_dict(torch.load("checkpoints/tiny_gpt/model.pt", weights_only=True)["state_dict"])
"""

from __future__ import annotations

import dataclasses
import os
import random
import warnings
from typing import TYPE_CHECKING, Callable, cast

import torch

import pippy_split as ps

from ..checkpoint.files import save_file
from ..zoo.gpt import generate
from .config import TrainConfig
from .corpus import parse_sum, sum_prompt
from .hf import export_hf, is_hf
from .run_dir import CHECKPOINT_FILE
from .setup import SUM_MAX, Prepared, fresh_model

if TYPE_CHECKING:
    from ..zoo.gpt import TinyGPT

__all__ = ["finish", "save_model_file"]


def save_model_file(path: str, state_dict: dict, meta: dict) -> str:
    """``{"state_dict", "meta"}`` as ``<path>/model.pt``, replacing the old one only once complete."""
    return save_file(os.path.join(path, CHECKPOINT_FILE), lambda f: torch.save({"state_dict": state_dict,
                                                                                 "meta": meta}, f))


def finish(cfg: TrainConfig, prep: Prepared, dcp_dir: str, losses: list[float], world: int,
           log: Callable[..., None]) -> None:
    fresh = fresh_model(cfg, prep)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ps.checkpoint.load(dcp_dir, fresh, strict=False, no_dist=True)
    for w in caught:
        if issubclass(w.category, UserWarning) and "does not match the model" in str(w.message):
            log(f"[yellow]stages' checkpoint vs fresh model: {w.message}")
    merged = {k: v.detach().cpu() for k, v in fresh.state_dict().items()}
    fresh.eval()
    if prep.gpt_cfg is not None:  # the built-in TinyGPT on characters
        sample(cfg, fresh, prep.corpus, log)
    if cfg.export_hf:
        if not (is_hf(cfg) or hasattr(fresh, "save_pretrained")):
            log(f"[yellow]--export-hf writes Hugging Face models (save_pretrained); {type(fresh).__name__} has none: "
                "skipped")
        else:
            log(f"Hugging Face directory written to {export_hf(fresh, cfg.export_hf, cfg.tokenizer, cfg.export_shard_size)}")
    pipe = prep.pipe
    meta = {"model": cfg.model or "TinyGPT", "gpt_config": prep.gpt_cfg,
            "chars": prep.corpus.chars if prep.gpt_cfg is not None else None,
            "data": _data_description(cfg, prep), "steps": cfg.steps, "run_name": cfg.run_name,
            "schedule": cfg.schedule, "ranks": world,
            "num_stages": pipe.num_stages, "split": [list(s.modules) for s in pipe.stages],
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "losses": list(losses), "lr": cfg.lr,
            # the whole config and where it ran: `pippy-split generate RUN_DIR` rebuilds the run's stages from it
            "config": dataclasses.asdict(cfg), "cwd": os.getcwd()}
    path = save_model_file(cfg.checkpoint, merged, meta)
    log(f"checkpoint saved to {path} ({len(merged)} tensors, original FQNs)")


def _data_description(cfg: TrainConfig, prep: Prepared) -> str:
    if cfg.data:
        return cfg.data + (" (lines packed per microbatch)" if cfg.pack else "")
    if prep.gpt_cfg is not None:
        return "additions (operands padded, answers reversed)"
    return f"{cfg.model}'s example batch"


def sample(cfg: TrainConfig, model: torch.nn.Module, corpus, log: Callable[..., None]) -> None:
    """Greedy samples from ``model`` (the built-in sums are judged right or wrong)."""
    model = cast("TinyGPT", model)  # the built-in model (sampling runs only for it)
    rng = random.Random(cfg.seed + 1234)
    if cfg.data:
        lines = [ln for ln in corpus.text.splitlines() if ln.strip()] or [corpus.text]
        prompts = [ln[: max(1, len(ln) // 2)] for ln in rng.sample(lines, min(cfg.samples, len(lines)))]
    else:
        prompts = [sum_prompt(rng.randint(0, SUM_MAX), rng.randint(0, SUM_MAX), SUM_MAX) for _ in range(cfg.samples)]
    reverse = not cfg.data  # the built-in corpus writes answers backwards
    correct = judged = 0
    log("[bold]samples[/] (greedy" + (", the model writes the answer's digits backwards" if reverse else "") + "):")
    for p in prompts:
        ids = corpus.encode(p)[None, -model.block_size:]
        out = generate(model, ids, 8 if not cfg.data else 32)
        text = corpus.decode(out[0].tolist())
        line = text.split("\n", 1)[0] if p.count("\n") == 0 else text
        ok = parse_sum(line, reverse=reverse)
        if ok is not None:
            judged += 1
            correct += ok
        mark = "" if ok is None else ("  [green]✓[/]" if ok else "  [red]✗[/]")
        if reverse and ok is not None:
            lhs, answer = line.split("=", 1)
            a, b = (int(v) for v in lhs.split("+"))
            log(f"  {line!r:12}  i.e. {a:>2} + {b:>2} = {answer[::-1]:<4}{mark}")
        else:
            log(f"  {line!r}{mark}")
    if not cfg.data or judged:
        log(f"correct sums: {correct}/{len(prompts)}")
