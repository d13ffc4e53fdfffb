"""``pippy-split train --model hf:CONFIG``: a Hugging Face causal LM from a config, your text, an HF export.

Where this sits: one of the model sources of :mod:`pippy_split.training.setup` (beside the
built-in TinyGPT and ``module:factory``), and the export at the end of
:mod:`pippy_split.training.finish`. Needs the ``transformers`` extra. The model is
built from ``config.json`` (a file, or a directory holding one; nothing is downloaded),
or, from a directory with safetensors weights, built on ``meta`` and filled stage by stage
(each rank reads only its own stages' tensors, :class:`SafetensorsStateDict`), then
trained on a text file tokenized by a local tokenizer directory (``--tokenizer``) or
as UTF-8 bytes, with the causal LM loss (next-token cross entropy, the loss the model
computes itself when given ``labels=``). ``--export-hf DIR`` writes the trained model
as ``save_pretrained`` does: ``config.json`` and safetensors shards with their index,
which ``AutoModelForCausalLM.from_pretrained(DIR)`` loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .config import TrainConfig
from .errors import JobError

__all__ = ["hf_model", "load_tokenizer", "causal_lm_loss", "export_hf", "is_hf", "SafetensorsStateDict",
           "tied_aliases", "pretrained_dir"]


def is_hf(cfg: TrainConfig) -> bool:
    return bool(cfg.model and cfg.model.startswith("hf:"))


def _transformers() -> Any:
    try:
        import transformers  # the job extra's, optional (and slow to import): only hf: models need it
    except ImportError:
        raise JobError("--model hf:... needs transformers: pip install 'pippy-split[job]' "
                         "(or pip install transformers)") from None
    return transformers


def hf_config(spec: str) -> Any:
    """``hf:PATH``: PATH a config.json file or a directory with one (local only)."""
    t = _transformers()
    path = spec.split(":", 1)[1]
    if os.path.isdir(path):
        return t.AutoConfig.from_pretrained(path, local_files_only=True)
    if not os.path.isfile(path):
        raise JobError(f"--model {spec}: {path} is neither a config.json file nor a directory holding one")
    with open(path, encoding="utf-8") as f:
        values = json.load(f)
    if "model_type" not in values:
        raise JobError(f"--model {spec}: {path} has no model_type (e.g. \"qwen2\", \"llama\")")
    return t.AutoConfig.for_model(**values)


def hf_model(cfg: TrainConfig, meta: bool = False) -> Any:
    """The causal LM of ``--model hf:PATH`` (random weights under ``--seed``, no cache in its output);
    on ``meta`` (no memory) when its weights come from a pretrained directory, stage by stage."""
    t = _transformers()
    assert cfg.model is not None
    config = hf_config(cfg.model)
    config.use_cache = False
    torch.manual_seed(cfg.seed)
    with torch.device("meta" if meta else "cpu"):
        return t.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def load_tokenizer(directory: str) -> Any:
    """A local tokenizer directory (``tokenizer.json`` and its config; nothing is downloaded)."""
    return _transformers().AutoTokenizer.from_pretrained(directory, local_files_only=True)


def causal_lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of an HF output (``.logits``) against shifted targets, mean over tokens."""
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)


def export_hf(model: Any, directory: str, tokenizer: str | None, shard_size: str = "2GB") -> str:
    """``save_pretrained``: config.json, safetensors shards and their index (and the tokenizer's files)."""
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=shard_size)
    if tokenizer:
        load_tokenizer(tokenizer).save_pretrained(directory)
    return directory


class SafetensorsStateDict(Mapping):
    """A pretrained directory's tensors by FQN, read one tensor at a time when asked for: a stage
    filled from it reads only its own tensors (``read`` lists them). ``aliases`` maps a tied name
    the files leave out (``lm_head.weight``) to the one they hold.

    Example (a directory as ``save_pretrained`` writes it):
        >>> import tempfile, pippy_split as ps
        >>> from safetensors.torch import save_model
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> tmp = tempfile.TemporaryDirectory(); save_model(model, f"{tmp.name}/model.safetensors")
        >>> sd = SafetensorsStateDict(tmp.name)
        >>> pipe = ps.pipeline(model, ["2"], (torch.randn(2, 4),))
        >>> stage = pipe.build_stage(1, "cpu", state_dict=sd); sd.read  # stage 1's tensors only, each once
        ['2.weight', '2.bias']
    """

    def __init__(self, directory: str, aliases: Mapping[str, str] | None = None) -> None:
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                self.files = {k: os.path.join(directory, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            single = os.path.join(directory, "model.safetensors")
            if not os.path.isfile(single):
                raise JobError(f"{directory} has no model.safetensors or model.safetensors.index.json")
            from safetensors import safe_open  # the job extra's, optional: only hf: models read it

            with safe_open(single, "pt") as f:
                self.files = {k: single for k in f.keys()}  # noqa: SIM118 - safe_open has keys(), no __iter__
        self.aliases = {k: v for k, v in (aliases or {}).items() if k not in self.files and v in self.files}
        self.read: list[str] = []

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open  # the job extra's, optional: only hf: models read it

        name = self.aliases.get(key, key)
        if name not in self.files:
            raise KeyError(key)
        self.read.append(key)
        with safe_open(self.files[name], "pt") as f:
            return f.get_tensor(name)

    def __contains__(self, key: object) -> bool:  # Mapping's would read the tensor to answer
        return key in self.files or key in self.aliases

    def __iter__(self) -> Iterator[str]:
        return iter([*self.files, *self.aliases])

    def __len__(self) -> int:
        return len(self.files) + len(self.aliases)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{name: first name of the same tensor}`` for every parameter held under several names."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def pretrained_dir(cfg: TrainConfig) -> str | None:
    """The directory of ``--model hf:DIR`` when it holds safetensors weights (else None: random init)."""
    assert cfg.model is not None
    path = cfg.model.split(":", 1)[1]
    if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                   for f in ("model.safetensors", "model.safetensors.index.json")):
        return path
    return None
