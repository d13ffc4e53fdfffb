"""Two gloo ranks running torch.distributed.pipelining-style code through pippy_split.compat:
losses, outputs and gradients against the unsplit model and against the peer itself."""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks

from . import bodies

ATOL = 1e-5


def close(a, b) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def merged_grads(results: list[dict]) -> dict:
    return {k: v for r in results for k, v in r["grads"].items()}


def check_grads(grads: dict, ref: dict) -> None:
    assert set(grads) == set(ref)
    for k in ref:
        close(grads[k], ref[k])


@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"])
def test_traced_pipe_one_stage_per_rank(schedule):
    """build_stage(pipe.info()), torch's SplitPoint, rank-specific step calls; Interleaved1F1B
    and friends with one stage per rank; a reused losses list; return_outputs; eval(target, losses)."""
    results = run_ranks(bodies.traced_body, 2, schedule, timeout=80)
    ref_losses, ref_out, ref_grads = bodies.reference(*bodies.make())
    check_grads(merged_grads(results), ref_grads)
    first, last = results
    assert len(last["losses"]) == bodies.N_MB  # replaced each step, not appended to
    for got, want in zip(last["losses"], ref_losses):
        close(got, want)
    close(last["out"], ref_out)
    assert first["out"] is None and first["eval"] is None
    assert first["no_out"] is None and last["no_out"] is None  # return_outputs=False
    close(last["eval"], ref_out)
    assert len(last["eval_losses"]) == bodies.N_MB
    for got, want in zip(last["eval_losses"], ref_losses):
        close(got, want)


@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_positional_mb_kwargs_reach_a_later_stage(schedule):
    """pipeline(module, mb_args, mb_kwargs): only rank 0 is given y, stage 1 reads it; sum loss."""
    last = run_ranks(bodies.kwargs_body, 2, schedule, timeout=80)[1]
    close(last["out"], last["ref_out"])
    torch.testing.assert_close(last["loss"], last["ref_loss"], atol=1e-4, rtol=1e-6)


@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                                      "DualPipeV"])
def test_manual_stages_two_per_rank_with_dw_builder(schedule):
    """PipelineStage(submodule, i, n, device, input_args=...) with dw_builder: the runner runs
    once per microbatch and stage (after B, or as W); grads equal the unsplit model's."""
    results = run_ranks(bodies.manual_body, 2, schedule, bodies.N_MB, timeout=80)
    model, x, target = bodies.make()
    ref_losses, ref_out, ref_grads = bodies.reference(model, x, target)
    check_grads(merged_grads(results), ref_grads)
    for r in results:
        assert r["runs"] == {i: bodies.N_MB for i in r["runs"]}
    holder = next(r for r in results if r["losses"] is not None)
    close(holder["out"], ref_out)
    for got, want in zip(holder["losses"], ref_losses):
        close(got, want)
    placement = results[0]["placement"]
    expected = {0: 0, 1: 1, 2: 1, 3: 0} if schedule in ("ZBVZeroBubble", "DualPipeV") else {0: 0, 1: 1, 2: 0, 3: 1}
    assert placement == expected
    kinds = {a[1] for acts in results[0]["order"].values() for a in acts}
    assert ("W" in kinds) == (schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"))


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_without_loss_fn_step_is_forward_only_on_every_rank():
    """No loss_fn: step() runs forward only (no grads) instead of raising on the last rank while
    the others wait; step(losses=) then says why; eval(target=, losses=); loss_kwargs."""
    first, last = run_ranks(bodies.forward_only_body, 2, timeout=80)
    model, x, target = bodies.make()
    ref_losses, ref_out, _ = bodies.reference(model, x, target)
    close(last["out"], ref_out)
    assert first["out"] is None
    assert first["no_grads"] and last["no_grads"]
    assert first["losses_error"] is None and "no loss_fn" in last["losses_error"]
    close(last["eval"], ref_out)
    for got, want in zip(last["eval_losses"], ref_losses):
        close(got, want)
    for got, want in zip(last["kw_losses"], ref_losses):  # loss_kwargs={"scale": 2.0} reached loss_fn
        close(got, 2 * want)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_same_steps_as_torch_distributed_pipelining():
    """A traced GPipe step and a hand-built Interleaved1F1B step, once through the peer and once
    through compat, in the same process group: the same outputs, losses and grads."""
    results = run_ranks(bodies.versus_peer_body, 2, timeout=110)
    model, x, target = bodies.make()
    ref_losses, ref_out, ref_grads = bodies.reference(model, x, target)
    for part in ("traced", "manual"):
        for lib in ("peer", "ours"):
            check_grads({k: v for r in results for k, v in r[lib][part]["grads"].items()}, ref_grads)
        last = {lib: results[1][lib][part] for lib in ("peer", "ours")}
        close(last["ours"]["out"], last["peer"]["out"])
        close(last["ours"]["out"], ref_out)
        assert len(last["ours"]["losses"]) == len(last["peer"]["losses"]) == bodies.N_MB
        for a, b in zip(last["ours"]["losses"], last["peer"]["losses"]):
            close(a, b)
        assert results[0]["ours"][part]["out"] is None and results[0]["peer"][part]["out"] is None


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_construction_errors_have_the_peers_exception_types():
    """ScheduleZBVZeroBubble / DualPipeV with the wrong stages, a bare stage, the abstract base,
    unknown names, indices out of range: the peer's exception type for each."""
    cases = run_ranks(bodies.error_types_body, 1, timeout=50)[0]
    assert len(cases) == 9
    for case, (peer, ours) in cases.items():
        assert peer != "no error", case
        assert ours == peer, f"{case}: peer raises {peer}, compat {ours}"
