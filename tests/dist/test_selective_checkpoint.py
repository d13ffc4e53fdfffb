"""Activation checkpointing against the unsplit model and against no checkpointing:
selective regions by module FQN on every schedule (the I/W split recomputes each region
once), and recomputes that leave BatchNorm's running statistics as one forward left them."""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks

SELECTIVE_CASES = [
    ("tiny_gpt", "1F1B", 4, ["blocks.*.attn", "blocks.*.mlp"]),
    ("tiny_gpt", "GPipe", 4, ["blocks.*"]),
    ("tiny_gpt", "Interleaved1F1B", 2, ["blocks.*.mlp"]),
    ("tiny_gpt", "ZBVZeroBubble", 2, ["blocks.*.attn", "blocks.*.mlp"]),
    ("tiny_gpt", "InterleavedZeroBubble", 2, ["blocks.*"]),
    ("tiny_gpt", "DualPipeV", 2, ["blocks.*"]),
    ("tiny_llama", "ZBVZeroBubble", 2, ["layers.*.attention"]),
    ("tiny_unet", "1F1B", 4, ["down*", "up*"]),
]
_PATTERNS = {"tied_lm": ["blocks.*.mlp"], "fan_out_skip": ["mid", "tail"]}


def _matrix() -> list[tuple[str, str, int, list[str]]]:
    """Every model x {1F1B, Interleaved1F1B, ZBVZeroBubble, DualPipeV} where its stage count fits 2 ranks or 4."""
    from pippy_split import zoo
    from pippy_split.schedule.orders import get_order_spec

    out = []
    for name, patterns in _PATTERNS.items():
        stages = zoo.get(name).num_stages
        for schedule in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"):
            per_rank = get_order_spec(schedule).default_stages_per_rank()
            world = stages // per_rank if stages % per_rank == 0 else 0
            if world >= 2 and not (schedule == "DualPipeV" and 4 < 2 * world - 1):
                out.append((name, schedule, world, patterns))
    return out


SELECTIVE_CASES += [c for c in _matrix() if c not in SELECTIVE_CASES]


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name,schedule,world,patterns", SELECTIVE_CASES)
def test_selective_checkpointing_is_exact_and_recomputes_each_region_once(name, schedule, world, patterns):
    from .bodies import reference
    from .recompute_bodies import selective_step

    ref_loss, ref_grads = reference(name, 4)
    results = run_ranks(selective_step, world, name, schedule, 4, patterns, timeout=150)
    calls = 0
    for r in results:
        assert abs(r["loss"] - ref_loss) < 1e-5
        for fqn, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[fqn], atol=1e-5, rtol=0, msg=lambda m, f=fqn: f"{f}: {m}")
        for region_calls, recomputes in r["counts"]:
            assert recomputes == region_calls  # one recompute per region call, I and W together
            calls += region_calls
    assert calls > 0


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["GPipe", "ZBVZeroBubble"])
@pytest.mark.parametrize("checkpoint", ["full", ["blocks.*"], ["blocks.*.bn", "blocks.*.drop"]])
def test_recompute_draws_the_same_dropout_and_moves_batchnorm_statistics_once(schedule, checkpoint):
    from .recompute_bodies import dropout_bn_step

    plain = run_ranks(dropout_bn_step, 2, schedule, None, timeout=150)
    ckpt = run_ranks(dropout_bn_step, 2, schedule, checkpoint, timeout=150)
    for a, b in zip(plain, ckpt):
        assert a["losses"] == b["losses"]
        assert a["state"].keys() == b["state"].keys()
        for k in a["state"]:
            assert torch.equal(a["state"][k], b["state"][k]), k  # running_mean/var, num_batches_tracked, grads


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule,world", [("ZBVZeroBubble", 2), ("1F1B", 4)])
def test_a_region_recomputes_under_the_autocast_its_forward_ran_in(schedule, world):
    from .recompute_bodies import bf16_step

    plain = run_ranks(bf16_step, world, schedule, None, timeout=150)
    selective = run_ranks(bf16_step, world, schedule, ["blocks.*.attn", "blocks.*.mlp"], timeout=150)
    for a, b in zip(plain, selective):
        assert a["loss"] == b["loss"]
        for k in a["grads"]:
            assert torch.equal(a["grads"][k], b["grads"][k]), k  # the same bf16 ops in the same order


HF_CASES = [
    ("llama", "1F1B", 2, 2, ["model.layers.*.mlp", "model.layers.*.self_attn"]),
    ("llama", "ZBVZeroBubble", 2, 4, ["model.layers.*"]),
    ("gpt2", "ZBVZeroBubble", 2, 4, ["transformer.h.*.mlp"]),
    ("albert", "1F1B", 2, 2, ["*.attention"]),  # one shared layer called 8 times: a region per call
]


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,schedule,world,stages,patterns", HF_CASES)
def test_selective_checkpointing_of_hf_models_from_their_module_paths(name, schedule, world, stages, patterns):
    pytest.importorskip("transformers")
    from .hf_recompute_bodies import hf_reference, hf_selective_step

    ref_loss, ref_grads = hf_reference(name)
    results = run_ranks(hf_selective_step, world, name, schedule, stages, patterns, timeout=200)
    for r in results:
        assert r["loss"] == pytest.approx(ref_loss, abs=1e-5)
        for fqn, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[fqn], atol=1e-5, rtol=0, msg=lambda m, f=fqn: f"{f}: {m}")
        assert all(calls == recomputes for calls, recomputes in r["counts"])
    assert sum(calls for r in results for calls, _ in r["counts"]) > 0
