"""The training kit against the unsplit model on the same batch: token-normalised losses."""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks

from .training_bodies import token_reference, token_step, zero_items_step

SCHEDULES = {"1F1B": 4, "Interleaved1F1B": 2, "ZBVZeroBubble": 2, "DualPipeV": 2}  # tiny GPT: 4 stages


def _assert_grads(results, ref_grads, scale=1.0):
    seen = set()
    for r in results:
        for fqn, g in r["grads"].items():
            torch.testing.assert_close(g, scale * ref_grads[fqn], atol=1e-5, rtol=0, msg=lambda m, f=fqn: f"{f}: {m}")
            seen.add(fqn)
    assert seen == set(ref_grads)


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_loss_count_gives_the_mean_over_valid_tokens(schedule):
    ref_loss, ref_grads = token_reference()
    results = run_ranks(token_step, SCHEDULES[schedule], schedule, timeout=150)
    for r in results:
        assert abs(r["loss"] - ref_loss) < 1e-5, (r["loss"], ref_loss)
    _assert_grads(results, ref_grads)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_loss_count_accumulates_over_steps():
    _, ref_grads = token_reference()
    _assert_grads(run_ranks(token_step, 2, "ZBVZeroBubble", 2, timeout=150), ref_grads, scale=2.0)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_loss_count_of_zero_is_named():
    errors = run_ranks(zero_items_step, 4, timeout=100)  # every rank raises, none waits
    for text in errors:
        assert text is not None and "stage 3 (rank 3): loss_count gives 0 items for the whole batch" in text, errors


CLIP_CASES = [("tied_lm", "1F1B", 2), ("tied_lm", "GPipe", 2), ("tiny_gpt", "ZBVZeroBubble", 2),
              ("tiny_gpt", "Interleaved1F1B", 2), ("tiny_gpt", "DualPipeV", 2), ("fan_out_skip", "1F1B", 3),
              ("tiny_llama", "1F1B", 4)]


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("name,schedule,world", CLIP_CASES)
def test_clip_grad_norm_equals_the_unsplit_model(name, schedule, world, norm_type):
    from .training_bodies import clip_reference, clip_step

    n_mb = 4
    total, max_norm, clipped = clip_reference(name, n_mb, 0.3, norm_type)
    results = run_ranks(clip_step, world, name, schedule, n_mb, max_norm, norm_type, timeout=150)
    _assert_clipped(results, total, clipped)


def _assert_clipped(results, total, clipped):
    seen = set()
    for r in results:
        assert r["total"] == pytest.approx(total, rel=1e-6), (r["total"], total)
        for fqn, g in r["grads"].items():
            torch.testing.assert_close(g, clipped[fqn], atol=1e-6, rtol=1e-5, msg=lambda m, f=fqn: f"{f}: {m}")
            seen.add(fqn)
    assert seen == set(clipped)


TIED_CASES = [("GPipe", 4), ("1F1B", 4), ("Interleaved1F1B", 2), ("LoopedBFS", 2), ("InterleavedZeroBubble", 2),
              ("ZBVZeroBubble", 2), ("DualPipeV", 2)]


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("schedule,world", TIED_CASES)
def test_clip_counts_each_tied_group_once_wherever_its_holders_sit(schedule, world, norm_type):
    """Three tied groups over 4 stages: under V placement (ZBVZeroBubble, DualPipeV) each
    group's holders sit on one rank, under loop placement on two; every tied tensor enters
    the total norm exactly once either way."""
    from .training_bodies import clip_step, tied_groups_clip_reference

    n_mb = 4
    total, max_norm, clipped = tied_groups_clip_reference(n_mb, 0.3, norm_type)
    results = run_ranks(clip_step, world, "tied_groups", schedule, n_mb, max_norm, norm_type, timeout=150)
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        assert results[0]["stages"] == [0, 3], results[0]["stages"]  # the embedding and head on one rank
    _assert_clipped(results, total, clipped)


