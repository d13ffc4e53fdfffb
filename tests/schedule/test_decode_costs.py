"""``ps.simulate`` of a decode order priced by measured costs (issue 39): per stage, the
prefill apart, a message latency, lanes of different sizes; and the runtime's comm batches
recorded by the timing observer."""

import pytest

import pippy_split as ps
from pippy_split.schedule.actions import Action, ActionKind
from pippy_split.schedule.decode_order import decode_cost_fn, decode_order, lower_decode
from pippy_split.schedule.timing import ActionRecorder

pytestmark = pytest.mark.timeout(60)

PLACEMENT = {0: 0, 1: 1}


def lowered(lanes: int, rounds: int) -> dict:
    return lower_decode(decode_order(PLACEMENT, lanes=lanes, rounds=rounds), PLACEMENT, links={1: {0}},
                        token_readers={0})


def test_costs_by_stage_and_prefill():
    f = decode_cost_fn({"D": 2.0, (1, "D"): 3.0, (0, "prefill"): 8.0})
    assert (f(0, "D"), f(1, "D"), f(0, "prefill"), f(1, "prefill")) == (2.0, 3.0, 8.0, 3.0)
    with pytest.raises(ValueError, match="'D' and 'prefill'"):
        decode_cost_fn({"F": 1.0})


def test_one_lane_alternates():
    # one lane: the ranks take turns; each round costs both steps and both messages
    sim = ps.simulate(lowered(1, 4), {(0, "D"): 2.0, (1, "D"): 3.0}, comm_latency=0.5)
    assert sim.makespan == pytest.approx(4 * (2.0 + 3.0) + 4 * 0.5 + 3 * 0.5)  # values each round, tokens 3 times
    assert sim.busy[0] == pytest.approx(8.0 / sim.makespan)


def test_latency_and_prefill_lower_the_busy_fraction():
    plain = ps.simulate(lowered(2, 8))
    slow = ps.simulate(lowered(2, 8), {"D": 1.0}, comm_latency=0.25)
    assert slow.busy[1] < plain.busy[1]
    filled = ps.simulate(lowered(2, 8), {"D": 1.0, "prefill": 4.0})
    assert filled.makespan > plain.makespan and filled.busy[1] < plain.busy[1]
    # a per-link latency, and lanes of different sizes (microbatch_scale: one figure per lane)
    linked = ps.simulate(lowered(2, 8), 1.0, comm_latency={(0, 1): 0.25})
    assert linked.makespan == pytest.approx(slow.makespan)
    scaled = ps.simulate(lowered(2, 8), 1.0, microbatch_scale=[1.0, 0.5])
    assert scaled.makespan < plain.makespan
    assert len(scaled.timeline[0]) == len(lowered(2, 8)[0])


def test_recorder_keeps_comm_batches_when_asked():
    import torch

    send = Action(0, ActionKind.SEND_D, 0, peer=1, round=0)
    for messages, count in ((False, 0), (True, 1)):
        rec = ActionRecorder(torch.device("cpu"), None, messages)
        rec.batch([send], 1.0, 2.0)
        assert len(rec.times) == count
