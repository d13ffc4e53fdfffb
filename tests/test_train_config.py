"""`pippy-split train`'s typed config, TOML file, logs, schedules and checkpoint file (mostly in-process)."""

from __future__ import annotations

import copy
import json
import os
import pickle

import pytest
import torch

import pippy_split as ps
from pippy_split import zoo
from pippy_split.training.config import TrainConfig, build_train_parser, field_docs, parse_train_args
from pippy_split.training.errors import JobError
from pippy_split.training.optim import average_accumulated, lr_at
from pippy_split.training.setup import CHECKPOINT_FILE, load_model_file

from .test_cli import _cli, _ok


def test_toml_file_then_flags_then_defaults(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('schedule = "1F1B"\nsteps = 50\nlr = 0.001\nbf16 = true\nactivation_checkpoint = "blocks.*.mlp"\n')
    cfg = parse_train_args(["--config", str(job), "--steps", "7", "--no-bf16"])
    assert (cfg.schedule, cfg.steps, cfg.lr, cfg.bf16, cfg.microbatches) == ("1F1B", 7, 0.001, False, 4)
    assert cfg.activation_checkpoint == "blocks.*.mlp"
    assert parse_train_args(["--activation-checkpoint"]).activation_checkpoint == "full"


@pytest.mark.parametrize("text,message", [
    ("stpes = 5\n", "unknown option 'stpes'; did you mean steps"),
    ("steps = 'many'\n", "steps = 'many' should be int"),
    ("bf16 = 1\n", "bf16 = 1 should be bool"),
])
def test_bad_toml_names_the_key(tmp_path, text, message):
    job = tmp_path / "job.toml"
    job.write_text(text)
    with pytest.raises(JobError, match=message):
        parse_train_args(["--config", str(job)])


def test_every_field_has_a_docstring_that_is_its_help():
    import dataclasses

    docs = field_docs(TrainConfig)
    assert {f.name for f in dataclasses.fields(TrainConfig)} == set(docs)
    text = build_train_parser().format_help()
    assert "--grad-accum" in text and "pipeline steps per optimizer step" in text


def test_each_run_has_its_own_directory():
    assert parse_train_args([]).checkpoint == os.path.join("checkpoints", "tiny_gpt")
    assert parse_train_args(["--model", "mymodels:qwen2_tiny"]).checkpoint == os.path.join("checkpoints", "qwen2_tiny")
    assert parse_train_args(["--data", "a/notes.txt"]).run_name == "tiny_gpt-notes"
    assert parse_train_args(["--run-name", "exp1"]).checkpoint == os.path.join("checkpoints", "exp1")


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_lr_schedules_warm_up_then_decay(schedule):
    cfg = TrainConfig(steps=100, lr=1.0, warmup_steps=10, lr_schedule=schedule)
    lrs = [lr_at(cfg, s) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))  # warmup rises
    tail = lrs[10:]
    assert all(a >= b for a, b in zip(tail, tail[1:]))  # then never rises
    assert tail[-1] == pytest.approx(1.0 if schedule == "constant" else 0.1, abs=0.01)


def test_gradient_accumulation_is_the_mean_over_the_accumulated_batches():
    entry = zoo.get("tiny_gpt", num_stages=2, n_layer=2)
    x, y = entry.args[0], entry.target
    one, acc = copy.deepcopy(entry.model), copy.deepcopy(entry.model)
    whole = ps.build_schedule(ps.pipeline(one, entry.split_spec, (x[:2],)), "Interleaved1F1B", 4,
                              loss_fn=entry.loss_fn)
    half = ps.build_schedule(ps.pipeline(acc, entry.split_spec, (x[:2],)), "Interleaved1F1B", 2,
                             loss_fn=entry.loss_fn)
    whole.step(x, target=y)
    half.step(x[:4], target=y[:4])
    half.step(x[4:], target=y[4:])
    average_accumulated(half, 2)
    for (n, p), q in zip(one.named_parameters(), acc.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=0, msg=n)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned_by_model_pt",))


def test_model_file_loads_weights_only_and_refuses_a_code_payload(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = tmp_path / "good"
    good.mkdir()
    torch.save({"state_dict": {"w": torch.ones(2)}, "meta": {"steps": 3, "split": [["a"], ["b"]]}},
               good / CHECKPOINT_FILE)
    assert load_model_file(str(good))["meta"]["steps"] == 3
    bad = tmp_path / "bad"
    bad.mkdir()
    with open(bad / CHECKPOINT_FILE, "wb") as f:
        pickle.dump({"state_dict": {}, "meta": _Payload()}, f)
    with pytest.raises(JobError, match="is not a checkpoint this job wrote .* so it will not be loaded"):
        load_model_file(str(bad))
    assert not (tmp_path / "pwned_by_model_pt").exists()  # refused, not executed


@pytest.mark.timeout(300)
def test_redirected_output_logs_plain_lines_metrics_and_held_out_loss(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("".join(f"{i} + {i} = {2 * i}\n" for i in range(60)))
    out = _ok(_cli("train", "--data", str(text), "--steps", "6", "--log-every", "2", "--eval-every", "3",
                   "--grad-accum", "2", "--samples", "1", "--no-tensorboard", cwd=tmp_path))
    assert "step 2  loss" in out and "step 6  loss" in out and "grad norm" in out and "tok/s" in out
    assert "step 3  held-out loss" in out
    run_dir = tmp_path / "checkpoints" / "tiny_gpt-notes"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(r["lr"] > 0 and r["grad_norm"] > 0 and r["peak_mib"] > 0 for r in steps)
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    meta = load_model_file(str(run_dir))["meta"]
    assert meta["data"] == str(text) and meta["run_name"] == "tiny_gpt-notes"
