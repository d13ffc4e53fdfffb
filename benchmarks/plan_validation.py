"""Does the planner predict what runs? Predicted vs measured step time and peak memory (issue 12).

Run: ``python -m benchmarks.plan_validation [--reps N] [--out PATH]``. Tiny GPT d=256,
8 blocks, batch 32, seq 128 (``common.gpt``), 2 gloo ranks, one thread each.

1. On both ranks at once (each as busy as the runs that follow), ``ps.plan`` profiles
   the model on a microbatch of 4 samples (``--profile-passes``, least time per op),
   runs each split's stages on one process (``plan/measure.py``: every action kind at
   microbatches of 4 and 2, plain and checkpointed, least time; saved bytes around each
   action), measures the link on the group (``CommModel.measure``) and simulates every family,
   stages per rank 1 and 2, m in {2, 4, 8, 16}, checkpointing off and on; splits are
   balanced by ``"flops"`` so that both ranks cut exactly where the plan did (time-
   balanced cuts would move with timing noise). Rank 0's plan is the prediction.
2. Rank 0 picks the configurations to run (below) and sends them to rank 1.
3. The 3 fastest fitting candidates and 5 more of other families/m/AC run on 2 ranks:
   ``ps.pipeline(model, S, mb, balance="flops")`` + ``ps.build_schedule``, all
   configurations taking turns step by step; ``step time`` is the wall clock of a
   step fenced by barriers (the least over the reps, max over the two ranks: the profile
   keeps each op's least time too, and this machine is shared; the median is kept as
   well); ``memory`` is, per rank, the bytes of the parameters,
   gradients and Adam state actually present after an optimizer step (summed over the
   tensors) plus the peak of the live storages autograd saved for backward during a
   step (``saved_tensors_hooks``, each storage once, parameters left out:
   ``pippy_split.plan.saved_bytes.SavedBytes``, the counter the stage measurement uses
   on one process; here it counts the pipelined step on each rank). It does not see
   transient gradient buffers or receive buffers that autograd does not save. The
   measured figures never use the prediction.
4. Top 3: the plan's three best, by predicted step time. Measured order: by pairwise
   wins, a pair's winner the one whose median per-step ratio to the other is below 1
   (``_top3``; the orders by least step and by ratio to the plan's first are reported
   too). Each pair is listed with its predicted gap and measured ratio; a gap within the
   plan's ``resolution`` (its measurement's timing noise, at least 1%) is a tie the
   prediction cannot resolve.

Results: ``benchmarks/results/plan_validation.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import pippy_split as ps
from pippy_split.plan import Plan, predict_candidate
from pippy_split.testing import run_ranks

from . import common
from .training_kit import _SavedBytes

GLOBAL_BATCH, EXAMPLE_MB = 32, 4
RESULTS = Path(__file__).parent / "results"


def _config_key(c: dict) -> str:
    return f"{c['schedule']} S={c['stages']} m={c['m']} AC={'full' if c['ac'] else 'off'}"


def _static_bytes(stages: list, opt: torch.optim.Optimizer) -> float:
    seen: dict[int, int] = {}
    for st in stages:
        for p in st.module.parameters():
            for t in (p, p.grad):
                if t is not None:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return float(sum(seen.values()))


def _plan_here(profile_passes: int, measure: bool = True) -> tuple["Plan", float]:
    entry = common.gpt(256)
    mb_args, mb_kwargs = common.mb_example(entry, GLOBAL_BATCH // EXAMPLE_MB)
    mb_target = entry.target[:EXAMPLE_MB]
    t0 = time.perf_counter()
    plan = ps.plan(entry.model, mb_args, example_kwargs=mb_kwargs or None, example_target=mb_target, num_ranks=2,
                   memory_budget="4GB",
                   loss_fn=entry.loss_fn, global_batch=GLOBAL_BATCH, microbatches=(2, 4, 8, 16),
                   balance=("flops",), profile_passes=profile_passes, measure=measure)
    return plan, time.perf_counter() - t0


def _predictions(plan: "Plan") -> tuple[list[dict], list[dict]]:
    """Configurations to run (rank 0's picks) and what rank 0's plan predicts for each."""
    configs, preds = [], []
    for c in _pick(plan):
        configs.append({"schedule": c.schedule, "stages": c.split.num_stages, "m": c.n_microbatches,
                        "ac": c.activation_checkpoint})
        saved_only = predict_candidate(c.split, c.schedule, 2, c.n_microbatches, c.activation_checkpoint,
                              c.microbatch_size / c.split.batch, plan.comm, 2.0, plan.budget, saved_only=True)
        preds.append({"s": c.step_time, "rank": c.rank, "peak": [c.peak_bytes[r] for r in range(2)],
                      "peak_saved_only": [saved_only.peak_bytes[r] for r in range(2)], "bubble": c.bubble})
    return configs, preds


def _run_body(rank: int, world: int, reps: int, profile_passes: int, measure: bool) -> dict:
    """Plan here (both ranks profile at once, as busy as the runs that follow), then run
    rank 0's picks, all taking turns step by step."""
    plan, plan_s = _plan_here(profile_passes, measure)
    shared = [_predictions(plan) + (str(plan), plan_s, len(plan.candidates), plan.comm, plan.resolution)
              if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    configs, preds, plan_text, plan_s, n_candidates, comm, resolution = shared[0]
    entry = common.gpt(256)
    runs = {}
    for c in configs:  # a trace has static shapes: each m traces its own microbatch
        pipe = ps.pipeline(entry.model, c["stages"], *common.mb_example(entry, c["m"]), balance="flops")
        sched = ps.build_schedule(pipe, c["schedule"], c["m"], loss_fn=entry.loss_fn,
                                  activation_checkpoint="full" if c["ac"] else None)
        runs[_config_key(c)] = sched

    def step(sched):
        return sched.step(*entry.args, target=entry.target, **entry.kwargs)

    out = {k: {"s": [], "static": 0.0, "saved_peak": []} for k in runs}
    for k, sched in runs.items():  # warm-up, then one optimizer step so grads and Adam state exist
        params = [p for st in sched.stages for p in st.module.parameters()]
        opt = torch.optim.Adam(params, lr=1e-4)
        step(sched)
        opt.step()
        out[k]["static"] = _static_bytes(sched.stages, opt)
        opt.zero_grad(set_to_none=False)
    for _ in range(reps):
        for k, sched in runs.items():
            dist.barrier()
            t = time.perf_counter()
            step(sched)
            dist.barrier()
            out[k]["s"].append(time.perf_counter() - t)
    for k, sched in runs.items():
        params = {p.untyped_storage().data_ptr() for st in sched.stages for p in st.module.parameters()}
        counter = _SavedBytes(params)
        with counter.hooks():
            step(sched)
        out[k]["saved_peak"].append(counter.peak)
    return {"runs": out, "configs": configs, "preds": preds, "plan": plan_text, "plan_s": plan_s,
            "resolution": resolution,
            "candidates": n_candidates, "comm": {"bandwidth": comm.bandwidth, "latency": comm.latency,
                                                 "source": comm.source}}


def _pick(plan: "Plan") -> list:
    """The 3 fastest fitting candidates, then a spread: checkpointing on, and other
    families and microbatch counts (8 configurations in all)."""
    fit = plan.fitting
    chosen = list(fit[:3])
    wanted = [("1F1B", True), ("ZBVZeroBubble", True), ("GPipe", False), ("1F1B", False),
              ("Interleaved1F1B", False)]
    for schedule, ac in wanted:
        c = next((c for c in fit if c.schedule == schedule and c.activation_checkpoint == ac and c not in chosen
                  and c.n_microbatches == 8), None)
        if c is not None:
            chosen.append(c)
    return chosen


def _top3(rows: list[dict], resolution: float) -> dict:
    """The plan's three best against what was measured. Each pair's measured ratio is the
    median over reps of first/second (the configurations take turns step by step); the
    measured order ranks each by its pairwise wins (ratio < 1), then by median step. For
    comparison, the orders by least step and by median ratio to the plan's first."""
    top = rows[:3]
    names = [r["config"] for r in top]  # the plan's ranking
    ratio = {(a["config"], b["config"]): statistics.median(x / y for x, y in zip(a["measured_steps_s"],
                                                                                  b["measured_steps_s"]))
             for a in top for b in top}
    wins = {a: sum(ratio[(a, b)] < 1 for b in names if b != a) for a in names}
    median = {r["config"]: r["measured_median_s"] for r in top}
    measured = sorted(names, key=lambda k: (-wins[k], median[k]))
    pairs = []
    for i, a in enumerate(top):
        for b in top[i + 1:]:
            gap = b["predicted_s"] / a["predicted_s"] - 1
            pairs.append({"pair": [a["config"], b["config"]], "predicted_gap": gap,
                          "predicted": "tie" if abs(gap) <= resolution else ("first faster" if gap > 0
                                                                             else "second faster"),
                          "measured_ratio": ratio[(a["config"], b["config"])]})
    resolved = [p for p in pairs if p["predicted"] != "tie"]
    return {"top3_predicted_order": names, "top3_measured_order": measured,
            "top3_order_matches": names == measured,
            "top3_measured_order_by_least_step": sorted(names, key=lambda k: next(r["measured_s"] for r in top
                                                                                   if r["config"] == k)),
            "top3_measured_order_by_ratio_to_first": sorted(names, key=lambda k: ratio[(k, names[0])]),
            "top3_pairs": pairs,
            "top3_resolved_pairs_agree": all((p["measured_ratio"] < 1) == (p["predicted_gap"] > 0) for p in resolved)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--profile-passes", type=int, default=9, help="ps.plan(profile_passes=): more resist load")
    parser.add_argument("--out", default=str(RESULTS / "plan_validation.json"))
    parser.add_argument("--no-measure", action="store_true",
                        help="ps.plan(measure=False): predict from the op sums (write to another --out)")
    parser.add_argument("--rerender", action="store_true",
                        help="recompute the summary and markdown of --out from its rows, without running")
    args = parser.parse_args(argv)
    if args.rerender:
        result = json.loads(Path(args.out).read_text())
        result.update(_top3(result["rows"], result["resolution"]))
        Path(args.out).write_text(json.dumps(result, indent=2))
        Path(args.out).with_suffix(".md").write_text(_markdown(result))
        print(_markdown(result))
        return 0
    load_before = os.getloadavg()
    ranks = run_ranks(_run_body, 2, args.reps, args.profile_passes, not args.no_measure, timeout=2400)
    load_after = os.getloadavg()
    head = ranks[0]
    print(head["plan"])
    rows = []
    for cfg, pred in zip(head["configs"], head["preds"]):
        k = _config_key(cfg)
        steps = [max(a, b) for a, b in zip(ranks[0]["runs"][k]["s"], ranks[1]["runs"][k]["s"])]
        measured_s = min(steps)  # the least-disturbed step, as the profile keeps each op's least time
        measured_mem = [ranks[r]["runs"][k]["static"] + max(ranks[r]["runs"][k]["saved_peak"]) for r in range(2)]
        rows.append({"config": k, "predicted_s": pred["s"], "rank": pred["rank"], "measured_s": measured_s,
                     "time_error": pred["s"] / measured_s - 1,
                     "predicted_peak_bytes": pred["peak"],
                     "predicted_saved_only_peak_bytes": pred["peak_saved_only"],
                     "measured_peak_bytes": measured_mem,
                     "memory_error": [p / m - 1 for p, m in zip(pred["peak_saved_only"], measured_mem)],
                     "measured_median_s": statistics.median(steps), "measured_steps_s": steps})
    result = {"command": " ".join(["python -m benchmarks.plan_validation"] + (argv if argv is not None else sys.argv[1:])),
              "model": "tiny GPT d=256, 8 blocks, batch 32, seq 128; 2 gloo ranks, 1 thread each",
              "comm": head["comm"], "plan_seconds": head["plan_s"], "cpus": os.cpu_count(),
              "loadavg_before_after": [load_before, load_after], "candidates": head["candidates"], "rows": rows,
              "resolution": head["resolution"]}
    result.update(_top3(rows, head["resolution"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    Path(args.out).with_suffix(".md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


def _markdown(res: dict) -> str:
    lines = [f"# Planner validation ({res['model']})", "", f"`{res['command']}`; link {res['comm']['source']}: "
             f"{res['comm']['bandwidth'] / 1e9:.2f} GB/s, {res['comm']['latency'] * 1e6:.0f} us; "
             f"{res['candidates']} candidates planned in {res['plan_seconds']:.1f} s; load average "
             f"{res['loadavg_before_after'][0][0]:.1f} before, {res['loadavg_before_after'][1][0]:.1f} after on "
             f"{res['cpus']} CPUs. Measured step = least of the reps (max over ranks), median in brackets", "",
             "| config | predicted step | measured step | error | predicted peak (rank 0 / 1) | "
             "measured peak (rank 0 / 1) | error |", "|---|---|---|---|---|---|---|"]
    note = ("Predicted peak: parameters, gradients, Adam state and autograd-saved activations, as the "
            "measured counter sees them; in brackets where they differ, with what it cannot see: the split "
            "backward's output gradients held from I to W and a checkpointed stage's kept inputs")
    for r in res["rows"]:
        pp = " / ".join(f"{b / 2**20:.1f}" for b in r["predicted_saved_only_peak_bytes"])
        if r["predicted_peak_bytes"] != r["predicted_saved_only_peak_bytes"]:
            pp += " (" + " / ".join(f"{b / 2**20:.1f}" for b in r["predicted_peak_bytes"]) + ")"
        mp = " / ".join(f"{b / 2**20:.1f}" for b in r["measured_peak_bytes"])
        me = " / ".join(f"{e:+.0%}" for e in r["memory_error"])
        lines.append(f"| {r['config']} | {r['predicted_s'] * 1e3:.0f} ms | {r['measured_s'] * 1e3:.0f} ms | "
                     f"{r['time_error']:+.0%} | {pp} MiB | {mp} MiB | {me} |")
    lines += ["", note, "", f"Plan resolution (predictions closer than this are ties): "
              f"{res['resolution']:.1%}", "", f"top 3 predicted order: {res['top3_predicted_order']}",
              f"top 3 measured order:  {res['top3_measured_order']} (pairwise wins: median of per-step ratios "
              "< 1)", f"order matches: {res['top3_order_matches']}", "",
              f"measured order by least step: {res['top3_measured_order_by_least_step']}; by median ratio to the "
              f"plan's first: {res['top3_measured_order_by_ratio_to_first']}", "", "| pair | predicted | measured first/second |",
              "|---|---|---|"]
    for p in res["top3_pairs"]:
        lines.append(f"| {p['pair'][0]} vs {p['pair'][1]} | {p['predicted']} ({p['predicted_gap']:+.1%}) | "
                     f"{p['measured_ratio']:.3f} |")
    lines += ["", f"pairs predicted apart (more than the resolution) measured in the same order: "
              f"{res['top3_resolved_pairs_agree']}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
