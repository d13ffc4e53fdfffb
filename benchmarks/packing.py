"""Packed microbatches against padding every document to the longest: tokens per second and peak activations.

    python -m benchmarks.packing            # full run (2 gloo ranks, ~2-4 min on 2 cores)
    python -m benchmarks.packing --smoke    # tiny sizes, 1 rep (the smoke test)
    python -m benchmarks.packing --render benchmarks/results/packing.json   # tables of a saved run

The corpus: documents of random tokens whose lengths are log-normal (sigma 1, median
chosen so that the mean before clipping is a quarter of the longest, MAX), rounded and
clipped to [2, MAX]. Each step draws its own ``n_mb x R`` documents (a fixed seed per
step, so every repetition sees new documents and both layouts see the same ones) and
groups them into ``n_mb`` microbatches of ``R`` documents, in order. Each microbatch is
fed two ways:

    padded   one document per row, padded to MAX: a (R, MAX) microbatch, the same shape
             every time (targets -100 on padding, which carries document id -1); a static
             pipe traced on that shape.
    packed   the same R documents end to end in one row, ``pack_documents(group,
             max_tokens=R * MAX)``: a (1, L) microbatch, L = their total length, different
             for every microbatch; a pipe traced with dim 1 dynamic (``Dim("T", min=2,
             max=R * MAX)``) and the step's microbatches handed over as ``ps.Microbatches``
             (``step_inputs``).

So both layouts run the same real tokens in the same number of microbatches per step
(the pipeline's bubble is the same); only the padding differs. The model is the zoo's
tiny Llama, which takes ``(tokens, positions, documents)``: positions restart at every
document and attention stays inside a document (its mask is built from the document
ids), so the packed step computes the same losses and gradients as the padded one (the
tiny GPT's attention would cross documents in a packed row). The mask is dense
(B, 1, T, T), so packed attention still pays for a whole row (L^2 per microbatch against
R x MAX^2 padded); a varlen attention kernel would skip the cross-document blocks. Loss:
cross entropy summed over tokens with ``loss_count=(target != -100).sum()``, so the
gradient is the mean over the step's real tokens in both layouts.

Two ranks (gloo, one process and one intra-op thread each): 1F1B on 2 stages and
ZBVZeroBubble on 4 (two per rank, V placement), 8 blocks, d=128, MAX=128, R=8, 8
microbatches. In each rank pair the padded and the packed schedule take turns step by
step (``common.alternate``: the order rotates every repetition, each step is fenced by
barriers); per repetition (= one set of documents):

    tokens/s     real (non-padding) tokens of the step / its wall time; packed / padded is
                 the padded step time over the packed one (same tokens)
    activations  the most bytes autograd holds for backward at once during the step on
                 each rank (distinct storages saved through ``saved_tensors_hooks``,
                 parameters left out: ``pippy_split.plan.saved_bytes.SavedBytes``), measured
                 in one more step of each layout on the same documents after the timed
                 ones (the hooks cost time); RSS cannot show it on CPU
    padding      the fraction of the padded layout's token slots that are padding; what
                 packing can save at most is that fraction of the per-token work, i.e. a
                 tokens/s gain up to 1 / (1 - padding) and activations down to 1 - padding

Figures are medians of per-repetition ratios packed / padded, [min, max]. The machine's
load average is recorded before and after: on a shared 2-core machine the wall-clock
ratios are only as even as the load was.

Why the gains fall short of the padding: a packed microbatch is small (a few hundred
tokens), so the per-op and per-message costs that do not shrink with it weigh more, and
attention over a packed row costs L^2 with a dense mask. The activation peak follows the
longest microbatches in flight, not the mean one (the last stage under 1F1B holds one
microbatch at a time, so its peak is its longest packed row's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.export import Dim

import pippy_split as ps
from pippy_split import zoo
from pippy_split.packing import IGNORE, TokenBatch, pack_documents, step_inputs
from pippy_split.plan.saved_bytes import SavedBytes
from pippy_split.testing import run_ranks

from . import common
from .common import git_state, median_range

__all__ = ["Size", "FULL", "SMOKE", "SCHEDULES", "documents", "padded", "packed", "run", "markdown", "main"]

RESULTS = Path(__file__).parent / "results" / "packing.json"
SCHEDULES = {"1F1B": 2, "ZBVZeroBubble": 4}  # schedule -> stages (on 2 ranks)
LAYOUTS = ("padded", "packed")
FIELDS = ("input_ids", "position_ids", "document_ids", "targets")
REPS = 9


@dataclass(frozen=True)
class Size:
    d: int = 128
    n_layer: int = 8
    n_head: int = 4
    vocab: int = 64
    max_len: int = 128  # MAX: the longest document, what the padded layout pads to
    rows: int = 8  # R: documents per microbatch (padded rows; one packed row)
    n_mb: int = 8
    sigma: float = 1.0  # of the log-normal document length


FULL, SMOKE = Size(), Size(d=32, n_layer=4, max_len=32, rows=4, n_mb=4)


# ---- the corpus and the two layouts ------------------------------------------------


def documents(size: Size, seed: int) -> list[list[list[int]]]:
    """One step's documents: ``n_mb`` groups of ``rows`` token lists, log-normal lengths in [2, MAX]."""
    g = torch.Generator().manual_seed(seed)
    mu = math.log(size.max_len / 4) - size.sigma ** 2 / 2  # mean of the unclipped log-normal: MAX / 4
    n = size.n_mb * size.rows
    lengths = (mu + size.sigma * torch.randn(n, generator=g)).exp().round().clamp(2, size.max_len).long()
    docs = [torch.randint(1, size.vocab, (int(k),), generator=g).tolist() for k in lengths]
    return [docs[i:i + size.rows] for i in range(0, n, size.rows)]


