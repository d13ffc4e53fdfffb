"""DCP round trips of sharded stages by the model's own FQNs: PP2 x TP2 -> the unsplit model,
and PP2 x per-block FSDP2 -> PP4 on plain stages and -> PP2 x TP2 on 4 stages. Every loaded number is compared with the
unsplit model after the same optimizer step (atol 1e-5)."""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks

ATOL = 1e-5


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")


def _chunks(path, key: str) -> list[tuple]:
    """The offsets and sizes of the pieces DCP wrote for ``key`` (one per shard that wrote it)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata[key]
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)


def _assert_saved_exact(results: list[dict], ref: dict, what: str) -> None:
    """The ranks' own (gathered) weights and optimizer state after the step equal the unsplit model's."""
    for rank, r in enumerate(results):
        assert r["sharded"], f"{what} rank {rank}: no parameter is a DTensor"
        for n, w in r["weights"].items():
            _close(w, ref["weights"][n], f"{what} rank {rank} {n}")
            assert set(r["state"][n]) == set(ref["state"][n]), f"{what} rank {rank} {n}: state {set(r['state'][n])}"
            for k, v in r["state"][n].items():
                _close(v, ref["state"][n][k], f"{what} rank {rank} {n} {k}")
    assert set().union(*(r["weights"] for r in results)) == set(ref["weights"])


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_pp2_tp2_checkpoint_loads_into_the_unsplit_model(tmp_path):
    from pippy_split import checkpoint
    from tests.dist.nd_ckpt_bodies import SGD, entry, pp2_tp2_save, reference

    ref = reference("sgd")
    results = run_ranks(pp2_tp2_save, 4, str(tmp_path / "pp2tp2"), timeout=220)
    _assert_saved_exact(results, ref, "PP2 x TP2 after the step")
    assert any(n.endswith("attention.wq.weight") for r in results for n in r["sharded"])
    # written as the TP ranks' shards (column-wise: rows split in two), one key of the full shape
    d = ref["weights"]["layers.0.attention.wq.weight"].shape[0]
    for key in ("model.layers.0.attention.wq.weight", "optim.state.layers.0.attention.wq.weight.momentum_buffer"):
        assert _chunks(tmp_path / "pp2tp2", key) == [((0, 0), (d // 2, d)), ((d // 2, 0), (d // 2, d))], key

    model = entry().model
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # the loaded weights cannot be left over from initialisation
    opt = torch.optim.SGD(model.parameters(), **SGD)
    extra = checkpoint.load(tmp_path / "pp2tp2", model, opt, no_dist=True)
    assert extra == {"step": 1}
    for n, p in model.named_parameters():
        _close(p.detach(), ref["weights"][n], f"unsplit model loaded from PP2 x TP2: {n}")
        _close(opt.state[p]["momentum_buffer"], ref["state"][n]["momentum_buffer"],
               f"unsplit model's optimizer loaded from PP2 x TP2: {n} momentum_buffer")


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_pp2_per_block_fsdp2_checkpoint_loads_into_pp4_and_into_pp2_x_tp2(tmp_path):
    from tests.dist.nd_ckpt_bodies import ADAMW, pp2_fsdp_save, pp2_tp2_load, pp4_load, reference

    ref = reference("adamw")
    path = str(tmp_path / "pp2fsdp")
    saved = run_ranks(pp2_fsdp_save, 4, path, timeout=90)
    _assert_saved_exact(saved, ref, "PP2 x FSDP2 after the step")
    assert any(n.startswith("layers.") for r in saved for n in r["sharded"])
    # written as the DP ranks' FSDP2 shards (dim 0 split in two), one key of the full shape
    rows, cols = ref["weights"]["layers.3.feed_forward.w1.weight"].shape
    for key in ("model.layers.3.feed_forward.w1.weight", "optim.state.layers.3.feed_forward.w1.weight.exp_avg"):
        assert _chunks(path, key) == [((0, 0), (rows // 2, cols)), ((rows // 2, 0), (rows // 2, cols))], key

    loaded = run_ranks(pp4_load, 4, path, timeout=90)
    for rank, r in enumerate(loaded):
        assert r["extra"] == {"step": 1}, f"rank {rank}: extra {r['extra']}"
        assert not r["sharded"], f"rank {rank}: PP4 stages are plain, got DTensors {r['sharded']}"
        assert {k: r["hyper"][k] for k in ADAMW} == ADAMW, f"rank {rank}: {r['hyper']}"
        assert r["weights"], f"rank {rank}: holds no parameter"
    # every loaded number equals the saved model's (what the PP2 x FSDP2 ranks held, gathered) ...
    saved_weights = {n: w for r in saved for n, w in r["weights"].items()}
    saved_state = {n: s for r in saved for n, s in r["state"].items()}
    for rank, r in enumerate(loaded):
        for n, w in r["weights"].items():
            _close(w, saved_weights[n], f"PP4 rank {rank} loaded {n}")
            assert set(r["state"][n]) == {"step", "exp_avg", "exp_avg_sq"}, f"rank {rank} {n}: {set(r['state'][n])}"
            for k, v in r["state"][n].items():
                _close(v, saved_state[n][k], f"PP4 rank {rank} loaded {n} {k}")
    # ... and so the unsplit model's after the same step, over all of its parameters
    _assert_saved_exact([{**r, "sharded": ["-"]} for r in loaded], ref, "PP4 loaded from PP2 x FSDP2")

    # resharded into another sharded layout: 4 stages on PP2 x TP2, each TP rank reading its shards
    resharded = run_ranks(pp2_tp2_load, 4, path, timeout=90)
    for rank, r in enumerate(resharded):
        assert r["extra"] == {"step": 1}, f"rank {rank}: extra {r['extra']}"
        assert any(n.endswith("attention.wq.weight") for n in r["sharded"]), f"rank {rank}: {r['sharded']}"
    _assert_saved_exact(resharded, ref, "PP2 x TP2 (4 stages) loaded from PP2 x FSDP2")
