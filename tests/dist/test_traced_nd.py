"""Traced stages call the user's modules, so per-block FSDP2 and tensor parallelism apply to
them as to hand-built stages: exact against the unsplit model on a DeviceMesh (gloo, 4 ranks)."""

from __future__ import annotations

import pytest

from pippy_split.testing import run_ranks
from tests.dist.test_nd_parallel import _assert_dp_exact, _assert_exact


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_traced_stages_with_per_block_fsdp2_are_exact_and_gather_one_block_at_a_time(schedule):
    from tests.dist.traced_nd_bodies import reference, traced_per_block_fsdp

    ref = reference()
    results = run_ranks(traced_per_block_fsdp, 4, schedule, timeout=220)
    _assert_dp_exact(results, ref, f"traced {schedule} + per-block FSDP2")
    limit = max(ref["block_numel"], ref["embedding_numel"])
    for rank, r in enumerate(results):
        assert any(c.startswith("layers.") for c in r["called"]), r["called"]
        assert r["gathers"], f"rank {rank}: FSDP2 ran no all-gather"
        assert max(r["gathers"]) <= limit, f"rank {rank}: an all-gather of {max(r['gathers'])} elements (block: {limit})"


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_traced_stages_with_tensor_parallelism_are_exact(schedule):
    from tests.dist.traced_nd_bodies import reference, traced_tp

    results = run_ranks(traced_tp, 4, schedule, timeout=220)
    _assert_exact(results, reference(), f"traced {schedule} + TP2")
    assert not any(f for r in results for f in r["fused"])  # TP keeps the zero-bubble I/W split


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_pattern_naming_a_module_the_cut_enters_is_refused_by_name():
    from tests.dist.traced_nd_bodies import traced_glue_refused

    msg = run_ranks(traced_glue_refused, 1, timeout=100)[0]
    assert "stage 0" in msg and "layers.1" in msg and "traced ops" in msg, msg


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["fsdp", "tp"])
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_an_hf_llama_traced_with_per_block_fsdp2_or_tp_is_exact(schedule, kind):
    from tests.dist.traced_nd_bodies import hf_reference, hf_traced

    results = run_ranks(hf_traced, 4, schedule, kind, timeout=220)
    (_assert_dp_exact if kind == "fsdp" else _assert_exact)(results, hf_reference(), f"HF Llama {schedule} {kind}")
