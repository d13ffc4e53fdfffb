"""Models with a recurrent state (Mamba, Jamba, Zamba: conv and SSM states in Hugging Face's
cache; RecurrentGemma: states on its blocks; RWKV: ``state=``) generate as Hugging Face
``generate`` does on the unsplit model: greedy tokens equal and log-probabilities within 1e-5,
left-padded prompts (RWKV: prompts of one length, against each prompt alone), in one process
and on 2 gloo ranks under 1F1B and ZBVZeroBubble (``test_generate_archs.py``, every family);
here the pieces, a tiny Mamba and a tiny RWKV in one process, and a slot refilled with a
waiting prompt starting from a fresh state. The prefill and a step are two programs
(``pippy_split/generate/phased.py``)."""

from __future__ import annotations

import pytest
import torch

from pippy_split.generate.phased import PhaseBindings, PhasedProgram
from pippy_split.generate.recurrent import FixedState, StateColumns, state_rows_reset

from .archs import build, mid_cut
from .models import hf_reference, prompts
from .test_generate_archs import N_NEW, assert_equals_hf
from .test_generate_local import _live


def test_a_refilled_slot_starts_from_a_fresh_state() -> None:
    state = torch.ones(3, 2, 2)
    mask = torch.tensor([[1, 1, 1], [0, 0, 1], [0, 1, 1]])
    assert state_rows_reset(state, mask)[:, 0, 0].tolist() == [1.0, 0.0, 1.0]
    assert FixedState((4, 2)).full_shape(3) == (3, 4, 2)


def test_a_refilled_slot_starts_from_the_states_fresh_value_and_a_state_column_is_one_layers() -> None:
    state = torch.ones(2, 3)
    assert state_rows_reset(state, torch.tensor([[1, 1], [0, 1]]), -2.0)[:, 0].tolist() == [1.0, -2.0]
    cols = StateColumns([torch.zeros(2, 3), torch.ones(2, 3)], token_shift=True)
    assert cols[:, :, 1].shape == (2, 1, 3)  # a one-token step's token-shift state: per row, never across rows
    cols[:, :, 0] = torch.full((2, 3), 2.0)
    assert cols.columns[0][0, 0] == 2.0 and cols.columns[1][0, 0] == 1.0
    with pytest.raises(Exception, match=r"state\[k\]\[:, :, layer\]"):
        cols[0]


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
def test_a_tiny_mamba_decodes_as_hf_generate_with_one_message_layout_per_phase(monkeypatch) -> None:
    import pippy_split as ps
    from pippy_split.generate import phased

    traced: list[int] = []
    trace_again = phased.trace_again
    monkeypatch.setattr(phased, "trace_again", lambda pipe, root, args, *a, **k: (
        traced.append(int(args[0].shape[1])), trace_again(pipe, root, args, *a, **k))[1])
    model = _tiny_mamba()
    ids, mask = prompts(True, batch=3, length=4)
    pipe = ps.pipeline(model, ["backbone.layers.1"], (ids[:2],))
    out = pipe.generate(ids, attention_mask=mask, max_new_tokens=3, return_logprobs=True)
    # the step and the prefill of these prompts' length: no other prefill traced to stand for it
    assert sorted(traced) == [1, 4], traced
    ref, ref_logprobs = hf_reference(model, ids, mask, 3)
    assert torch.equal(out.sequences, ref)
    torch.testing.assert_close(out.logprobs, ref_logprobs, atol=1e-5, rtol=0)
    program = pipe.derived["decode_program"]
    assert isinstance(program, PhasedProgram)
    prefill, step = program.message_layout(0, 1, 3, 4, 0), program.message_layout(0, 1, 3, 1, 4)
    assert [s for s, _ in prefill if s != (0,)] and [s for s, _ in step if s != (0,)]
    assert len(prefill) == len(step)  # the same values, the other phase's empty
    assert all((a == (0,)) != (b == (0,)) for (a, _), (b, _) in zip(prefill, step))


def _tiny_rwkv() -> torch.nn.Module:
    import transformers as t

    torch.manual_seed(0)
    cfg = t.RwkvConfig(vocab_size=128, hidden_size=16, num_hidden_layers=2, attention_hidden_size=16,
                       intermediate_size=32, context_length=32)
    return t.RwkvForCausalLM(cfg).eval()


@pytest.mark.timeout(120)
def test_a_tiny_rwkv_decodes_each_row_as_hf_generate_on_it_alone_and_refuses_padding_by_name() -> None:
    import pippy_split as ps
    from pippy_split.generate import GenerationError

    from .archs import reference

    model = _tiny_rwkv()
    ids, mask = prompts(True, batch=3, length=4)
    pipe = ps.pipeline(model, ["rwkv.blocks.1"], (ids[:2],))
    with pytest.raises(GenerationError, match="RwkvForCausalLM reads no attention mask.*prompts of equal length"):
        pipe.generate(ids, attention_mask=mask, max_new_tokens=3)
    for length in (1, 4):  # a prompt of one token takes the model's one-token path in the prefill too
        ids, mask = prompts(False, batch=3, length=length)
        out = pipe.generate(ids, max_new_tokens=3, return_logprobs=True)
        ref, ref_logprobs = reference("rwkv", model, ids, mask, 3)
        assert torch.equal(out.sequences[:, : ref.shape[1]], ref), length
        live = _live(ref[:, length:], model.generation_config.eos_token_id)
        torch.testing.assert_close(out.logprobs[:, : live.shape[1]][live], ref_logprobs[live], atol=1e-5, rtol=0)
    program = pipe.derived["decode_program"]
    assert [p.kv for p in program.step.plans] == [tuple(range(5)), tuple(range(5, 10))]  # each stage its layer's


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
