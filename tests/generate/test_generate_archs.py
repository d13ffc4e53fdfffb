"""Generation follows training: every causal LM the project trains, cut between its blocks,
greedy-decodes as Hugging Face ``generate`` does on the unsplit model, token for token (and
log-probabilities to 1e-5) with left-padded prompts; a model whose cache is a recurrent state
is refused by name at generate's first line (never an ``IndexError`` from deep inside).

Before: OLMoE and Qwen2-MoE as trained (router aux loss on) failed to trace their decode step,
MPT (no ``position_ids``) was refused, Mamba-style models raised ``IndexError`` in transformers'
cache code."""

from __future__ import annotations

import pytest
import torch

import pippy_split as ps
from pippy_split.generate import GenerationError

from .archs import NAMES, RECURRENT, build, mid_cut
from .models import hf_reference, prompts
from .test_generate_local import _live

N_NEW = 6


def _hf_kwargs(model: torch.nn.Module) -> dict:
    # HF's own cached generate fails with left-padded prompts while the router aux loss is on
    # (its loss reads the whole mask beside the new tokens' router logits): the reference
    # switches it off, as the pipe's decode step does.
    return {"output_router_logits": False} if getattr(model.config, "output_router_logits", False) else {}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_pipe_generate_equals_hf_generate_or_refuses_by_name(name: str) -> None:
    model = build(name)
    ids, mask = prompts(True)
    pipe = ps.pipeline(model, mid_cut(model), (ids[:2],))
    assert pipe.num_stages == 2
    if name in RECURRENT:
        with pytest.raises(GenerationError, match="recurrent state"):
            pipe.generate(ids, attention_mask=mask, max_new_tokens=N_NEW)
        return
    ref, ref_logprobs = hf_reference(model, ids, mask, N_NEW, **_hf_kwargs(model))
    out = pipe.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, return_logprobs=True)
    assert torch.equal(out.sequences[:, : ref.shape[1]], ref), name
    n = ref.shape[1] - ids.shape[1]
    live = _live(ref[:, ids.shape[1]:], model.generation_config.eos_token_id)  # HF pads a row after its EOS
    torch.testing.assert_close(out.logprobs[:, :n][live], ref_logprobs[live], atol=1e-5, rtol=0)
