"""compile= with a different length in every microbatch: dynamo recompiles once per stage graph
(to dynamic shapes), not once per length (one process; dynamo's eager backend, so the count is
dynamo's own and no inductor compile time is spent)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim

import pippy_split as ps
from pippy_split import zoo


@pytest.mark.timeout(300)
def test_fifty_random_lengths_build_a_bounded_number_of_graphs():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    entry = zoo.get("tiny_gpt", n_layer=2, batch_size=4, num_stages=2)
    x, y = entry.args[0], entry.target
    dyn = {"idx": {1: Dim("T", min=2, max=32)}}
    plain_model = copy.deepcopy(entry.model)
    pipe = ps.pipeline(entry.model, zoo.layer_split("blocks", 2, 2), (x[:2],), dynamic_shapes=dyn)
    sched = ps.build_schedule(pipe, "InterleavedZeroBubble", 2, loss_fn=entry.loss_fn, compile={"backend": "eager"})
    plain = ps.build_schedule(ps.pipeline(plain_model, zoo.layer_split("blocks", 2, 2), (x[:2],), dynamic_shapes=dyn),
                              "InterleavedZeroBubble", 2, loss_fn=entry.loss_fn)
    g = torch.Generator().manual_seed(0)
    after_first = None
    lengths = set()
    for step in range(50):
        a, b = torch.randint(2, 33, (2,), generator=g).tolist()
        lengths |= {a, b}
        xs, ys = ps.Microbatches([x[:2, :a], x[2:, :b]]), ps.Microbatches([y[:2, :a], y[2:, :b]])
        sched.step(xs, target=ys)
        if step == 0:
            after_first = counters["stats"]["unique_graphs"]
    graphs = counters["stats"]["unique_graphs"]
    print(f"graphs after the first step {after_first}, after 50 steps of {len(lengths)} lengths {graphs}")
    assert len(lengths) > 20
    # once per stage graph from static to dynamic sizes at most; never one graph per length
    assert graphs - after_first <= pipe.num_stages * 2, (after_first, graphs)
    plain.step(xs, target=ys)
    assert abs(float(sched.loss) - float(plain.loss)) < 1e-5
