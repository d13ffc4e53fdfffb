"""``sched.generate`` on stages under per-block FSDP2, under tensor parallelism and under both
(gloo, 4 ranks on a DeviceMesh): greedy sequences equal Hugging Face ``generate`` on the
unsplit model token for token and logprobs to 1e-5, before and after a training step and
``optimizer.step()`` (live weights); each call gathers the stage whole and frees it. The three
4-rank layouts run in one spawn of the ranks (``four_ranks``, a module fixture: each body in
its own process group, its own error)."""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks

from .gen_bodies import case_results, cases_body, llama, reference
from .sharded_bodies import LAYERS, failing_generate_body, fsdp_body, fsdp_tp_body, tp_body

KWARGS = {"max_new_tokens": 6, "eos_token_id": 999, "pad_token_id": 0}  # no EOS: every step compared
FSDP = [("1F1B", (0, 1)), ("ZBVZeroBubble", (0, 1, 1, 0))]


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    cases = {**{f"fsdp-{s}": (fsdp_body, (KWARGS, s, len(stage_rank))) for s, stage_rank in FSDP},
             "tp": (tp_body, (KWARGS,)), "fsdp_tp": (fsdp_tp_body, (KWARGS,))}
    return run_ranks(cases_body, 4, cases, timeout=1140)


def _equal_hf(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    assert torch.equal(got[0], ref[0]), f"{what}: {got[0]} vs {ref[0]}"
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=0, msg=lambda m: f"{what}: {m}")


def _check(results: list[dict]) -> None:
    before, after = reference("llama", KWARGS, LAYERS), reference("llama", KWARGS, LAYERS, train_first=True)
    assert not torch.equal(before[0], after[0])  # the step changes what the model says
    for rank, r in enumerate(results):
        _equal_hf(r["before"], before, f"rank {rank} before the step")
        _equal_hf(r["after"], after, f"rank {rank} after the step")
        assert r["sharded"] > 0 and r["kept"], f"rank {rank}: parameters or hooks not put back: {r}"
        assert r["freed"], f"rank {rank}: a full tensor outlived its generate() call"
        assert len(r["gathered"]) == 2, r["gathered"]  # one gather per call


def _numel(names: tuple[str, ...], stage_rank: tuple[int, ...] = (0, 1)) -> list[int]:
    """Elements of the parameters whose FQN contains one of ``names``, per pipeline rank, for
    ``LAYERS`` layers cut evenly into ``len(stage_rank)`` stages placed on ``stage_rank[s]`` (the
    first stage holds the embedding, the last the norm and the head)."""
    per_stage = LAYERS // len(stage_rank)
    out = [0] * (max(stage_rank) + 1)
    for fqn, p in llama(LAYERS).named_parameters():
        if any(n in fqn for n in names):
            layer = next((i for i in range(LAYERS) if f"layers.{i}." in fqn), None)
            stage = 0 if "embed" in fqn else len(stage_rank) - 1 if layer is None else layer // per_stage
            out[stage_rank[stage]] += p.numel()
    return out


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("schedule,stage_rank", FSDP)
def test_generate_on_per_block_fsdp2_stages_equals_hf_before_and_after_a_step(four_ranks, schedule: str,
                                                                              stage_rank: tuple) -> None:
    results = case_results(four_ranks, f"fsdp-{schedule}")
    _check(results)
    whole = _numel(("",), stage_rank)
    for rank, r in enumerate(results):  # ranks (dp, pp): dp * 2 + pp; FSDP2 shards every parameter
        assert all(n == whole[rank % 2] for _, n in r["gathered"]), (rank, r["gathered"], whole)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_generate_on_tensor_parallel_stages_equals_hf_before_and_after_a_step(four_ranks) -> None:
    results = case_results(four_ranks, "tp")
    _check(results)
    linears = _numel(("_proj",))
    per_stage = 7 * LAYERS // 2  # ranks (pp, tp): pp * 2 + tp; 7 linears in each of a stage's layers
    for rank, r in enumerate(results):
        assert all((t, n) == (per_stage, linears[rank // 2]) for t, n in r["gathered"]), (rank, r["gathered"], linears)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_generate_on_fsdp2_over_tensor_parallel_stages_equals_hf_before_and_after_a_step(four_ranks) -> None:
    results = case_results(four_ranks, "fsdp_tp")
    _check(results)
    whole = sum(_numel(("",)))
    for rank, r in enumerate(results):  # one stage holding the whole model, every parameter sharded
        assert all(n == whole for _, n in r["gathered"]), (rank, r["gathered"], whole)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_generate_call_that_fails_puts_the_shards_and_hooks_back() -> None:
    (r,) = run_ranks(failing_generate_body, 1, timeout=240)
    assert r["error"] == "injected failure", r
    assert r["sharded"] > 0 and r["kept"] and r["freed"] and r["same"], r
