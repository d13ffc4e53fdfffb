"""Hand-written orders (CSV): every one validates and runs exactly, or is rejected before any rank starts."""

from __future__ import annotations

import random

import pytest

import pippy_split as ps
from pippy_split.schedule import lower, order_from_csv, order_to_csv
from pippy_split.testing import run_ranks

from .bodies import reference, run_orders

N_MB = 4


def _variants(count: int, seed: int = 0) -> list[str]:
    base = ps.get_schedule_class("1F1B").compute_order(2, N_MB, 1)
    rng = random.Random(seed)
    out = [order_to_csv(base)]
    for _ in range(count):
        order = {r: [a for a in acts if a is not None] for r, acts in base.items()}
        r = rng.randrange(2)
        i, j = rng.randrange(len(order[r])), rng.randrange(len(order[r]))
        order[r][i], order[r][j] = order[r][j], order[r][i]
        out.append(order_to_csv(order))
    return out


def _lowered_variants() -> list[str]:
    """The lowered 1F1B order as CSV (comm actions included), and one whose receives of
    mb 0 and mb 1 are swapped on rank 1: NCCL would hand each the other's tensor."""
    lowered = lower(ps.get_schedule_class("1F1B").compute_order(2, N_MB, 1))
    swapped = {r: list(acts) for r, acts in lowered.items()}
    texts = [str(a) for a in swapped[1]]
    i, j = texts.index("1RECV_F0"), texts.index("1RECV_F1")
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    return [order_to_csv(lowered), order_to_csv(swapped)]


def _valid(text: str) -> bool:
    order = order_from_csv(text)
    lowered = any(a is not None and a.kind.is_comm for acts in order.values() for a in acts)
    try:
        ps.validate(order if lowered else lower(order), 2, N_MB)
    except ps.ScheduleError:
        return False
    return True


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_random_hand_written_orders_run_or_are_rejected_up_front():
    texts = _variants(12) + _lowered_variants()
    expected_valid = [_valid(t) for t in texts]
    assert expected_valid[-2:] == [True, False]
    assert any(expected_valid) and not all(expected_valid)  # the sample holds both kinds
    results = run_ranks(run_orders, 2, texts, N_MB, timeout=180)
    ref_loss, _ = reference("mlp_stack", N_MB)
    for k, ok in enumerate(expected_valid):
        for rank_out in results:
            if ok:
                assert rank_out[k] != "rejected" and abs(rank_out[k] - ref_loss) < 1e-5, (k, texts[k])
            else:
                assert rank_out[k] == "rejected", (k, texts[k])
