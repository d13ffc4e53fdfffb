"""Runtime behaviour across ranks: failures, dynamic shapes, memory, data parallel."""

from __future__ import annotations

import time

import pytest
import torch

from pippy_split import zoo
from pippy_split.testing import RankFailure, run_ranks

from .bodies import ddp_pp, dynamic_steps, failing_rank, fsdp_pp, peak_held


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_failing_rank_brings_the_others_down_naming_the_peer():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(failing_rank, 3, 1, timeout=90)
    elapsed = time.monotonic() - start
    failures = info.value.failures
    assert "stage 1, microbatch 0: forward raised ValueError: injected failure" in failures[1]
    # The ranks around it fail on their own, well within the 20 s pipeline timeout, naming whom they waited for.
    assert "on rank 1" in failures[2] and "stage 2 waiting for the forward of microbatch 0" in failures[2]
    assert "rank 1" in failures[0]
    assert elapsed < 60


def _reference(T: int):
    entry = zoo.get("tiny_gpt")
    model = entry.model
    x, y = entry.args[0][:, :T], entry.target[:, :T]
    total = 0.0
    for xm, ym in zip(x.chunk(4), y.chunk(4)):
        loss = entry.loss_fn(model(xm), ym) / 4
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_dynamic_sequence_length_changes_between_steps():
    lengths = [32, 16, 24]
    results = run_ranks(dynamic_steps, 2, "ZBVZeroBubble", lengths, timeout=150)
    for k, T in enumerate(lengths):
        ref_loss, ref_grads = _reference(T)
        for rank_result in results:
            r = rank_result[k]
            assert abs(r["loss"] - ref_loss) < 1e-5
            assert all(h == 0 for h in r["held"])  # nothing held after a step
            for n, g in r["grads"].items():
                torch.testing.assert_close(g, ref_grads[n], atol=1e-5, rtol=0)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_1f1b_holds_at_most_p_microbatches_gpipe_holds_m():
    one_f_one_b = run_ranks(peak_held, 2, "1F1B", 8, timeout=100)
    gpipe = run_ranks(peak_held, 2, "GPipe", 8, timeout=100)
    assert one_f_one_b[0] == [(0, 2, 0)] and one_f_one_b[1] == [(1, 1, 0)]
    assert gpipe[0] == [(0, 8, 0)]


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("body", [ddp_pp, fsdp_pp], ids=["ddp", "fsdp2"])
def test_pipeline_times_data_parallel_matches_unsplit_model(body):
    results = run_ranks(body, 4, 2, timeout=150)
    entry = zoo.get("mlp_stack")
    model = entry.model
    x, y = entry.args[0], entry.target
    for xm, ym in zip(x.chunk(4), y.chunk(4)):
        (entry.loss_fn(model(xm), ym) / 4).backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    seen = set()
    for grads in results:
        for n, g in grads.items():
            torch.testing.assert_close(g, expected[n], atol=1e-5, rtol=0, msg=n)
            seen.add(n)
    assert seen == set(expected)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_killed_rank_makes_the_others_fail_fast_naming_it():
    from .bodies import killed_rank

    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(killed_rank, 3, timeout=100)
    failures = info.value.failures
    assert "signal" in failures[1].lower() or "SIGKILL" in failures[1]
    assert "on rank 1" in failures[2] and "the peer failed or went away" in failures[2]
    assert "rank 1" in failures[0]
    assert time.monotonic() - start < 50  # far below the 60 s pipeline timeout
