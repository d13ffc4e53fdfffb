"""Decode tokens/s on the training split (issues 30, 39): lanes = stage hops vs one lane vs the
unsplit model's Hugging Face ``generate`` with its KV cache in one process; each rank's busy
fraction beside the decode order's simulated one; ``pipe.generate``'s first call (which traces
the decode step) beside ``ps.pipeline()`` of the same model.

Run with ``python -m benchmarks.generate_decode [--quick] [--d 1024] [--worlds 2 4]``. An HF
Llama (d=1024 by default, 8 blocks, 8 heads, vocab 256) generates 64 new tokens for 32 prompts
of 16 tokens, greedy, fp32, on gloo ranks (1F1B: one stage per rank; one intra-op thread per
rank) and HF ``generate`` with ``use_cache=True`` in a process of its own (one more rank, outside
the pipe's group), one thread (the baseline a user has; the model's config says
``use_cache=False`` for training, which HF generate would otherwise follow and recompute every
token) while the other ranks wait. Each configuration
generates once to warm up (the decode program is traced then), then ``REPS`` times; the figure
is the median, the configurations taking turns (HF's included) so a loaded machine slows them
alike; each call starts on every rank at once (a barrier), and ratios are medians of per-turn
ratios. Tokens/s counts new tokens of all rows. Where each rank's time goes (:func:`analyse`):
its D actions (busy), comm batches before the peer posted (waiting: the pipeline's dependency)
and after (messages: the transport), host work between actions; the simulated busy fraction is
``ps.simulate`` of the same lowered order fed the measured per-stage step and prefill costs and
the measured message latency. CPU share: the rank's CPU time over the call's wall time. "Cores
for the ranks": a fixed weight-streaming loop (a decode step's linears) on every rank at once
against each rank alone, ``ranks x alone / together``: the number of ranks where each has a core
of its own, 1 where they take turns on one (lanes can only overlap the stages on cores that are
free). Results go to ``benchmarks/results/generate_decode.{json,md}``.

On this project's 2-core machine, 4 ranks share 2 cores: the 4-rank figures measure
oversubscription as much as pipelining, and a loaded machine moves every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import pippy_split as ps
from pippy_split.generate.decode_model import DecodeRoot, kv_layout
from pippy_split.generate.distributed import lowered_decode
from pippy_split.generate.lanes import make_lanes
from pippy_split.generate.options import GenerateOptions
from pippy_split.generate.program import example_step
from pippy_split.generate.programs import decode_program
from pippy_split.testing import run_ranks

try:
    from pippy_split.generate.eager import eager_on_stages
except ImportError:  # a tree before generate/eager.py (an A/B run of this script against it)
    eager_on_stages = None

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


def rank_body(rank: int, size: int, d: int, layers: int, batch: int, length: int, new: int,
              lanes_list: list[int | None]) -> dict:
    """Ranks ``0 .. size - 2`` run the pipe (their own group); the last rank runs HF ``generate``
    in a process of its own (a user's baseline process: its heap is not the pipe's)."""
    world = size - 1
    group = dist.new_group(list(range(world)))
    if rank == world:
        return _hf_rank(d, layers, batch, length, new, len(lanes_list))
    m = model(d, layers)
    ids = prompts(batch, length)
    spec = [f"model.layers.{i * layers // world}" for i in range(1, world)]
    pipe = ps.pipeline(m, spec, (ids[:2],))
    sched = ps.build_schedule(pipe, "1F1B", 2, loss_fn=lambda out, t: out.logits.sum(), group=group)
    out: dict[str, Any] = {}
    for lanes in lanes_list:
        sched.generate(ids, max_new_tokens=2, lanes=lanes)  # warm up: traces the decode step
    runs: dict[Any, list[dict]] = {lanes: [] for lanes in lanes_list}
    probes, rows_probes = [], []
    for _ in range(REPS):  # the configurations take turns (HF's too), so a busy machine slows them alike
        for lanes in lanes_list:
            dist.barrier()  # every rank starts the call together (a rank's wall is the call's, not a wait for it)
            faults, cpu, start = _minor_faults(), time.process_time(), time.perf_counter()
            with sched.timed_actions(messages=True) as times:  # every action, timed by the runtime's observer
                sched.generate(ids, max_new_tokens=new, lanes=lanes, eos_token_id=None)
            end = time.perf_counter()
            runs[lanes].append({"start": start, "end": end, "cpu": time.process_time() - cpu,
                                "faults": _minor_faults() - faults,
                                "actions": [(t.action, t.start, t.end) for t in times]})
        dist.barrier()  # HF's turn: the pipe's ranks wait (blocked, no CPU)
        dist.barrier()
        probes.append(cores_probe(world, group))
        rows_probes.append(rows_probe(m, world, batch) if rank == 0 else {})
        dist.barrier()
    eager = eager_on_stages(pipe, sched.stages) if eager_on_stages is not None else None
    program = eager if eager is not None else decode_program(pipe)  # the program sched.generate ran
    out["program"] = "eager" if eager is not None else "traced"
    for lanes in lanes_list:
        opts = GenerateOptions(max_new_tokens=new)
        lane_list = make_lanes(ids, torch.ones_like(ids), lanes or program.num_stages, None, opts)
        lowered, _ = lowered_decode(dict(sched.placement), program, lane_list)  # the order generate runs
        out[str(lanes)] = {"runs": runs[lanes], "lowered": lowered, "lanes": len(lane_list),
                           "rows": [lane.slots for lane in lane_list]}
    out["cores"] = statistics.median(probes)
    if rank == 0:
        out["rows_probe"] = {n: statistics.median(p[n] for p in rows_probes) for n in rows_probes[0]}
    return out


def _hf_rank(d: int, layers: int, batch: int, length: int, new: int, configs: int) -> dict:
    """The baseline's process: HF ``generate`` on one thread at its turn, waiting at the pipe's."""
    hf_model, ids = model(d, layers), prompts(batch, length)
    hf_generate(hf_model, ids, 2)
    walls, faults = [], []
    for _ in range(REPS):
        for _ in range(configs):
            dist.barrier()  # the pipe's turn
        dist.barrier()
        before = _minor_faults()
        walls.append(hf_generate(hf_model, ids, new))
        faults.append(_minor_faults() - before)
        dist.barrier()
        dist.barrier()  # the probes' turn
    return {"hf_walls": walls, "hf_faults": int(statistics.median(faults))}


def _minor_faults() -> int:
    """This process's minor page faults so far: pages the OS handed it fresh (zeroed), so memory a
    call newly touched (a rank that keeps growing, or an allocator that returns freed memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def analyse(per_rank: list[dict]) -> dict[str, Any]:
    """One configuration's turns on every rank (``per_rank[r]``: what :func:`rank_body` recorded),
    as measured and as simulated from the measured costs.

    Measured, per rank, over the call's wall time (median of the turns): ``busy`` (inside its
    stages' ``D`` actions), ``waiting`` (inside a comm batch before the peer had posted the
    message it receives: the pipeline's dependency), ``messages`` (inside a comm batch once
    both ends had posted: the transport's own cost), ``ends`` (before the first action and after
    the last: agreement, lowering, the result's broadcast), ``between`` (the rest: host work
    between actions). Costs: each stage's ``D``
    at rounds after the prefill and at the prefill, and each message's latency (receive done
    minus the later of the two posts; the ranks share one clock, ``perf_counter``), each a mean over
    every turn (a step slowed by the machine's load counts as it cost). Simulated:
    ``ps.simulate`` of the lowered order with those costs (each lane scaled by its rows, a
    step's cost taken from the lane size the call ran), and again with each step drawn from its
    stage's measured times -- never from the measured fractions."""
    world = len(per_rank)
    reps = len(per_rank[0]["runs"])
    step: dict[int, list[float]] = {}
    prefill: dict[int, list[float]] = {}
    latencies: list[float] = []
    parts: dict[str, list[list[float]]] = {k: [[] for _ in range(world)]
                                           for k in ("busy", "waiting", "messages", "between", "ends", "cpu_share")}
    walls = []
    for i in range(reps):
        runs = [per_rank[r]["runs"][i] for r in range(world)]
        sends: dict[tuple, float] = {}
        posts: dict[tuple, float] = {}
        for run in runs:
            for a, t0, _ in run["actions"]:
                if a.kind.is_comm and a.is_send:
                    sends[(a.kind.value[-1], a.stage, a.peer, a.mb, a.round)] = t0
        begin, finish = min(r["start"] for r in runs), max(r["end"] for r in runs)
        walls.append(finish - begin)
        for r, run in enumerate(runs):
            wall = run["end"] - run["start"]
            busy = wait = msg = 0.0
            batches: dict[tuple[float, float], float] = {}  # (post, end) -> the latest counterpart post
            for a, t0, t1 in run["actions"]:
                if a.kind.is_compute:
                    busy += t1 - t0
                    (prefill if a.round == 0 else step).setdefault(a.stage, []).append(t1 - t0)
                    continue
                if a.is_send:
                    batches.setdefault((t0, t1), t0)
                    continue
                sent = sends[(a.kind.value[-1], a.peer, a.stage, a.mb, a.round)]
                batches[(t0, t1)] = max(batches.get((t0, t1), t0), sent)
                posts[(a.kind.value, a.stage, a.mb, a.round)] = t0
                latencies.append(t1 - max(t0, sent))
            for (t0, t1), ready in batches.items():
                wait += min(t1, ready) - t0
                msg += t1 - min(t1, ready)
            spans = [(t0, t1) for _, t0, t1 in run["actions"]]
            ends = (min(spans)[0] - run["start"]) + (run["end"] - max(t1 for _, t1 in spans))
            for key, value in (("busy", busy), ("waiting", wait), ("messages", msg), ("ends", ends),
                               ("between", wall - busy - wait - msg - ends), ("cpu_share", run["cpu"])):
                parts[key][r].append(value / wall)
    costs: dict[Any, float] = {(s, "D"): statistics.fmean(v) for s, v in step.items()}
    costs.update({(s, "prefill"): statistics.fmean(v) for s, v in prefill.items()})
    latency = statistics.fmean(latencies) if latencies else 0.0
    rows = per_rank[0]["rows"]
    order, scale = _merged(per_rank), [n / max(rows) for n in rows]
    sim = ps.simulate(order, costs, comm_latency=latency, microbatch_scale=scale)
    # the same, each D drawn from its stage's measured times (a fixed seed): the steps' spread, not only
    # their mean, decides how long a rank waits at each exchange
    rng = random.Random(0)
    drawn = ps.simulate(order, lambda s, kind: rng.choice(prefill[s] if kind == "prefill" else step[s]),
                        comm_latency=latency, microbatch_scale=scale)
    return {"wall": statistics.median(walls), "walls": walls, "lanes": per_rank[0]["lanes"],
            **{k: [round(statistics.median(v), 3) for v in parts[k]] for k in parts},
            "predicted_busy": [round(sim.busy[r], 3) for r in range(world)], "predicted_wall": sim.makespan,
            "page_faults": [int(statistics.median(per_rank[r]["runs"][i]["faults"] for i in range(reps)))
                            for r in range(world)],
            "predicted_busy_drawn": [round(drawn.busy[r], 3) for r in range(world)],
            "stage_step_ms": [round(1e3 * costs[(s, "D")], 2) for s in sorted(step)],
            "prefill_ms": [round(1e3 * costs[(s, "prefill")], 2) for s in sorted(prefill)],
            "message_ms": round(1e3 * latency, 2)}


def _merged(per_rank: list[dict]) -> dict[int, list]:
    """The lowered order every rank ran (each rank built it alike; rank r's part from rank r)."""
    return {r: per_rank[r]["lowered"][r] for r in range(len(per_rank))}


def hf_generate(m: torch.nn.Module, ids: torch.Tensor, new: int) -> float:
    """Seconds of HF ``generate`` with its KV cache (greedy, exactly ``new`` tokens), one thread."""
    start = time.perf_counter()
    m.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True)
    return time.perf_counter() - start


