"""What every rank of ``pippy-split train`` trains: data, model and the traced, split Pipe.

Where this sits: the first half of :mod:`pippy_split.train`, before any rank runs.
:func:`prepare` gives the same :class:`Prepared` on every rank (same seed); every
rank runs it itself (:func:`pippy_split.training.loop.worker`), under torchrun or
the launcher's spawned ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.export import Dim

import pippy_split as ps

from ..schedule.orders import ORDERS
from ..zoo.entry import layer_split
from ..zoo.gpt import TinyGPT, lm_loss
from .config import TrainConfig
from .corpus import CharCorpus, addition_corpus
from .errors import JobError, call_user
from .factory import data_example, factory_loss, load_factory, unpack_entry, vocab_size_of
from .hf import SafetensorsStateDict, causal_lm_loss, hf_model, is_hf, pretrained_dir, tied_aliases
from .nd import block_split
from .run_dir import CHECKPOINT_FILE, load_model_file
from .text import read_documents, token_corpora

if TYPE_CHECKING:
    from ..split.pipe import Pipe

__all__ = ["Prepared", "prepare", "load_factory", "unpack_entry", "parse_split", "data_ranks", "SUM_MAX", "CHECKPOINT_FILE"]

SUM_MAX = 99  # operands of the built-in sums: 0..SUM_MAX
DEFAULT_N_LAYER = 4  # the built-in TinyGPT's blocks unless --n-layer says otherwise


@dataclass
class Prepared:
    """The run's data, model and Pipe, the same on every rank.

    ``corpus``/``gpt_cfg`` are set for the built-in TinyGPT (None with ``--model``);
    ``args``/``kwargs``/``target`` are the factory's batch (trained on every step);
    ``batch_size`` is the global batch.
    """

    world: int
    corpus: Any
    gpt_cfg: dict | None
    model: torch.nn.Module
    loss_fn: Callable
    args: tuple
    kwargs: dict
    target: Any
    batch_size: int
    pipe: Pipe = field(init=False)
    """The split, traced by :func:`prepare` after the model is built."""
    heldout: Any = None
    """Held-out text (a corpus like ``corpus``): the last tenth of --data's lines, or other sums."""
    heldout_documents: list[torch.Tensor] | None = None
    state_dict: Any = None
    """Where the stages' weights come from when ``model`` is on meta (a pretrained directory, lazily)."""
    dynamic_shapes: Any = None
    documents: list[torch.Tensor] | None = None
    """``--pack``: the text's lines, encoded; each step packs them into microbatches."""
    loss_count: Callable | None = None
    vocab_size: int | None = None
    """A token model trained on --data (hf: or a factory): its vocabulary, for the tokens' check."""
    reads_data: bool = True
    """False on a rank whose stages read no model input and hold no loss: it never reads --data."""


def parse_split(split: str | None) -> list[str] | None:
    return [s.strip() for s in split.split(",") if s.strip()] if split else None


def stages_per_rank(schedule: str) -> int:
    return ORDERS[schedule].default_stages_per_rank()


def gpt_config(cfg: TrainConfig, vocab_size: int) -> dict:
    """The built-in TinyGPT's config: the same whatever the ranks and schedule (``--n-layer``, default 4)."""
    n_layer = cfg.n_layer or DEFAULT_N_LAYER
    longest = pack_budget(cfg) if getattr(cfg, "pack", False) else cfg.seq_len
    return dict(vocab_size=vocab_size, d_model=cfg.d_model, n_layer=n_layer, n_head=4,
                block_size=max(64, longest))