def padded(group: list[list[int]], max_len: int) -> TokenBatch:
    """One document per row, padded to ``max_len`` (id 0, target -100, position 0, document -1)."""
    rows = len(group)
    ids = torch.zeros(rows, max_len, dtype=torch.int64)
    tgt = torch.full((rows, max_len), IGNORE, dtype=torch.int64)
    pos = torch.zeros(rows, max_len, dtype=torch.int64)
    doc = torch.full((rows, max_len), -1, dtype=torch.int64)
    for r, d in enumerate(group):
        n = len(d)
        ids[r, :n] = torch.tensor(d)
        tgt[r, :n - 1] = torch.tensor(d[1:])
        pos[r, :n] = torch.arange(n)
        doc[r, :n] = 0
    return TokenBatch(ids, tgt, pos, doc)


def packed(group: list[list[int]], max_tokens: int) -> TokenBatch:
    """The group's documents end to end in one row (``pack_documents``; they always fit one)."""
    (batch,) = pack_documents(group, max_tokens=max_tokens)
    return batch


def _sum_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum")


def _count(target: torch.Tensor) -> torch.Tensor:
    return (target != IGNORE).sum()


# ---- one rank ----------------------------------------------------------------------


def _schedule(layout: str, schedule: str, size: Size, example: TokenBatch) -> ps.PipelineSchedule:
    stages = SCHEDULES[schedule]
    # Same seed: the two layouts' models start identical (each gets its own copy to split).
    entry = zoo.get("tiny_llama", d_model=size.d, n_layer=size.n_layer, n_head=size.n_head, vocab_size=size.vocab,
                    max_seq=size.max_len, num_stages=stages, batch_size=2, seq_len=8)
    args = tuple(getattr(example, f) for f in FIELDS[:3])
    dynamic = None
    if layout == "packed":
        t = Dim("T", min=2, max=size.rows * size.max_len)
        dynamic = {"tokens": {1: t}, "positions": {1: t}, "documents": {1: t}}
    pipe = ps.pipeline(entry.model, zoo.layer_split("layers", size.n_layer, stages), args, dynamic_shapes=dynamic)
    return ps.build_schedule(pipe, schedule, size.n_mb, loss_fn=_sum_loss, loss_count=_count)


def _stepper(sched: ps.PipelineSchedule, steps: list[tuple]) -> Callable[[int], None]:
    def step(i: int) -> None:
        ids, pos, doc, tgt = steps[i]
        sched.step(ids, pos, doc, target=tgt)
        for st in sched.stages:  # no optimizer: drop the gradients, as zero_grad() would
            st.module.zero_grad(set_to_none=True)
    return step


