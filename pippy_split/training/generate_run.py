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

The launching process only checks the request and prints: it imports no model, split or schedule
code, which the ranks import where they rebuild the run (:func:`rebuild_pipe`,
:func:`generate_rank`). Those imports are the ranks' own work, and the launcher starts them some
seconds sooner (``benchmarks/generate_startup.py`` says where the start goes).

    pippy-split train --steps 400 --checkpoint checkpoints/sums
    pippy-split generate checkpoints/sums --prompt "07+45=" --prompt "12+30=" --max-new-tokens 3

Errors the command finds (no run directory, a run without ``model.pt``, a prompt the
vocabulary cannot read, a prompt plus ``--max-new-tokens`` beyond the model's positions) are
one line, as ``train``'s are.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import pippy_split as ps

from ..generate import GenerateOptions, GenerationError
from .config import TrainConfig
from .errors import JobError, RankFailed, as_job_error, report
from .launch import Interrupted, launch
from .prompts import PromptCodec
from .run_dir import CHECKPOINT_FILE, TRAIN_STATE_DIR, load_model_file, runs_in

__all__ = ["GenerateRequest", "make_request", "render", "run", "generate_worker", "generate_here", "generate_rank",
           "run_config", "rebuild_pipe", "process_ends"]


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """What every rank is asked: the run, the prompts as ids (left-padded), how to choose tokens."""

    run_dir: str
    input_ids: list[list[int]]
    attention_mask: list[list[int]]
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_token_id: int | None = None
    """Where a row stops (the task's end: the built-in sums' newline); None: the model's own EOS."""

    def sampling(self) -> dict[str, Any]:
        """The token-choice arguments of ``generate``."""
        return dict(max_new_tokens=self.max_new_tokens, do_sample=self.do_sample, temperature=self.temperature,
                    top_k=self.top_k, top_p=self.top_p, seed=self.seed)


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


# --------------------------------------------------------------------------- one rank


@dataclass
class Rebuilt:
    """The run's model, its trained weights loaded, and its Pipe."""

    model: Any
    pipe: Any


def rebuild_pipe(cfg: TrainConfig, saved: dict, pp: int) -> Rebuilt:
    """The run's model with its trained weights, split as the run split it (``pp`` pipeline ranks): the model
    and split as :func:`~pippy_split.training.setup.model_source` makes them for ``train``, the weights loaded
    as ``train --resume`` loads ``model.pt``. A split that differs from the one the run recorded is refused."""
    from ..zoo.gpt import TinyGPT  # the ranks' imports (see the module docstring)
    from .nd import block_split
    from .setup import fresh_model, gpt_split, model_source, parse_split, stages_per_rank

    meta = saved["meta"]
    num_stages = pp * stages_per_rank(cfg.schedule)
    dynamic = None
    model: torch.nn.Module
    if meta.get("gpt_config"):  # the built-in TinyGPT: its config is recorded; its text is not needed
        model = TinyGPT(**meta["gpt_config"])
        given = parse_split(cfg.split) or gpt_split(meta["gpt_config"]["n_layer"], num_stages, cfg.schedule)
        split = block_split(cfg, model, num_stages, given)
        args: tuple = (torch.zeros(max(1, cfg.batch_size // cfg.microbatches), cfg.seq_len, dtype=torch.long),)
        kwargs: dict = {}
    else:
        here = meta.get("cwd")
        if isinstance(here, str) and here not in sys.path:
            sys.path.append(here)  # a module:factory the run imported from its directory
        prep, split, args, kwargs = model_source(cfg, num_stages)
        model, dynamic = prep.model, prep.dynamic_shapes
        if prep.state_dict is not None:
            # A pretrained directory's model is built on meta to train (each stage filled from the files), but
            # generate runs the whole model once on every rank (its KV layout), so here it is built whole.
            model = fresh_model(cfg, prep)
    missing, unexpected = model.load_state_dict(saved["state_dict"], strict=False)
    if missing or unexpected:
        raise JobError(f"{cfg.checkpoint}/model.pt does not match the run's model: missing {missing}, "
                       f"unexpected {unexpected}")
    model.eval()
    pipe = ps.pipeline(model, split, args, kwargs or None, dynamic_shapes=dynamic)
    stages = [list(s.modules) for s in pipe.stages]
    if meta.get("split") is not None and stages != meta["split"]:
        raise JobError(f"the run's model split into {meta['split']} when it trained, but {stages} now (has its "
                       f"model source changed?); generate runs on the stages the run trained")
    return Rebuilt(model, pipe)


def _check_vocabulary(model: Any, ids: Any) -> None:
    from .factory import vocab_size_of

    vocab = vocab_size_of(model)
    if vocab is not None and int(ids.max()) >= vocab:
        raise JobError(f"a prompt has token id {int(ids.max())}, beyond the model's vocab_size {vocab}")


def generate_rank(req: GenerateRequest, rank: int, world: int, device: Any) -> list[list[int]]:
    """This rank's part: rebuild the run's stages on the run's mesh, ``sched.generate``; every rank
    returns each row's new tokens (up to and with its EOS)."""
    from .nd import Layout, parallelize_stages

    saved = read_run(req.run_dir)
    cfg = run_config(saved["meta"], req.run_dir)
    if world != cfg.ranks:
        raise JobError(f"the run trained on {cfg.ranks} ranks; generate runs on the same ranks, not {world}")
    layout = Layout.of(cfg, world, rank, device)
    built = rebuild_pipe(cfg, saved, layout.pp)
    sched = ps.build_schedule(built.pipe, cfg.schedule, cfg.microbatches, device=device, group=layout.pp_group)
    parallelize_stages(cfg, sched, built.model, layout)
    ids, mask = torch.tensor(req.input_ids, device=device), torch.tensor(req.attention_mask, device=device)
    _check_vocabulary(built.model, ids)
    eos = req.eos_token_id
    if eos is None:
        eos = getattr(getattr(built.model, "generation_config", None), "eos_token_id", None)
    out = sched.generate(ids, attention_mask=mask, eos_token_id=req.eos_token_id,
                         **req.sampling())  # the same call and result on every rank
    return [_until_eos(row, eos) for row in out.sequences[:, ids.shape[1]:].tolist()]


def _until_eos(tokens: list[int], eos: int | list[int] | None) -> list[int]:
    """A row's new tokens up to and with its first EOS (after it ``generate`` pads)."""
    stops = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


def generate_worker(req: GenerateRequest, alone: bool = False) -> list[list[int]]:
    """One rank of ``pippy-split generate`` (under torchrun or the launcher): its process group, then
    :func:`generate_rank`. An error the command found reaches the launcher as its message alone.

    ``alone``: the run's one rank, in this process (a group of one on an in-memory store, no rendezvous)."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    backend = "nccl" if use_cuda else "gloo"
    if alone:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)
    try:
        return generate_rank(req, dist.get_rank(), dist.get_world_size(), device)
    except BaseException as e:
        found = as_job_error(e)
        if found is None or found is e:
            raise
        raise found from None
    finally:
        dist.destroy_process_group()
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
        GenerateOptions(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except GenerationError as e:  # named by its flag: "temperature must be ..." -> "--temperature must be ..."
        text = str(e)
        field = next((f for f in ("max_new_tokens", "temperature", "top_k", "top_p", "seed") if text.startswith(f)), "")
        raise JobError("--" + field.replace("_", "-") + text[len(field):] if field else text) from None
    codec = PromptCodec.of_run(cfg, meta)
    ids, mask = codec.batch(list(args.prompt))
    _check_positions(cfg, meta, ids.shape[1], args.max_new_tokens)
    req = GenerateRequest(run_dir=run_dir, input_ids=ids.tolist(), attention_mask=mask.tolist(),
                          max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_id=_task_end(cfg, codec))
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
