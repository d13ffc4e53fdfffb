"""``pippy-split generate RUN_DIR --prompt ...``: sample from a ``pippy-split train`` run on its own stages and ranks.

Where this sits: after a train run, beside :mod:`pippy_split.train`. The run's ``model.pt``
holds its trained weights (original FQNs) and, in its ``meta``, the run's whole
:class:`~pippy_split.training.config.TrainConfig` and the directory it ran in
(:mod:`pippy_split.training.finish`). From those every rank rebuilds what ``train
--resume`` rebuilds: the same model from the same source
(:func:`pippy_split.training.setup.model_source`; the built-in TinyGPT from its recorded
config), the trained weights loaded before it is split, the same split (checked against the
stages the run recorded), the same schedule and mesh over the same number of local ranks
(launched as ``train`` launches them, or under ``torchrun``; a run of one rank in this process,
with no launcher). Then every rank calls ``sched.generate`` with the prompts, read in the run's
own vocabulary (:mod:`pippy_split.training.prompts`), and the text of rank 0's result is printed.

This module is the command's launching process: it checks the arguments, builds the request every
rank gets (:mod:`pippy_split.training.generate_request`), launches the ranks and prints. It imports
no model, split or schedule code: a rank's side (:mod:`pippy_split.training.generate_rank`, which
rebuilds the run and generates) is imported only where a rank runs (:func:`generate_worker`). Those
imports are the ranks' own work, and the launcher starts them some seconds sooner
(``benchmarks/generate_startup.py`` says where the start goes).

    pippy-split train --steps 400 --checkpoint checkpoints/sums
    pippy-split generate checkpoints/sums --prompt "07+45=" --prompt "12+30=" --max-new-tokens 3

Errors the command finds (no run directory, a run without ``model.pt``, a prompt the
vocabulary cannot read, a prompt plus ``--max-new-tokens`` beyond the model's positions) are
one line, as ``train``'s are.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import traceback
from typing import Any

from ..generate import GenerateOptions, GenerationError
from .config import TrainConfig
from .errors import JobError, RankFailed, report
from .generate_request import SAMPLING, GenerateRequest, read_run, run_config
from .launch import Interrupted, launch
from .prompts import PromptCodec
from .run_dir import runs_in

__all__ = ["make_request", "render", "run", "generate_worker", "generate_here", "process_ends"]


# --------------------------------------------------------------------------- a rank, where one runs


def generate_worker(req: GenerateRequest, alone: bool = False) -> list[list[int]]:
    """One rank of ``pippy-split generate`` (launched, under torchrun, or ``alone``: the run's one rank in this
    process): :func:`~pippy_split.training.generate_rank.generate_in_group`, then, in a process that is only a
    rank, :func:`process_ends`."""
    # The ranks' code (model, split, schedule: seconds of imports) is imported where a rank runs, never in the
    # launcher before it launches (see the module docstring; issue 39).
    from .generate_rank import generate_in_group

    try:
        return generate_in_group(req, alone)
    finally:
        if not alone:
            process_ends()  # a launched rank, or a torchrun rank that prints and exits


def process_ends() -> None:
    """This process ends next (a rank that has generated, or the command's process once it has printed): its
    objects (the traces leave hundreds of thousands) are frozen (:func:`gc.freeze`), so that the interpreter's
    exit frees them by reference count without walking them in a collection after each module it clears. On
    a loaded 2-core machine that walk took 10-15 s of a rank's exit (0.5-1 s frozen), which the launcher waits
    for, and 2 s of the launching process's own exit (0.3 s frozen)."""
    gc.freeze()


def generate_here(req: GenerateRequest) -> list[list[int]]:
    """A run of one rank, generated in this process (no rank is launched: the launcher's start, a second
    interpreter's imports and its exit are saved). What fails reads as the launcher would say it: ``rank 0
    failed: CAUSE``, a bug with its traceback."""
    try:
        return generate_worker(req, alone=True)
    except JobError as e:
        raise RankFailed(f"rank 0 failed: {e.line}", e.frames) from None
    except Exception as e:
        first = str(e).strip().splitlines()
        cause = f"{type(e).__name__}: {first[0]}" if first else type(e).__name__
        raise RankFailed(f"rank 0 failed: {cause}", traceback.format_exc().rstrip()) from None


# --------------------------------------------------------------------------- the command


def make_request(args: argparse.Namespace) -> tuple[GenerateRequest, Any, int]:
    """The request every rank gets, the run's vocabulary, and how many ranks the run used; a
    :class:`JobError` for anything wrong that shows before a rank starts."""
    run_dir = os.path.abspath(args.run_dir)
    if not args.prompt:
        raise JobError("--prompt TEXT is required (repeat it for several prompts)")
    meta = read_run(args.run_dir)["meta"]
    cfg = run_config(meta, run_dir)
    try:  # generate's own checks of the arguments, here before any rank starts
        options = GenerateOptions(**{f: getattr(args, f) for f in SAMPLING})
    except GenerationError as e:  # named by its flag: "temperature must be ..." -> "--temperature must be ..."
        text = str(e)
        field = next((f for f in SAMPLING if text.startswith(f)), "")
        raise JobError("--" + field.replace("_", "-") + text[len(field):] if field else text) from None
    codec = PromptCodec.of_run(cfg, meta)
    ids, mask = codec.batch(list(args.prompt))
    _check_positions(cfg, meta, ids.shape[1], args.max_new_tokens)
    req = GenerateRequest(run_dir=run_dir, input_ids=ids.tolist(), attention_mask=mask.tolist(), options=options,
                          eos_token_id=_task_end(cfg, codec))
    return req, codec, cfg.ranks


def _check_positions(cfg: TrainConfig, meta: dict, prompt_len: int, new_tokens: int) -> None:
    """A prompt plus its new tokens beyond the model's positions, as the run's config says them (the built-in
    TinyGPT's ``block_size``, a Hugging Face config's ``max_position_embeddings``): refused here."""
    limit, name = None, ""
    if meta.get("gpt_config"):
        limit, name = meta["gpt_config"].get("block_size"), "TinyGPT's block_size"
    elif cfg.model and cfg.model.startswith("hf:"):
        path = cfg.model[3:]
        path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except (OSError, ValueError):
            values = {}
        key = next((k for k in ("max_position_embeddings", "n_positions") if isinstance(values.get(k), int)), None)
        limit, name = (values[key], f"{os.path.basename(path)}'s {key}") if key else (None, "")
    if isinstance(limit, int) and prompt_len + new_tokens > limit:
        raise JobError(f"the longest prompt is {prompt_len} tokens, and {prompt_len} + --max-new-tokens {new_tokens} = "
                       f"{prompt_len + new_tokens} positions, beyond the model's {limit} ({name}); shorten the prompt "
                       f"or ask for at most {max(0, limit - prompt_len)} new tokens")


def _task_end(cfg: TrainConfig, codec: Any) -> int | None:
    """The built-in sums end an answer with a newline: generation stops there (None: the model's own EOS)."""
    return codec.chars.index("\n") if is_sums(cfg, codec) and "\n" in codec.chars else None


def is_sums(cfg: TrainConfig, codec: Any) -> bool:
    """A run of the built-in TinyGPT on the built-in sums (whose answers are written backwards)."""
    return codec.kind == "chars" and not cfg.data and not cfg.model


def render(prompts: list[str], completions: list[str], as_json: bool = False, reversed_sums: bool = False) -> str:
    """What the command prints: each prompt followed by its completion, or a JSON list. Completions of one line
    are one line each; several of more lines are set apart by a blank line. ``reversed_sums``: each answer is
    also read back the right way round, after a note saying the digits are written backwards.

    Example:
        >>> print(render(["1+2=", "3+4="], ["3", "7"]), end="")
        1+2=3
        3+4=7
        >>> print(render(["07+45="], ["25"], reversed_sums=True), end="")
        (the model writes an answer's digits backwards, as it trained: 07+45=25 is 7 + 45 = 52)
        07+45=25    i.e. 7 + 45 = 52
        >>> print(render(["Once", "Then"], [" upon\\na time", " more"]), end="")  # lines of text: set apart
        Once upon
        a time
        <BLANKLINE>
        Then more
        >>> render(["1+2="], ["3"], as_json=True)
        '[{"prompt": "1+2=", "completion": "3"}]\\n'
    """
    if as_json:
        return json.dumps([{"prompt": p, "completion": c} for p, c in zip(prompts, completions)],
                          ensure_ascii=False) + "\n"
    if reversed_sums:
        note = "(the model writes an answer's digits backwards, as it trained: 07+45=25 is 7 + 45 = 52)\n"
        return note + "".join(f"{p}{c}{_read_back(p, c)}\n" for p, c in zip(prompts, completions))
    texts = [p + c.rstrip("\n") for p, c in zip(prompts, completions)]
    sep = "\n\n" if len(texts) > 1 and any("\n" in t for t in texts) else "\n"
    return sep.join(texts) + "\n"


def _read_back(prompt: str, completion: str) -> str:
    """``    i.e. 7 + 45 = 52`` for a sum prompt and a reversed answer of digits ("" otherwise)."""
    lhs, _, _ = prompt.partition("=")
    a, plus, b = lhs.partition("+")
    answer = completion.strip()
    if not (plus and a.isdigit() and b.isdigit() and answer.isdigit()):
        return ""
    return f"    i.e. {int(a)} + {int(b)} = {int(answer[::-1])}"


def _print(args: argparse.Namespace, codec: Any, completions: list[list[int]], sums: bool) -> None:
    texts = [codec.decode(c).removesuffix("\n") if sums else codec.decode(c) for c in completions]
    print(render(list(args.prompt), texts, args.json, reversed_sums=sums), end="", flush=True)


def run(args: argparse.Namespace) -> int:
    """``pippy-split generate``: check, launch the run's ranks (or, under torchrun, be one), print rank 0's text.
    A folder of runs (``checkpoints/``) without ``--prompt``: the runs in it."""
    runs = runs_in(args.run_dir)
    if runs and not args.prompt:
        print(f"runs in {args.run_dir}:")
        for name, state in runs.items():
            print(f"  {os.path.join(args.run_dir, name)}  {state}")
        print(f"generate from one: pippy-split generate {os.path.join(args.run_dir, next(iter(runs)))} --prompt TEXT",
              flush=True)
        return 0
    try:
        return _run(args)
    except JobError as e:
        return report("generate", e)


def _run(args: argparse.Namespace) -> int:
    req, codec, ranks = make_request(args)
    sums = is_sums(run_config(read_run(args.run_dir)["meta"], req.run_dir), codec)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        try:
            completions = generate_worker(req)
        except JobError as e:
            raise RankFailed(f"rank {os.environ['RANK']} failed: {e.line}", e.frames) from None
        if int(os.environ["RANK"]) == 0:
            _print(args, codec, completions, sums)
        return 0
    try:
        if ranks == 1:
            completions = generate_here(req)
        else:
            completions = launch(generate_worker, (req,), ranks=ranks, name="pippy-split-generate",
                                 command="generate")[0]
    except (Interrupted, KeyboardInterrupt) as e:
        print("pippy-split generate: interrupted", file=sys.stderr, flush=True)
        return 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)
    _print(args, codec, completions, sums)
    process_ends()  # the command's process: its exit is next
    return 0
