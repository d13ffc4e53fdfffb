"""Property tests: every generated order validates, lowered or not, with skip links;
scrambled orders either validate or raise ScheduleError, never anything else.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pippy_split.schedule.actions import Action, ActionKind, Order
from pippy_split.schedule.deps import Link, chain_links
from pippy_split.schedule.lower import lower, merge_backward, peer_table, split_backward
from pippy_split.schedule.orders import ORDERS
from pippy_split.schedule.placement import stage_to_rank
from pippy_split.schedule.simulate import simulate
from pippy_split.schedule.validate import ScheduleError, validate

F, B = ActionKind.F, ActionKind.B
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def generated(draw) -> tuple[str, Order, int, int, str]:
    """(name, order, num_stages, n_microbatches, placement) from the ORDERS registry."""
    name = draw(st.sampled_from(sorted(ORDERS)))
    spec = ORDERS[name]
    p = draw(st.integers(1, 8))
    lo = spec.min_stages_per_rank
    v = spec.stages_per_rank or draw(st.integers(lo, lo + 2))
    m = draw(st.integers(1, 12))
    for candidate in (m, m + 2 * p):  # some families need m >= a multiple of p
        try:
            return name, spec.compute_order(p, candidate, v), p * v, candidate, spec.placement
        except ValueError:
            continue
    assume(False)
    raise AssertionError("unreachable")


@st.composite
def skip_links(draw, num_stages: int) -> list[Link]:
    """The chain plus up to 4 random forward links ``src < dst`` (grad or not)."""
    extra = []
    if num_stages > 1:
        for _ in range(draw(st.integers(0, 4))):
            a, b = draw(st.integers(0, num_stages - 1)), draw(st.integers(0, num_stages - 1))
            if a != b:
                extra.append((min(a, b), max(a, b), draw(st.booleans())))
    return chain_links(num_stages) + extra


def check_or_schedule_error(order: Order, num_stages: int, m: int, **kw) -> bool:
    """True when valid; False on ScheduleError; anything else propagates (a bug)."""
    try:
        validate(order, num_stages, m, **kw)
    except ScheduleError as err:
        assert err.rank is None or err.rank in order
        assert err.step is None or 0 <= err.step < len(order[err.rank])
        return False
    return True


@SETTINGS
@given(generated())
def test_every_generated_order_validates_and_lowers(case) -> None:
    name, order, num_stages, m, placement = case
    validate(order, num_stages, m, placement=placement)
    lowered = lower(order, placement=placement)
    validate(lowered, num_stages, m, placement=placement)
    # the simulator agrees that it runs
    simulate(order)
    simulate(lowered)


@SETTINGS
@given(generated(), st.data())
def test_generated_orders_with_skip_links(case, data) -> None:
    name, order, num_stages, m, placement = case
    links = data.draw(skip_links(num_stages))
    validate(order, num_stages, m, links=links, placement=placement)
    lowered = lower(order, links=links)
    validate(lowered, num_stages, m, links=links, placement=placement)
    simulate(lowered, links=links)


@SETTINGS
@given(generated())
def test_split_and_merge_keep_orders_valid(case) -> None:
    name, order, num_stages, m, _ = case
    split = split_backward(order)
    validate(split, num_stages, m)
    validate(merge_backward(split), num_stages, m)
    validate(lower(split), num_stages, m)


@st.composite
def any_placement_bfs(draw) -> tuple[Order, int, int, dict[int, int], list[Link]]:
    """Breadth-first order (forwards ascending, backwards descending per rank)
    under an arbitrary stage -> rank map: valid for any links with src < dst."""
    p = draw(st.integers(1, 5))
    num_stages = draw(st.integers(1, 9))
    m = draw(st.integers(1, 4))
    placement = {s: draw(st.integers(0, p - 1)) for s in range(num_stages)}
    order: Order = {r: [] for r in range(p)}
    for r in range(p):
        stages = [s for s in range(num_stages) if placement[s] == r]
        order[r] = [Action(s, F, mb) for s in stages for mb in range(m)]
        order[r] += [Action(s, B, mb) for s in reversed(stages) for mb in range(m)]
    return order, num_stages, m, placement, draw(skip_links(num_stages))


@SETTINGS
@given(any_placement_bfs())
def test_any_placement_with_skip_links(case) -> None:
    order, num_stages, m, placement, links = case
    validate(order, num_stages, m, links=links, placement=placement)
    lowered = lower(order, links=links, placement=placement)
    validate(lowered, num_stages, m, links=links, placement=placement)
    # same-rank pairs never communicate; a single occupied rank has no comm at all
    for s, peers in peer_table(num_stages, links, placement).items():
        for t in peers.recv_f + peers.send_f + peers.recv_b + peers.send_b:
            assert placement[t] != placement[s]
    if len(set(placement.values())) == 1:
        assert all(a.kind.is_compute for acts in lowered.values() for a in acts)


def scramble(order: Order, rng: random.Random, mode: str) -> Order:
    out = {r: list(acts) for r, acts in order.items()}
    for acts in out.values():
        if not acts:
            continue
        if mode == "shuffle":
            rng.shuffle(acts)
        elif mode == "swaps":
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(len(acts))
                j = min(len(acts) - 1, i + rng.randint(1, 4))
                acts[i], acts[j] = acts[j], acts[i]
        elif mode == "drop":
            del acts[rng.randrange(len(acts))]
        elif mode == "duplicate":
            acts.insert(rng.randrange(len(acts) + 1), rng.choice(acts))
    return out


@SETTINGS
@given(generated(), st.sampled_from(["shuffle", "swaps", "drop", "duplicate"]), st.booleans(), st.randoms())
def test_scrambled_orders_validate_or_raise_schedule_error(case, mode, lowered, rng) -> None:
    name, order, num_stages, m, placement = case
    base = lower(order) if lowered else order
    scrambled = scramble(base, rng, mode)
    if check_or_schedule_error(scrambled, num_stages, m):
        # whatever validate accepts really runs to the end
        simulate(scrambled)


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_registry_grid_small(name: str) -> None:
    """Every family over a small grid, without hypothesis: p 1..4, m up to 8."""
    spec = ORDERS[name]
    seen = 0
    for p in range(1, 5):
        for v in [spec.stages_per_rank] if spec.stages_per_rank else [spec.min_stages_per_rank, 3]:
            for m in range(1, 9):
                try:
                    order = spec.compute_order(p, m, v)
                except ValueError:
                    continue
                seen += 1
                S = p * v
                assert stage_to_rank(S, p, spec.placement) == {
                    a.stage: r for r, acts in order.items() for a in acts if a is not None
                }
                validate(order, S, m, placement=spec.placement)
                validate(lower(order), S, m, placement=spec.placement)
    assert seen > 0