def cores_probe(world: int, group: Any = None) -> float:
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
    dist.barrier(group)
    together = loop()
    alone = 0.0
    for r in range(world):
        dist.barrier(group)
        if r == dist.get_rank():
            alone = loop()
    dist.barrier(group)
    return world * alone / together


def rows_probe(m: torch.nn.Module, world: int, batch: int = 32) -> dict[int, float]:
    """Milliseconds of one stage's linears (the model's first ``1 / world`` of its blocks, with the
    model's own weights) at the rows of a lane (``batch / world`` and ``batch`` rows), this rank alone: a
    decode step that reads its weights once per call costs nearly the same at either, and then
    lanes cannot gain."""
    blocks = list(m.model.layers)[: len(m.model.layers) // world]
    weights = [mod.weight for b in blocks for mod in b.modules() if isinstance(mod, torch.nn.Linear)]
    out = {}
    for rows in (batch // world, batch):
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        with torch.no_grad():
            for w in weights:
                torch.nn.functional.linear(xs[w.shape[1]], w)
            start = time.perf_counter()
            for _ in range(5):
                for w in weights:
                    torch.nn.functional.linear(xs[w.shape[1]], w)
        out[rows] = 1e3 * (time.perf_counter() - start) / 5
    return out


def first_call(d: int, layers: int, length: int) -> dict[str, float]:
    """Seconds of ``ps.pipeline()`` (2 stages) and of the pipe's first ``generate`` (which traces
    the decode step) and its second, in this process, on one thread; and what the decode step's
    ``torch.export`` costs alone, with generate's dynamic dims (batch, new tokens, past) and with
    every dim static (as ``ps.pipeline()``'s own trace): where the first call's time goes."""
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
    second = time.perf_counter() - start
    root, layout = DecodeRoot(m), kv_layout(m, torch.device("cpu"))
    args, shapes = example_step(layout, "cpu", torch.float32)
    one, _ = example_step(layout, "cpu", torch.float32, t=1)  # one new token; only the past's length dynamic
    past_only = {"input_ids": {}, "position_ids": {}, "attention_mask": {1: torch.export.Dim.DYNAMIC},
                 "past": [{2: torch.export.Dim.DYNAMIC} for _ in layout]}
    traces = {}
    for name, a, dims in (("decode_trace_dynamic_s", args, shapes), ("decode_trace_past_only_s", one, past_only),
                          ("decode_trace_static_s", args, None)):
        start = time.perf_counter()
        torch.export.export(root, a, dynamic_shapes=dims, strict=False)
        traces[name] = time.perf_counter() - start
    program = "eager" if pipe.derived.get("eager_program") is not None else "traced"
    return {"pipeline_s": split, "first_generate_s": first, "second_generate_s": second,
            "first_over_pipeline": first / split, "program": program, **traces}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="d=64, 4 prompts, 8 new tokens (a smoke run)")
    parser.add_argument("--d", type=int, default=1024, help="hidden size (issue 39 asks d=1024)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="rank counts to run")
    parser.add_argument("--prompts", type=int, default=32, help="prompts in the call (issue 39 asks 32; the "
                        "rows of a lane are prompts / lanes)")
    parser.add_argument("--new", type=int, default=64, help="new tokens a prompt (issue 39 asks 64; longer "
                        "generations weigh the cache's growth: --new 256 --tag long)")
    parser.add_argument("--tag", default="", help="results go to generate_decode_TAG.{json,md} (e.g. a run under "
                        "another allocator setting: GLIBC_TUNABLES=... python -m benchmarks.generate_decode --tag ...)")
    args = parser.parse_args()
    d, layers, batch, length, new = (64, 8, 4, 8, 8) if args.quick else (args.d, 8, args.prompts, 16, args.new)
    tokens = batch * new
    rows: dict[str, Any] = {"config": {"d": d, "layers": layers, "prompts": batch, "prompt_len": length,
                                       "new_tokens": new, "reps": REPS,
                                       "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}}
    rows["first_call"] = first_call(d, layers, length)
    for world in args.worlds:
        *results, hf_result = run_ranks(rank_body, world + 1, d, layers, batch, length, new, [None, 1], timeout=3000)
        hf = statistics.median(hf_result["hf_walls"])
        rows[f"hf_generate_1_process_{world}"] = {"wall": hf, "tokens_per_s": tokens / hf,
                                                  "page_faults": hf_result["hf_faults"],
                                                  "cores_for_the_ranks": round(results[0]["cores"], 2),
                                                  "stage_linears_ms_by_rows": {str(k): round(v, 1) for k, v in
                                                                               results[0]["rows_probe"].items()}}
        hf_walls = hf_result["hf_walls"]  # HF's turns between the pipe's, in a process of its own
        for lanes in ("None", "1"):
            row = analyse([r[lanes] for r in results])
            row["tokens_per_s"] = tokens / row["wall"]
            row["over_hf"] = round(statistics.median(h / w for h, w in zip(hf_walls, row["walls"])), 3)
            row["program"] = results[0].get("program", "traced")  # the decode program sched.generate ran
            rows[f"{world}_ranks_lanes_{'hops' if lanes == 'None' else '1'}"] = row
        hops, one = rows[f"{world}_ranks_lanes_hops"], rows[f"{world}_ranks_lanes_1"]
        hops["over_lanes_1"] = round(statistics.median(o / h for o, h in zip(one["walls"], hops["walls"])), 3)
        # what the measured step costs allow: the two orders simulated with each one's own measured costs
        hops["over_lanes_1_simulated"] = round(one["predicted_wall"] / hops["predicted_wall"], 3)
    print(json.dumps(rows, indent=1))
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        name = "generate_decode" + (f"_{args.tag}" if args.tag else "")
        (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
        first = rows["first_call"]
        lines = [f"d={d}, {layers} blocks, {batch} prompts x {new} new tokens, fp32, one thread per process; "
                 f"median of {REPS} turns, HF's turns between the pipe's, in a process of its own; ratios are medians of "
                 "per-turn ratios. Per rank, fractions of the call's wall time: busy (in its D actions), "
                 "waiting (in a comm batch before the peer posted: the pipeline's dependency), messages "
                 "(in a comm batch after both posted), ends (before the first action and after the last), "
                 "between (host work between actions). Simulated: "
                 "ps.simulate of the lowered order fed the measured costs (each stage's step and prefill: "
                 "their means, or each step drawn from its stage's measured times; the mean message "
                 "latency), not the measured fractions. Page faults a call: the rank's minor faults during the "
                 "call (median of the turns). Allocator: glibc's defaults" + (
                     f", GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']}" if os.environ.get("GLIBC_TUNABLES") else "")
                 + ".", "",
                 "| run | lanes | tokens/s | over HF | over lanes=1 | busy (measured) | busy (simulated: mean costs) | "
                 "busy (simulated: drawn costs) | "
                 "waiting | messages | ends | between | step ms per stage | prefill ms per stage | message ms | "
                 "page faults a call |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for world in args.worlds:
            hf_row = rows[f"hf_generate_1_process_{world}"]
            lines.append(f"| HF generate (KV cache), 1 process (with the {world}-rank run) | - | "
                         f"{hf_row['tokens_per_s']:.0f} | 1 | - | - | - | - | - | - | - | - | - | - | - | "
                         f"{hf_row['page_faults']} |")
            for key in (f"{world}_ranks_lanes_hops", f"{world}_ranks_lanes_1"):
                row = rows[key]
                lines.append(f"| {key.replace('_', ' ')} ({row.get('program', 'traced')}) | {row['lanes']} | {row['tokens_per_s']:.0f} | "
                             f"{row['over_hf']} | {row.get('over_lanes_1', 1)} | {row['busy']} | "
                             f"{row['predicted_busy']} | {row['predicted_busy_drawn']} | {row['waiting']} | {row['messages']} | {row['ends']} | {row['between']} | "
                             f"{row['stage_step_ms']} | {row['prefill_ms']} | {row['message_ms']} | {row['page_faults']} |")
        lines += ["", "Lanes = hops over lanes = 1 as the simulator prices the two orders from their own measured "
                  "costs (the bound those step costs set): " + ", ".join(
                      f"{w} ranks {rows[f'{w}_ranks_lanes_hops']['over_lanes_1_simulated']}" for w in args.worlds) + "."]
        lines += ["", "One stage's linears alone (rank 0's weights, ms by rows): " + ", ".join(
            f"{w} ranks {rows[f'hf_generate_1_process_{w}']['stage_linears_ms_by_rows']}" for w in args.worlds) + "."]
        lines += ["", "Cores the ranks got at once (a weight-streaming loop on every rank together vs each alone; "
                  "the rank count where each has a core of its own): "
                  + ", ".join(f"{w} ranks {rows[f'hf_generate_1_process_{w}']['cores_for_the_ranks']}"
                              for w in args.worlds) + "."]
        lines += ["", f"ps.pipeline() {first['pipeline_s']:.2f} s; pipe.generate's first call "
                  f"({first.get('program', 'traced')} decode program) {first['first_generate_s']:.2f} s "
                  f"({first['first_over_pipeline']:.2f}x), its second {first['second_generate_s']:.2f} s. The decode "
                  f"step's torch.export alone: {first['decode_trace_dynamic_s']:.2f} s with generate's dynamic dims "
                  f"(batch, new tokens, past), {first['decode_trace_past_only_s']:.2f} s with only the past's length "
                  f"dynamic (one new token), {first['decode_trace_static_s']:.2f} s with every dim static."]
        (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
