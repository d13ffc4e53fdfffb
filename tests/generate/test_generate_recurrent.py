"""Models with a recurrent state (Mamba, Jamba, Zamba: conv and SSM states in Hugging Face's
cache; RecurrentGemma: states on its blocks) generate as Hugging Face ``generate`` does on the
unsplit model: greedy tokens equal and log-probabilities within 1e-5, left-padded prompts, in
one process and on 2 gloo ranks under 1F1B and ZBVZeroBubble (``test_generate_archs.py``,
every family); here the pieces, a tiny Mamba in one process, and a slot refilled with a waiting
prompt starting from a fresh state. The
prefill and a step are two programs (``pippy_split/generate/phased.py``); RWKV stays refused
by name (``test_generate_archs.py``)."""

from __future__ import annotations

import pytest
import torch

from pippy_split.generate.phased import PhaseBindings, PhasedProgram
from pippy_split.generate.recurrent import FixedState, state_rows_reset

from .archs import build, mid_cut
from .models import hf_reference, prompts
from .test_generate_archs import N_NEW, assert_equals_hf


def test_a_refilled_slot_starts_from_a_fresh_state() -> None:
    state = torch.ones(3, 2, 2)
    mask = torch.tensor([[1, 1, 1], [0, 0, 1], [0, 1, 1]])
    assert state_rows_reset(state, mask)[:, 0, 0].tolist() == [1.0, 0.0, 1.0]
    assert FixedState((4, 2)).full_shape(3) == (3, 4, 2)


def test_a_phase_spec_is_empty_in_the_other_phase() -> None:
    from pippy_split.generate.phased import PhaseSpec

    spec = PhaseSpec(owner=None, phase="prefill", k=0, dtype=torch.float32)
    assert spec.concrete_shape(PhaseBindings("step", 1, {})) == (0,)


def _tiny_mamba() -> torch.nn.Module:
    import transformers as t

    torch.manual_seed(0)
    cfg = t.MambaConfig(vocab_size=128, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                        conv_kernel=3, time_step_rank=2)
    return t.MambaForCausalLM(cfg).eval()


@pytest.mark.timeout(120)
def test_a_tiny_mamba_decodes_as_hf_generate_with_one_message_layout_per_phase() -> None:
    import pippy_split as ps

    model = _tiny_mamba()
    ids, mask = prompts(True, batch=3, length=4)
    pipe = ps.pipeline(model, ["backbone.layers.1"], (ids[:2],))
    out = pipe.generate(ids, attention_mask=mask, max_new_tokens=3, return_logprobs=True)
    ref, ref_logprobs = hf_reference(model, ids, mask, 3)
    assert torch.equal(out.sequences, ref)
    torch.testing.assert_close(out.logprobs, ref_logprobs, atol=1e-5, rtol=0)
    program = pipe.derived["decode_program"]
    assert isinstance(program, PhasedProgram)
    prefill, step = program.message_layout(0, 1, 3, 4, 0), program.message_layout(0, 1, 3, 1, 4)
    assert [s for s, _ in prefill if s != (0,)] and [s for s, _ in step if s != (0,)]
    assert len(prefill) == len(step)  # the same values, the other phase's empty
    assert all((a == (0,)) != (b == (0,)) for (a, _), (b, _) in zip(prefill, step))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_jamba_continuous_batching_equals_hf_generate() -> None:
    import pippy_split as ps

    model = build("jamba")
    ids, mask = prompts(True)
    pipe = ps.pipeline(model, mid_cut(model), (ids[:2],))
    out = pipe.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, return_logprobs=True, lanes=1, slots=2)
    assert isinstance(pipe.derived["decode_program"], PhasedProgram)
    assert_equals_hf("jamba", out.sequences, out.logprobs)
