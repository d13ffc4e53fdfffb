"""PP2 x per-block FSDP2 with blocks kept gathered for a step (``fsdp_gather="once"``): exact
against the unsplit model over two steps with SGD between (1F1B and the zero-bubble
ZBVZeroBubble, whose I runs the whole backward under FSDP2), every parameter back to its shard
when ``step()`` returns, and FSDP2's all-gathers and reduce-scatters counted in the second step.

Per step and rank, with ``m`` microbatches: per microbatch, a block is all-gathered for each
forward and again for each backward (``2 m``) and a stage root once per microbatch (FSDP2
keeps a root gathered from its forward to its backward); kept gathered, each module is
all-gathered once, by its first forward, and not again in any backward. Blocks ``"once"``
does not keep (the budget) are gathered per action, but the block an action ends with is
reused by the next action on the rank when that starts with it. Either way each module's
gradients are reduce-scattered once, on its stage's last backward.
"""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks
from tests.dist.test_nd_parallel import ATOL

N_MB = 4


def _assert_exact(results: list[dict], ref: dict, what: str) -> None:
    for step in range(2):
        for rank, res in enumerate(results):
            for name, g in res["grads"][step].items():
                torch.testing.assert_close(g, ref["grads"][step][name], atol=ATOL, rtol=0,
                                           msg=lambda m, n=name, r=rank, s=step: f"{what} step {s} rank {r} {n}: {m}")
        got = set().union(*(r["grads"][step] for r in results))
        assert got == set(ref["grads"][step]), f"{what} step {step}: missing {sorted(set(ref['grads'][step]) - got)}"
    for rank, res in enumerate(results):
        assert res["sharded_after_step"] == [True, True], f"{what} rank {rank}: a parameter left gathered after step()"
        # eval() gathers per microbatch; FSDP2 itself leaves a stage root gathered after a forward
        assert res["blocks_sharded_after_eval"], f"{what} rank {rank}: a block left gathered after eval()"


def _modules(res: dict) -> tuple[int, int]:
    """(blocks, stage roots holding parameters) of this rank's stages."""
    roots = sum(s in (0, 3 if len(res["stages"]) == 2 else 1) for s in res["stages"])
    return len(res["blocks"]), roots


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_blocks_gathered_once_per_step_are_exact_and_gathered_once(schedule):
    from tests.dist.gather_once_bodies import reference, two_steps

    ref = reference()
    once = run_ranks(two_steps, 4, schedule, "once", None, timeout=280)
    _assert_exact(once, ref, f"{schedule} once")
    for rank, res in enumerate(once):
        blocks, roots = _modules(res)
        assert res["gathers"] == blocks + roots, f"rank {rank}: {res['gathers']} all-gathers, kept {res['kept']}"
        assert res["scatters"] == blocks + roots, f"rank {rank}: {res['scatters']} reduce-scatters"
        # eval(): each block per microbatch as before; a root stays gathered from its first forward
        assert res["eval_gathers"] == N_MB * blocks + roots, f"rank {rank}: {res['eval_gathers']} in eval()"
        assert all(res["fused"]) == (schedule == "ZBVZeroBubble"), res["fused"]  # FSDP2: I runs the whole backward
    per_mb = run_ranks(two_steps, 4, schedule, "per_microbatch", None, timeout=280)
    _assert_exact(per_mb, ref, f"{schedule} per microbatch")
    for rank, res in enumerate(per_mb):
        blocks, roots = _modules(res)
        assert res["kept"] == []
        assert res["gathers"] == 2 * N_MB * blocks + N_MB * roots, f"rank {rank}: {res['gathers']} all-gathers"
        assert res["scatters"] == blocks + roots, f"rank {rank}: {res['scatters']} reduce-scatters"


