"""`pippy-split train --model module:factory --data ...`: your model on your text (text, JSONL or a saved
`datasets` dataset), the causal LM loss derived for a model taking `labels=`, clear refusals naming the
fields a factory must give, and --data read only on the ranks whose stages use it."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from pippy_split.training.config import TrainConfig
from pippy_split.training.errors import JobError
from pippy_split.training.setup import prepare
from pippy_split.training.text import read_documents

from .test_cli import _cli, _ok

transformers = pytest.importorskip("transformers")

QWEN = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "tie_word_embeddings": True}

_FACTORIES = f'''
import torch
import transformers
from torch import nn


def qwen():  # a plain nn.Module: a causal LM whose forward takes labels=
    config = transformers.AutoConfig.for_model(**{QWEN!r})
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def bigram():  # no labels=, no loss_fn: the job cannot know its loss
    return nn.Sequential(nn.Embedding(256, 16), nn.Linear(16, 256)), (torch.zeros(4, 8, dtype=torch.long),)


def two_inputs():
    return nn.Bilinear(4, 4, 4), (torch.randn(4, 4), torch.randn(4, 4))
'''

TEXT = "".join(f"the {i}th line says {i * 7 % 13} apples.\n" for i in range(120))


def _write(tmp_path):
    (tmp_path / "data_models.py").write_text(_FACTORIES)
    (tmp_path / "text.txt").write_text(TEXT)


def _cfg(tmp_path, **kw) -> TrainConfig:
    values = dict(model="data_models:qwen", data=str(tmp_path / "text.txt"), schedule="1F1B", batch_size=8,
                  microbatches=4, seq_len=16, checkpoint=str(tmp_path / "ck"))
    values.update(kw)
    return TrainConfig(**values)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    _write(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", ["", *sys.path])
    yield tmp_path
    sys.modules.pop("data_models", None)  # another test's module of the same name must not find this one


def test_a_plain_causal_lm_trains_on_the_text_with_the_loss_it_computes_itself(in_tmp):
    """The derived loss of the pipelined model equals the model's own ``labels=`` loss on the same windows."""
    prep = prepare(_cfg(in_tmp), world=2, log=print)
    assert prep.reads_data and prep.corpus is not None and prep.heldout is not None
    x, y = prep.corpus.batch(2, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], y[:, :-1])  # next-token windows of the file's bytes
    window = torch.cat([x, y[:, -1:]], dim=1)
    with torch.no_grad():
        own = prep.model(window, labels=window).loss  # the HF model shifts labels itself
        piped = prep.loss_fn(prep.pipe(x), y)
    torch.testing.assert_close(piped, own, atol=1e-5, rtol=0)
    assert prep.pipe.num_stages == 2


def test_a_middle_rank_never_reads_the_data(in_tmp):
    cfg = _cfg(in_tmp, data=str(in_tmp / "text.txt"))
    seen = {}
    for rank in range(4):
        prep = prepare(cfg, world=4, log=print, rank=rank)
        seen[rank] = (prep.reads_data, prep.corpus is not None)
    assert seen[0] == (True, True) and seen[3] == (True, True)  # the inputs, and the loss's target
    assert seen[1] == seen[2] == (False, False)


def test_a_factory_without_a_loss_says_which_fields_to_give(in_tmp):
    with pytest.raises(JobError, match=r"gives no loss_fn and its forward takes no labels="):
        prepare(_cfg(in_tmp, model="data_models:bigram"), world=2, log=print)
    with pytest.raises(JobError, match=r"gives no loss_fn and target: .*model, args \(one batch\), loss_fn and "
                                         r"target.*--data FILE"):
        prepare(_cfg(in_tmp, model="data_models:bigram", data=None), world=2, log=print)
    with pytest.raises(JobError, match="the model is called as model\\(input_ids\\).*has 2 tensors"):
        prepare(_cfg(in_tmp, model="data_models:two_inputs"), world=2, log=print)


def test_jsonl_documents_by_field_and_a_bad_line_named(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}", "id": i}) + "\n" for i in range(20)))
    train, held = read_documents(TrainConfig(data=str(path)))
    assert train == [f"doc {i}\n" for i in range(18)] and held == ["doc 18\n", "doc 19\n"]
    path.write_text('{"text": "a"}\n{"body": "b", "id": 2}\n')
    with pytest.raises(JobError, match=r"line 2 has no string field 'text' \(it has: body, id\); .*--data-field"):
        read_documents(TrainConfig(data=str(path)))
    path.write_text('{"body": "b", "id": 2}\n')
    assert read_documents(TrainConfig(data=str(path), data_field="body")) == (["b\n"], [])


def test_a_saved_dataset_trains_on_train_and_holds_out_validation(tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b", "c d", "e f"]}),
                                   "validation": datasets.Dataset.from_dict({"text": ["held"]})})
    splits.save_to_disk(str(tmp_path / "ds"))
    train, held = read_documents(TrainConfig(data=str(tmp_path / "ds")))
    assert train == ["a b\n", "c d\n", "e f\n"] and held == ["held\n"]
    with pytest.raises(JobError, match=r"has no column 'body' \(it has: text\)"):
        read_documents(TrainConfig(data=str(tmp_path / "ds"), data_field="body"))


@pytest.mark.timeout(600)
def test_train_a_factory_on_jsonl_over_three_ranks_logs_and_evaluates(tmp_path):
    """End to end: the middle rank reads no data, yet every rank evaluates the held-out loss together."""
    _write(tmp_path)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in TEXT.splitlines()))
    out = _ok(_cli("train", "--model", "data_models:qwen", "--data", "docs.jsonl", "--schedule", "1F1B", "--ranks", "3",
                   "--split", "model.layers.1,model.layers.3", "--steps", "4", "--batch-size", "6",
                   "--microbatches", "3", "--seq-len", "16", "--eval-every", "2", "--log-every", "2",
                   cwd=tmp_path, timeout=500))
    records = [json.loads(line) for line in (tmp_path / "checkpoints" / "qwen" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert sum("eval_loss" in r for r in records) == 2
    assert "3 stages on 3 ranks" in out and "step 4  loss" in out


def test_a_candidate_becomes_the_runs_flags():
    from types import SimpleNamespace

    from pippy_split.training.planned import config_of_candidate

    best = SimpleNamespace(schedule="Interleaved1F1B", n_microbatches=8, activation_checkpoint=True,
                           split=SimpleNamespace(cut_fqns=["layers.2", "layers.4", "layers.6"]))
    cfg = config_of_candidate(TrainConfig(plan="1GB", schedule="GPipe", microbatches=2), best)
    assert (cfg.plan, cfg.schedule, cfg.microbatches, cfg.split, cfg.activation_checkpoint) == \
        (None, "Interleaved1F1B", 8, "layers.2,layers.4,layers.6", "full")


@pytest.mark.timeout(600)
def test_train_plan_runs_the_plans_choice(tmp_path):
    from pippy_split.training.setup import load_model_file

    out = _ok(_cli("train", "--model", "zoo:mlp_stack", "--plan", "1GB", "--steps", "3", "--log-every", "1",
                   cwd=tmp_path, timeout=500))
    chosen = next(line for line in out.splitlines() if line.startswith("plan under 1GB per rank: "))
    meta = load_model_file(str(tmp_path / "checkpoints" / "mlp_stack"))["meta"]
    assert chosen.split(": ", 1)[1].startswith(f"{meta['schedule']} x")  # the run used the plan's schedule
    assert f"schedule {meta['schedule']}" in out and "step 3  loss" in out