def _body(rank: int, world: int, schedule: str, size: Size, warmup: int, reps: int, seed: int) -> dict:
    groups = [documents(size, seed + i) for i in range(warmup + reps)]
    make = {"padded": lambda g: padded(g, size.max_len), "packed": lambda g: packed(g, size.rows * size.max_len)}
    batches = {lay: [[make[lay](g) for g in step] for step in groups] for lay in LAYOUTS}
    steps = {lay: [step_inputs(b, *FIELDS) for b in batches[lay]] for lay in LAYOUTS}
    scheds = {lay: _schedule(lay, schedule, size, batches[lay][0][0]) for lay in LAYOUTS}
    run = {lay: _stepper(scheds[lay], steps[lay]) for lay in LAYOUTS}
    calls = {lay: iter(range(warmup + reps)) for lay in LAYOUTS}  # the i-th call of each runs step i's documents
    times = common.alternate({lay: (lambda lay=lay: run[lay](next(calls[lay]))) for lay in LAYOUTS}, warmup, reps)
    peaks: dict[str, list[int]] = {lay: [] for lay in LAYOUTS}
    for i in range(warmup, warmup + reps):
        for lay in LAYOUTS:
            params = {p.untyped_storage().data_ptr() for st in scheds[lay].stages for p in st.module.parameters()}
            counter = SavedBytes(params)
            dist.barrier()
            with counter.hooks():
                run[lay](i)
            peaks[lay].append(counter.peak)
    timed = batches["padded"][warmup:]
    real = [sum(b.n_tokens for b in step) for step in timed]
    slots = [sum(b.shape[0] * b.shape[1] for b in step) for step in timed]
    lengths = [b.shape[1] for step in batches["packed"][warmup:] for b in step]
    assert real == [sum(b.n_tokens for b in step) for step in batches["packed"][warmup:]]
    return {"times": times, "peak_bytes": peaks, "real_tokens": real, "padded_slots": slots,
            "packed_lengths": lengths, "losses": {lay: float(scheds[lay].loss) for lay in LAYOUTS}}


# ---- the run -----------------------------------------------------------------------


def measure(schedule: str, size: Size, warmup: int, reps: int, seed: int = 0, timeout: float = 900.0) -> dict:
    ranks = run_ranks(_body, 2, schedule, size, warmup, reps, seed, timeout=timeout)
    r0 = ranks[0]
    wall = {lay: r0["times"][lay]["wall"] for lay in LAYOUTS}  # fenced: the same on both ranks
    cpu = {lay: [sum(r["times"][lay]["cpu"][i] for r in ranks) for i in range(reps)] for lay in LAYOUTS}
    real, slots = r0["real_tokens"], r0["padded_slots"]
    tps = {lay: [n / s for n, s in zip(real, wall[lay])] for lay in LAYOUTS}
    pad = [1 - n / s for n, s in zip(real, slots)]
    per_rank = []
    for r, x in enumerate(ranks):
        p = x["peak_bytes"]
        per_rank.append({"rank": r, "padded_bytes": common.summarize(p["padded"]),
                         "packed_bytes": common.summarize(p["packed"]),
                         "packed_over_padded": common.summarize([a / b for a, b in zip(p["packed"], p["padded"])])})
    return {"schedule": schedule, "stages": SCHEDULES[schedule], "reps": reps, "warmup": warmup,
            "real_tokens": common.summarize(real), "padded_slots": slots[0],
            "padding_fraction": common.summarize(pad),
            "ideal_gain": common.summarize([s / n for n, s in zip(real, slots)]),
            "packed_row_lengths": common.summarize(r0["packed_lengths"]),
            "padded_s": common.summarize(wall["padded"]), "packed_s": common.summarize(wall["packed"]),
            "padded_tokens_per_s": common.summarize(tps["padded"]),
            "packed_tokens_per_s": common.summarize(tps["packed"]),
            "tokens_per_s_packed_over_padded": common.summarize([b / a for a, b in zip(wall["packed"], wall["padded"])]),
            "cpu_packed_over_padded": common.summarize([a / b for a, b in zip(cpu["packed"], cpu["padded"])]),
            "activations": per_rank, "last_loss": r0["losses"]}


