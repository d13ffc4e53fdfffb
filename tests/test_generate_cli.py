"""`pippy-split generate RUN_DIR --prompt ...`: samples from a `pippy-split train` run on the stages and ranks it
trained with (the built-in TinyGPT with its characters, an hf: model with its tokenizer), equal to `pipe.generate`
on the run's trained weights in one process; what is wrong is one line."""

from __future__ import annotations

import gc
import json

import pytest
import torch

import pippy_split as ps
from pippy_split.cli import build_parser, main
from pippy_split.training.finish import save_model_file
from pippy_split.training.generate_run import make_request, render
from pippy_split.training.setup import load_model_file
from pippy_split.zoo.gpt import TinyGPT

from .test_cli import _cli, _ok

_TRAIN = ("train", "--steps", "2", "--batch-size", "8", "--d-model", "16", "--samples", "0", "--no-tensorboard")


def _left_padded(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _split_of(meta: dict) -> list[str]:
    return [stage[0] for stage in meta["split"][1:]]


@pytest.fixture(scope="module")
def sums(tmp_path_factory):
    """A 2-step run of the built-in TinyGPT (ZBVZeroBubble, 4 stages on 2 ranks) and `pipe.generate` on its
    trained weights in this process (characters in, characters out)."""
    where = tmp_path_factory.mktemp("generate")
    _ok(_cli(*_TRAIN, "--checkpoint", "sums", cwd=where))
    saved = load_model_file(str(where / "sums"))
    meta = saved["meta"]
    model = TinyGPT(**meta["gpt_config"])
    model.load_state_dict(saved["state_dict"])
    pipe = ps.pipeline(model.eval(), _split_of(meta), (torch.zeros(2, 16, dtype=torch.long),))
    chars = meta["chars"]

    def reference(prompts: list[str], masked: bool = True, **kwargs) -> list[str]:
        """Each row's new characters up to the end of its answer (the task's newline, not shown)."""
        ids, mask = _left_padded([[chars.index(c) for c in p] for p in prompts])
        new = pipe.generate(ids, attention_mask=mask if masked else None, **kwargs).sequences[:, ids.shape[1]:]
        return ["".join(chars[i] for i in row).split("\n")[0] for row in new.tolist()]

    return where, reference


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_greedy_samples_equal_pipe_generate_on_the_trained_weights(sums):
    where, reference = sums
    prompts = ["07+45=", "1+2=", "99+99="]  # different lengths: left-padded into one batch
    out = _ok(_cli("generate", "sums", *(a for p in prompts for a in ("--prompt", p)), "--max-new-tokens", "6",
                   "--json", cwd=where))
    got = json.loads(out)
    assert [g["prompt"] for g in got] == prompts
    want = reference(prompts, max_new_tokens=6)
    assert [g["completion"] for g in got] == want and all(len(w) <= 6 for w in want)
    assert reference(prompts, masked=False, max_new_tokens=6) != want  # the pads must be masked to get these
    text = _ok(_cli("generate", "sums", "--prompt", "07+45=", "--prompt", "1+2=", "--max-new-tokens", "6",
                    cwd=where)).splitlines()
    assert text[0] == "(the model writes an answer's digits backwards, as it trained: 07+45=25 is 7 + 45 = 52)"
    assert [ln.split("    i.e.")[0] for ln in text[1:]] == ["07+45=" + want[0], "1+2=" + want[1]], text


def test_the_flags_are_generates_arguments_and_the_text_is_each_prompt_and_completion(sums, monkeypatch):
    where, _ = sums
    monkeypatch.chdir(where)
    args = build_parser().parse_args(["generate", "sums", "--prompt", "12+34=", "--prompt", "5+6=", "--max-new-tokens",
                                      "8", "--do-sample", "--seed", "7", "--top-k", "3", "--top-p", "0.9",
                                      "--temperature", "1.5"])
    req, codec, ranks = make_request(args)
    assert req.sampling() == dict(max_new_tokens=8, do_sample=True, temperature=1.5, top_k=3, top_p=0.9, seed=7)
    assert ranks == 2 and req.run_dir == str(where / "sums")
    assert [codec.decode(r[-n:]) for r, n in zip(req.input_ids, (6, 4))] == ["12+34=", "5+6="]
    assert req.attention_mask == [[1] * 6, [0, 0, 1, 1, 1, 1]]  # left-padded
    assert render(["12+34=", "5+6="], ["64", "11"]) == "12+34=64\n5+6=11\n"


def _one_line(capsys, *argv: str) -> str:
    code = main(["generate", *argv])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1, (code, err)
    return err[0].removeprefix("pippy-split generate: ")


def test_what_is_wrong_is_one_line_before_any_rank_starts(sums, tmp_path, capsys, monkeypatch):
    where, _ = sums
    monkeypatch.chdir(where)
    assert _one_line(capsys, "nowhere", "--prompt", "1") == \
        "nowhere: no such run directory (the --checkpoint directory of a pippy-split train run)"
    (where / "empty").mkdir(exist_ok=True)
    assert _one_line(capsys, "empty", "--prompt", "1") == \
        "empty holds no trained weights (model.pt): it is not a pippy-split train run"
    (where / "unfinished" / "train_state").mkdir(parents=True, exist_ok=True)
    assert _one_line(capsys, "unfinished", "--prompt", "1") == (
        "unfinished holds no trained weights (model.pt): the run has not finished (train writes model.pt at its "
        "end; its train_state/ is a checkpoint to continue with train --resume)")
    assert _one_line(capsys, "sums", "--prompt", "1+2=", "--prompt", "x+y=") == (
        "--prompt 'x+y=': 'x', 'y' not in the run's vocabulary, the characters '\\n+0123456789=' the built-in "
        "TinyGPT trained on")
    assert _one_line(capsys, "sums", "--prompt", "") == "--prompt '' is empty: a prompt needs at least one token"
    assert _one_line(capsys, "sums", "--prompt", "1", "--do-sample", "--temperature", "0") == \
        "--temperature must be a finite number > 0, got 0.0"
    assert _one_line(capsys, "sums", "--prompt", "1", "--max-new-tokens", "-1") == \
        "--max-new-tokens must be an int >= 0, got -1"
    assert _one_line(capsys, "sums", "--prompt", "1+2=", "--prompt", "1+2", "--max-new-tokens", "64") == (
        "the longest prompt is 4 tokens, and 4 + --max-new-tokens 64 = 68 positions, beyond the model's 64 "
        "(TinyGPT's block_size); shorten the prompt or ask for at most 60 new tokens")  # it was found in the ranks
    whole = (where / "sums" / "model.pt").read_bytes()
    for name, data in (("random", bytes(range(256)) * 8), ("cut", whole[: len(whole) // 2])):
        (where / name).mkdir(exist_ok=True)
        (where / name / "model.pt").write_bytes(data)
        assert _one_line(capsys, name, "--prompt", "1") == (  # was "pickled objects that could run code" / 26 lines
            f"{name}/model.pt is not a complete checkpoint this job wrote (it cannot be read back: cut short, or "
            "other bytes); point generate at the directory of a run train finished, or train it again")
    save_model_file(str(tmp_path), {}, {"config": {"model": "zoo:mlp_stack"}, "cwd": str(tmp_path)})
    assert _one_line(capsys, str(tmp_path), "--prompt", "1") == (
        "the run trained zoo:mlp_stack on its own example batch, not on text, so it has no vocabulary to read a "
        "prompt with; generate samples from runs on --data text (hf: or module:factory models) and from the "
        "built-in TinyGPT")
    save_model_file(str(tmp_path), {}, {"model": "hf:tiny.json"})  # a model.pt from before the config was recorded
    assert _one_line(capsys, str(tmp_path), "--prompt", "1") == (
        f"{tmp_path}/model.pt records no run configuration (it was written before pippy-split recorded one): "
        "train the run again to generate from it")


_QWEN = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": True}


def _word_tokenizer(lines: list[str], directory) -> object:
    """A word-level tokenizer of ``lines``, saved as a local tokenizer directory."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    fast.save_pretrained(str(directory))
    return fast


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_an_hf_run_from_a_pretrained_directory_generates_with_its_tokenizer(tmp_path):
    """hf:DIR with safetensors (trained on meta stage by stage, generated from the whole model) and --tokenizer;
    generated from another directory than the run's, whose relative paths are read from where the run ran."""
    transformers = pytest.importorskip("transformers")
    lines = [f"the {i} line says {i * 7 % 13} apples" for i in range(40)]
    (tmp_path / "text.txt").write_text("".join(ln + "\n" for ln in lines))
    config = transformers.AutoConfig.for_model(**_QWEN)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "pre"))
    tokenizer = _word_tokenizer(lines, tmp_path / "tok")
    _ok(_cli(*_TRAIN, "--model", "hf:pre", "--data", "text.txt", "--tokenizer", "tok", "--schedule", "1F1B",
             "--seq-len", "8", "--checkpoint", "qwen", cwd=tmp_path))
    prompts = ["the 3 line says", "apples"]
    (tmp_path / "elsewhere").mkdir()
    got = json.loads(_ok(_cli("generate", "../qwen", "--prompt", prompts[0], "--prompt", prompts[1],
                              "--max-new-tokens", "5", "--json", cwd=tmp_path / "elsewhere")))
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.load_state_dict(load_model_file(str(tmp_path / "qwen"))["state_dict"])
    pipe = ps.pipeline(model.eval(), ["model.layers.1"], (torch.zeros(2, 8, dtype=torch.long),))
    ids, mask = _left_padded([tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts],
                             pad=tokenizer.pad_token_id)
    new = pipe.generate(ids, attention_mask=mask, max_new_tokens=5).sequences[:, ids.shape[1]:]
    assert [g["completion"] for g in got] == [tokenizer.decode(row) for row in new.tolist()]


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_a_run_on_fsdp2_replicas_generates_on_its_mesh(tmp_path):
    """--dp 2: the run's 2 ranks and (dp=2, pp=1) mesh, its stages' blocks under FSDP2; the output equals the plain
    pipe's on the same weights."""
    _ok(_cli(*_TRAIN, "--dp", "2", "--checkpoint", "dp", cwd=tmp_path))
    got = json.loads(_ok(_cli("generate", "dp", "--prompt", "07+45=", "--max-new-tokens", "4", "--json", cwd=tmp_path)))
    saved = load_model_file(str(tmp_path / "dp"))
    meta = saved["meta"]
    assert meta["config"]["dp"] == 2 and meta["ranks"] == 1  # one pipeline rank per replica
    model = TinyGPT(**meta["gpt_config"])
    model.load_state_dict(saved["state_dict"])
    pipe = ps.pipeline(model.eval(), _split_of(meta), (torch.zeros(2, 16, dtype=torch.long),))
    ids = torch.tensor([[meta["chars"].index(c) for c in "07+45="]])
    new = pipe.generate(ids, max_new_tokens=4).sequences[0, 6:].tolist()
    assert got[0]["completion"] == "".join(meta["chars"][i] for i in new).split("\n")[0]  # the answer ends there


def test_a_folder_of_runs_lists_them(sums, capsys, monkeypatch):
    """Issue 40: `generate checkpoints/` (the folder --help points at) lists the runs inside it."""
    where, _ = sums
    monkeypatch.chdir(where)
    (where / "runs" / "b" / "train_state").mkdir(parents=True, exist_ok=True)
    (where / "runs" / "a").mkdir(exist_ok=True)
    (where / "runs" / "a" / "model.pt").write_bytes((where / "sums" / "model.pt").read_bytes())
    assert main(["generate", "runs"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "runs in runs:", "  runs/a  finished (model.pt)",
        "  runs/b  not finished (train_state/ only: continue it with train --resume)",
        "generate from one: pippy-split generate runs/a --prompt TEXT"]
    assert _one_line(capsys, "runs", "--prompt", "1") == \
        "runs holds runs, not one (a, b): name one, e.g. pippy-split generate runs/a --prompt TEXT"


def test_a_run_of_one_rank_generates_in_this_process(sums, capsys, monkeypatch):
    """Issue 39: a run of one rank is generated in the command's own process (no launcher, no second
    interpreter), with the same tokens as `pipe.generate`; what fails there still reads `rank 0 failed: ...`."""
    where, reference = sums
    monkeypatch.chdir(where)
    saved = load_model_file(str(where / "sums"))
    meta = dict(saved["meta"], ranks=1, num_stages=1, split=None, schedule="GPipe")
    meta["config"] = dict(meta["config"], ranks=1, schedule="GPipe", split=None)
    save_model_file(str(where / "one"), saved["state_dict"], meta)

    def no_launch(*args, **kwargs):
        raise AssertionError("a run of one rank launched a process")

    monkeypatch.setattr("pippy_split.training.generate_run.launch", no_launch)
    threads = torch.get_num_threads()
    try:
        assert main(["generate", "one", "--prompt", "07+45=", "--prompt", "1+2=", "--max-new-tokens", "6",
                     "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert [g["completion"] for g in got] == reference(["07+45=", "1+2="], max_new_tokens=6)
        first, *rest = saved["state_dict"].items()  # weights the model does not match: found in the rank
        save_model_file(str(where / "one"), dict(rest), meta)
        assert main(["generate", "one", "--prompt", "1+2="]) == 1
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("pippy-split generate: rank 0 failed: ") and f"missing ['{first[0]}']" in line, line
    finally:  # what the command does to its own process before it exits: undone for the tests after this one
        torch.set_num_threads(threads)
        gc.unfreeze()
