"""PP2 x DP2 x TP2 on 8 gloo ranks: traced stages, per-block FSDP2 and TP by ``ps.parallelize``
on one 3-D DeviceMesh, exact against the unsplit model (loss, every gradient gathered with
``full_tensor()``, and ``ps.clip_grad_norm_``'s total norm; atol 1e-5)."""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks

ATOL = 1e-5


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_pp2_dp2_tp2_on_8_ranks_is_exact(schedule):
    from tests.dist.nd8_bodies import pp_dp_tp, reference

    ref = reference()
    results = run_ranks(pp_dp_tp, 8, schedule, timeout=280)
    what = f"PP2 x DP2 x TP2 {schedule}"
    for rank, r in enumerate(results):
        assert r["coords"] == (rank // 4, rank // 2 % 2, rank % 2), f"rank {rank}: mesh coordinates {r['coords']}"
        # the blocks' linears are sharded over dp and tp, everything else over dp only
        wq = [p for n, p in r["placements"].items() if n.endswith("attention.wq.weight")]
        assert wq and all(len(p) == 2 for p in wq), f"{what} rank {rank}: wq placements {wq}"
        assert set(r["placements"]) == set(r["grads"]), (
            f"{what} rank {rank}: parameters that are not DTensors: {sorted(set(r['grads']) - set(r['placements']))}")
    for pp in range(2):
        for tp in range(2):  # the two DP replicas of each (pp, tp) ran half the batch each
            a, b = results[4 * pp + tp]["loss"], results[4 * pp + 2 + tp]["loss"]
            assert abs((a + b) / 2 - ref["loss"]) < ATOL, f"{what} pp {pp} tp {tp}: mean loss {(a + b) / 2} vs {ref['loss']}"
    for rank, r in enumerate(results):
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, ref["grads"][name], atol=ATOL, rtol=0,
                                       msg=lambda m, n=name, k=rank: f"{what} rank {k} {n}: {m}")
        assert abs(r["norm"] - ref["norm"]) < ATOL, f"{what} rank {rank}: total norm {r['norm']} vs {ref['norm']}"
    for pp in range(2):  # every rank of a pipeline rank's (dp, tp) block holds the same stages, whole
        held = [set(results[4 * pp + i]["grads"]) for i in range(4)]
        assert all(h == held[0] for h in held), f"{what} pp {pp}: ranks hold different parameters"
    got = set().union(*(r["grads"] for r in results))
    assert got == set(ref["grads"]), f"{what}: parameters without a gradient: {sorted(set(ref['grads']) - got)}"
