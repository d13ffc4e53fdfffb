"""Peak memory per rank (RSS) and peak activations held, ours against the peer (issue item 6).

Run alone with ``python -m benchmarks.memory [--mode quick]``. Tiny GPT d=256, 8 blocks, batch
32, seq 128, 8 microbatches, 2 stages on 2 ranks, for 1F1B and GPipe. Unlike step
time, each tool runs in its own pair of rank processes (RSS is per process). Per rank
and per step after a warm-up step:

    peak RSS of the step   Linux VmHWM after resetting it (``/proc/self/clear_refs``)
                           just before the step: everything resident, model included
    peak activations held  most microbatches whose forward state a rank holds at once
                           (ours: ``PipelineStage.held_microbatches``; the peer: its
                           stages' ``fwd_cache``), sampled after every forward

In full mode 1F1B also runs ours with the model built on the meta device (each rank
then allocates only its own stage: the documented path for models bigger than a rank),
plus the RSS when the rank starts (torch imported, group up: the floor both pay), right
after building (model traced and split) and the process's peak
over the whole run (``ru_maxrss``, tracing included). Target: ours <= 0.8x the peer's
step peak RSS.
"""

from __future__ import annotations

import dataclasses
import resource

import torch

from pippy_split import zoo
from pippy_split.testing import run_ranks
from pippy_split.zoo.gpt import TinyGPT

from . import common

__all__ = ["run", "measure"]

TARGET = 0.8


def _track_held(stages: list, tool: str, peak: list[int]) -> None:
    """Wrap each stage's forward so that ``peak[0]`` follows the most microbatches held."""
    def held() -> int:
        if tool == "ours":
            return sum(s.held_microbatches for s in stages)
        return sum(len(s.fwd_cache) for s in stages)

    name = "forward" if tool == "ours" else "forward_one_chunk"
    for st in stages:
        fn = getattr(st, name)

        def wrapped(*args, _fn=fn, **kwargs):
            out = _fn(*args, **kwargs)
            peak[0] = max(peak[0], held())
            return out

        setattr(st, name, wrapped)


def _meta_entry(d: int, world: int) -> zoo.ZooEntry:
    """The same entry with its model built on the meta device (docs/splitting.md: models bigger than one rank)."""
    entry = common.gpt(d, num_stages=world)
    m = entry.model
    with torch.device("meta"):
        model = TinyGPT(m.tok_emb.num_embeddings, d, len(m.blocks), m.blocks[0].attn.n_head, m.block_size)
    return dataclasses.replace(entry, model=model)  # the real model is freed with `entry`


def _body(rank: int, world: int, tool: str, schedule: str, d: int, n_mb: int, reps: int) -> dict:
    start = common.rss_mb()  # torch imported, process group up, nothing built
    entry = _meta_entry(d, world) if tool == "ours_meta" else common.gpt(d, num_stages=world)
    if tool == "ours_meta":
        # Only this rank's stages are allocated, initialised by their modules' reset_parameters().
        runner = common.build_ours(entry, schedule, n_mb, device="cpu")
        tool = "ours"
    elif tool in ("ours", "ours_release"):
        runner = common.build_ours(entry, schedule, n_mb)
        if tool == "ours_release":  # sent outputs give their memory back (the default on GPUs only)
            runner.sched.release_sent_outputs = True
            tool = "ours"
    else:
        runner = common.build_peer(entry, schedule, n_mb, rank, world)
    built = common.rss_mb()
    runner.step()  # warm-up: first-step allocations, the peer's shape inference
    peaks, held = [], []
    for _ in range(reps):
        counter = [0]
        _track_held(runner.stages, tool, counter)
        ok = common.reset_peak_rss()
        runner.step()
        peaks.append(common.peak_rss_mb() if ok else float("nan"))
        held.append(counter[0])
        for st in runner.stages:  # unwrap for the next repetition
            st.__dict__.pop("forward" if tool == "ours" else "forward_one_chunk", None)
    return {"start_mb": start, "built_mb": built, "step_peak_mb": peaks, "held": held,
            "run_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure(schedule: str, d: int = 256, n_mb: int = 8, reps: int = 5,
            tools: tuple[str, ...] = ("ours", "peer")) -> dict:
    """Each tool on 2 ranks of its own; per rank: RSS (MB) and held microbatches, and ours/peer.

    ``tools`` may add "ours_meta": ours with the model built on the meta device, so that
    a rank allocates only its own stages' parameters.
    """
    res = {tool: run_ranks(_body, 2, tool, schedule, d, n_mb, reps, timeout=900) for tool in tools}
    ranks = []
    for r in range(2):
        row = {}
        for tool in tools:
            x = res[tool][r]
            row[tool] = {"step_peak_mb": common.summarize(x["step_peak_mb"]), "held": common.summarize(x["held"]),
                         "start_mb": x["start_mb"], "built_mb": x["built_mb"], "run_peak_mb": x["run_peak_mb"],
                         "step_peak_above_start_mb": common.summarize([p - x["start_mb"] for p in x["step_peak_mb"]])}
        row["ours_over_peer"] = row["ours"]["step_peak_mb"]["median"] / row["peer"]["step_peak_mb"]["median"]
        row["above_start_ours_over_peer"] = (row["ours"]["step_peak_above_start_mb"]["median"]
                                             / row["peer"]["step_peak_above_start_mb"]["median"])
        if "ours_release" in row:  # the same tool freeing sent outputs: what that saves
            row["released_over_kept_above_start"] = (row["ours_release"]["step_peak_above_start_mb"]["median"]
                                                     / row["ours"]["step_peak_above_start_mb"]["median"])
        if "ours_meta" in row:
            row["meta_over_peer"] = row["ours_meta"]["step_peak_mb"]["median"] / row["peer"]["step_peak_mb"]["median"]
        ranks.append(row)
    return {"schedule": schedule, "d": d, "n_mb": n_mb, "reps": reps, "ranks": ranks,
            "met": all(r["ours_over_peer"] <= TARGET for r in ranks)}


def run(mode: str = "full", reps: int = 5) -> dict:
    """1F1B (with the meta-device variant in full mode) and GPipe; quick, smoke: 1F1B only."""
    if mode != "full":
        return {"rows": [measure("1F1B", reps=reps)]}
    return {"rows": [measure("1F1B", reps=reps, tools=("ours", "peer", "ours_meta", "ours_release")),
                     measure("GPipe", reps=reps, tools=("ours", "peer", "ours_release"))]}


def _report(row: dict) -> None:
    for r, x in enumerate(row["ranks"]):
        kept = ""
        if "ours_release" in x:
            kept = (f"; above start: released {x['ours_release']['step_peak_above_start_mb']['median']:.0f} MB vs "
                    f"kept {x['ours']['step_peak_above_start_mb']['median']:.0f} MB "
                    f"-> {x['released_over_kept_above_start']:.2f}x")
        print(f"{row['schedule']:5s} rank {r}: ours {x['ours']['step_peak_mb']['median']:.0f} MB "
              f"peer {x['peer']['step_peak_mb']['median']:.0f} MB -> {x['ours_over_peer']:.2f}x; held "
              f"{x['ours']['held']['median']:.0f} vs {x['peer']['held']['median']:.0f}{kept}")


def main(argv: list[str] | None = None) -> dict:
    return common.item_main(__doc__, run, _report, argv)


if __name__ == "__main__":
    main()
