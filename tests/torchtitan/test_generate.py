"""torchtitan's models generate in one process (``pipe.generate``): its ``Decoder`` takes no KV cache,
so it decodes by recomputing the prefix each step (``pippy_split/generate/recompute.py``), and the
tokens equal a greedy loop over the unsplit model's full forward of the growing sequence
(log-probabilities to 1e-5); prompts of unequal length are refused by name. On 2 gloo ranks,
after the Trainer's sequence: ``test_trainer_sequence.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'pippy-split[torchtitan]' "
                                         "and, on CPU, pip install --no-deps triton==3.8.0)")

import pippy_split as ps  # noqa: E402
from pippy_split.generate import GenerationError  # noqa: E402
from pippy_split.integrations.torchtitan import _autocast_as_on  # noqa: E402

from .bodies import GEN_NEW, gen_prompts, greedy_reference, reference_model  # noqa: E402


@pytest.mark.timeout(300)
def test_pipe_generate_equals_greedy_full_forward() -> None:
    """DeepSeek-V3 (a dense layer, then a MoE layer with its router's no_grad / autocast regions), cut
    between its two blocks; Llama 3 is checked on 2 ranks."""
    model = reference_model("deepseek_v3", 2).eval()
    with _autocast_as_on(torch.device("cpu")):
        pipe = ps.pipeline(model, 2, (gen_prompts()[:1],))
    want, want_logprobs = greedy_reference(model, gen_prompts(), GEN_NEW)
    out = pipe.generate(gen_prompts(), max_new_tokens=GEN_NEW, return_logprobs=True)
    assert torch.equal(out.sequences, want)
    torch.testing.assert_close(out.logprobs, want_logprobs, atol=1e-5, rtol=0)
    mask = torch.ones_like(gen_prompts())
    mask[2, :1] = 0
    with pytest.raises(GenerationError, match=f"{type(model).__name__} keeps no cache and reads no attention mask.*"
                                              "prompts of one length"):
        pipe.generate(gen_prompts(), attention_mask=mask, max_new_tokens=2)
