"""`pippy-split train --model hf:CONFIG`: a tiny Qwen2 from a config on a text file, held-out loss,
resume, and an export that transformers loads with the trained weights (no downloads)."""

from __future__ import annotations

import json

import pytest
import torch

from pippy_split.training.setup import load_model_file

from .test_cli import _cli, _ok

transformers = pytest.importorskip("transformers")

CONFIG = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "tie_word_embeddings": True}


@pytest.mark.timeout(600)
def test_hf_config_trains_on_text_resumes_and_exports_what_transformers_loads(tmp_path, capsys, monkeypatch):
    from .test_train_errors import _one_line

    (tmp_path / "tiny.json").write_text(json.dumps(CONFIG))
    (tmp_path / "text.txt").write_text("".join(f"the {i}th line says {i * 7 % 13} apples.\n" for i in range(200)))
    (tmp_path / "job.toml").write_text('model = "hf:tiny.json"\ndata = "text.txt"\nsteps = 20\nseq_len = 32\n'
                                       'batch_size = 16\neval_every = 10\nlog_every = 10\nno_such = 1\n')
    monkeypatch.chdir(tmp_path)  # refused in this process, before any rank starts
    assert "unknown option 'no_such'" in _one_line(capsys, "--config", "job.toml")
    (tmp_path / "job.toml").write_text((tmp_path / "job.toml").read_text().replace("no_such = 1\n", ""))
    out = _ok(_cli("train", "--config", "job.toml", "--export-hf", "hf_out", "--export-shard-size", "100KB",
                   cwd=tmp_path, timeout=400))
    run_dir = tmp_path / "checkpoints" / "tiny"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    held = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(held) == 2 and held[-1] < held[0]  # the held-out loss goes down
    assert "step 20  loss" in out and "Hugging Face directory written to hf_out" in out
    export = tmp_path / "hf_out"
    assert (export / "config.json").exists() and (export / "model.safetensors.index.json").exists()
    assert len(list(export.glob("model-*.safetensors"))) > 1  # sharded, with its index
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
    trained = transformers.AutoModelForCausalLM.from_config(loaded.config).eval()
    trained.load_state_dict(load_model_file(str(run_dir))["state_dict"])  # the pipelined stages, merged
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, atol=1e-5, rtol=0)
    # --resume continues from the run's weights and AdamW state
    out = _ok(_cli("train", "--config", "job.toml", "--steps", "22", "--resume", "--eval-every", "0",
                   cwd=tmp_path, timeout=400))
    assert "resumed at step 20 of 22" in out
    # the job's default split cuts between the decoder layers, so the run generates (issue 39: it cut inside
    # model.layers.3, and generate refused the run after 56 s)
    assert load_model_file(str(run_dir))["meta"]["split"][1:] == [["model.layers.1"], ["model.layers.2"],
                                                                  ["model.layers.3", "model.norm", "lm_head"]]
    got = json.loads(_ok(_cli("generate", str(run_dir), "--prompt", "the 3th line", "--max-new-tokens", "4", "--json",
                              cwd=tmp_path, timeout=400)))
    assert got[0]["prompt"] == "the 3th line" and 1 <= len(got[0]["completion"].encode()) <= 4 * 4, got


def test_a_pretrained_directory_fills_each_stage_from_its_own_tensors_only(tmp_path):
    """Built on meta, each stage reads only its keys from the safetensors shards (tied lm_head via its alias)."""
    import pippy_split as ps
    from pippy_split.training.hf import SafetensorsStateDict, tied_aliases

    cfg = transformers.AutoConfig.for_model(**CONFIG)
    cfg.use_cache = False
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(cfg)
    source.save_pretrained(tmp_path / "pre", safe_serialization=True, max_shard_size="100KB")
    ids = torch.randint(0, 256, (2, 16))
    seen: list[set[str]] = []
    for i in range(4):  # as each rank does: its own meta model and pipe, then only its stage
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        pipe = ps.pipeline(model, 4, (ids,))
        sd = SafetensorsStateDict(str(tmp_path / "pre"), tied_aliases(model))
        module = pipe.build_stage(i, "cpu", state_dict=sd).module
        own = set(module.state_dict())
        assert set(sd.read) <= own and set(sd.read) >= {n for n, _ in module.named_parameters()}
        assert len(sd.read) == len(set(sd.read)), f"stage {i} read a tensor from disk more than once: {sd.read}"
        for name, value in module.state_dict().items():
            torch.testing.assert_close(value, source.state_dict()[name], msg=name)
        seen.append(set(sd.read))
    assert all(not (a & b) - {"lm_head.weight", "model.embed_tokens.weight"}
               for k, a in enumerate(seen) for b in seen[k + 1:])  # no stage read another's tensors
