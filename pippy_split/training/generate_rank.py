"""One rank of ``pippy-split generate``: the finished run's stages rebuilt on the run's mesh, then ``sched.generate``.

Where this sits: run in every rank the command starts (launched as ``train`` launches its
ranks, under ``torchrun``, or the one rank of a 1-rank run in the command's own process), never
in the launching process before it launches: :mod:`pippy_split.training.generate_run` imports
this module only where a rank runs, so the model, split and schedule code imported here (some
seconds on a loaded machine, ``benchmarks/generate_startup.py``) is the ranks' own work. A rank
reads the request (:class:`~pippy_split.training.generate_request.GenerateRequest`) and the run's
``model.pt``, rebuilds what ``train --resume`` rebuilds: the same model from the same source
(:func:`pippy_split.training.setup.model_source`; the built-in TinyGPT from its recorded config),
the trained weights loaded before it is split, the same split (checked against the stages the
run recorded), the same schedule and mesh; then calls ``sched.generate`` with the prompts. Every
rank returns the same new tokens.

Example (one rank of a finished run, in a process group of its own):
    >>> tokens = generate_in_group(req, alone=True)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

import pippy_split as ps

from ..zoo.gpt import TinyGPT
from .config import TrainConfig
from .errors import JobError, as_job_error
from .factory import vocab_size_of
from .generate_request import GenerateRequest, read_run, run_config
from .nd import Layout, block_split, parallelize_stages
from .setup import fresh_model, gpt_split, model_source, parse_split, stages_per_rank

__all__ = ["Rebuilt", "rebuild_pipe", "generate_rank", "generate_in_group"]


@dataclass
class Rebuilt:
    """The run's model, its trained weights loaded, and its Pipe."""

    model: torch.nn.Module
    pipe: ps.Pipe


def rebuild_pipe(cfg: TrainConfig, saved: dict, pp: int) -> Rebuilt:
    """The run's model with its trained weights, split as the run split it (``pp`` pipeline ranks): the model
    and split as :func:`~pippy_split.training.setup.model_source` makes them for ``train``, the weights loaded
    as ``train --resume`` loads ``model.pt``. A split that differs from the one the run recorded is refused."""
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


def _check_vocabulary(model: torch.nn.Module, ids: torch.Tensor) -> None:
    vocab = vocab_size_of(model)
    if vocab is not None and int(ids.max()) >= vocab:
        raise JobError(f"a prompt has token id {int(ids.max())}, beyond the model's vocab_size {vocab}")


def generate_rank(req: GenerateRequest, rank: int, world: int, device: torch.device) -> list[list[int]]:
    """This rank's part: rebuild the run's stages on the run's mesh, ``sched.generate``; every rank
    returns each row's new tokens (up to and with its EOS)."""
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


def generate_in_group(req: GenerateRequest, alone: bool = False) -> list[list[int]]:
    """This rank's process group (under torchrun or the launcher), then :func:`generate_rank`. An error the
    command found reaches the launcher as its message alone.

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
