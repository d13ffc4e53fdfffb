"""Checkpoints: original FQNs, resharding across pipeline layouts, optimizer state, safe writes."""

from __future__ import annotations

import os

import pytest
import torch

import pippy_split as ps
from pippy_split import checkpoint, zoo
from pippy_split.checkpoint import CheckpointError
from pippy_split.testing import RankFailure, run_ranks

from . import checkpoint_bodies as bodies


def _adamw_step(model, entry, lr=bodies.LR):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    entry.loss_fn(model(*entry.args), entry.target).backward()
    opt.step()
    opt.zero_grad()
    return opt


def _assert_same(got: dict, expected: dict, what: str, atol: float = 0.0):
    assert set(got) == set(expected), f"{what}: keys differ: {set(got) ^ set(expected)}"
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{what} {k}: {m}")


# --------------------------------------------------------------------------- #
# One process
# --------------------------------------------------------------------------- #


def test_round_trip_unsplit_model_to_pipe_stages(tmp_path):
    entry = zoo.get("tiny_gpt")
    opt = _adamw_step(entry.model, entry)
    path = tmp_path / "ckpt"
    assert checkpoint.save(path, entry.model, opt, extra={"step": 1, "note": "hi"}) == str(path)
    assert checkpoint.saved_keys(path) == sorted(entry.model.state_dict())

    other = zoo.get("tiny_gpt", seed=1)
    pipe = ps.pipeline(other.model, other.split_spec, other.args)
    mods = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    opt2 = torch.optim.AdamW(bodies.params_of(mods), lr=0.5)
    assert checkpoint.load(path, pipe, opt2) == {"step": 1, "note": "hi"}

    want = bodies.by_fqn([entry.model], opt)
    got = bodies.by_fqn(mods, opt2)
    _assert_same(got["params"], want["params"], "param")
    _assert_same(got["exp_avg"], want["exp_avg"], "exp_avg")
    assert got["lr"] == bodies.LR
    p = mods[0].get_parameter("tok_emb.weight")
    assert opt2.state[p]["step"].item() == 1
    torch.testing.assert_close(pipe(*entry.args), entry.model(*entry.args), atol=1e-6, rtol=0)


def test_tied_weights_either_way(tmp_path):
    """head.weight IS tok_emb.weight: stored under both names, loads into either layout."""
    entry = zoo.get("tied_lm")
    opt = _adamw_step(entry.model, entry)
    checkpoint.save(tmp_path / "unsplit", entry.model, opt)
    assert {"tok_emb.weight", "head.weight"} <= set(checkpoint.saved_keys(tmp_path / "unsplit"))

    other = zoo.get("tied_lm", seed=1)
    pipe = ps.pipeline(other.model, other.split_spec, other.args)
    mods = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    opt2 = torch.optim.AdamW(bodies.params_of(mods), lr=bodies.LR)
    checkpoint.load(tmp_path / "unsplit", mods, opt2)
    want = bodies.by_fqn([entry.model], opt)
    got = bodies.by_fqn(mods, opt2)
    _assert_same(got["params"], want["params"], "param")
    _assert_same(got["exp_avg"], want["exp_avg"], "exp_avg")

    # and back: stages -> a fresh unsplit model
    checkpoint.save(tmp_path / "stages", mods, opt2)
    third = zoo.get("tied_lm", seed=2).model
    opt3 = torch.optim.AdamW(third.parameters(), lr=bodies.LR)
    checkpoint.load(tmp_path / "stages", third, opt3)
    _assert_same(bodies.by_fqn([third], opt3)["exp_avg"], want["exp_avg"], "exp_avg")
    assert third.head.weight is third.tok_emb.weight
    torch.testing.assert_close(third.head.weight, entry.model.head.weight, atol=0, rtol=0)


