"""N-D parallelism: pipelining on a DeviceMesh dimension, with FSDP2 / DDP / TP on the others.

Every test compares with the unsplit model on the whole batch (loss and every
gradient, atol 1e-5) or asserts a named error on every rank.
"""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks

ATOL = 1e-5


def _assert_exact(results: list[dict], ref: dict, what: str) -> None:
    for rank, res in enumerate(results):
        assert abs(res["loss"] - ref["loss"]) < ATOL, f"{what} rank {rank}: loss {res['loss']} vs {ref['loss']}"
    for rank, res in enumerate(results):
        for name, g in res["grads"].items():
            torch.testing.assert_close(g, ref["grads"][name], atol=ATOL, rtol=0,
                                       msg=lambda m, n=name, r=rank: f"{what} rank {r} {n}: {m}")
    got = set().union(*(r["grads"] for r in results))
    assert got == set(ref["grads"]), f"{what}: parameters without a gradient: {sorted(set(ref['grads']) - got)}"


@pytest.mark.dist
@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule", ["1F1B"])
def test_build_schedule_clip_and_checkpoint_take_a_mesh_dimension(schedule, tmp_path):
    from pippy_split import checkpoint
    from tests.dist.nd_bodies import llama_entry, llama_reference, mesh_build_schedule

    ref = llama_reference(steps_after=True)
    results = run_ranks(mesh_build_schedule, 4, schedule, str(tmp_path), timeout=180)
    _assert_exact(results, ref, schedule)
    for rank, res in enumerate(results):
        assert abs(res["norm"] - ref["norm"]) < 1e-5, f"rank {rank}: total norm {res['norm']} vs {ref['norm']}"
        pg_rank, pg_world, local_rank, same_group = res["pg"]
        assert (pg_rank, pg_world, same_group) == (local_rank, 2, True), f"rank {rank}: pipeline group {res['pg']}"
    for replica in (0, 1):  # each pipeline replica wrote its own checkpoint over its mesh["pp"] group
        model = llama_entry().model
        checkpoint.load(tmp_path / f"replica{replica}", model, no_dist=True)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), ref["weights"][name], atol=ATOL, rtol=0,
                                       msg=lambda m, n=name, r=replica: f"replica {r} {n}: {m}")


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_plan_and_its_best_schedule_take_a_mesh_dimension():
    from tests.dist.nd_bodies import llama_reference, mesh_plan

    _assert_exact(run_ranks(mesh_plan, 4, timeout=180), llama_reference(), "plan")


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_two_dimensional_mesh_as_the_pipeline_group_is_refused_by_name():
    from tests.dist.nd_bodies import two_dim_mesh_refused

    for rank, msg in enumerate(run_ranks(two_dim_mesh_refused, 4, timeout=100)):
        assert "DeviceMesh of 2 dimensions" in msg and 'mesh["pp"]' in msg, f"rank {rank}: {msg}"


def _assert_dp_exact(results: list[dict], ref: dict, what: str) -> None:
    """Data-parallel replicas each ran half the batch: their mean loss is the whole batch's."""
    losses = [r["loss"] for r in results]
    for pp in range(2):  # ranks (dp, pp): dp * 2 + pp
        mean = (losses[pp] + losses[2 + pp]) / 2
        assert abs(mean - ref["loss"]) < ATOL, f"{what}: replicas' mean loss {mean} vs {ref['loss']}"
    _assert_exact([{**r, "loss": ref["loss"]} for r in results], ref, what)


@pytest.mark.dist
@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B"])
def test_hand_built_stages_with_per_block_fsdp2_on_a_mesh_are_exact(schedule):
    from tests.dist.nd_bodies import hand_built_fsdp, hb_reference

    _assert_dp_exact(run_ranks(hand_built_fsdp, 4, schedule, timeout=180), hb_reference(), schedule)


@pytest.mark.dist
@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "ZBVZeroBubble"])
def test_hand_built_stages_with_tensor_parallelism_on_a_mesh_are_exact(schedule):
    from tests.dist.nd_bodies import hand_built_tp, hb_reference

    _assert_exact(run_ranks(hand_built_tp, 4, schedule, timeout=180), hb_reference(), schedule)


# ---- the zero-bubble I/W split with data parallelism: exact, never silently wrong ----------
# FSDP2 reduce-scatters a block's gradients when the backward reaches its inputs (in I): a
# stage holding FSDP2 runs its whole backward in I (W empty), with a warning naming it.


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_zero_bubble_with_fsdp2_applied_after_build_schedule_is_exact():
    from tests.dist.nd_bodies import hb_reference, traced_fsdp_after_build

    results = run_ranks(traced_fsdp_after_build, 4, "ZBVZeroBubble", timeout=180)
    _assert_dp_exact(results, hb_reference(), "traced ZBVZeroBubble + fully_shard after build_schedule")
    for rank, res in enumerate(results):
        assert all(res["fused"]), f"rank {rank}: {res['fused']}"
        assert any("FSDP2" in w and "stage" in w for w in res["warned"]), f"rank {rank}: {res['warned']}"


@pytest.mark.dist
@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"])
def test_zero_bubble_with_per_block_fsdp2_on_hand_built_stages_is_exact(schedule):
    from tests.dist.nd_bodies import hand_built_fsdp, hb_reference

    results = run_ranks(hand_built_fsdp, 4, schedule, timeout=180)
    _assert_dp_exact(results, hb_reference(), schedule)
    assert all(all(r["fused"]) for r in results)


@pytest.mark.dist
@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"])
def test_zero_bubble_with_ddp_on_hand_built_stages_is_exact_and_still_split(schedule):
    from tests.dist.nd_bodies import hand_built_ddp, hb_reference

    results = run_ranks(hand_built_ddp, 4, schedule, timeout=180)
    _assert_dp_exact(results, hb_reference(), schedule)
    assert not any(any(r["fused"]) for r in results), "DDP keeps the I/W split (its sync runs once, after the step)"


# ---- ps.parallelize: torch's own fully_shard / parallelize_module by FQN patterns ---------


@pytest.mark.dist
@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["fsdp", "tp"])
def test_parallelize_applies_per_block_fsdp2_and_tp_plans_by_pattern_exactly(kind):
    from tests.dist.nd_bodies import hb_reference, parallelize_helper

    results = run_ranks(parallelize_helper, 4, "1F1B", kind, timeout=180)
    (_assert_dp_exact if kind == "fsdp" else _assert_exact)(results, hb_reference(), f"parallelize {kind}")
    # fsdp: 2 blocks + the root per stage; tp: 7 sharded linears per block, 2 blocks per stage
    assert all(r["wrapped"] == (3 if kind == "fsdp" else 14) for r in results), [r["wrapped"] for r in results]