BLOCK = 16448 * 4  # one block of the tiny Llama, fp32 bytes
EMBEDDING, HEAD = 64 * 32 * 4, (64 * 32 + 32) * 4  # stage 0's root (tok_embeddings); stage 1's (norm, output)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_the_budget_keeps_the_smallest_modules_that_fit():
    from tests.dist.gather_once_bodies import reference, two_steps

    # Stage 0: its root and its first block fit exactly; stage 1's root is 128 bytes larger,
    # so after it no block fits
    results = run_ranks(two_steps, 4, "1F1B", "once", f"{EMBEDDING + BLOCK}B", timeout=280)
    _assert_exact(results, reference(), "budget")
    for rank, res in enumerate(results):
        stage0 = res["stages"] == [0]
        assert res["kept"] == (["0:", "0:layers.0"] if stage0 else ["1:"]), f"rank {rank}: kept {res['kept']}"
        # stage 0: three modules once each (layers.1, the one block not kept, is handed from
        # each action to the next); stage 1: its root once, and layers.2 / layers.3 gathered
        # by the first forward, then one each for the 7 later actions (the other is handed over)
        expected = 3 if stage0 else 1 + 2 + 7
        assert res["gathers"] == expected, f"rank {rank}: {res['gathers']} all-gathers, kept {res['kept']}"
        assert res["scatters"] == 3, f"rank {rank}: {res['scatters']} reduce-scatters"


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_too_small_a_budget_keeps_nothing_and_hands_blocks_between_adjacent_actions(schedule):
    from tests.dist.gather_once_bodies import reference, two_steps

    results = run_ranks(two_steps, 4, schedule, "once", 100, timeout=280)
    _assert_exact(results, reference(), f"{schedule} budget too small")
    # 1F1B per microbatch: 2 * 4 * 2 blocks + 4 root = 20 all-gathers on either stage
    expected = {"1F1B": {(0,): 15, (1,): 13}, "ZBVZeroBubble": {(0, 3): 15, (1, 2): 11}}[schedule]
    for rank, res in enumerate(results):
        # only stage roots without parameters of their own (0 bytes) fit
        assert all(k.endswith(":") for k in res["kept"]), f"rank {rank}: kept {res['kept']}"
        if schedule == "1F1B":
            # stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3: 2 + 2 + 1 + 1 + 1 + 1 + 1 + 2 block gathers;
            # stage 1 runs F B F B ...: 2 + 7 * 1; and each root once per microbatch (4)
            assert res["kept"] == []
        assert res["gathers"] == expected[tuple(res["stages"])], f"rank {rank}: {res['gathers']} all-gathers"


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("budget", [None, 100])
def test_hand_built_interleaved_stages_gathered_once_are_exact(budget):
    """Two stages per rank (Interleaved1F1B), hand-built: their first step learns the shapes
    with a real forward, with the blocks kept (no budget) or handed between the rank's actions."""
    from tests.dist.gather_once_bodies import hand_built
    from tests.dist.nd_bodies import hb_reference
    from tests.dist.test_nd_parallel import _assert_dp_exact

    results = run_ranks(hand_built, 4, "Interleaved1F1B", budget, timeout=280)
    _assert_dp_exact(results, hb_reference(), f"hand-built Interleaved1F1B, gather_budget={budget}")
    for rank, res in enumerate(results):
        assert res["sharded"], f"rank {rank}: a parameter left gathered after step()"
        if budget is None:  # 2 stages x (1 block + root), each once; a middle stage's root holds nothing
            assert res["gathers"] == 3, f"rank {rank}: {res['gathers']} all-gathers"


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("budget", [None, "100B"], ids=["all-kept", "none-kept"])
def test_gathered_once_with_activation_checkpointing_is_exact(budget):
    """Checkpointed blocks recompute their forward inside the backward: with the block kept
    gathered (no budget) or handed between actions (a budget no module fits), both steps
    stay exact and every parameter is back to its shard after step()."""
    from tests.dist.gather_once_bodies import reference, two_steps

    results = run_ranks(two_steps, 4, "1F1B", "once", budget, {"activation_checkpoint": ["layers.*"]}, timeout=280)
    _assert_exact(results, reference(), f"activation checkpointing, budget {budget}")
    if budget is None:
        for rank, res in enumerate(results):
            blocks, roots = _modules(res)
            assert res["gathers"] == blocks + roots, f"rank {rank}: {res['gathers']} all-gathers, kept {res['kept']}"
