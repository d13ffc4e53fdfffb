"""`pippy-split train --dp N --tp M`: pipeline x FSDP2 x TP on a (dp, pp, tp) mesh trains exactly what the
plain pipeline trains on the same rows (losses, gradient norms and final weights), and wrong layouts are
refused before any rank starts."""

from __future__ import annotations

import json

import pytest
import torch

from pippy_split.training.nd import fsdp_patterns, tp_plan_for
from pippy_split.training.setup import load_model_file

from .test_cli import _cli, _ok

_SAME = ["--schedule", "1F1B", "--steps", "3", "--log-every", "1", "--lr-schedule", "constant",
         "--warmup-steps", "0", "--samples", "0"]


def _run(tmp_path, name: str, *flags: str) -> tuple[list[dict], dict]:
    out = _ok(_cli("train", *_SAME, "--checkpoint", name, *flags, cwd=tmp_path, timeout=500))
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], load_model_file(str(tmp_path / name))["state_dict"] | {"_out": out}


def _assert_same_training(a: tuple[list[dict], dict], b: tuple[list[dict], dict]) -> None:
    (steps_a, weights_a), (steps_b, weights_b) = a, b
    for x, y in zip(steps_a, steps_b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5) and x["grad_norm"] == pytest.approx(y["grad_norm"],
                                                                                                   abs=1e-5)
    weights_a.pop("_out"), weights_b.pop("_out")
    assert weights_a.keys() == weights_b.keys()
    for k in weights_a:
        torch.testing.assert_close(weights_a[k], weights_b[k], atol=1e-4, rtol=0, msg=k)


@pytest.mark.timeout(900)
def test_dp2_over_half_rows_trains_what_one_pipeline_trains_on_all_rows(tmp_path):
    plain = _run(tmp_path, "plain", "--ranks", "2", "--batch-size", "64")
    dp = _run(tmp_path, "dp", "--ranks", "4", "--dp", "2", "--batch-size", "32")
    assert "mesh (dp=2, pp=2, tp=1): 2 pipeline replicas, each on its 32 rows of a 64-row step" in dp[1]["_out"]
    _assert_same_training(plain, dp)


@pytest.mark.timeout(900)
def test_tp2_of_a_qwen2_from_a_config_trains_what_the_plain_pipeline_trains(tmp_path):
    pytest.importorskip("transformers")
    from .test_train_hf import CONFIG

    (tmp_path / "tiny.json").write_text(json.dumps(CONFIG))
    (tmp_path / "text.txt").write_text("".join(f"the {i}th line says {i * 7 % 13} apples.\n" for i in range(60)))
    common = ("--model", "hf:tiny.json", "--data", "text.txt", "--seq-len", "16", "--batch-size", "8")
    plain = _run(tmp_path, "plain", *common, "--ranks", "2")
    tp = _run(tmp_path, "tp", *common, "--ranks", "4", "--tp", "2")
    assert "each stage split over 2 tensor-parallel ranks" in tp[1]["_out"]
    _assert_same_training(plain, tp)


def test_layouts_that_cannot_work_are_refused_before_any_rank_starts(tmp_path):
    r = _cli("train", "--ranks", "3", "--dp", "2", cwd=tmp_path)
    assert r.returncode == 2 and "--ranks 3 must be a multiple of --dp 2 x --tp 1" in r.stderr
    r = _cli("train", "--ranks", "4", "--dp", "2", "--model", "zoo:mlp_stack", cwd=tmp_path)
    assert r.returncode == 2 and "not with --pack or a factory's own batch" in r.stderr
    for flag in (["--bf16"], ["--activation-checkpoint"], ["--compile"], ["--grad-accum", "2"], ["--plan", "1GB"]):
        r = _cli("train", "--ranks", "4", "--tp", "2", *flag, cwd=tmp_path)
        assert r.returncode == 2 and f"--dp/--tp with {flag[0]} is not checked exact" in r.stderr


def test_tp_plans_are_known_layouts_only():
    from pippy_split.zoo.gpt import TinyGPT

    gpt = TinyGPT(vocab_size=8, d_model=8, n_layer=2, n_head=2, block_size=8)
    assert sorted(tp_plan_for(gpt)) == ["blocks.*.mlp.fc", "blocks.*.mlp.proj"]
    assert fsdp_patterns(gpt) == ["blocks.*"]
    with pytest.raises(SystemExit, match="--tp: no tensor-parallel plan for Sequential"):
        tp_plan_for(torch.nn.Sequential(torch.nn.Linear(2, 2)))
