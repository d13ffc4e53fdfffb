"""``sched.generate`` on gloo ranks: the same sequences on every rank, equal to the unsplit
model's, under looped and V schedules on 1, 2 and 4 ranks (HF Llama's rotary tables and mask
reach every stage from stage 0: skip edges at every decode step).

The 2-rank cases of this file run in one spawn of the ranks (``two_ranks``, a module fixture:
each case in its own process group, its own error). On 4 ranks, looped 1F1B here (skip edges to
ranks that are not neighbours, tokens from the last stage's rank to three others); V placement
on 4 ranks, with the same skip edges, is test_continuous_batching.py's ZBVZeroBubble-4r case."""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks

from .gen_bodies import (
    bad_call_body,
    case_results,
    cases_body,
    failing_rank_body,
    generate_body,
    generate_on_meta_body,
    layers_for,
    reference,
    retained_rounds_body,
    trace_fails_on_one_rank_body,
)

GREEDY = {"max_new_tokens": 6, "eos_token_id": 999, "pad_token_id": 0}  # no EOS: every step compared
SAMPLING = {"max_new_tokens": 6, "do_sample": True, "seed": 11, "top_k": 30, "temperature": 0.9, "lanes": 2}
CASES = [  # (model, schedule, world, stages)
    ("llama", "1F1B", 2, 2),
    ("llama", "Interleaved1F1B", 2, 4),
    ("llama", "ZBVZeroBubble", 2, 4),
    ("llama", "DualPipeV", 2, 4),
    ("tiny_gpt", "1F1B", 1, 1),
    ("tiny_gpt", "Interleaved1F1B", 1, 2),
    ("llama", "1F1B", 4, 4),
]
TRAINED = [("tiny_gpt", "DualPipeV", 4), ("llama", "1F1B", 2)]
BAD_CALLS = [({"max_new_tokens": -2}, "max_new_tokens"),
             ({"max_new_tokens": 2, "do_sample": True, "top_p": 0.0}, "top_p")]
TWO_RANKS = {  # key: (body, args) of every 2-rank case, run by one cases_body spawn
    **{f"{n}-{s}": (generate_body, (n, s, stages, GREEDY)) for n, s, world, stages in CASES if world == 2},
    **{f"trained-{n}-{s}": (generate_body, (n, s, stages, GREEDY, True)) for n, s, stages in TRAINED},
    "sampling": (generate_body, ("tiny_gpt", "ZBVZeroBubble", 4, SAMPLING)),
    **{f"bad-{m}": (bad_call_body, (kw,)) for kw, m in BAD_CALLS},
    "meta": (generate_on_meta_body, (GREEDY,)),
    "trace-fails": (trace_fails_on_one_rank_body, ()),
    "retained": (retained_rounds_body, ()),
}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(cases_body, 2, TWO_RANKS, timeout=840)


def _check(results: list[dict], ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    seq, logprobs = ref
    for r in results:
        assert torch.equal(r["sequences"], results[0]["sequences"])
        assert torch.equal(r["logprobs"], results[0]["logprobs"])
    out = results[0]
    assert torch.equal(out["sequences"][:, : seq.shape[1]], seq)
    n = seq.shape[1] - (out["sequences"].shape[1] - out["logprobs"].shape[1])
    torch.testing.assert_close(out["logprobs"][:, :n], logprobs[:, :n], atol=1e-5, rtol=0)


@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,schedule,world,stages", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}r" for c in CASES])
def test_generate_on_ranks_equals_unsplit(request, name: str, schedule: str, world: int, stages: int) -> None:
    if world == 2:
        results = case_results(request.getfixturevalue("two_ranks"), f"{name}-{schedule}")
    else:
        results = run_ranks(generate_body, world, name, schedule, stages, GREEDY, timeout=540)
    _check(results, reference(name, GREEDY, layers_for(stages)))


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_sampling_on_ranks_equals_one_process(two_ranks) -> None:
    """Row r's token at step t comes from (seed, r, t): 2 ranks under V placement and 2 lanes
    give the tokens one process gives with one lane."""
    _check(case_results(two_ranks, "sampling"), reference("tiny_gpt", {**SAMPLING, "lanes": 1}, layers_for(4)))