def test_checkpoint_of_another_model_lists_missing_and_unexpected_keys(tmp_path):
    mlp = zoo.get("mlp_stack").model
    checkpoint.save(tmp_path / "mlp", mlp)
    gpt = zoo.get("tiny_gpt").model
    before = {k: v.clone() for k, v in gpt.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(tmp_path / "mlp", gpt)
    msg = str(info.value)
    n_gpt, n_mlp = len(gpt.state_dict()), len(mlp.state_dict())
    assert f"{n_gpt} missing keys" in msg and f"{n_mlp} unexpected keys" in msg, msg
    assert "blocks.0.attn.proj.bias" in msg and "layers.0.fc.bias" in msg, msg
    assert f"and {n_gpt - 10} more" in msg, msg
    assert len(info.value.missing) == n_gpt and len(info.value.unexpected) == n_mlp
    assert all(torch.equal(v, before[k]) for k, v in gpt.state_dict().items())  # nothing loaded


def test_partial_match_strict_and_not(tmp_path):
    big = zoo.get("tiny_gpt", n_layer=4).model
    checkpoint.save(tmp_path / "big", big)
    small = zoo.get("tiny_gpt", n_layer=2, num_stages=2, seed=1).model
    with pytest.raises(CheckpointError, match=r"unexpected keys .*blocks\.2\.") as info:
        checkpoint.load(tmp_path / "big", small)
    assert "missing" not in str(info.value)
    with pytest.warns(UserWarning, match="unexpected keys"):
        checkpoint.load(tmp_path / "big", small, strict=False)
    torch.testing.assert_close(small.blocks[1].attn.qkv.weight, big.blocks[1].attn.qkv.weight, atol=0, rtol=0)


def test_shape_mismatch_is_named(tmp_path):
    checkpoint.save(tmp_path / "c", zoo.get("tiny_gpt", d_model=32).model)
    expected = r"53 tensors differ in shape .*blocks\.0\.attn\.proj\.bias: \(32,\) vs \(16,\), .* and 43 more"
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.load(tmp_path / "c", zoo.get("tiny_gpt", d_model=16).model)


def test_missing_checkpoint_and_missing_optimizer_state(tmp_path):
    model = zoo.get("mlp_stack").model
    with pytest.raises(CheckpointError, match="no checkpoint at .*nowhere"):
        checkpoint.load(tmp_path / "nowhere", model)
    checkpoint.save(tmp_path / "c", model)  # no optimizer
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match="16 missing keys .*optimizer state of layers.0.fc.bias"):
        checkpoint.load(tmp_path / "c", model, opt)


def test_unwritable_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    model = zoo.get("mlp_stack").model
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*a_file/ckpt: Not a directory"):
        checkpoint.save(blocker / "ckpt", model)
    # an existing directory that is not a checkpoint is never replaced
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a checkpoint and is not empty; refusing"):
        checkpoint.save(precious, model)
    assert (precious / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["a_file", "precious"]


def _fill(model, value):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _loaded_value(path):
    model = _fill(zoo.get("mlp_stack").model, -1.0)
    checkpoint.load(path, model)
    values = {float(v) for p in model.parameters() for v in p.detach().unique()}
    assert len(values) == 1, values
    return values.pop()


def test_failed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    path = tmp_path / "ckpt"
    checkpoint.save(path, _fill(zoo.get("mlp_stack").model, 3.0))
    real_write = FileSystemWriter.write_data

    def write_then_fail(self, plan, planner):
        with open(os.path.join(str(self.path), "__0_0.distcp"), "wb") as f:
            f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", write_then_fail)
    with pytest.raises(CheckpointError, match="No space left on device.*previous checkpoint .* unchanged"):
        checkpoint.save(path, _fill(zoo.get("mlp_stack").model, 7.0))
    assert os.listdir(tmp_path) == ["ckpt"]  # the temporary directory is gone
    assert _loaded_value(path) == 3.0
    monkeypatch.setattr(FileSystemWriter, "write_data", real_write)
    checkpoint.save(path, _fill(zoo.get("mlp_stack").model, 7.0))
    assert _loaded_value(path) == 7.0 and os.listdir(tmp_path) == ["ckpt"]


@pytest.mark.dist
def test_killed_save_leaves_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, _fill(zoo.get("mlp_stack").model, 3.0))

    # killed while writing: the half-written temporary directory is never read
    with pytest.raises(RankFailure, match="SIGKILL"):
        run_ranks(bodies.killed_while_writing, 1, path, timeout=60)
    assert any(".tmp-" in n for n in os.listdir(tmp_path))
    assert _loaded_value(path) == 3.0

    # killed between the two renames of the fallback: load finds the backup
    with pytest.raises(RankFailure, match="SIGKILL"):
        run_ranks(bodies.killed_between_renames, 1, path, timeout=60)
    assert not os.path.exists(path)
    with pytest.warns(UserWarning, match="interrupted"):
        assert _loaded_value(path) == 3.0

    # the next save clears every leftover
    checkpoint.save(path, _fill(zoo.get("mlp_stack").model, 5.0))
    assert os.listdir(tmp_path) == ["ckpt"]
    assert _loaded_value(path) == 5.0


