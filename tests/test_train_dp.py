"""`pippy-split train --dp N`: the job's own split falls between blocks (FSDP2 and TP shard whole blocks).
That a head tied to its embedding trains exactly under pipeline x FSDP2 is tested in test_train_nd.py
(test_a_tied_head_under_dp2_trains_what_one_pipeline_trains_on_all_rows), beside --tp 2 of the same model:
both compare with one plain run."""

from __future__ import annotations

import json
import os

import pytest

from pippy_split.training.config import TrainConfig, load_toml
from pippy_split.training.errors import JobError
from pippy_split.training.nd import block_split
from pippy_split.training.setup import model_source
from pippy_split.zoo.gpt import TinyGPT

transformers = pytest.importorskip("transformers")

CONFIG = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "tie_word_embeddings": True}


def test_dp_and_tp_runs_cut_between_blocks_or_refuse_by_name(tmp_path):
    (tmp_path / "tiny.json").write_text(json.dumps(CONFIG))
    for flags in ({"dp": 2}, {"tp": 2}):
        cfg = TrainConfig(model=f"hf:{tmp_path / 'tiny.json'}", data="unused.txt", **flags)
        assert model_source(cfg, 4)[1] == ["model.layers.1", "model.layers.2", "model.layers.3"]
    gpt = TinyGPT(vocab_size=8, d_model=8, n_layer=2, n_head=2, block_size=8)
    assert block_split(TrainConfig(), gpt, 4, None) == 4  # a plain run with fewer blocks than stages: balanced
    gpt = TinyGPT(vocab_size=8, d_model=8, n_layer=2, n_head=2, block_size=8)
    with pytest.raises(JobError, match=r"--dp 2 shards whole blocks, so each of the 4 stages needs one: TinyGPT "
                                         r"has 2 \(blocks\)"):
        block_split(TrainConfig(dp=2), gpt, 4, None)
    with pytest.raises(JobError, match=r"--dp 2 --tp 2 shards whole blocks \(blocks\.\*\), so the split must fall "
                                         r"between blocks; blocks\.1\.mlp is inside one"):
        block_split(TrainConfig(dp=2, tp=2), gpt, 2, ["blocks.1.mlp"])
    assert block_split(TrainConfig(dp=2), gpt, 2, ["blocks.1"]) == ["blocks.1"]


def test_the_readme_s_toml_run_cuts_at_block_boundaries_so_it_can_generate():
    """Issue 39: the job's default split of examples/qwen2_tiny.toml (a plain run, no --dp) falls between the
    decoder layers, where generation keeps each stage's own KV cache; it used to balance by cost, cutting inside
    model.layers.3."""
    pytest.importorskip("transformers")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    values = load_toml(os.path.join(root, "examples", "qwen2_tiny.toml"))
    values["model"] = "hf:" + os.path.join(root, values["model"][3:])
    cfg = TrainConfig(**values)
    assert cfg.dp == cfg.tp == 1 and cfg.split is None
    assert model_source(cfg, 4)[1] == ["model.layers.1", "model.layers.2", "model.layers.3"]
