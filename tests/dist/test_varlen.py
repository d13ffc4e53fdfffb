"""Microbatches of different shapes in one step: exact under every schedule, and refused loudly when wrong.

gloo ranks in the order-matched transport (the default); exact = the loss and every
gradient against the unsplit model on the same microbatches, atol 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks

from .varlen_bodies import (
    ALL_SCHEDULES,
    LENGTHS,
    LENGTHS_8,
    bad_step,
    every_schedule,
    hand_built_unequal,
    packed_reference,
    packed_step,
    ranks_disagree,
    reference,
    stages_for,
    with_options,
)

pytestmark = pytest.mark.dist


def _assert_exact(result: dict, ref_loss: float, ref_grads: dict, atol: float = 1e-5) -> None:
    assert abs(result["loss"] - ref_loss) < atol, (result["loss"], ref_loss)
    for n, g in result["grads"].items():
        torch.testing.assert_close(g, ref_grads[n], atol=atol, rtol=0, msg=n)


def _check_world(results: list[dict], name: str, world: int, schedules: list[str], sizes: list[int]) -> None:
    refs = {}
    for schedule in schedules:
        n = stages_for(schedule, world)
        if n not in refs:
            refs[n] = reference(name, n, sizes=sizes)
        ref_loss, ref_grads = refs[n]
        seen: set[str] = set()
        for rank_result in results:
            r = rank_result[schedule]
            _assert_exact(r, ref_loss, ref_grads)
            seen |= set(r["grads"])
            if r["out"] is not None:  # the last stage's rank: one output per microbatch, its own length
                assert r["out_type"] == "Microbatches"
                assert [o[1 if name != "fan_out_skip" else 0] for o in r["out"]] == sizes
        assert seen == set(ref_grads), f"{schedule}: missing {set(ref_grads) - seen}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["tiny_gpt", "tiny_llama", "fan_out_skip"])
def test_unequal_microbatches_are_exact_under_every_schedule_on_2_ranks(name):
    results = run_ranks(every_schedule, 2, name, ALL_SCHEDULES, timeout=280)
    _check_world(results, name, 2, ALL_SCHEDULES, LENGTHS)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", ["tiny_gpt", "tiny_llama"])
def test_unequal_microbatches_are_exact_under_every_schedule_on_4_ranks(name):
    results = run_ranks(every_schedule, 4, name, ALL_SCHEDULES, LENGTHS_8, timeout=400)
    _check_world(results, name, 4, ALL_SCHEDULES, LENGTHS_8)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule,option", [
    ("1F1B", "full_ac"), ("ZBVZeroBubble", "full_ac"), ("ZBVZeroBubble", "selective_ac"),
    ("Interleaved1F1B", "selective_ac"), ("1F1B", "loss_count"), ("DualPipeV", "loss_count"),
    ("1F1B", "bf16"), ("ZBVZeroBubble", "bf16"),
])
def test_unequal_microbatches_with_stage_options(schedule, option):
    results = run_ranks(with_options, 2, schedule, option, timeout=280)
    n = stages_for(schedule, 2)
    if option == "bf16":  # against the unsplit model under the same autocast
        ref_loss, ref_grads = reference("tiny_llama", n, autocast=True)
        for r in results:
            _assert_exact(r, ref_loss, ref_grads, atol=1e-5)
        return
    ref_loss, ref_grads = reference("tiny_llama", n, loss_count=option == "loss_count")
    for r in results:
        _assert_exact(r, ref_loss, ref_grads)
    if option == "loss_count":  # the token-mean's gradient, and its norm over every rank's stages
        want = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
        assert all(abs(r["norm"] - float(want)) < 1e-4 for r in results)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("what,expect", [
    ("out_of_range", ["microbatch 2", "'idx'", "size 40 in dim 1", "[2, 32]"]),
    ("static_dim", ["microbatch 1", "idx"]),
    ("wrong_count", ["Microbatches of 3 entries", "4 microbatches"]),
])
def test_bad_microbatches_fail_on_every_rank_before_any_message(what, expect):
    errors = run_ranks(bad_step, 2, what, timeout=180)
    for text in errors:
        assert all(e in text for e in expect), text


@pytest.mark.timeout(200)
def test_ranks_given_different_lengths_fail_on_every_rank():
    errors = run_ranks(ranks_disagree, 2, timeout=180)
    for text in errors:
        assert "ranks 0 and 1 were given different inputs" in text and "microbatch 3" in text, text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["qwen2", "tiny_llama"])
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_packed_documents_with_restarting_positions_are_exact(kind, schedule):
    pytest.importorskip("transformers")
    results = run_ranks(packed_step, 2, kind, schedule, timeout=280)
    ref_loss, ref_grads = packed_reference(kind, stages_for(schedule, 2))
    seen: set[str] = set()
    for r in results:
        _assert_exact(r, ref_loss, ref_grads)
        seen |= set(r["grads"])
    assert seen == set(ref_grads)
    assert len(set(results[0]["lengths"])) > 1


@pytest.mark.timeout(200)
def test_hand_built_stages_refuse_unequal_microbatches_on_every_rank():
    errors = run_ranks(hand_built_unequal, 2, timeout=180)
    for text in errors:
        assert "microbatch 2 has input shapes" in text and "dynamic_shapes" in text, text
