"""Order-matched transport (every tag 0, NCCL's rule on gloo): exact results on multi-stage
schedules with skips across 2 and 4 ranks, tags provably ignored, ranks that disagree fail
loudly, and a 3-rank job exits cleanly after destroy_process_group()."""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import free_port, run_ranks

from .ordered_bodies import (
    clean_exit_worker,
    mismatched_microbatches,
    skip_stack_reference,
    skip_stack_step,
    tags_ignored,
)

N_MB = 4
MULTI_STAGE = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_transport_matches_by_order_not_tag():
    assert run_ranks(tags_ignored, 2, True, timeout=90)[1] == [1.0, 2.0]
    assert run_ranks(tags_ignored, 2, False, timeout=90)[1] == [2.0, 1.0]


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", MULTI_STAGE)
def test_skip_stack_multi_stage_schedules_exact(schedule, world):
    if world == 2 and schedule in ("ZBVZeroBubble", "DualPipeV"):
        pytest.skip("2 stages per rank only: 8 stages need 4 ranks")
    n_mb = 8 if schedule == "DualPipeV" else N_MB  # DualPipeV needs m >= 2p - 1
    results = run_ranks(skip_stack_step, world, schedule, n_mb, timeout=200)
    ref_loss, ref_grads = skip_stack_reference(n_mb)
    seen = set()
    for r in results:
        assert abs(r["loss"] - ref_loss) < 1e-5
        for fqn, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[fqn], atol=1e-5, rtol=0, msg=lambda m, f=fqn: f"{f}: {m}")
            seen.add(fqn)
    assert seen == set(ref_grads)
    assert sorted(s for r in results for s in r["stages"]) == list(range(8))


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_ranks_with_different_schedules_fail_on_every_rank():
    errors = run_ranks(mismatched_microbatches, 2, timeout=90)
    for text in errors:
        assert text is not None and "ranks built different schedules" in text, errors
        assert "n_microbatches=4" in text and "n_microbatches=8" in text


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_three_ranks_exit_cleanly_after_destroy(tmp_path, schedule):
    """Issue 10: 3 ranks under torchrun aborted in about half the runs; 10 runs each."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for run in range(10):
        out = tmp_path / f"{schedule}{run}"
        out.mkdir()
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=3, rdzv_backend="c10d",
                              rdzv_endpoint=f"localhost:{free_port()}", max_restarts=0, monitor_interval=0.5,
                              start_method="spawn", run_id=f"clean-exit-{schedule}-{run}")
        elastic_launch(config, clean_exit_worker)(str(out), schedule)  # raises ChildFailedError on SIGABRT
        assert sorted(p.name for p in out.glob("*.ok")) == ["rank0.ok", "rank1.ok", "rank2.ok"]


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_sent_outputs_give_their_memory_back(schedule):
    from .bodies import reference
    from .ordered_bodies import released_outputs_step

    ref_loss, ref_grads = reference("tiny_gpt", N_MB)
    for release in (True, False, None):  # None: the default, off on CPU
        results = run_ranks(released_outputs_step, 2, schedule, N_MB, release, timeout=150)
        for r in results:
            assert abs(r["loss"] - ref_loss) < 1e-5
            for fqn, g in r["grads"].items():
                torch.testing.assert_close(g, ref_grads[fqn], atol=1e-5, rtol=0)
        first = results[0]
        assert len(first["held_bytes"]) == N_MB
        if release is True:  # one element each, down from (mb, T, C)
            assert all(h <= 4 for h in first["held_bytes"]), first["held_bytes"]
        else:
            assert first["held_bytes"] == first["full_bytes"]
