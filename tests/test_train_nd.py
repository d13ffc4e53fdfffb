"""`pippy-split train --dp N --tp M`: pipeline x FSDP2 x TP on a (dp, pp, tp) mesh trains exactly what the
plain pipeline trains on the same rows (losses, gradient norms and final weights), and wrong layouts are
refused before any rank starts. The --tp 2 and --dp 2 runs of a tiny Qwen2 (head tied to its embedding)
compare with one plain run of it (``qwen_plain``)."""

from __future__ import annotations

import json

import pytest
import torch

from pippy_split.training.errors import JobError
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
        # The norm of every gradient (about 3 here) sums squares reduced in another order under FSDP2's
        # reduce-scatter: fp32 rounding grows with its size, so it is compared relative to it (observed 4.5e-6)
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5) and x["grad_norm"] == pytest.approx(y["grad_norm"],
                                                                                                   rel=1e-5, abs=1e-5)
    weights_a, weights_b = ({k: v for k, v in w.items() if k != "_out"} for w in (weights_a, weights_b))
    assert weights_a.keys() == weights_b.keys()
    for k in weights_a:
        torch.testing.assert_close(weights_a[k], weights_b[k], atol=1e-4, rtol=0, msg=k)


@pytest.mark.timeout(900)
def test_dp2_over_half_rows_trains_what_one_pipeline_trains_on_all_rows(tmp_path):
    plain = _run(tmp_path, "plain", "--ranks", "2", "--batch-size", "64")
    dp = _run(tmp_path, "dp", "--ranks", "4", "--dp", "2", "--batch-size", "32")
    assert "mesh (dp=2, pp=2, tp=1): 2 pipeline replicas, each on its 32 rows of a 64-row step" in dp[1]["_out"]
    _assert_same_training(plain, dp)


_QWEN = ("--model", "hf:tiny.json", "--data", "text.txt", "--seq-len", "16")


@pytest.fixture(scope="module")
def qwen_plain(tmp_path_factory):
    """A tiny Qwen2 from a config (head tied to its embedding) and the plain pipeline's run of it on 2 ranks,
    8 rows a step, cut between blocks as --dp and --tp cut it."""
    pytest.importorskip("transformers")
    from .test_train_hf import CONFIG

    where = tmp_path_factory.mktemp("qwen")
    (where / "tiny.json").write_text(json.dumps(CONFIG))
    (where / "text.txt").write_text("".join(f"the {i}th line says {i * 7 % 13} apples.\n" for i in range(60)))
    return where, _run(where, "plain", *_QWEN, "--ranks", "2", "--batch-size", "8", "--split", "model.layers.2")


@pytest.mark.timeout(900)
def test_tp2_of_a_qwen2_from_a_config_trains_what_the_plain_pipeline_trains(qwen_plain):
    where, plain = qwen_plain
    tp = _run(where, "tp", *_QWEN, "--batch-size", "8", "--ranks", "4", "--tp", "2")
    assert "each stage split over 2 tensor-parallel ranks" in tp[1]["_out"]
    _assert_same_training(plain, tp)


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_a_tied_head_under_dp2_trains_what_one_pipeline_trains_on_all_rows(qwen_plain):
    """The head tied to the embedding lives on both pipeline ranks (1F1B: stage 0 and stage 1), each
    holding an FSDP2 shard of it: the tied gradient is summed shard by shard across the pipeline."""
    where, plain = qwen_plain
    dp = _run(where, "dp", *_QWEN, "--ranks", "4", "--dp", "2", "--batch-size", "4")
    assert "mesh (dp=2, pp=2, tp=1)" in dp[1]["_out"]
    for weights in (plain[1], dp[1]):
        torch.testing.assert_close(weights["lm_head.weight"], weights["model.embed_tokens.weight"], atol=0, rtol=0)
    _assert_same_training(plain, dp)


def test_layouts_that_cannot_work_are_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """In this process (pippy_split.train.train_main): a refusal comes before any rank is launched."""
    from .test_train_errors import _one_line

    monkeypatch.chdir(tmp_path)
    assert "--ranks 3 must be a multiple of --dp 2 x --tp 1" in _one_line(capsys, "--ranks", "3", "--dp", "2")
    assert "not with --pack or a factory's own batch" in _one_line(capsys, "--ranks", "4", "--dp", "2", "--model",
                                                                   "zoo:mlp_stack")
    for flag in (["--bf16"], ["--activation-checkpoint"], ["--compile"], ["--grad-accum", "2"], ["--plan", "1GB"]):
        assert f"--dp/--tp with {flag[0]} is not checked exact" in _one_line(capsys, "--ranks", "4", "--tp", "2",
                                                                             *flag)


def test_tp_plans_are_known_layouts_only():
    from pippy_split.zoo.gpt import TinyGPT

    gpt = TinyGPT(vocab_size=8, d_model=8, n_layer=2, n_head=2, block_size=8)
    assert sorted(tp_plan_for(gpt)) == ["blocks.*.mlp.fc", "blocks.*.mlp.proj"]
    assert fsdp_patterns(gpt) == ["blocks.*"]
    with pytest.raises(JobError, match="--tp: no tensor-parallel plan for Sequential"):
        tp_plan_for(torch.nn.Sequential(torch.nn.Linear(2, 2)))