def run(smoke: bool = False, reps: int = REPS, warmup: int = 2) -> dict:
    size = SMOKE if smoke else FULL
    if smoke:
        reps, warmup = 1, 1
    commit, dirty = git_state(Path(__file__).parent)
    meta = {"command": "python -m benchmarks.packing" + (" --smoke" if smoke else "")
            + ("" if smoke or reps == REPS else f" --reps {reps}"),
            "commit": commit, "dirty": dirty, "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "size": asdict(size), "reps": reps, "warmup": warmup,
            "load_avg_before": os.getloadavg()}
    rows = []
    t0 = time.perf_counter()
    for schedule in SCHEDULES:
        rows.append(measure(schedule, size, warmup, reps))
        print(f"  {schedule}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    meta["load_avg_after"] = os.getloadavg()
    meta["seconds"] = time.perf_counter() - t0
    return {"meta": meta, "rows": rows}


# ---- the tables --------------------------------------------------------------------


def _kib(s: dict) -> str:
    return f"{s['median'] / 1024:,.0f} KiB"


def markdown(res: dict) -> str:
    m, s = res["meta"], res["meta"]["size"]
    first = res["rows"][0]
    lines = [f"`{m['command']}`", "",
             f"Commit `{m['commit']}`{' (with uncommitted changes)' if m.get('dirty') else ''}, torch {m['torch']}, "
             f"{m['cpus']} CPUs, load average {m['load_avg_before'][0]:.2f} before / {m['load_avg_after'][0]:.2f} "
             f"after (1-min; 5-min {m['load_avg_before'][1]:.2f} / {m['load_avg_after'][1]:.2f}), {m['seconds']:.0f} s. "
             f"2 gloo ranks, tiny Llama d={s['d']} {s['n_layer']} blocks; documents with log-normal lengths "
             f"(sigma {s['sigma']}) in [2, {s['max_len']}], {s['n_mb']} microbatches of {s['rows']} documents per step: "
             f"padded ({s['rows']} x {s['max_len']}) or packed into one row (1 x L, L = "
             f"{median_range(first['packed_row_lengths'], '{:.0f}')} tokens); {m['warmup']} warm-up + {m['reps']} timed steps "
             "per layout, alternating step by step, new documents every step (the same for both layouts).", "",
             f"Real tokens per step {median_range(first['real_tokens'], '{:.0f}')} of {first['padded_slots']} padded slots: "
             f"padding fraction {median_range(first['padding_fraction'])}, so at most a "
             f"{median_range(first['ideal_gain'])}x tokens/s gain and activations down to "
             f"{1 - first['padding_fraction']['median']:.2f}x.", "",
             "Same losses in both layouts (the last step, same documents, same weights): "
             + "; ".join(f"{row['schedule']} padded {row['last_loss']['padded']:.6f}, packed "
                         f"{row['last_loss']['packed']:.6f}" for row in res["rows"]) + ".", "",
             "### Tokens per second (packed / padded: median of per-step ratios [min, max])", "",
             "| schedule | padded tokens/s | packed tokens/s | packed/padded tokens/s | ideal 1/(1-padding) | "
             "packed/padded CPU s (2 ranks) |",
             "|---|---|---|---|---|---|"]
    for row in res["rows"]:
        lines.append(f"| {row['schedule']} ({row['stages']} stages) | {median_range(row['padded_tokens_per_s'], '{:,.0f}')} | "
                     f"{median_range(row['packed_tokens_per_s'], '{:,.0f}')} | {median_range(row['tokens_per_s_packed_over_padded'])}x | "
                     f"{median_range(row['ideal_gain'])}x | {median_range(row['cpu_packed_over_padded'])}x |")
    lines += ["", "### Peak activation bytes per rank (packed / padded: median of per-step ratios [min, max])", "",
              "Most bytes autograd holds for backward at once during the step (saved storages, parameters left "
              "out), medians over the steps.", "",
              "| schedule | rank | padded | packed | packed/padded | 1 - padding |", "|---|---|---|---|---|---|"]
    for row in res["rows"]:
        for x in row["activations"]:
            lines.append(f"| {row['schedule']} | {x['rank']} | {_kib(x['padded_bytes'])} | {_kib(x['packed_bytes'])} | "
                         f"{median_range(x['packed_over_padded'])}x | {1 - row['padding_fraction']['median']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 1 warm-up + 1 timed step per layout")
    parser.add_argument("--reps", type=int, default=REPS, help="timed steps per layout after the warm-up")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"write the JSON here (default: {RESULTS.relative_to(RESULTS.parents[2])} in a full "
                             "run; nothing in --smoke); the markdown goes beside it")
    parser.add_argument("--render", type=Path, default=None, help="print the tables of a saved JSON; run nothing")
    args = parser.parse_args(argv)
    if args.render is not None:
        res = json.loads(args.render.read_text())
        print(markdown(res))
        return res
    print("python -m benchmarks.packing" + (" --smoke" if args.smoke else ""), flush=True)
    res = run(args.smoke, args.reps)
    out = args.out if args.out is not None else (None if args.smoke else RESULTS)
    text = markdown(res)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2, default=str) + "\n")
        out.with_suffix(".md").write_text(text)
    print(text)
    return res


if __name__ == "__main__":
    main()
