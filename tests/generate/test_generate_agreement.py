"""Ranks that give ``sched.generate`` different arguments all raise one named error, before
any message and within seconds, with the rank that differs kept alive (it catches and goes on);
the group stays usable: the same call afterwards decodes as usual.

Before the agreement, different prompts, masks or EOS per rank returned tokens wrong for at
least one rank's arguments with no error, and different token counts, lanes or slots hung
until the transport's timeout or aborted a process."""

from __future__ import annotations

import pytest
import torch

from pippy_split.generate.agreement import ARGUMENTS, argument_digest
from pippy_split.testing import run_ranks

from .agreement_bodies import disagreeing_body

DIFFERING = ["input_ids", "attention_mask", "max_new_tokens", "eos_token_id", "pad_token_id", "lanes", "slots",
             "do_sample", "temperature", "top_k", "top_p", "seed", "return_logprobs"]


def test_every_argument_of_generate_is_in_the_digest() -> None:
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    base = argument_digest(ids, {"max_new_tokens": 2})
    assert base.shape == (1, len(ARGUMENTS)) and int(base.min()) >= 0 and int(base.max()) < 2**52
    assert torch.equal(base, argument_digest(ids.clone(), {"max_new_tokens": 2}))
    assert not torch.equal(argument_digest(ids[:, :2], {"max_new_tokens": 2})[0, :1], base[0, :1])  # the shape
    assert not torch.equal(argument_digest(ids.flip(0), {"max_new_tokens": 2})[0, :1], base[0, :1])  # the order


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(disagreeing_body, 2, [*DIFFERING, "bad_eos", "none"], timeout=600)


@pytest.mark.dist
@pytest.mark.timeout(660)
@pytest.mark.parametrize("which", DIFFERING)
def test_ranks_that_disagree_all_raise_naming_the_argument(ranks: list[dict], which: str) -> None:
    for r, out in enumerate(ranks):
        kind, text, seconds = out[which]
        assert kind == "GenerationError", (r, which, kind, text)
        assert "different" in text and which in text.split("different", 1)[1].split(";")[0], (r, text)
        assert seconds < 60, (r, which, seconds)  # not the transport's timeout


@pytest.mark.dist
@pytest.mark.timeout(660)
def test_a_bad_argument_on_one_rank_stops_every_rank_naming_it(ranks: list[dict]) -> None:
    kind0, text0, s0 = ranks[0]["bad_eos"]
    kind1, text1, s1 = ranks[1]["bad_eos"]
    assert kind1 == "GenerationError" and "eos_token_id" in text1
    assert kind0 == "PipelineError" and "rank 1" in text0 and "eos_token_id" in text0, text0
    assert max(s0, s1) < 60


@pytest.mark.dist
@pytest.mark.timeout(660)
def test_the_group_is_usable_after_a_refused_call(ranks: list[dict]) -> None:
    (k0, seq0, _), (k1, seq1, _) = ranks[0]["none"], ranks[1]["none"]
    assert k0 == k1 == "ok" and torch.equal(seq0, seq1)
