"""Continuous batching: with fewer slots than prompts, a row that finishes hands its slot to
the lane's next waiting prompt, and every row's tokens are what it gets with every row in
flight (Hugging Face ``generate`` of the whole batch). The lanes' bookkeeping and the
truncated decode order (a lane that has nothing left stops on every rank at once) are
tested as pure data; the sequences in one process and on gloo ranks."""

from __future__ import annotations

import random

import pytest
import torch

import pippy_split as ps
from pippy_split.generate import GenerationError
from pippy_split.generate.distributed import lowered_decode, pack_message, packed_size, unpack_message
from pippy_split.generate.lanes import Lane, make_lanes
from pippy_split.generate.options import GenerateOptions
from pippy_split.generate.programs import decode_program
from pippy_split.schedule.actions import ActionKind, parse_action
from pippy_split.schedule.batch_loop import run_batches
from pippy_split.schedule.decode_order import (
    content_round,
    decision_lag,
    decode_message,
    decode_order,
    lower_decode,
    validate_decode,
)
from pippy_split.schedule.placement import stage_to_rank
from pippy_split.testing import run_ranks

from .gen_bodies import build, case_results, cases_body, generate_body, layers_for, reference
from .models import hf_model, hf_reference, prompts

N_NEW = 8
EOS = {"llama": [3, 68], "qwen2": [104, 94], "gpt2": [19, 2], "mistral_tied": [122]}  # rows end at different steps


def _lane(lengths: list[int], slots: int, max_new: int, eos: tuple[int, ...] = ()) -> Lane:
    width = max(lengths)
    ids = torch.arange(1, 1 + len(lengths) * width).reshape(len(lengths), width)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, width - n:] = 1
    return Lane(ids * mask, mask, list(range(len(lengths))), slots=slots, max_new_tokens=max_new, eos=eos, pad=0)


def test_a_refilled_row_sees_only_its_own_tokens() -> None:
    lane = _lane([2, 3, 3], slots=2, max_new=2, eos=(99,))
    assert lane.rounds == 2 + 2 + 2  # row 2 waits for row 0's slot (free at round 2), feeds 3 tokens
    lane.inputs(0)
    lane.advance(0, torch.tensor([99, 7]))  # row 0 ends with EOS at its first token
    fed = lane.inputs(1)
    assert lane.occupant == [2, 1]
    # slot 0 now holds row 2 (prompt 7, 8, 9): its first token, and a mask hiding row 0's columns
    assert fed.ids[:, 0].tolist() == [7, 7]
    assert fed.mask.tolist() == [[0, 0, 0, 1], [1, 1, 1, 1]]
    assert fed.positions[:, 0].tolist() == [0, 3]
    assert [p.row for p in lane.producing(1)] == [1]  # row 2 feeds its prompt, row 1 chooses
    lane.advance(1, torch.tensor([0, 5]))  # row 1 reaches max_new_tokens
    fed = lane.inputs(2)
    # slot 1 is idle (nobody waits): it feeds the pad and sees only itself, so its position
    # stays 0 however many rounds the lane runs (a learned-position table is never outrun)
    assert fed.ids[:, 0].tolist() == [8, 0] and fed.positions[:, 0].tolist() == [1, 0]
    assert fed.mask[1].tolist() == [0, 0, 0, 0, 1]
    lane.advance(2, torch.tensor([0, 0]))
    assert [(p.row, p.step) for p in lane.producing(3)] == [(2, 0)]
    lane.advance(3, torch.tensor([99, 0]))
    assert lane.idle_after == 3  # every slot idle, nobody waiting: the lane can stop


def test_rounds_bound_counts_every_row_to_max_new_tokens() -> None:
    lane = _lane([3, 1, 4, 2, 2], slots=2, max_new=3)
    t = 0
    while lane.idle_after is None:
        lane.inputs(t)
        lane.advance(t, torch.tensor([5, 5]))
        t += 1
    assert t == lane.rounds


@pytest.mark.parametrize("style,ranks,per_rank", [("loop", 2, 1), ("loop", 2, 2), ("v", 2, 2), ("loop", 4, 1),
                                                   ("loop", 4, 2), ("v", 4, 2), ("loop", 3, 1)])
def test_lanes_stopping_early_keep_every_rank_in_step(style: str, ranks: int, per_rank: int) -> None:
    """Cut each lane's rounds at a random point (the round its rows ended, plus the lag): what
    is left still runs to the end under NCCL's batch rule, with both ends of every message."""
    n = ranks * per_rank
    placement = stage_to_rank(n, ranks, style)
    links = {s: {s - 1} for s in range(1, n)}
    if n > 2:
        links[n - 1].add(0)
    lanes, rounds = 3, 7
    lowest = {min(s for s in placement if placement[s] == r) for r in set(placement.values())}
    lowered = lower_decode(decode_order(placement, lanes=lanes, rounds=rounds), placement, links=links,
                           token_readers=lowest)
    validate_decode(lowered, placement, lanes=lanes, rounds=rounds)
    lag = decision_lag(lowered, placement)
    rng = random.Random(ranks * 10 + per_rank)
    for _ in range(20):
        stop = {lane: min(rounds, rng.randrange(rounds) + lag) for lane in range(lanes)}
        cut = {r: [a for a in acts if content_round(a) < stop[a.lane]] for r, acts in lowered.items()}
        assert not run_batches(cut, {}).blocked  # type: ignore[arg-type]
        sends = sorted(decode_message(a) for acts in cut.values() for a in acts if a.kind.is_comm and a.is_send)
        recvs = sorted(decode_message(a) for acts in cut.values() for a in acts if a.kind.is_comm and not a.is_send)
        assert sends == recvs


