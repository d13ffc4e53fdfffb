"""Generation follows training: every causal LM the project trains, cut between its blocks,
greedy-decodes as Hugging Face ``generate`` does on the unsplit model, token for token (and
log-probabilities to 1e-5) with left-padded prompts, Mamba, Jamba, Zamba and RecurrentGemma
(a recurrent state) included, and RWKV (``state=``, no attention mask) with prompts of one
length against HF generate on each prompt alone (HF's batched RWKV step mixes the rows); RWKV
refuses left-padded prompts by name at generate's first line.

Before: OLMoE and Qwen2-MoE as trained (router aux loss on) failed to trace their decode step,
MPT (no ``position_ids``) was refused, Mamba-style models raised ``IndexError`` in transformers'
cache code, then were refused by name (issue 39 made them decode: ``test_generate_recurrent.py``);
RWKV was refused by name (issue 39 made it decode)."""

from __future__ import annotations

import pytest
import torch

from .archs import NAMES, RECURRENT, arch_prompts, build, generation_check, reference
from .test_generate_local import _live

N_NEW = 6


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_pipe_generate_equals_hf_generate_or_refuses_by_name(name: str) -> None:
    verdict, detail = generation_check(name, N_NEW)
    assert verdict == ("refused" if name in RECURRENT else "equal"), (name, verdict, detail)


RANKED = [(name, schedule, stages) for name in ("olmoe", "mpt", "qwen2_moe")
          for schedule, stages in (("1F1B", 2), ("ZBVZeroBubble", 4))]
# recurrent states: one schedule per family keeps the suite short (every family ran under both by hand);
# RWKV under both: its state travels as a state= argument, not in a cache, and V placement puts two of
# its stages (their own layers' columns) on one rank
RANKED += [("mamba", "1F1B", 2), ("jamba", "ZBVZeroBubble", 4), ("recurrent_gemma", "1F1B", 2),
           ("zamba", "ZBVZeroBubble", 4), ("rwkv", "1F1B", 2), ("rwkv", "ZBVZeroBubble", 4)]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    from pippy_split.testing import run_ranks

    from .archs import arch_generate_body
    from .gen_bodies import cases_body

    cases = {f"{n}-{s}": (arch_generate_body, (n, s, stages, {"max_new_tokens": N_NEW})) for n, s, stages in RANKED}
    return run_ranks(cases_body, 2, cases, timeout=840)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,schedule,stages", RANKED, ids=[f"{n}-{s}" for n, s, _ in RANKED])
def test_sched_generate_on_two_ranks_equals_hf_generate(two_ranks, name: str, schedule: str, stages: int) -> None:
    from .gen_bodies import case_results

    results = case_results(two_ranks, f"{name}-{schedule}")
    for r in results:
        assert torch.equal(r["sequences"], results[0]["sequences"])
    assert_equals_hf(name, results[0]["sequences"], results[0]["logprobs"])


def assert_equals_hf(name: str, sequences: torch.Tensor, logprobs: torch.Tensor) -> None:
    """Greedy ``sequences`` equal HF ``generate`` on the unsplit model (:func:`~.archs.reference`)
    and ``logprobs`` its to 1e-5."""
    model = build(name)
    ids, mask = arch_prompts(name)
    ref, ref_logprobs = reference(name, model, ids, mask, N_NEW)
    assert torch.equal(sequences[:, : ref.shape[1]], ref), name
    n = ref.shape[1] - ids.shape[1]
    live = _live(ref[:, ids.shape[1]:], model.generation_config.eos_token_id)
    torch.testing.assert_close(logprobs[:, :n][live], ref_logprobs[live], atol=1e-5, rtol=0)