def gpt_split(n_layer: int, num_stages: int, schedule: str = "") -> list[str]:
    """The built-in TinyGPT's default cuts, all at module boundaries (so the run can generate): its blocks dealt
    out evenly, or, with more stages than blocks, a stage per block with the embeddings and then the head on
    their own; a :class:`JobError` saying what works beyond that.

    Example:
        >>> gpt_split(4, 4), gpt_split(4, 6)
        (['blocks.1', 'blocks.2', 'blocks.3'], ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3', 'ln_f'])
    """
    if num_stages <= n_layer:
        return layer_split("blocks", n_layer, num_stages)
    if num_stages <= n_layer + 2:
        return [f"blocks.{i}" for i in range(n_layer)] + (["ln_f"] if num_stages == n_layer + 2 else [])
    raise JobError(f"the built-in TinyGPT has {n_layer} blocks, so it cuts into at most {n_layer + 2} stages "
                   f"(embeddings, one per block, head); {schedule or 'the schedule'} places {num_stages}: pass "
                   f"--n-layer {num_stages - 2} or more, fewer --ranks, or a schedule with one stage per rank "
                   "(1F1B)")


def corpus_of(cfg: TrainConfig, chars: str = "") -> Any:
    """The user's text (plain next-character prediction), or the built-in sums: operands
    zero-padded, answers written backwards, windows starting at line starts, loss on the
    answers only (see :mod:`pippy_split.training.corpus`)."""
    if cfg.data:
        return CharCorpus(_split_text(cfg)[0], chars=chars or _text_chars(cfg))
    return CharCorpus(addition_corpus(max_value=SUM_MAX, seed=cfg.seed, reverse=True, pad=True), chars=chars,
                      prompt_end="=")


def heldout_of(cfg: TrainConfig, chars: str) -> Any:
    """Text the run never trains on: the last tenth of --data's lines (None under 10 lines), or
    sums drawn with another seed (the task is synthetic: some sums recur)."""
    if cfg.data:
        held = _split_text(cfg)[1]
        return CharCorpus(held, chars=chars) if len(held) > cfg.seq_len + 1 else None
    return CharCorpus(addition_corpus(max_value=SUM_MAX, seed=cfg.seed + 1, reverse=True, pad=True), chars=chars,
                      prompt_end="=")


def _text_chars(cfg: TrainConfig) -> str:
    return "".join(sorted(set("".join(d for part in read_documents(cfg) for d in part))))


def _split_text(cfg: TrainConfig) -> tuple[str, str]:
    """(training text, held-out text) of --data's documents (:mod:`.text`)."""
    train, held = read_documents(cfg)
    return "".join(train), "".join(held)


def fresh_model(cfg: TrainConfig, prep: Prepared) -> torch.nn.Module:
    """A new unsplit model of the run's kind (what ``model.pt`` is loaded into)."""
    if is_hf(cfg):
        return hf_model(cfg)
    if prep.gpt_cfg is not None:  # the built-in model
        return TinyGPT(**prep.gpt_cfg)
    torch.manual_seed(cfg.seed)
    assert cfg.model is not None
    return unpack_entry(call_user(load_factory(cfg.model), f"--model {cfg.model}"))[0]


