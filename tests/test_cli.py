"""The `pippy-split` commands, run for real in subprocesses at small sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pippy_split import checkpoint as ps_checkpoint
from pippy_split.commands.simulate import parse_costs
from pippy_split.training.corpus import CharCorpus, addition_corpus, parse_sum


def _cli(*args: str, cwd=None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="160")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "pippy_split.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


def test_data_is_deterministic_and_correct():
    text = addition_corpus(50, seed=3)
    assert text == addition_corpus(50, seed=3)
    assert all(parse_sum(line) for line in text.splitlines())
    assert parse_sum("1+2=4") is False and parse_sum("garbage") is None
    corpus = CharCorpus(text)
    x, y = corpus.batch(4, 8, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert corpus.decode(corpus.encode("12+3=15\n")) == "12+3=15\n"


def test_reversed_sums_and_answer_only_targets():
    text = addition_corpus(50, seed=3, reverse=True, pad=True)
    assert all(parse_sum(line, reverse=True) for line in text.splitlines())
    assert all(line[2] == "+" and line[5] == "=" for line in text.splitlines())  # 2-digit operands
    assert parse_sum("17+45=26", reverse=True) and parse_sum("17+45=62", reverse=True) is False
    assert parse_sum("17+45=") is False
    corpus = CharCorpus(text, prompt_end="=")
    x, y = corpus.batch(16, 12, torch.Generator().manual_seed(0))
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        window = corpus.decode(row_x)
        assert parse_sum(window, reverse=True)  # starts at a line start: a whole sum comes first
        cut, end = window.index("="), window.index("\n")
        assert all(t == -100 for t in row_y[:cut])  # the prompt a+b= is not learned
        assert all(t != -100 for t in row_y[cut:end])  # the answer and its newline are
        assert -100 in row_y[end:end + 3]  # the next prompt is not


def test_parse_costs():
    assert parse_costs("F=1,I=2,W=0.5") == {"F": 1.0, "I": 2.0, "W": 0.5}
    assert parse_costs(None) is None
    with pytest.raises(ValueError):
        parse_costs("X=1")


@pytest.mark.timeout(300)
def test_simulate_compare_and_svg(tmp_path):
    svg = tmp_path / "zbv.svg"
    out = _ok(_cli("simulate", "--schedule", "ZBVZeroBubble", "--ranks", "2", "--microbatches", "4",
                   "--costs", "F=1,I=1,W=1", "--svg", str(svg), "--compare"))
    assert "bubble fraction" in out and "peak activations per rank" in out
    assert svg.exists() and svg.read_text().lstrip().startswith(("<svg", "<?xml"))
    for name in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"):
        assert name in out


@pytest.mark.timeout(300)
def test_simulate_rejects_bad_sizes():
    r = _cli("simulate", "--schedule", "NoSuchSchedule", "--ranks", "2", "--microbatches", "4")
    assert r.returncode == 2 and "unknown schedule" in r.stdout


@pytest.mark.timeout(300)
def test_inspect_zoo_rich_and_json():
    out = _ok(_cli("inspect", "zoo:fan_out_skip"))
    assert out.strip()
    data = json.loads(_ok(_cli("inspect", "zoo:fan_out_skip", "--json")))
    assert data["num_stages"] == 3 and len(data["stages"]) == 3
    assert all({"modules", "num_params", "flops"} <= set(s) for s in data["stages"])
    assert data["edges"] and all({"src", "dst", "shape", "dtype", "grad", "skip"} <= set(e) for e in data["edges"])
    assert any(e["skip"] for e in data["edges"])  # the fan-out skip jumps a stage
    assert isinstance(data["shared_parameters"], dict)


@pytest.mark.timeout(300)
def test_train_small_run_writes_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = _ok(_cli("train", "--steps", "3", "--ranks", "2", "--checkpoint", str(ckpt), "--samples", "2",
                   "--clip-grad-norm", "1.0", "--activation-checkpoint", "--bf16", cwd=tmp_path))
    assert "first loss" in out and "last loss" in out
    assert "correct sums" in out
    saved = torch.load(ckpt / "model.pt", weights_only=False)
    assert "tok_emb.weight" in saved["state_dict"] and "head.weight" in saved["state_dict"]
    assert saved["meta"]["steps"] == 3 and saved["meta"]["num_stages"] == 4
    assert not [p for p in os.listdir(ckpt) if p.endswith(".tmp")]
    # --resume restores weights and AdamW state, here into another layout (4 stages on 4 ranks, GPipe).
    assert ps_checkpoint.saved_keys(ckpt / "train_state")
    out = _ok(_cli("train", "--steps", "4", "--ranks", "4", "--schedule", "GPipe", "--checkpoint", str(ckpt),
                   "--samples", "1", "--resume", cwd=tmp_path))
    assert "resumed at step 3 of 4" in out


@pytest.mark.timeout(300)
def test_train_selective_activation_checkpoint_patterns(tmp_path):
    """`--activation-checkpoint PATTERNS` checkpoints only the matching modules; a pattern that
    matches nothing is refused, naming the closest module names."""
    out = _ok(_cli("train", "--steps", "2", "--ranks", "2", "--checkpoint", str(tmp_path / "c"), "--samples", "1",
                   "--activation-checkpoint", "blocks.*.mlp", cwd=tmp_path))
    assert "last loss" in out
    bad = _cli("train", "--steps", "1", "--ranks", "2", "--checkpoint", str(tmp_path / "d"), "--samples", "1",
               "--activation-checkpoint", "blocks.*.mpl", cwd=tmp_path)
    assert bad.returncode != 0 and "blocks.*.mpl" in bad.stdout + bad.stderr


@pytest.mark.timeout(300)
def test_train_packs_the_lines_of_a_text_file_into_unequal_microbatches(tmp_path, capsys, monkeypatch):
    from .test_train_errors import _one_line

    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i}: " + "abc" * (i % 7 + 1) + "\n" for i in range(40)))
    out = _ok(_cli("train", "--data", str(text), "--pack", "--steps", "3", "--ranks", "2", "--checkpoint",
                   str(tmp_path / "ckpt"), "--samples", "1", cwd=tmp_path))
    assert "36 lines" in out  # the last tenth is held out
    assert "packed whole" in out and "first loss" in out and "last loss" in out
    monkeypatch.chdir(tmp_path)  # refused in this process, before any rank starts
    assert "--pack packs the lines of a --data text file" in _one_line(capsys, "--pack", "--steps", "1")