# --------------------------------------------------------------------------- #
# Two ranks: 4 stages (ZBV) -> 2 stages (1F1B) -> unsplit, with AdamW state
# --------------------------------------------------------------------------- #


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_reshard_across_layouts_with_optimizer_state(tmp_path):
    ckpt4, ckpt2, wrong = (str(tmp_path / n) for n in ("four_stages", "two_stages", "mlp"))
    bad = str(tmp_path / "a_file" / "ckpt")
    (tmp_path / "a_file").write_text("x")
    checkpoint.save(wrong, zoo.get("mlp_stack").model)

    saved = run_ranks(bodies.train_save, 2, ckpt4, bad, timeout=150)
    assert [r["stages"] for r in saved] == [[0, 3], [1, 2]]
    for r in saved:  # the unwritable path failed on every rank, without a hang
        assert r["bad"] is not None and "a_file/ckpt" in r["bad"] and "Not a directory" in r["bad"], r["bad"]
    params4 = {k: v for r in saved for k, v in r["params"].items()}
    exp_avg4 = {k: v for r in saved for k, v in r["exp_avg"].items()}
    assert set(params4) == set(zoo.get("tiny_gpt").model.state_dict())

    # 4 stages / 2 ranks -> 2 stages / 2 ranks, then two more steps and a save
    loaded = run_ranks(bodies.load_step_save, 2, ckpt4, wrong, ckpt2, timeout=150)
    assert [r["stages"] for r in loaded] == [[0], [1]]
    for r in loaded:
        assert "missing keys" in r["wrong"] and "unexpected keys" in r["wrong"], r["wrong"]
        assert r["extra"] == {"step": 1} and r["lr"] == bodies.LR
    _assert_same({k: v for r in loaded for k, v in r["params"].items()}, params4, "param")
    _assert_same({k: v for r in loaded for k, v in r["exp_avg"].items()}, exp_avg4, "exp_avg")

    # 4 stages / 2 ranks -> the unsplit model in this process, same two steps
    model = zoo.get("tiny_gpt", seed=2).model
    opt = torch.optim.AdamW(model.parameters(), lr=0.3)
    assert checkpoint.load(ckpt4, model, opt) == {"step": 1}
    ref = bodies.by_fqn([model], opt)
    _assert_same(ref["params"], params4, "param")
    _assert_same(ref["exp_avg"], exp_avg4, "exp_avg")
    args, target, loss_fn = bodies.data()
    ref_losses = []
    for _ in range(2):
        loss = loss_fn(model(*args), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    for r in loaded:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5, rel=0), (r["losses"], ref_losses)

    # 2 stages / 2 ranks -> unsplit: the pipelined steps landed where the unsplit ones did
    fresh = zoo.get("tiny_gpt", seed=3).model
    opt3 = torch.optim.AdamW(fresh.parameters(), lr=0.3)
    assert checkpoint.load(ckpt2, fresh, opt3) == {"step": 3}
    after = bodies.by_fqn([fresh], opt3)
    _assert_same(after["params"], bodies.by_fqn([model])["params"], "param after 3 steps", atol=1e-5)
    _assert_same(after["exp_avg"], bodies.by_fqn([model], opt)["exp_avg"], "exp_avg after 3 steps", atol=1e-5)


@pytest.mark.dist
def test_a_key_held_by_several_ranks_is_written_by_the_lowest(tmp_path):
    path = str(tmp_path / "replicas")
    errors = run_ranks(bodies.save_replicas, 2, path, timeout=60)
    for e in errors:  # rank 1's failed write in the first save was raised on both ranks
        assert "rank 1: OSError: [Errno 5] Input/output error" in e, e
    assert os.listdir(tmp_path) == ["replicas"]
    assert _loaded_value(path) == 0.0
    assert checkpoint.load(path, zoo.get("mlp_stack").model) == {"rank": 0}


@pytest.mark.dist
def test_a_problem_on_one_rank_fails_every_rank(tmp_path):
    results = run_ranks(bodies.one_rank_is_wrong, 2, str(tmp_path / "c"), timeout=60)
    for errors in results:
        assert len(errors) == 2, errors
        assert "belongs to none of the given modules (rank 1)" in errors[0], errors[0]
        assert "meta device" in errors[1] and "(rank 1)" in errors[1], errors[1]