def prepare(cfg: TrainConfig, world: int, log: Callable[..., None], rank: int | None = None) -> Prepared:
    """Data, model and the traced, split Pipe: the same on every rank (same seed).

    ``rank``: this rank in the pipeline group; a token model's ``--data`` is read only where
    a stage of the rank reads a model input or computes the loss (None: read it)."""
    num_stages = world * stages_per_rank(cfg.schedule)
    M, B = cfg.microbatches, cfg.batch_size
    if B % M:
        raise JobError(f"--batch-size {B} is not divisible by --microbatches {M}")
    # --resume: model.pt where the run finished once (its record; train_state/, newer or as new, then loads over it)
    has_model = os.path.isfile(os.path.join(cfg.checkpoint, CHECKPOINT_FILE))
    resume_state = load_model_file(cfg.checkpoint) if cfg.resume and has_model else None
    prep, split_spec, ex_args, ex_kwargs = model_source(cfg, num_stages, resume_state)
    if resume_state is not None and prep.state_dict is not None:  # a meta model: the stages read model.pt
        prep.state_dict = resume_state["state_dict"]
        log(f"[green]resumed[/] from {os.path.join(cfg.checkpoint, CHECKPOINT_FILE)}")
    elif resume_state is not None:
        missing, unexpected = prep.model.load_state_dict(resume_state["state_dict"], strict=False)
        if missing or unexpected:
            raise JobError(f"checkpoint {cfg.checkpoint} does not match the model: "
                             f"missing {missing}, unexpected {unexpected}")
        log(f"[green]resumed[/] from {os.path.join(cfg.checkpoint, CHECKPOINT_FILE)}")
    prep.world = world
    prep.pipe = ps.pipeline(prep.model, split_spec, ex_args, ex_kwargs, dynamic_shapes=prep.dynamic_shapes)
    if prep.pipe.num_stages % world:
        raise JobError(f"{prep.pipe.num_stages} stages cannot be spread over {world} ranks")
    if prep.vocab_size is not None:  # a token model on --data: the text is read where it is used
        prep.reads_data = rank is None or rank in data_ranks(prep.pipe, cfg.schedule, world)
        if prep.reads_data:
            prep.corpus, prep.heldout = token_corpora(cfg, prep.vocab_size)
    return prep


def model_source(cfg: TrainConfig, num_stages: int, resume_state: dict | None = None) -> tuple:
    """``(prep, split_spec, example_args, example_kwargs)`` of the run's model (no Pipe yet): the built-in
    TinyGPT, ``hf:``, or a factory; the example is one microbatch."""
    if cfg.model is None:
        return _builtin(cfg, num_stages, resume_state)
    if is_hf(cfg):
        return _hf(cfg, num_stages)
    return _factory(cfg, num_stages)


def data_ranks(pipe: Pipe, schedule: str, world: int) -> set[int]:
    """The ranks holding a stage that reads a model input, or the last stage (which needs the target).

    Example:
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        >>> pipe = ps.pipeline(model, ["1", "2", "3"], (torch.randn(2, 4),))  # 4 stages
        >>> sorted(data_ranks(pipe, "1F1B", 4)), sorted(data_ranks(pipe, "ZBVZeroBubble", 2))
        ([0, 3], [0])
    """
    where = ORDERS[schedule].stage_placement(pipe.num_stages, world)
    reading = {st.index for st in pipe.stages if any(i.kind == "input" for i in st.inputs)}
    return {where[s] for s in reading | {pipe.num_stages - 1}}


