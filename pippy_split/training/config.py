"""The typed configuration of ``pippy-split train``: one dataclass, a TOML file, the command line.

Where this sits: the first thing :mod:`pippy_split.train` reads. Every field of
:class:`TrainConfig` is a key of the TOML file (``pippy-split train --config job.toml``)
and a flag of the command line (``--batch-size`` for ``batch_size``); the command line
wins over the file, the file over the defaults. Each field's docstring is its ``--help``.

Example:
    >>> cfg = parse_train_args(["--steps", "5", "--schedule", "1F1B"])
    >>> cfg.steps, cfg.schedule, cfg.microbatches
    (5, '1F1B', 4)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import JobError

__all__ = ["TrainConfig", "TRAIN_DESCRIPTION", "build_train_parser", "parse_train_args", "load_toml"]

TRAIN_DESCRIPTION = "`pippy-split train`: train a model pipelined over local ranks."
"""What ``python -m pippy_split.train --help`` opens with."""


@dataclass(kw_only=True)
class TrainConfig:
    """One training run. Defaults train a character-level TinyGPT on written-out sums."""

    model: str | None = None
    """module:factory returning an nn.Module, (model, args[, kwargs]) or an object with fields model, args, loss_fn,
    target; zoo:NAME; or hf:CONFIG (a config.json, or a directory holding one, with safetensors weights or not: a
    Hugging Face causal LM). With --data a factory's model is a language model called as model(input_ids), its loss
    the factory's loss_fn or, when its forward takes labels=, the causal LM loss. Default: a TinyGPT on --data or
    the built-in addition corpus."""
    split: str | None = None
    """comma-separated FQNs to split at (the beginning of each); default: balanced over the stages"""
    schedule: str = "ZBVZeroBubble"
    """schedule name (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)"""
    ranks: int = 2
    """local ranks to launch (ignored under torchrun): pipeline ranks x --dp x --tp"""
    dp: int = 1
    """data-parallel replicas of the pipeline, each sharding its stages' blocks with FSDP2 (ps.parallelize) and
    training on its --batch-size rows of a dp x batch-size row step"""
    tp: int = 1
    """tensor-parallel ranks per stage (Llama-family blocks; the built-in TinyGPT's MLPs)"""
    microbatches: int = 4
    """microbatches per step"""
    steps: int = 400
    """optimizer steps in all, the total: a --resume'd run trains on until its step count reaches it (--steps 600
    after 400 trains 200 more)"""
    grad_accum: int = 1
    """pipeline steps per optimizer step: gradients of this many batches are averaged before AdamW steps"""
    lr: float = 3e-3
    """peak learning rate"""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay (torch.optim.AdamW's weight_decay): each step every parameter, biases,
    norms and embeddings included, shrinks by lr x weight_decay of itself; 0 turns it off"""
    lr_schedule: str = "cosine"
    """after the warmup: cosine (to 10% of lr), linear (to 10%) or constant"""
    warmup_steps: int | None = None
    """linear warmup steps; default min(20, steps / 10)"""
    batch_size: int = 128
    """rows per pipeline step (all microbatches)"""
    seq_len: int = 16
    """characters per row (16 holds one sum and more)"""
    d_model: int = 64
    """the built-in TinyGPT's width"""
    n_layer: int | None = None
    """the built-in TinyGPT's blocks; default max(4, number of stages)"""
    seed: int = 0
    """weights, data order and dropout; the same on every rank"""
    run_name: str = ""
    """the run's name: its checkpoints and logs go to checkpoints/<run_name>; default: the model's name"""
    checkpoint: str = ""
    """the run's directory (model.pt, the stages' checkpoint, metrics.jsonl); default checkpoints/<run_name>"""
    resume: bool = False
    """continue the run in --checkpoint where it stopped: weights, AdamW state, step count (metrics.jsonl goes on
    from it), the LR schedule's place and the data order; --steps is the run's total"""
    data: str | None = None
    """train on this text: a text file (a document per line), a .jsonl file, or a directory saved by datasets'
    save_to_disk; the built-in TinyGPT's vocabulary is its characters, other models read tokens (--tokenizer)"""
    data_field: str = "text"
    """--data .jsonl or dataset: the field holding each document's text"""
    tokenizer: str | None = None
    """with --model hf:... or module:factory: a local tokenizer directory for --data (default: the text's UTF-8 bytes
    as ids)"""
    export_hf: str | None = None
    """write the trained model here as a Hugging Face directory (config.json, safetensors shards and index)
    that AutoModelForCausalLM.from_pretrained loads (with --model hf:...)"""
    export_shard_size: str = "2GB"
    """--export-hf: the largest safetensors shard (e.g. 2GB, 500MB)"""
    pack: bool = False
    """with --data: each microbatch is one row of whole lines of the file packed up to batch-size/microbatches
    x seq-len characters, so microbatches differ in length (ps.Microbatches); the loss is the mean over every
    predicted character of the step"""
    eval_every: int = 0
    """evaluate the loss on held-out data (the last tenth of the text) every N steps; 0: never"""
    log_every: int = 10
    """a plain log line every N steps when the output is not a terminal (every step goes to metrics.jsonl)"""
    tensorboard: bool = True
    """also write TensorBoard scalars to <checkpoint>/tensorboard when tensorboard is installed"""
    plan: str | None = field(default=None, metadata={"metavar": "MEMORY"})
    """choose --schedule, --microbatches, --split and --activation-checkpoint with ps.plan under this memory budget
    per rank (e.g. 2GB) before training; every rank takes rank 0's plan"""
    samples: int = 8
    """lines to sample at the end"""
    activation_checkpoint: str | None = field(default=None, metadata={"nargs": "?", "const": "full",
                                                                      "metavar": "PATTERNS"})
    """recompute each stage right before its backward instead of keeping its activations; with comma-separated
    module FQN patterns (e.g. 'blocks.*.mlp'), only those modules"""
    bf16: bool = False
    """run the stages under torch.autocast(bfloat16), the loss in fp32"""
    compile: bool = False
    """torch.compile every stage (the first step compiles)"""
    checkpoint_every: int = field(default=0, metadata={"metavar": "N"})
    """write the stages, AdamW state and data position every N steps; a group the launcher restarts
    (--max-restarts) resumes from the last complete one"""
    max_restarts: int = 0
    """restart the local group this many times after a rank fails (under torchrun: torchrun --max-restarts)"""
    simulate_failure: str | None = field(default=None, metadata={"metavar": "RANK:STEP"})
    """testing: SIGKILL that rank when it reaches that step, on the first attempt only"""
    clip_grad_norm: float | None = field(default=None, metadata={"metavar": "MAX"})
    """clip the gradients of all stages of all ranks to this total 2-norm (ps.clip_grad_norm_)"""

    def __post_init__(self) -> None:
        if not self.run_name:
            self.run_name = default_run_name(self.model, self.data)
        if not self.checkpoint:
            self.checkpoint = os.path.join("checkpoints", self.run_name)


def default_run_name(model: str | None, data: str | None = None) -> str:
    """``tiny_gpt`` for the built-in model (``tiny_gpt-<file>`` on --data), else the factory's or zoo
    entry's name.

    Example:
        >>> default_run_name(None), default_run_name(None, "notes/README.md"), default_run_name("zoo:tiny_llama")
        ('tiny_gpt', 'tiny_gpt-README', 'tiny_llama')
        >>> default_run_name("mymodels:qwen2_tiny"), default_run_name("hf:examples/qwen2_tiny.json")
        ('qwen2_tiny', 'qwen2_tiny')
    """
    if not model:
        name = "tiny_gpt" + (f"-{os.path.splitext(os.path.basename(data))[0]}" if data else "")
    elif model.startswith("hf:"):  # a config.json (its file name) or a directory (its name)
        path = model[3:].rstrip("/")
        stem = os.path.splitext(os.path.basename(path))[0]
        name = os.path.basename(os.path.dirname(path)) if stem == "config" else stem
    else:
        name = model.split(":", 1)[-1].split(".")[-1]
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "run"


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right after it in the class body), whitespace folded."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


_TYPES = {"int": int, "float": float, "str": str}


def _base_type(annotation: str) -> tuple[str, bool]:
    """``"int | None"`` -> ``("int", True)``."""
    parts = [p.strip() for p in annotation.split("|")]
    optional = "None" in parts
    return next(p for p in parts if p != "None"), optional


def build_train_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The command line of :class:`TrainConfig` (plus ``--config FILE``); defaults are None so
    that only flags given on the command line override the TOML file."""
    p = parser or argparse.ArgumentParser(prog="pippy-split train", description=TRAIN_DESCRIPTION)
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="read these options from a TOML file (keys: the option names with _); flags given here win")
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind, _ = _base_type(str(f.type))
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = f" (default {default})" if default not in (None, False, "") else ""
        help_text = (docs.get(f.name, "") + shown).replace("%", "%%")
        if kind == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            p.add_argument(flag, type=_TYPES[kind], default=None, help=help_text, **dict(f.metadata))
    return p


def load_toml(path: str) -> dict[str, Any]:
    """A TOML file's keys, checked against :class:`TrainConfig` (an unknown key names the closest ones)."""
    try:  # local: on Python 3.10 only --config needs a TOML reader (tomli, not a dependency)
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise JobError("--config needs Python 3.11+ (tomllib) or `pip install tomli`") from None
    with open(path, "rb") as f:
        values = tomllib.load(f)
    values = {k.replace("-", "_"): v for k, v in values.items()}
    known = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for key, value in values.items():
        if key not in known:
            near = difflib.get_close_matches(key, known, n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise JobError(f"{path}: unknown option {key!r}{hint} (options: {', '.join(known)})")
        kind, optional = _base_type(str(known[key].type))
        wanted: dict[str, type | tuple[type, ...]] = {"bool": bool, "int": int, "float": (int, float), "str": str}
        want = wanted[kind]
        if not isinstance(value, want) or (kind == "int" and isinstance(value, bool)):
            raise JobError(f"{path}: {key} = {value!r} should be {kind}")
    return values


def parse_train_args(argv: list[str] | None = None, namespace: argparse.Namespace | None = None) -> TrainConfig:
    """Defaults, then ``--config``'s TOML file, then the flags given."""
    ns = namespace if namespace is not None else build_train_parser().parse_args(argv)
    return config_from_namespace(ns)


def config_from_namespace(ns: argparse.Namespace) -> TrainConfig:
    values: dict[str, Any] = load_toml(ns.config) if getattr(ns, "config", None) else {}
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values.update({k: v for k, v in vars(ns).items() if k in names and v is not None})
    return TrainConfig(**values)
