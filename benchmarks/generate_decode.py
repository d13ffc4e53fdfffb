"""Decode tokens/s on the training split (issues 30, 39): lanes = stage hops vs one lane vs the
unsplit model's Hugging Face ``generate`` with its KV cache in one process; each rank's busy
fraction beside the decode order's simulated one; ``pipe.generate``'s first call (which traces
the decode step) beside ``ps.pipeline()`` of the same model.

Run with ``python -m benchmarks.generate_decode [--quick] [--d 1024] [--worlds 2 4]``. An HF
Llama (d=1024 by default, 8 blocks, 8 heads, vocab 256) generates 64 new tokens for 32 prompts
of 16 tokens, greedy, fp32, on gloo ranks (1F1B: one stage per rank; one intra-op thread per
rank) and HF ``generate`` with ``use_cache=True`` on rank 0's process, one thread (the baseline a
user has; the model's config says ``use_cache=False`` for training, which HF generate would
otherwise follow and recompute every token) while the other ranks wait. Each configuration
generates once to warm up (the decode program is traced then), then ``REPS`` times; the figure
is the median, the configurations taking turns (HF's included) so a loaded machine slows them
alike. Tokens/s counts new tokens of all rows. Busy fraction: a rank's time inside its stages'
decode steps over the call's wall time; predicted: ``ps.simulate`` of the same lowered order with
one cost per compute; CPU share: the rank's CPU time over the call's wall time. "Cores for the
ranks": a fixed weight-streaming loop (a decode step's linears) on every rank at once against each
rank alone, ``ranks x alone / together``: the number of ranks where each has a core of its own,
1 where they take turns on one (lanes can only overlap the stages on cores that are free).
Results go to ``benchmarks/results/generate_decode.{json,md}``.

On this project's 2-core machine, 4 ranks share 2 cores: the 4-rank figures measure
oversubscription as much as pipelining, and a loaded machine moves every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import pippy_split as ps
from pippy_split.generate.distributed import lowered_decode
from pippy_split.generate.lanes import make_lanes
from pippy_split.generate.options import GenerateOptions
from pippy_split.generate.programs import decode_program
from pippy_split.testing import run_ranks

RESULTS = Path(__file__).resolve().parent / "results"
REPS = 3


def model(d: int, layers: int) -> torch.nn.Module:
    import transformers as t

    torch.manual_seed(0)
    cfg = t.LlamaConfig(vocab_size=256, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
                        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256, use_cache=False,
                        eos_token_id=None, bos_token_id=None, pad_token_id=0)
    return t.LlamaForCausalLM(cfg).eval()


def prompts(batch: int, length: int) -> torch.Tensor:
    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(0))


def rank_body(rank: int, world: int, d: int, layers: int, batch: int, length: int, new: int,
              lanes_list: list[int | None]) -> dict:
    m = model(d, layers)
    ids = prompts(batch, length)
    spec = [f"model.layers.{i * layers // world}" for i in range(1, world)]
    pipe = ps.pipeline(m, spec, (ids[:2],))
    sched = ps.build_schedule(pipe, "1F1B", 2, loss_fn=lambda out, t: out.logits.sum())
    out: dict[str, Any] = {}
    hf_model = model(d, layers) if rank == 0 else None
    for lanes in lanes_list:
        sched.generate(ids, max_new_tokens=2, lanes=lanes)  # warm up: traces the decode step
    if hf_model is not None:
        hf_generate(hf_model, ids, 2)
    walls: dict[Any, list[float]] = {lanes: [] for lanes in lanes_list}
    cpus: dict[Any, list[float]] = {lanes: [] for lanes in lanes_list}
    busy: dict[Any, list[float]] = {lanes: [] for lanes in lanes_list}
    steps: dict[Any, list[float]] = {lanes: [] for lanes in lanes_list}
    hf_walls, probes = [], []
    for _ in range(REPS):  # the configurations take turns (HF's too), so a busy machine slows them alike
        for lanes in lanes_list:
            cpu, start = time.process_time(), time.perf_counter()
            with sched.timed_actions() as times:  # every D action, timed by the runtime's observer
                sched.generate(ids, max_new_tokens=new, lanes=lanes, eos_token_id=None)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            computes = [t.seconds for t in times]
            walls[lanes].append(wall)
            cpus[lanes].append(cpu / wall)
            busy[lanes].append(sum(computes) / wall)
            steps[lanes].append(statistics.median(computes))
        dist.barrier()
        if hf_model is not None:  # rank 0 alone, one thread; the other ranks wait (blocked, no CPU)
            hf_walls.append(hf_generate(hf_model, ids, new))
        dist.barrier()
        probes.append(cores_probe(world))
    program = decode_program(pipe)
    for lanes in lanes_list:
        opts = GenerateOptions(max_new_tokens=new)
        lane_list = make_lanes(ids, torch.ones_like(ids), lanes or program.num_stages, None, opts)
        lowered, _ = lowered_decode(dict(sched.placement), program, lane_list)  # the order generate runs
        out[str(lanes)] = {"wall": statistics.median(walls[lanes]), "busy": statistics.median(busy[lanes]),
                           "cpu_share": statistics.median(cpus[lanes]),
                           "stage_step_ms": 1e3 * statistics.median(steps[lanes]),
                           "predicted_busy": ps.simulate(lowered).busy[rank], "lanes": len(lane_list)}
    out["hf_wall"] = statistics.median(hf_walls) if hf_walls else None
    out["cores"] = statistics.median(probes)
    return out


def hf_generate(m: torch.nn.Module, ids: torch.Tensor, new: int) -> float:
    """Seconds of HF ``generate`` with its KV cache (greedy, exactly ``new`` tokens), one thread."""
    start = time.perf_counter()
    m.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True)
    return time.perf_counter() - start


def cores_probe(world: int) -> float:
    """How many cores ``world`` one-thread ranks get at once, from a fixed weight-streaming loop
    (8 linears of 1024 x 1024, 16 rows, as a decode step) run by every rank together, then by
    this rank alone while the others wait: ``world x alone / together`` (``world`` where each
    rank has a core of its own, 1 where they take turns on one)."""
    weights = [torch.randn(1024, 1024, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    x = torch.randn(16, 1024)

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(8):
            for w in weights:
                torch.nn.functional.linear(x, w)
        return time.perf_counter() - start

    loop()
    dist.barrier()
    together = loop()
    alone = 0.0
    for r in range(world):
        dist.barrier()
        if r == dist.get_rank():
            alone = loop()
    dist.barrier()
    return world * alone / together


def first_call(d: int, layers: int, length: int) -> dict[str, float]:
    """Seconds of ``ps.pipeline()`` (2 stages) and of the pipe's first ``generate`` (which traces
    the decode step) and its second, in this process, on one thread."""
    torch.set_num_threads(1)
    m = model(d, layers)
    ids = prompts(2, length)
    start = time.perf_counter()
    pipe = ps.pipeline(m, [f"model.layers.{layers // 2}"], (ids,))
    split = time.perf_counter() - start
    start = time.perf_counter()
    pipe.generate(ids, max_new_tokens=2)
    first = time.perf_counter() - start
    start = time.perf_counter()
    pipe.generate(ids, max_new_tokens=2)
    return {"pipeline_s": split, "first_generate_s": first, "second_generate_s": time.perf_counter() - start,
            "first_over_pipeline": first / split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="d=64, 4 prompts, 8 new tokens (a smoke run)")
    parser.add_argument("--d", type=int, default=1024, help="hidden size (issue 39 asks d=1024)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="rank counts to run")
    args = parser.parse_args()
    d, layers, batch, length, new = (64, 8, 4, 8, 8) if args.quick else (args.d, 8, 32, 16, 64)
    tokens = batch * new
    rows: dict[str, Any] = {"config": {"d": d, "layers": layers, "prompts": batch, "prompt_len": length,
                                       "new_tokens": new, "reps": REPS}}
    rows["first_call"] = first_call(d, layers, length)
    for world in args.worlds:
        results = run_ranks(rank_body, world, d, layers, batch, length, new, [None, 1], timeout=3000)
        hf = results[0]["hf_wall"]  # HF's turns between the pipe's, on rank 0's process
        rows[f"hf_generate_1_process_{world}"] = {"wall": hf, "tokens_per_s": tokens / hf,
                                                  "cores_for_the_ranks": round(results[0]["cores"], 2)}
        for lanes in ("None", "1"):
            wall = max(r[lanes]["wall"] for r in results)
            rows[f"{world}_ranks_lanes_{'hops' if lanes == 'None' else '1'}"] = {
                "lanes": results[0][lanes]["lanes"], "wall": wall, "tokens_per_s": tokens / wall,
                "over_hf": round(hf / wall, 3),
                "busy": [round(r[lanes]["busy"], 3) for r in results],
                "predicted_busy": [round(r[lanes]["predicted_busy"], 3) for r in results],
                "cpu_share": [round(r[lanes]["cpu_share"], 3) for r in results],
                "stage_step_ms": [round(r[lanes]["stage_step_ms"], 2) for r in results]}
        hops, one = rows[f"{world}_ranks_lanes_hops"], rows[f"{world}_ranks_lanes_1"]
        hops["over_lanes_1"] = round(one["wall"] / hops["wall"], 3)
    print(json.dumps(rows, indent=1))
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "generate_decode.json").write_text(json.dumps(rows, indent=1) + "\n")
        first = rows["first_call"]
        lines = [f"d={d}, {layers} blocks, {batch} prompts x {new} new tokens, fp32, one thread per process; "
                 f"median of {REPS} turns, HF's turns between the pipe's on rank 0.", "",
                 "| run | lanes | tokens/s | over HF | over lanes=1 | busy per rank (measured) | "
                 "busy per rank (simulated) | CPU share per rank | one stage step, ms (median per rank) |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for world in args.worlds:
            hf_row = rows[f"hf_generate_1_process_{world}"]
            lines.append(f"| HF generate (KV cache), 1 process (with the {world}-rank run) | - | "
                         f"{hf_row['tokens_per_s']:.0f} | 1 | - | - | - | - | - |")
            for key in (f"{world}_ranks_lanes_hops", f"{world}_ranks_lanes_1"):
                row = rows[key]
                lines.append(f"| {key.replace('_', ' ')} | {row['lanes']} | {row['tokens_per_s']:.0f} | "
                             f"{row['over_hf']} | {row.get('over_lanes_1', 1)} | {row['busy']} | "
                             f"{row['predicted_busy']} | {row['cpu_share']} | {row['stage_step_ms']} |")
        lines += ["", "Cores the ranks got at once (a weight-streaming loop on every rank together vs each alone; "
                  "the rank count where each has a core of its own): "
                  + ", ".join(f"{w} ranks {rows[f'hf_generate_1_process_{w}']['cores_for_the_ranks']}"
                              for w in args.worlds) + "."]
        lines += ["", f"ps.pipeline() {first['pipeline_s']:.2f} s; pipe.generate's first call {first['first_generate_s']:.2f} s "
                  f"({first['first_over_pipeline']:.2f}x), its second {first['second_generate_s']:.2f} s."]
        (RESULTS / "generate_decode.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