def test_the_lag_covers_a_receive_batched_with_the_next_round() -> None:
    """A rank that learns round t's tokens in the same batch as it receives round t + 1's values
    cannot skip round t + 1 on what it learns there: the lag counts that."""
    placement = {0: 0, 1: 1, 2: 2}
    batched = {r: [parse_action(t) for t in row.split()] for r, row in {
        0: "0D0.0 0SEND_D0.0>1 0RECV_T0.1<2 0D0.1 0SEND_D0.1>1",
        1: "1RECV_D0.0<0 1D0.0 1SEND_D0.0>2 1RECV_T0.1<2 1RECV_D0.1<0 1D0.1 1SEND_D0.1>2",
        2: "2RECV_D0.0<1 2D0.0 2SEND_T0.1>0 2SEND_T0.1>1 2RECV_D0.1<1 2D0.1"}.items()}
    assert decision_lag(batched, placement) == 2


def test_slots_must_be_positive() -> None:
    from pippy_split import zoo

    e = zoo.get("tiny_gpt")
    pipe = ps.pipeline(e.model, e.split_spec, e.args)
    with pytest.raises(GenerationError, match="slots must be None or an int >= 1"):
        pipe.generate(e.args[0][:2, :4], max_new_tokens=2, slots=0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(EOS))
def test_refilled_slots_equal_hf_generate(name: str) -> None:
    model, spec = hf_model(name)
    ids, mask = prompts(True)
    pipe = ps.pipeline(model, spec, (ids[:2],))
    ref, ref_logprobs = hf_reference(model, ids, mask, N_NEW, eos_token_id=EOS[name], pad_token_id=0)
    for lanes, slots in [(1, 1), (2, 1), (2, 2)]:
        out = pipe.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, return_logprobs=True,
                            eos_token_id=EOS[name], pad_token_id=0, lanes=lanes, slots=slots)
        assert torch.equal(out.sequences[:, : ref.shape[1]], ref), (name, lanes, slots)
        assert (out.sequences[:, ref.shape[1]:] == 0).all()
        n = ref.shape[1] - ids.shape[1]
        live = _live(ref[:, ids.shape[1]:], EOS[name])
        torch.testing.assert_close(out.logprobs[:, :n][live], ref_logprobs[live], atol=1e-5, rtol=0)


def _live(new: torch.Tensor, eos: list[int]) -> torch.Tensor:
    hit = torch.isin(new, torch.tensor(eos))
    return (hit.cumsum(1) - hit.long()) == 0


@pytest.mark.timeout(600)
def test_sampling_with_refills_is_the_same_as_without() -> None:
    from pippy_split import zoo

    e = zoo.get("tiny_gpt")
    pipe = ps.pipeline(e.model, e.split_spec, e.args)
    ids, mask = prompts(True, batch=7, low=1)
    ids = ids % 64
    kw = {"max_new_tokens": N_NEW, "do_sample": True, "seed": 5, "top_p": 0.9, "eos_token_id": [20, 34],
          "pad_token_id": 0, "attention_mask": mask, "return_logprobs": True}
    whole = pipe.generate(ids, lanes=1, **kw)
    assert (whole.sequences[:, -N_NEW:] == 0).any()  # some rows did end early (so slots were refilled)
    for lanes, slots in [(1, 1), (2, 2), (3, 1)]:
        out = pipe.generate(ids, lanes=lanes, slots=slots, **kw)
        assert torch.equal(out.sequences, whole.sequences), (lanes, slots)
        torch.testing.assert_close(out.logprobs, whole.logprobs, atol=1e-5, rtol=0)


CASES = [("llama", "1F1B", 2, 2, [11, 68]), ("tiny_gpt", "Interleaved1F1B", 2, 4, [3, 32]),  # rows end at
         ("tiny_gpt", "ZBVZeroBubble", 4, 8, [20, 34]), ("tiny_gpt", "DualPipeV", 2, 4, [3, 32])]  # different steps
