"""Module calls kept through ``torch.no_grad()`` / autocast regions inside a module's forward
(issue 41): an MoE router that picks experts and counts their load under no_grad, and experts
run in an autocast region, in every block (torchtitan's DeepSeek-V3 router has this shape).

Keeping the signature of a module called *inside* such a region changed the exported graph,
so every signature was dropped with a warning: stages ran traced ops only (per-block
``fully_shard``, hooks and ``parallelize_module`` did not take effect). Now only the modules
called inside a region go without one: each block is the user's module, called whole.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import pippy_split as ps
from pippy_split.split.trace import trace_model
from pippy_split.testing import run_ranks
from tests.split import region_bodies as rb


def test_blocks_with_regions_stay_calls_and_an_even_split_cuts_between_them():
    model, x, _ = rb.case()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = ps.pipeline(model, 4, (x[:rb.MB],))
    assert not [w for w in caught if "could not keep" in str(w.message)], [str(w.message) for w in caught]
    for i in range(4):  # one block per stage, each the user's object, called whole
        st = pipe.get_stage_module(i)
        assert f"layers.{i}" in [str(n.target) for n in st.graph.nodes if n.op == "call_module"]
        assert st.get_submodule(f"layers.{i}") is model.layers[i]
    fired: list[int] = []
    handle = model.layers[1].register_forward_hook(lambda *_: fired.append(1))
    with torch.no_grad():
        got = pipe(x[:rb.MB])
    handle.remove()
    assert fired == [1]
    torch.testing.assert_close(got, rb.case()[0](x[:rb.MB]), atol=0, rtol=0)


def test_modules_called_inside_a_region_keep_no_signature_and_those_around_it_do():
    model, x, _ = rb.case()
    kept = set(trace_model(model, (x[:rb.MB],)).module_signatures)
    assert {"layers.0", "layers.0.feed_forward", "layers.0.feed_forward.router", "layers.0.attention"} <= kept
    assert not any(k.startswith("layers.0.feed_forward.experts") for k in kept)  # called inside the autocast region


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """Both rank bodies in one spawn of 2 gloo ranks."""
    return run_ranks(rb.both_steps, 2, timeout=240)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_1f1b_on_two_ranks_is_exact_with_the_users_blocks_called(two_ranks):
    want_loss, want_grads, want_counters = rb.reference()
    grads: dict[str, torch.Tensor] = {}
    counters: dict[str, torch.Tensor] = {}
    for rank, r in enumerate(r["plain"] for r in two_ranks):
        assert abs(r["loss"] - want_loss) < 1e-6
        assert r["same"] and r["fired"] == rb.N_MB, (rank, r["same"], r["fired"])  # a hook fires once per microbatch
        assert [f"layers.{2 * rank}", f"layers.{2 * rank + 1}"] == [c for c in r["calls"] if c.startswith("layers.")]
        grads.update(r["grads"])
        counters.update(r["counters"])
    assert set(grads) == set(want_grads)
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=1e-5, msg=n)
    for n, c in want_counters.items():  # the routers' load counters: every microbatch counted once
        torch.testing.assert_close(counters[n], c, atol=0, rtol=0, msg=n)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_per_block_fsdp2_applies_to_blocks_with_regions(two_ranks):
    """``ps.parallelize(fsdp=["layers.*"])`` shards each block on its own (before: the pattern
    named glue and was refused); 1F1B stays exact."""
    want_loss, want_grads, _ = rb.reference()
    grads: dict[str, torch.Tensor] = {}
    for rank, r in enumerate(r["fsdp"] for r in two_ranks):
        assert abs(r["loss"] - want_loss) < 1e-6
        assert {f"layers.{2 * rank}", f"layers.{2 * rank + 1}"} <= set(r["sharded"]), r["sharded"]
        grads.update(r["grads"])
    assert set(grads) == set(want_grads)
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=1e-5, msg=n)


def test_torchtitan_deepseek_v3_keeps_its_module_calls():
    """torchtitan's own DeepSeek-V3 (MoE router under no_grad, experts under autocast) at a tiny
    size: an int split keeps the blocks as the user's modules (before: every stage traced ops)."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'pippy_split[torchtitan]')")
    from tests.torchtitan.models import config  # imports torchtitan

    torch.manual_seed(0)
    model = config("deepseek_v3", 4).build()
    model.init_weights()
    tokens = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = ps.pipeline(model, 2, (tokens,))
    assert not [w for w in caught if "could not keep" in str(w.message)]
    calls = [[str(n.target) for n in pipe.get_stage_module(i).graph.nodes if n.op == "call_module"] for i in range(2)]
    assert "layers.0" in calls[0] and {"layers.2", "layers.3"} <= set(calls[1]), calls
    assert pipe.get_stage_module(1).get_submodule("layers.3") is model.layers["3"]
    fired: list[int] = []
    handle = model.layers["3"].register_forward_hook(lambda *_: fired.append(1))
    with torch.no_grad():
        got = pipe(tokens)
    handle.remove()
    assert fired == [1]
    with torch.no_grad():
        torch.testing.assert_close(got, model(tokens), atol=1e-6, rtol=1e-5)

