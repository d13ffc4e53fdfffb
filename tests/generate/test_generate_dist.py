"""``sched.generate`` on gloo ranks: the same sequences on every rank, equal to the unsplit
model's, under looped and V schedules on 1, 2 and 4 ranks (HF Llama's rotary tables and mask
reach every stage from stage 0: skip edges at every decode step)."""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks

from .gen_bodies import bad_call_body, failing_rank_body, generate_body, reference

CASES = [  # (model, schedule, world, stages)
    ("llama", "1F1B", 2, 2),
    ("llama", "Interleaved1F1B", 2, 4),
    ("llama", "ZBVZeroBubble", 2, 4),
    ("llama", "DualPipeV", 2, 4),
    ("tiny_gpt", "1F1B", 1, 1),
    ("tiny_gpt", "Interleaved1F1B", 1, 2),
    ("llama", "1F1B", 4, 4),
    ("llama", "ZBVZeroBubble", 4, 8),
]


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
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,schedule,world,stages", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}r" for c in CASES])
def test_generate_on_ranks_equals_unsplit(name: str, schedule: str, world: int, stages: int) -> None:
    kwargs = {"max_new_tokens": 6, "eos_token_id": 999, "pad_token_id": 0}  # no EOS: every step compared
    results = run_ranks(generate_body, world, name, schedule, stages, kwargs, timeout=540)
    _check(results, reference(name, kwargs))


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_sampling_on_ranks_equals_one_process() -> None:
    """Row r's token at step t comes from (seed, r, t): 2 ranks under V placement and 2 lanes
    give the tokens one process gives with one lane."""
    kwargs = {"max_new_tokens": 6, "do_sample": True, "seed": 11, "top_k": 30, "temperature": 0.9, "lanes": 2}
    results = run_ranks(generate_body, 2, "tiny_gpt", "ZBVZeroBubble", 4, kwargs, timeout=540)
    _check(results, reference("tiny_gpt", {**kwargs, "lanes": 1}))


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,schedule,stages", [("tiny_gpt", "DualPipeV", 4), ("llama", "1F1B", 2)])
def test_generate_after_a_training_step_uses_the_new_weights(name: str, schedule: str, stages: int) -> None:
    kwargs = {"max_new_tokens": 6, "eos_token_id": 999, "pad_token_id": 0}
    results = run_ranks(generate_body, 2, name, schedule, stages, kwargs, True, timeout=540)
    before = reference(name, kwargs)
    _check(results, reference(name, kwargs, train_first=True))
    assert not torch.equal(results[0]["sequences"], before[0])  # the step changed what the model says


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kwargs,match", [({"max_new_tokens": -2}, "max_new_tokens"),
                                          ({"max_new_tokens": 2, "do_sample": True, "top_p": 0.0}, "top_p")])
def test_bad_calls_fail_on_every_rank(kwargs: dict, match: str) -> None:
    results = run_ranks(bad_call_body, 2, kwargs, timeout=240)
    assert len(set(results)) == 1 and match in results[0], results


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
@pytest.mark.timeout(600)
def test_generate_on_a_pipe_built_on_meta() -> None:
    """Each rank holds only its own stages' tensors; the decode step is traced on stand-ins of
    the rest (it failed with "Tensor on device cpu is not on the expected device meta")."""
    from .gen_bodies import generate_on_meta_body

    kwargs = {"max_new_tokens": 6, "eos_token_id": 999, "pad_token_id": 0}
    results = run_ranks(generate_on_meta_body, 2, kwargs, timeout=540)
    seq, _ = reference("llama", kwargs)
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