AC_CASES = [(name, schedule) for name in ("tiny_gpt", "tied_lm", "fan_out_skip")
            for schedule in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")]


def _world(name: str, schedule: str) -> int | None:
    from pippy_split import zoo
    from pippy_split.schedule.orders import get_order_spec

    stages, per_rank = zoo.get(name).num_stages, get_order_spec(schedule).default_stages_per_rank()
    return stages // per_rank if stages % per_rank == 0 and stages // per_rank >= 1 else None


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name,schedule", AC_CASES)
def test_full_activation_checkpointing_is_exact_and_recomputes_once(name, schedule):
    from .bodies import reference
    from .training_bodies import ac_step

    world = _world(name, schedule)
    if world is None or (schedule == "DualPipeV" and 4 < 2 * world - 1):
        pytest.skip(f"{name}'s stage count does not fit {schedule} with 4 microbatches")
    ref_loss, ref_grads = reference(name, 4)
    results = run_ranks(ac_step, world, name, schedule, 4, timeout=150)
    for r in results:
        assert abs(r["loss"] - ref_loss) < 1e-5
        assert all(n == 2 * 4 for n in r["calls"].values()), r["calls"]  # forward + one recompute per mb
    _assert_grads(results, ref_grads)


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule,world", [("1F1B", 2), ("1F1B", 4), ("GPipe", 4)])
def test_moe_aux_loss_from_every_layer_trains_exactly(schedule, world):
    from .training_bodies import moe_reference, moe_step

    ref_loss, ref_grads = moe_reference(4)
    results = run_ranks(moe_step, world, schedule, 4, timeout=280)
    if world == 4:  # router logits of layers 0-1 skip to the last stage, with gradients
        assert results[0]["skips"] > 0
    for r in results:
        assert abs(r["loss"] - ref_loss) < 1e-5, (r["loss"], ref_loss)
    _assert_grads(results, ref_grads)


BF16_CASES = AC_CASES + [("tiny_unet", "Interleaved1F1B")]


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name,schedule", BF16_CASES)
def test_bf16_matches_the_unsplit_model_under_the_same_autocast(name, schedule):
    """Tolerance: the pipelined stages run the same bf16 ops in the same order as the unsplit
    model under autocast; only the I/W split sums weight gradients in another order
    (measured <= 2.5e-6 relative), so atol 1e-5 plus rtol 1e-4 holds with room."""
    from .training_bodies import bf16_reference, bf16_step

    world = _world(name, schedule)
    if world is None or (schedule == "DualPipeV" and 4 < 2 * world - 1):
        pytest.skip(f"{name}'s stage count does not fit {schedule} with 4 microbatches")
    ref_loss, ref_grads = bf16_reference(name, 4)
    results = run_ranks(bf16_step, world, name, schedule, 4, timeout=150)
    seen = set()
    for r in results:
        assert abs(r["loss"] - ref_loss) < 1e-5
        for fqn, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[fqn], atol=1e-5, rtol=1e-4, msg=lambda m, f=fqn: f"{f}: {m}")
            seen.add(fqn)
    assert seen == set(ref_grads)
    if name in ("fan_out_skip", "tiny_unet") and world > 1:  # conv/linear outputs cross as bf16
        assert any("bfloat16" in d for r in results for d in r["edge_dtypes"])


def test_mixed_precision_must_be_an_autocast_dtype():
    import pippy_split as ps
    from pippy_split import zoo

    entry = zoo.get("tied_lm")
    mb = ps.split_args_kwargs(entry.args, entry.kwargs, 4)[0][0]
    pipe = ps.pipeline(entry.model, entry.split_spec, mb)
    with pytest.raises(ValueError, match=r"mixed_precision=torch.int8 is not an autocast dtype; use torch.bfloat16"):
        ps.build_schedule(pipe, "Interleaved1F1B", 4, loss_fn=entry.loss_fn, mixed_precision=torch.int8)
    with pytest.raises(ValueError, match=r"activation_checkpoint='blocks\.\*'"):
        ps.build_schedule(pipe, "Interleaved1F1B", 4, loss_fn=entry.loss_fn, activation_checkpoint="blocks.*")


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name,schedule,world", [("fan_out_skip", "1F1B", 3), ("tiny_unet", "ZBVZeroBubble", 2)])
def test_fp16_loss_scaling_matches_and_every_rank_skips_an_overflow_together(name, schedule, world):
    """fp16: the scaled, then unscaled gradients equal the unsplit model's under the same autocast and
    scale (same fp16 ops; atol 1e-5 + rtol 1e-3 for fp16's coarser rounding in reordered sums). An
    overflow on one rank only (faked on rank 0) makes every rank skip the step and halve the scale."""
    from .training_bodies import fp16_reference, fp16_step

    ref = fp16_reference(name, 4, 256.0)
    clean = run_ranks(fp16_step, world, name, schedule, 4, 256.0, -1, timeout=150)
    for r in clean:
        assert r["stepped"] and r["changed"] and r["scale"] == 256.0
        for fqn, g in r["grads"].items():
            torch.testing.assert_close(g, ref[fqn], atol=1e-5, rtol=1e-3, msg=lambda m, f=fqn: f"{f}: {m}")
    poisoned = run_ranks(fp16_step, world, name, schedule, 4, 256.0, 0, timeout=150)
    assert [(r["stepped"], r["changed"], r["scale"]) for r in poisoned] == [(False, False, 128.0)] * world


@pytest.mark.dist
@pytest.mark.timeout(400)
@pytest.mark.parametrize("schedule,world", [("ZBVZeroBubble", 2), ("InterleavedZeroBubble", 2)])
def test_compile_with_the_zero_bubble_split_is_exact(schedule, world):
    """torch.compile on every stage (inductor's C++ backend on CPU), I/W split included."""
    from .bodies import reference
    from .training_bodies import compile_step

    ref_loss, ref_grads = reference("tiny_gpt", 4)
    results = run_ranks(compile_step, world, "tiny_gpt", schedule, 4, timeout=380)
    for r in results:
        assert abs(r["loss"] - ref_loss) < 1e-5
    _assert_grads(results, ref_grads)