@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,schedule,stages", TRAINED)
def test_generate_after_a_training_step_uses_the_new_weights(two_ranks, name: str, schedule: str,
                                                             stages: int) -> None:
    results = case_results(two_ranks, f"trained-{name}-{schedule}")
    before = reference(name, GREEDY, layers_for(stages))
    _check(results, reference(name, GREEDY, layers_for(stages), train_first=True))
    assert not torch.equal(results[0]["sequences"], before[0])  # the step changed what the model says


@pytest.mark.dist
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kwargs,match", BAD_CALLS)
def test_bad_calls_fail_on_every_rank(two_ranks, kwargs: dict, match: str) -> None:
    results = case_results(two_ranks, f"bad-{match}")
    assert len(set(results)) == 1 and match in results[0], results


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_a_decode_trace_failing_on_one_rank_fails_every_rank_before_any_message(two_ranks) -> None:
    """The trace runs before the ranks agree on the call, so its error is agreed on like a bad
    argument: rank 0 raises its own, the other names it (and nobody waits for a message)."""
    mine, other = case_results(two_ranks, "trace-fails")
    assert mine == "RuntimeError: injected trace failure", mine
    assert "rank 0" in other and "injected trace failure" in other, other


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_a_rank_holds_the_values_of_at_most_two_rounds_a_lane(two_ranks) -> None:
    """Memory of a call stays bounded by the lanes, not the rounds: every rank's decode run holds
    at most two rounds' stage values per lane (before the fix rank 0, without the last stage,
    held all 12 rounds of both lanes, each with every layer's cache: a peak RSS of 3,853 MiB
    against rank 1's 886 MiB for a call in benchmarks.generate_decode's setting)."""
    results = case_results(two_ranks, "retained")
    assert torch.equal(results[0]["sequences"], results[1]["sequences"])
    for r in results:
        assert r["computes"] >= 2 * 12, r  # both lanes, 12 rounds (the prefill chooses the first token)
        assert r["most_held"] <= 2 * 2, r


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_rank_failing_mid_generation_stops_the_others() -> None:
    results = run_ranks(failing_rank_body, 2, timeout=240)
    assert results[1]["error"] == "RuntimeError: injected failure"
    assert results[0]["error"].startswith("PipelineAborted"), results[0]
    assert "rank 1 failed in generate(): RuntimeError: injected failure" in results[0]["error"]
    assert results[0]["seconds"] < 60  # named within the failure channel's poll, not the transport's timeout


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_stage_under_fsdp2_generates_what_the_unsharded_pipe_does():
    """It used to be refused by name; now the call gathers the shards (generate/gathered.py)."""
    from .gen_bodies import generate_on_fsdp_stages

    ((seq, logprobs, got_seq, got_logprobs),) = run_ranks(generate_on_fsdp_stages, 1, timeout=100)
    assert torch.equal(got_seq, seq)
    torch.testing.assert_close(got_logprobs, logprobs, atol=1e-5, rtol=0)


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_generate_on_a_pipe_built_on_meta(two_ranks) -> None:
    """Each rank holds only its own stages' tensors; the decode step is traced on stand-ins of
    the rest (it failed with "Tensor on device cpu is not on the expected device meta")."""
    results = case_results(two_ranks, "meta")
    seq, _ = reference("llama", GREEDY, layers_for(2))
    assert all(torch.equal(r, seq) for r in results)


def test_a_tensor_left_on_a_stand_in_is_refused_by_name() -> None:
    from pippy_split.generate import GenerationError
    from pippy_split.generate.distributed import bind_live
    from pippy_split.generate.stand_ins import stand_in

    decode = torch.nn.Linear(3, 2)
    decode.weight = stand_in(decode.weight)  # traced on meta; this rank's stage lacks it
    live = torch.nn.Module()
    live.bias = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(GenerationError, match="stage 1's decode step reads weight"):
        bind_live(decode, live, 1)
    assert decode.bias is live.bias
