"""ps.plan: candidates ranked as simulate predicts, the memory budget filters, the best
candidate trains exactly like the unsplit model, errors say what to change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pippy_split as ps
from pippy_split import zoo
from pippy_split.plan import CommModel, PlanError, parse_bytes, predict_candidate
from pippy_split.plan.report import ties
from pippy_split.testing import run_ranks

from .bodies import GLOBAL_BATCH, plan_best_step


@pytest.fixture(scope="module")
def small_plan():
    entry = zoo.get("mlp_stack", d=16)
    return entry, ps.plan(entry.model, (entry.args[0][:2],), num_ranks=2, memory_budget="1GB",
                          loss_fn=entry.loss_fn, global_batch=8, microbatches=(2, 4, 8),
                          schedules=["GPipe", "1F1B", "ZBVZeroBubble", "Interleaved1F1B"])


def test_candidates_ranked_by_their_own_simulation(small_plan) -> None:
    _, plan = small_plan
    fit = plan.fitting
    assert len(fit) >= 8 and plan.best is fit[0]
    assert [c.step_time for c in fit] == sorted(c.step_time for c in fit)
    # candidates that tie with their run's fastest (within plan.resolution, or within their
    # spreads unless the plan is too noisy) share its rank; the next one starts a new rank
    assert [c.rank for c in fit] == sorted(c.rank for c in fit) and fit[0].rank == 1
    for prev, c in zip(fit, fit[1:]):
        head = next(h for h in fit if h.rank == prev.rank)
        assert (c.rank == prev.rank) == ties(head, c, plan.resolution, spreads=not plan.too_noisy)
    for c in fit[:6]:  # re-simulating a candidate from its split gives its prediction
        again = predict_candidate(c.split, c.schedule, 2, c.n_microbatches, c.activation_checkpoint,
                         c.microbatch_size / c.split.batch, plan.comm, 2.0, plan.budget)
        assert again.step_time == pytest.approx(c.step_time)
        assert again.peak_bytes == pytest.approx(c.peak_bytes)
    keys = {c.key for c in plan.candidates}
    assert len(keys) == len(plan.candidates)  # no duplicates
    assert {c.schedule for c in fit} == {"GPipe", "1F1B", "ZBVZeroBubble", "Interleaved1F1B"}


def test_ties_share_a_rank() -> None:
    from pippy_split.plan.report import Candidate, rank_with_ties

    def cand(name: str, t: float, peak: float, fits: bool = True) -> Candidate:
        return Candidate(name, 1, None, 4, 4, False, t, {0: peak}, 0.0, fits, None)  # type: ignore[arg-type]

    ranked = rank_with_ties([cand("a", 1.00, 9), cand("b", 1.005, 5), cand("c", 1.03, 1), cand("d", 0.5, 1, False)],
                            0.01)
    assert [(c.schedule, c.rank) for c in ranked] == [("a", 1), ("b", 1), ("c", 2), ("d", 0)]


def test_predictions_move_the_right_way(small_plan) -> None:
    _, plan = small_plan
    by = {c.key: c for c in plan.candidates}
    s = plan.candidates[0].split.metric
    plain, ac = by[("1F1B", 1, s, 4, False)], by[("1F1B", 1, s, 4, True)]
    # on one basis, the split's op sums: a measured contender's step time comes from timed
    # steps and an unmeasured one's from op sums, so across the two noise can order them
    ops = dataclasses.replace(plain.split, measured=None)
    plain_t, ac_t = (predict_candidate(ops, "1F1B", 2, 4, c.activation_checkpoint, c.microbatch_size / ops.batch,
                                       plan.comm, 2.0, plan.budget).step_time for c in (plain, ac))
    assert ac_t > plain_t  # the forward runs again
    assert max(ac.simulation.peak_bytes.values()) < max(plain.simulation.peak_bytes.values())
    gpipe8, one8 = by[("GPipe", 1, s, 8, False)], by[("1F1B", 1, s, 8, False)]
    assert gpipe8.peak_bytes[0] > one8.peak_bytes[0]  # GPipe holds all 8 microbatches


def test_memory_budget_filters(small_plan) -> None:
    entry, _ = small_plan
    # op sums (measure=False) of a split by params (by time it moves with a busy machine's noise): the
    # same predicted peaks in both plans, so the budget falls between them
    kw = dict(num_ranks=2, loss_fn=entry.loss_fn, global_batch=8, microbatches=(2, 4, 8), schedules=["GPipe", "1F1B"],
              measure=False, balance=("params",))
    peaks = sorted(c.peak for c in ps.plan(entry.model, (entry.args[0][:2],), memory_budget="1GB", **kw).candidates)
    budget = (peaks[0] + peaks[-1]) / 2
    tight = ps.plan(entry.model, (entry.args[0][:2],), memory_budget=budget, **kw)
    assert tight.fitting and all(c.peak <= budget for c in tight.fitting)
    assert all(c.peak > budget for c in tight.candidates if not c.fits)
    assert any(not c.fits for c in tight.candidates)
    with pytest.raises(PlanError, match=r"smallest predicted peak is .* Raise memory_budget to at least"):
        ps.plan(entry.model, (entry.args[0][:2],), num_ranks=2, memory_budget=peaks[0] / 10, loss_fn=None,
                global_batch=8, microbatches=(2, 4), schedules=["1F1B"])


def test_tables_and_svg(small_plan, tmp_path) -> None:
    _, plan = small_plan
    text = str(plan)
    for word in ("schedule", "split", "AC", "step time", "peak memory per rank", "bubble", plan.best.schedule):
        assert word in text
    assert plan.best.schedule in str(plan.best) and "m=" in str(plan.best)
    plan.best.to_svg(str(tmp_path / "best.svg"))
    assert (tmp_path / "best.svg").read_text().startswith("<svg")


def test_pipe_for_another_microbatch_size_is_exact(small_plan) -> None:
    entry, plan = small_plan
    c = next(c for c in plan.candidates if c.microbatch_size != c.split.batch)
    x = entry.args[0][: c.microbatch_size]
    torch.testing.assert_close(c.pipe(x), entry.model(x))
    assert c.pipe.num_stages == c.split.num_stages


def test_parse_bytes_and_comm_model() -> None:
    assert parse_bytes("2GB") == 2e9 and parse_bytes("1GiB") == 2**30 and parse_bytes(5) == 5.0
    with pytest.raises(ValueError, match="cannot read memory size '2 parsecs'"):
        parse_bytes("2 parsecs")
    assert CommModel(bandwidth=1e9, latency=1e-5).time(1e6) == pytest.approx(1e-5 + 1e-3)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        CommModel(bandwidth=0)


def test_microbatches_must_divide_the_batch() -> None:
    entry = zoo.get("mlp_stack", d=16)
    with pytest.raises(ValueError, match=r"microbatches \[3\] do not divide global_batch=8"):
        ps.plan(entry.model, (entry.args[0][:2],), num_ranks=2, memory_budget="1GB", loss_fn=None, global_batch=8,
                microbatches=(2, 3))


def test_unknown_schedule_refused_before_profiling() -> None:
    entry = zoo.get("mlp_stack", d=16)
    with pytest.raises(ValueError, match="unknown schedule 'Fancy'"):
        ps.plan(entry.model, (entry.args[0][:2],), num_ranks=2, memory_budget="1GB", loss_fn=None, global_batch=8,
                schedules=["Fancy"])


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_best_candidate_trains_like_the_unsplit_model() -> None:
    results = run_ranks(plan_best_step, 2, timeout=200)
    entry = zoo.get("mlp_stack", d=16)
    m = results[0]["m"]
    assert all(r["m"] == m and r["schedule"] == results[0]["schedule"] for r in results)
    assert all(r["cuts"] == results[0]["cuts"] and r["step_time"] == results[0]["step_time"] for r in results)
    assert results[0]["comm"].startswith("measured")
    x, y = entry.args[0], entry.target
    ref = 0.0
    for xs, ys in zip(x.chunk(m), y.chunk(m)):
        loss = entry.loss_fn(entry.model(xs), ys) / m
        loss.backward()
        ref += loss.item()
    grads = {n: p.grad for n, p in entry.model.named_parameters()}
    seen = set()
    for r in results:
        assert abs(r["loss"] - ref) < 1e-5
        for fqn, g in r["grads"].items():
            torch.testing.assert_close(g, grads[fqn], atol=1e-5, rtol=0)
            seen.add(fqn)
    assert seen == set(grads)
    assert GLOBAL_BATCH == x.shape[0]
