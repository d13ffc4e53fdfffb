"""``pipe.generate`` equals the unsplit model's Hugging Face ``generate`` (greedy, fp32), token
for token, with the log-probabilities an RL loss needs; and bad calls are refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pippy_split as ps

from .models import HF, hf_model, hf_reference, prompts

N_NEW = 8


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(HF))
def test_greedy_equals_hf_generate(name: str) -> None:
    model, spec = hf_model(name)
    ids, _ = prompts(False)
    pipe = ps.pipeline(model, spec, (ids[:2],))
    for padded in (False, True):
        ids, mask = prompts(padded)
        out = pipe.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, return_logprobs=True)
        assert_like_hf(model, out, ids, mask, N_NEW)


def assert_like_hf(model: torch.nn.Module, out: Any, ids: torch.Tensor, mask: torch.Tensor, n_new: int) -> None:
    """``out`` (a Generation with logprobs) has HF ``generate``'s greedy tokens on the unsplit
    ``model`` and its log-probabilities to 1e-5 (HF stops once every row has finished; past that
    point its rows are pad, and a row's steps after its EOS are not compared)."""
    ref, ref_logprobs = hf_reference(model, ids, mask, n_new)
    assert torch.equal(out.sequences[:, : ref.shape[1]], ref)
    n = ref.shape[1] - ids.shape[1]
    live = _live(ref[:, ids.shape[1]:], model.generation_config.eos_token_id)
    torch.testing.assert_close(out.logprobs[:, :n][live], ref_logprobs[live], atol=1e-5, rtol=0)


def _live(new: torch.Tensor, eos: int | list[int] | None) -> torch.Tensor:
    """Steps at which a row had not finished yet (its EOS step included)."""
    if eos is None:
        return torch.ones_like(new, dtype=torch.bool)
    hit = torch.isin(new, torch.tensor(eos if isinstance(eos, list) else [eos]))
    return (hit.cumsum(1) - hit.long()) == 0


def _zoo_reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int, positions_arg: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding with the unsplit model and no cache: the whole sequence every token."""
    seq, m, logprobs = ids, mask, []
    for _ in range(n):
        pos = (m.cumsum(-1) - 1).masked_fill(m == 0, 1)
        with torch.no_grad():
            if positions_arg:
                logits = model(seq, pos, attention_mask=m)[:, -1]
            else:
                logits = model(seq, attention_mask=m, position_ids=pos)[:, -1]
        token = logits.argmax(-1)
        logprobs.append(torch.log_softmax(logits, -1).gather(1, token[:, None])[:, 0])
        seq = torch.cat([seq, token[:, None]], 1)
        m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
    return seq, torch.stack(logprobs, 1)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["tiny_gpt", "tied_lm", "tiny_llama"])
def test_zoo_greedy_equals_unsplit_model(name: str) -> None:
    from pippy_split import zoo

    entry = zoo.get(name)
    pipe = ps.pipeline(entry.model, entry.split_spec, entry.args)
    for padded in (False, True):
        ids, mask = prompts(padded, low=1)
        ids = ids % 64
        ref, ref_logprobs = _zoo_reference(entry.model, ids, mask, N_NEW, name == "tiny_llama")
        out = pipe.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, return_logprobs=True, lanes=2)
        assert torch.equal(out.sequences, ref), (name, padded)
        torch.testing.assert_close(out.logprobs, ref_logprobs, atol=1e-5, rtol=0)


@pytest.mark.timeout(600)
def test_each_stage_keeps_its_own_layers_cache() -> None:
    """The cache of layer j lives on the stage that holds layer j; no message carries it."""
    from pippy_split.generate.programs import decode_program

    model, spec = hf_model("llama")  # 4 layers, cut before layer 2
    ids, _ = prompts(False)
    pipe = ps.pipeline(model, spec, (ids[:2],))
    program = decode_program(pipe)
    assert [p.kv for p in program.plans] == [(0, 1, 2, 3), (4, 5, 6, 7)]  # keys and values of layers 0-1, 2-3
    for e in program.messages():
        assert e.src_output not in program.plans[e.src_stage].kv_outputs.values(), str(e)
    assert program.links() == {1: {0}} and program.token_readers() == {0}
    out = pipe.generate(ids, max_new_tokens=0)
    assert torch.equal(out.sequences, ids) and out.logprobs is None


@pytest.mark.timeout(600)
def test_a_cut_between_a_cache_update_and_its_attention_generates(monkeypatch) -> None:
    """The job's example Qwen2 (examples/qwen2_tiny.json) balanced into 4 stages by flops, with
    whole blocks not preferred (``BLOCK_SLACK`` 0), cuts inside block 3, between the layer's cache
    update and the attention reading it: the last stage computes with keys stage 2 makes. It used
    to be refused ('cut the model at its blocks' boundaries', found only at generate time); the
    keys now travel as a message."""
    import json
    from pathlib import Path

    import transformers

    config = json.loads((Path(__file__).parents[2] / "examples" / "qwen2_tiny.json").read_text())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config)).eval()
    ids, mask = prompts(True)
    monkeypatch.setattr("pippy_split.split.balance.BLOCK_SLACK", 0.0)
    pipe = ps.pipeline(model, 4, (torch.randint(0, config["vocab_size"], (4, 64)),))
    from pippy_split.generate.programs import decode_program

    program = decode_program(pipe)
    kept_elsewhere = {j for p in program.plans[:-1] for j in p.kv}
    crossing = [e for e in program.messages() if e.dst_stage == pipe.num_stages - 1
                and e.src_output in {program.plans[e.src_stage].kv_outputs.get(j) for j in kept_elsewhere}]
    assert crossing, "the balanced cut no longer falls between a cache update and its attention"
    out = pipe.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, return_logprobs=True)
    assert_like_hf(model, out, ids, mask, N_NEW)


def test_generate_runs_on_the_schedules_own_runtime() -> None:
    """``sched.generate`` runs the decode order on the schedule's Interpreter (the one its steps
    run on): its observer sees every D action, one per stage, lane and round that ran, and a
    training step after it still runs. Before, generation had its own loop the runtime never saw."""
    from pippy_split import zoo
    from pippy_split.schedule.actions import ActionKind

    e = zoo.get("tiny_gpt")
    pipe = ps.pipeline(e.model, e.split_spec, e.args)
    sched = ps.build_schedule(pipe, "Interleaved1F1B", 2, loss_fn=lambda out, t: out.float().mean())
    ids = e.args[0][:3, :4]
    with sched.timed_actions() as times:
        out = sched.generate(ids, max_new_tokens=3, lanes=2, eos_token_id=None)
    assert torch.equal(out.sequences, pipe.generate(ids, max_new_tokens=3, lanes=2, eos_token_id=None).sequences)
    decoded = {(t.action.stage, t.action.mb, t.action.round) for t in times}
    assert {t.action.kind for t in times} == {ActionKind.D}
    assert decoded == {(s, lane, r) for s in range(pipe.num_stages) for lane in range(2) for r in range(3)}
    sched.step(torch.cat([e.args[0], e.args[0]]), target=torch.zeros(16))


def test_a_balanced_split_cutting_inside_a_block_generates(monkeypatch) -> None:
    """``pipeline(model, 3)``, whole blocks not preferred (``BLOCK_SLACK`` 0), cuts inside
    ``model.layers.1`` (between its attention and its MLP): the pipe generates what HF ``generate``
    does, so any cut training takes can sample."""
    model, _ = hf_model("llama")
    ids, mask = prompts(True)
    monkeypatch.setattr("pippy_split.split.balance.BLOCK_SLACK", 0.0)
    pipe = ps.pipeline(model, 3, (ids,))
    assert any("in model.layers.1" in e.display_name for e in pipe.edges if e.src_stage == 0 and e.dst_stage == 1)
    ref, ref_logprobs = hf_reference(model, ids, mask, 4)
    out = pipe.generate(ids, attention_mask=mask, max_new_tokens=4, return_logprobs=True)
    assert torch.equal(out.sequences[:, : ref.shape[1]], ref)
