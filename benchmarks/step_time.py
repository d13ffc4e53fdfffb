"""Step time, ours against torch.distributed.pipelining, and pipeline efficiency (issue items 2-4).

Run alone with ``python -m benchmarks.step_time [--mode quick]``; ``python -m benchmarks.compare``
runs it with the others. Two gloo ranks, one process and one intra-op thread each, on
the zoo's tiny GPT (8 blocks, batch 32, seq 128, 4 heads):

    step      d=256, 8 microbatches: GPipe and 1F1B on 2 stages, Interleaved1F1B and
              ZBVZeroBubble on 4 stages (2 per rank). Target: ours <= 0.92x the peer.
    overhead  d=32, 32 microbatches (1 sample each): compute is tiny, so the runtime's own
              cost shows. Target: ours <= 0.6x the peer.
    efficiency  every step case against one process on one thread running the unsplit
              model over the same 8 microbatches (the serial step / the pipelined step),
              beside its simulated ideal: the schedule's own order simulated
              (``ps.simulate``) with each (stage, kind)'s least time in one recorded step
              of ours (``sched.timed_actions``), the ideal being the sum of those action
              times over the makespan. Target: within 3% of the ideal (1F1B's ideal with
              equal stages is p*m/(m+p-1) = 1.78x at p=2, m=8).

Ours, the peer and (for efficiency) the serial baseline live in the same two rank
processes and take turns step by step (see ``common.alternate``); each figure is the
median over repetitions of the per-repetition ratio, with its min and max. Beside the
wall-clock ratio, the ratio of CPU seconds (both ranks together) says how much work each
tool does per step; unlike wall time, it barely moves when other processes load the
machine, so it separates "our runtime costs more" from "the machine was busy".
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch.distributed as dist

from pippy_split.testing import run_ranks

from . import common

__all__ = ["Config", "configs", "run", "measure"]

@dataclass(frozen=True)
class Config:
    """One side-by-side measurement."""

    item: str  # "step" | "overhead"
    schedule: str
    num_stages: int
    d: int
    n_mb: int
    serial: bool = False  # also time the unsplit model on rank 0 (pipeline efficiency)
    target: float = 0.92  # ours / peer must be at most this


def configs(mode: str = "full") -> list[Config]:
    """full: every schedule at both sizes; quick: 1F1B at both sizes (with the serial
    baseline); smoke: 1F1B overhead only."""
    schedules = [("1F1B", 2)] if mode != "full" else [("GPipe", 2), ("1F1B", 2), ("Interleaved1F1B", 4),
                                                      ("ZBVZeroBubble", 4)]
    out = [] if mode == "smoke" else [Config("step", s, n, 256, 8, serial=True, target=0.92)
                                      for s, n in schedules]
    out += [Config("overhead", s, n, 32, 32, target=0.6) for s, n in schedules]
    return out


def _body(rank: int, world: int, cfg: Config, warmup: int, reps: int) -> dict:
    ours = common.build_ours(common.gpt(cfg.d, num_stages=cfg.num_stages), cfg.schedule, cfg.n_mb)
    peer = common.build_peer(common.gpt(cfg.d, num_stages=cfg.num_stages), cfg.schedule, cfg.n_mb, rank, world)
    fns = {"ours": ours.step, "peer": peer.step}
    if cfg.serial:
        serial = common.build_serial(common.gpt(cfg.d, num_stages=cfg.num_stages), cfg.n_mb)
        fns["serial"] = serial.step if rank == 0 else None
    times = common.alternate(fns, warmup, reps)
    out = {"times": times, "peer_note": peer.note}
    if cfg.serial:  # more steps of ours, each compute action timed: the simulated ideal's costs
        least: dict[str, float] = {}
        out["timed_steps"] = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            with ours.sched.timed_actions() as timed:  # type: ignore[attr-defined]
                ours.step()
            dist.barrier()
            out["timed_steps"].append({"wall": time.perf_counter() - t0, "actions": [
                (t.action.stage, t.action.kind.name, t.action.mb, t.start - t0, t.end - t0) for t in timed]})
            for t in timed:
                key = f"{t.action.stage},{t.action.kind.name}"
                least[key] = min(least.get(key, float("inf")), t.seconds)
        out["least_action_s"] = least
    return out


def replayed_makespan(per_rank: list[list[tuple[int, str, int, float]]], num_stages: int) -> float:
    """The step's makespan had every compute action taken exactly the time it took in that
    step, each starting as soon as its rank was free and its input had been computed: no
    message, runtime or Python cost between actions. ``per_rank``: each rank's actions
    ``(stage, kind, mb, seconds)`` in the order it ran them, on a chain of stages.

    Example:
        >>> replayed_makespan([[(0, "F", 0, 1.0), (0, "B", 0, 2.0)], [(1, "F", 0, 1.0), (1, "B", 0, 2.0)]], 2)
        6.0
    """
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * len(per_rank)
    pos = [0] * len(per_rank)
    while any(p < len(acts) for p, acts in zip(pos, per_rank)):
        moved = False
        for r, acts in enumerate(per_rank):
            while pos[r] < len(acts):
                stage, kind, mb, seconds = acts[pos[r]]
                if kind == "F":
                    deps = [(stage - 1, "F", mb)] if stage > 0 else []
                elif kind in ("B", "I"):
                    deps = [(stage + 1, k, mb) for k in ("B", "I")] if stage < num_stages - 1 else []
                else:
                    deps = []
                have = [done[d] for d in deps if d in done]
                if deps and not have:
                    break
                start = max([free[r], *have])
                free[r] = done[(stage, kind, mb)] = start + seconds
                pos[r] += 1
                moved = True
        if not moved:
            raise ValueError("the recorded actions cannot be replayed (an input never computed)")
    return max(free)


def simulated_ideal(cfg: Config, least_action_s: dict[str, float]) -> dict[str, float]:
    """The schedule's compute order on 2 ranks simulated with each (stage, kind)'s least
    measured time: ``{"ideal_speedup": busy / makespan, "makespan_s", "busy_s"}``."""
    import pippy_split as ps
    from pippy_split.schedule import get_schedule_class

    cls = get_schedule_class(cfg.schedule)
    order = cls.compute_order(2, cfg.n_mb, cfg.num_stages // 2)
    costs = {(int(k.split(",")[0]), k.split(",")[1]): v for k, v in least_action_s.items()}
    sim = ps.simulate(order, costs)
    busy = sum(costs[(a.stage, a.kind.name)] for acts in order.values() for a in acts if a is not None)
    equal = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # equal stages, B = 2 F: the textbook ideal
    equal_busy = sum(equal[a.kind.name] for acts in order.values() for a in acts if a is not None)
    return {"ideal_speedup": busy / sim.makespan, "makespan_s": sim.makespan, "busy_s": busy,
            "equal_stages_ideal_speedup": equal_busy / ps.simulate(order, equal).makespan}


def measure(cfg: Config, warmup: int = 1, reps: int = 5, timeout: float = 900.0) -> dict:
    """Run one config on 2 ranks; return times and the ratios that the table shows."""
    ranks = run_ranks(_body, 2, cfg, warmup, reps, timeout=timeout)
    t = {name: v["wall"] for name, v in ranks[0]["times"].items()}  # fenced: the same on both ranks
    # CPU seconds of both ranks together, per repetition: the work each tool does.
    cpu = {name: [sum(r["times"][name]["cpu"][i] for r in ranks) for i in range(reps)] for name in t}
    row = {"config": asdict(cfg), "reps": reps, "peer_note": ranks[0]["peer_note"],
           "ours_s": common.summarize(t["ours"]), "peer_s": common.summarize(t["peer"]),
           "ours_over_peer": common.summarize([a / b for a, b in zip(t["ours"], t["peer"])]),
           "ours_cpu_s": common.summarize(cpu["ours"]), "peer_cpu_s": common.summarize(cpu["peer"]),
           "cpu_ours_over_peer": common.summarize([a / b for a, b in zip(cpu["ours"], cpu["peer"])])}
    row["met"] = row["ours_over_peer"]["median"] <= cfg.target
    if cfg.serial:
        row["serial_s"] = common.summarize(t["serial"])
        row["serial_cpu_s"] = common.summarize(cpu["serial"])
        row["speedup_ours"] = common.summarize([s / a for s, a in zip(t["serial"], t["ours"])])
        row["speedup_peer"] = common.summarize([s / b for s, b in zip(t["serial"], t["peer"])])
        least = {k: v for r in ranks for k, v in r["least_action_s"].items()}  # a stage lives on one rank
        row["simulated"] = simulated_ideal(cfg, least)
        row["ideal_speedup"] = row["simulated"]["ideal_speedup"]
        row["of_ideal"] = row["speedup_ours"]["median"] / row["ideal_speedup"]
        # The same steps replayed with their own action times: what is left is the runtime's
        # cost between actions (messages, Python); the rest of the gap to the ideal is the
        # actions themselves running slower than their least time (both ranks computing at once).
        replays, busy = [], []
        for i in range(len(ranks[0]["timed_steps"])):
            steps = [r["timed_steps"][i] for r in ranks]
            per_rank = [[(a[0], a[1], a[2], a[4] - a[3]) for a in st["actions"]] for st in steps]
            replays.append(steps[0]["wall"] / replayed_makespan(per_rank, cfg.num_stages))
            busy.append(sum(a[3] for acts in per_rank for a in acts))
        row["wall_over_replay"] = common.summarize(replays)
        row["busy_over_serial"] = common.summarize([b / row["serial_s"]["median"] for b in busy])
    return row


def run(mode: str = "full", reps: int = 5) -> dict:
    """Every config of ``mode`` in turn; ``{"rows": [...]}``."""
    return {"rows": [measure(cfg, reps=reps) for cfg in configs(mode)]}


def _report(row: dict) -> None:
    c, r = row["config"], row["ours_over_peer"]
    print(f"{c['item']:8s} {c['schedule']:16s} d={c['d']:3d} m={c['n_mb']:2d}  ours/peer {r['median']:.2f} "
          f"[{r['min']:.2f}, {r['max']:.2f}]")


def main(argv: list[str] | None = None) -> dict:
    return common.item_main(__doc__, run, _report, argv)


if __name__ == "__main__":
    main()