def _builtin(cfg: TrainConfig, num_stages: int, resume_state: dict | None) -> tuple:
    saved_chars = resume_state["meta"].get("chars", "") if resume_state else ""
    corpus = corpus_of(cfg, chars=saved_chars)
    gpt_cfg = gpt_config(cfg, corpus.vocab_size)
    if resume_state and resume_state["meta"].get("gpt_config"):
        gpt_cfg = resume_state["meta"]["gpt_config"]
    torch.manual_seed(cfg.seed)
    model = TinyGPT(**gpt_cfg)
    split_spec = block_split(cfg, model, num_stages,
                             parse_split(cfg.split) or gpt_split(gpt_cfg["n_layer"], num_stages, cfg.schedule))
    B, M = cfg.batch_size, cfg.microbatches
    x0, _ = corpus.batch(B, cfg.seq_len, torch.Generator().manual_seed(cfg.seed + 1))
    prep = Prepared(world=0, corpus=corpus, gpt_cfg=gpt_cfg, model=model, loss_fn=lm_loss, args=(), kwargs={},
                    target=None, batch_size=B, heldout=heldout_of(cfg, corpus.chars))
    if cfg.pack:
        return _packed(cfg, prep, split_spec)
    return prep, split_spec, (x0[: B // M],), {}


def pack_budget(cfg: TrainConfig) -> int:
    """``--pack``: characters per microbatch (one row)."""
    return cfg.batch_size // cfg.microbatches * cfg.seq_len


def _packed(cfg: TrainConfig, prep: Prepared, split_spec: Any) -> tuple:
    """--pack: the text's lines as documents, a pipe traced with a dynamic length up to the budget,
    a summed loss over predicted characters divided by their count in the step (``loss_count``)."""
    lines = [ln + "\n" for ln in prep.corpus.text.splitlines() if ln.strip()]
    if not lines:
        raise JobError(f"--pack: {cfg.data} has no non-empty lines to pack")
    prep.documents = [prep.corpus.encode(ln) for ln in lines]
    if prep.heldout is not None:
        prep.heldout_documents = [prep.heldout.encode(ln + "\n") for ln in prep.heldout.text.splitlines()
                                  if ln.strip()] or None
    budget = pack_budget(cfg)
    prep.loss_fn, prep.loss_count = packed_lm_loss, valid_targets
    prep.dynamic_shapes = {"idx": {1: Dim("T", min=2, max=budget)}}
    return prep, split_spec, (torch.zeros(1, min(budget, 16), dtype=torch.long),), {}


def packed_lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy over the predicted positions (-100: none), for ``loss_count``."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100,
                                             reduction="sum")


def valid_targets(target: torch.Tensor) -> torch.Tensor:
    return (target != -100).sum()


def _hf(cfg: TrainConfig, num_stages: int) -> tuple:
    """--model hf:CONFIG: the causal LM on --data's tokens, split over its decoder layers."""
    pretrained = pretrained_dir(cfg)
    model = hf_model(cfg, meta=pretrained is not None)  # pretrained: each rank fills only its stages
    split_spec = block_split(cfg, model, num_stages, parse_split(cfg.split))
    prep = Prepared(world=0, corpus=None, gpt_cfg=None, model=model, loss_fn=causal_lm_loss, args=(), kwargs={},
                    target=None, batch_size=cfg.batch_size, vocab_size=model.config.vocab_size,
                    state_dict=None if pretrained is None else SafetensorsStateDict(pretrained, tied_aliases(model)))
    return prep, split_spec, (torch.zeros(cfg.batch_size // cfg.microbatches, cfg.seq_len, dtype=torch.long),), {}


def _factory(cfg: TrainConfig, num_stages: int) -> tuple:
    """--model module:factory (:mod:`.factory`): its own batch, or a language model on --data's tokens."""
    assert cfg.model is not None
    torch.manual_seed(cfg.seed)
    model, args, kwargs, spec, loss_fn, target = unpack_entry(call_user(load_factory(cfg.model), f"--model {cfg.model}"))
    split_spec = block_split(cfg, model, num_stages, parse_split(cfg.split) or spec)
    example = data_example(cfg, model, args, kwargs) if cfg.data else None
    loss = factory_loss(cfg, model, loss_fn, target)
    if example is not None:
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = False  # no cache objects in the traced output
        prep = Prepared(world=0, corpus=None, gpt_cfg=None, model=model, loss_fn=loss, args=(), kwargs={},
                        target=None, batch_size=cfg.batch_size, vocab_size=vocab_size_of(model))
        return prep, split_spec, (example,), {}
    if not args:
        raise JobError(f"--model {cfg.model} returns a module without an example batch: pass --data FILE, or "
                         "return (model, args) with loss_fn and target")
    B, M = args[0].shape[0], cfg.microbatches
    if B % M:
        raise JobError(f"the factory's batch ({B}) is not divisible by --microbatches {M}")
    ex_args = tuple(a[: B // M] if isinstance(a, torch.Tensor) else a for a in args)
    prep = Prepared(world=0, corpus=None, gpt_cfg=None, model=model, loss_fn=loss, args=args, kwargs=kwargs,
                    target=target, batch_size=B)
    return prep, split_spec, ex_args, kwargs
