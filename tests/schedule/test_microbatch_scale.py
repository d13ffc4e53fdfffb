"""simulate() with microbatches of different sizes (pure: no tensors run, no process group)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.export import Dim

import pippy_split as ps
from pippy_split import zoo
from pippy_split.schedule import simulate
from pippy_split.schedule.dynamic_sizes import message_bytes
from pippy_split.schedule.lower import lower
from pippy_split.schedule.orders import get_order_spec
from pippy_split.schedule.placement import placement_of_order

FAMILIES = ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"]


def _order(name: str, ranks: int = 2, n_mb: int = 4):
    return get_order_spec(name).compute_order(ranks, n_mb)


@pytest.mark.parametrize("name", FAMILIES)
def test_unit_scale_is_the_plain_simulation(name):
    order = _order(name)
    plain = simulate(order, activation_bytes=[3.0] * 8)
    ones = simulate(order, activation_bytes=[3.0] * 8, microbatch_scale=[1, 1, 1, 1])
    assert ones.makespan == plain.makespan and ones.peak_bytes == plain.peak_bytes


@pytest.mark.parametrize("name", FAMILIES)
def test_a_uniform_scale_scales_time_and_bytes(name):
    order = _order(name)
    plain = simulate(order, {"F": 1, "I": 1, "W": 1}, comm_latency=0.5, activation_bytes=[2.0] * 8)
    double = simulate(order, {"F": 1, "I": 1, "W": 1}, comm_latency=0.5, activation_bytes=[2.0] * 8,
                      microbatch_scale=[2, 2, 2, 2])
    assert double.makespan == pytest.approx(2 * plain.makespan)
    assert double.peak_bytes == {r: 2 * b for r, b in plain.peak_bytes.items()}
    assert double.bubble_fraction == pytest.approx(plain.bubble_fraction)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(FAMILIES), scale=st.lists(st.floats(0.25, 4.0), min_size=4, max_size=4),
       which=st.integers(0, 3))
def test_a_longer_microbatch_costs_more(name, scale, which):
    order = _order(name)
    base = simulate(order, microbatch_scale=scale)
    longer = list(scale)
    longer[which] *= 1.5
    slower = simulate(order, microbatch_scale=longer)
    assert slower.makespan >= base.makespan  # never cheaper (it may hide in a bubble)
    busy = (1 - base.bubble_fraction) * base.makespan
    assert (1 - slower.bubble_fraction) * slower.makespan > busy  # but the ranks work longer


@pytest.mark.parametrize("name", FAMILIES)
def test_a_lowered_order_is_priced_per_microbatch_too(name):
    order = _order(name)
    n = 1 + max(a.stage for acts in order.values() for a in acts if a)
    links = [(s, s + 1, True) for s in range(n - 1)]
    lowered = lower(order, links, placement_of_order(order))
    plain = simulate(lowered, links=links, comm_latency=0.5)
    double = simulate(lowered, links=links, comm_latency=0.5, microbatch_scale=[2, 2, 2, 2])
    assert double.makespan == pytest.approx(2 * plain.makespan)
    skewed = simulate(lowered, links=links, comm_latency=0.5, microbatch_scale=[3, 1, 1, 1])
    assert skewed.makespan > plain.makespan


def test_bad_scale_is_refused():
    with pytest.raises(ValueError, match="one positive number per microbatch"):
        simulate(_order("1F1B"), microbatch_scale=[1, 2])


def test_a_microbatchs_messages_are_sized_by_its_own_length():
    """What a receive allocates per microbatch (the runtime's shapes) grows with its tokens, and
    that ratio is the scale simulate takes for a length distribution."""
    entry = zoo.get("tiny_gpt")
    x = entry.args[0]
    pipe = ps.pipeline(entry.model, entry.split_spec, (x[:2],), dynamic_shapes={"idx": {1: Dim("T", min=2, max=64)}})
    (T,) = [s.symbol for s in pipe.symbols]
    lengths = [16, 32, 24, 8]
    sizes = [message_bytes(pipe.edges, {T: n}) for n in lengths]
    assert [s / sizes[0] for s in sizes] == [n / 16 for n in lengths]
    from pippy_split.schedule.runtime import Interpreter, StepContext

    ctx = StepContext(n_microbatches=4, train=True, bindings=[{T: n} for n in lengths])
    interp = Interpreter({}, {0: 0}, 0, None)
    dynamic = [e for e in pipe.edges if e.spec.is_dynamic]
    for mb, n in enumerate(lengths):
        for e in dynamic:
            shape = interp._shape(e.spec, ctx, mb)
            assert shape == e.spec.concrete_shape({T: n}) and n in shape
    scale = [s / sizes[0] for s in sizes]
    sim = simulate(_order("1F1B", 4, 4), microbatch_scale=scale)
    assert sim.makespan > simulate(_order("1F1B", 4, 4)).makespan  # mean scale 1.25 > 1
    assert torch.tensor(scale).mean() == 1.25