_REFILL = {"max_new_tokens": 6, "pad_token_id": 0, "lanes": 2, "slots": 1}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """The 2-rank cases, run by one spawn of the ranks."""
    cases = {f"{n}-{s}": (generate_body, (n, s, stages, {**_REFILL, "eos_token_id": eos}))
             for n, s, world, stages, eos in CASES if world == 2}
    return run_ranks(cases_body, 2, cases, timeout=540)


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,schedule,world,stages,eos", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}r" for c in CASES])
def test_refilled_slots_on_ranks_equal_unsplit(request, name: str, schedule: str, world: int, stages: int,
                                               eos: list[int]) -> None:
    if world == 2:
        results = case_results(request.getfixturevalue("two_ranks"), f"{name}-{schedule}")
    else:
        kwargs = {**_REFILL, "eos_token_id": eos}
        results = run_ranks(generate_body, world, name, schedule, stages, kwargs, timeout=540)
    seq, logprobs = reference(name, {"max_new_tokens": 6, "eos_token_id": eos, "pad_token_id": 0}, layers_for(stages))
    for r in results:
        assert torch.equal(r["sequences"], results[0]["sequences"])
    out = results[0]
    assert (out["sequences"][:, 6:] == 0).any()  # rows ended early and handed their slots on
    assert torch.equal(out["sequences"][:, : seq.shape[1]], seq)
    n = seq.shape[1] - 6
    live = _live(seq[:, 6:], eos)
    torch.testing.assert_close(out["logprobs"][:, :n][live], logprobs[:, :n][live], atol=1e-5, rtol=0)


@pytest.mark.timeout(600)
def test_a_long_lane_never_outruns_learned_positions() -> None:
    """GPT-2's 64 learned positions: each row needs at most 36, but the lane runs 100 rounds and
    one slot sits idle for the last 35 of them; an idle slot must not count positions up."""
    model, spec = hf_model("gpt2")
    ids, mask = prompts(False)
    eos = [126]
    assert Lane(ids, mask, list(range(5)), slots=2, max_new_tokens=30, eos=()).rounds > 64
    pipe = ps.pipeline(model, spec, (ids[:2],))
    ref, _ = hf_reference(model, ids, mask, 30, eos_token_id=eos, pad_token_id=0)
    out = pipe.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=0, lanes=1,
                        slots=2)
    assert torch.equal(out.sequences[:, : ref.shape[1]], ref)


def test_a_packed_message_gives_back_every_value() -> None:
    """A stage's values travel as one buffer: any dtype (bool masks of odd sizes, complex rotary
    frequencies, int64), any shape, each value read back exactly, at an aligned offset."""
    g = torch.Generator().manual_seed(0)
    values = [torch.rand(3, 1, 1, 7, generator=g) > 0.5, torch.randn(2, 5, dtype=torch.complex64, generator=g),
              torch.randint(0, 9, (3,), generator=g), torch.randn(3, 1, 5, generator=g).transpose(0, 2),
              torch.empty(0, 4), torch.tensor(2.5, dtype=torch.float64)]
    layout = [(tuple(v.shape), v.dtype) for v in values]
    buffer = pack_message(values)
    assert buffer.dtype == torch.uint8 and buffer.numel() == packed_size(layout)
    for v, back in zip(values, unpack_message(buffer.clone(), layout)):
        assert back.dtype == v.dtype and torch.equal(back, v)


def _messages_body(rank: int, world: int) -> dict:
    """Generate on a 4-stage looped tiny GPT (its stages send several values each) with a
    transport that counts what is posted; the order this rank ran, from the same call."""
    _, pipe, sched = build("tiny_gpt", "Interleaved1F1B", 4)
    ids, mask = prompts(True, batch=5)
    ids = ids % 64
    p2p = sched._runtime.p2p  # the schedule's own transport: generate runs on the training runtime
    batches: list[int] = []
    post = p2p.post
    p2p.post = lambda ops: (batches.append(len(ops)), post(ops))[1]  # type: ignore[method-assign]
    sched.generate(ids, attention_mask=mask, max_new_tokens=4, lanes=2, eos_token_id=None)
    program = decode_program(pipe)
    lanes = make_lanes(ids, mask, 2, None, GenerateOptions(max_new_tokens=4))
    lowered, _ = lowered_decode(dict(sched.placement), program, lanes)
    runs, comm, in_run = 0, 0, False
    for a in lowered[rank]:
        comm += a.kind is not ActionKind.D
        runs += a.kind is not ActionKind.D and not in_run
        in_run = a.kind is not ActionKind.D
    values = max(len([e for e in program.messages() if e.src_stage == s and e.dst_stage == s + 1])
                 for s in range(program.num_stages - 1))
    return {"posted_ops": sum(batches), "batches": len(batches), "comm_actions": comm, "comm_runs": runs,
            "values_per_hop": values}


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_one_transport_op_per_message() -> None:
    """Each message of the lowered decode order is one transport op, however many values a stage
    sends (they travel packed): with several values per hop, one op each would cost a
    rendezvous per value per lane and round; and each run of comm actions is one posted batch."""
    for r in run_ranks(_messages_body, 2, timeout=240):
        assert r["values_per_hop"] > 1  # the case needs stages that send several values
        assert r["posted_ops"] == r["comm_actions"]
        assert r["batches"] == r["comm_runs"]
