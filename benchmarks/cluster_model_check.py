"""The cluster planner's cost model against this machine (issue 33): predicted vs measured
step times of zoo transformers on 2 and 4 gloo ranks.

Run: ``python -m benchmarks.cluster_model_check [--smoke] [--reps N] [--only MODEL]``
(``--block-alone``: only one block of each model in one process, measured against its
matmul-only time, ``results/cluster_model_check_block.json``). For
each case (a zoo model, a rank count, a schedule and microbatches), inside the rank
processes that train it (one process and one intra-op thread per rank, as ``run_ranks``
starts them, so the constants see the same sharing of the CPU as the step):

1. **Constants of this machine**, measured with every rank busy at once: the matmul
   FLOP/s of one rank at the model's own matmul shapes (fp32, one thread), the memory
   bandwidth of one rank (a large copy), gloo's point-to-point cost between neighbouring
   ranks (a ping-pong of a 1-float and of a boundary-activation-sized tensor: latency per
   message, and bandwidth from the difference), and, as a diagnostic, one block's
   forward and backward alone.
2. **Measured step**: ``ps.pipeline`` + ``ps.build_schedule`` on the ranks, one step fenced
   by barriers (``benchmarks.common.alternate``) right after each set of constants.
3. **Predicted step**: a :class:`~pippy_split.plan.cluster.Cluster` of ``world`` "GPUs"
   with the constants measured just before that step (``flops`` = the measured rate at
   the model's shapes, so ``efficiency=1``), priced by the planner itself,
   ``pippy_split.plan.cluster.price_layout``: per-stage costs from :mod:`pippy_split.plan.cluster.costs`
   (fp32: 4 bytes an element) and the schedule's real order simulated.

Each step gets its own prediction and ratio (the machine is shared, and its load moves
the constants and the step alike); a row gives the medians over ``--reps`` steps with
their min and max.

Results: ``benchmarks/results/cluster_model_check.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pippy_split import zoo
from pippy_split.plan.cluster import Cluster, ClusterLayout, ModelShape, Runtime, price_layout
from pippy_split.plan.cluster.block import block_times
from pippy_split.plan.cluster.costs import layout_costs
from pippy_split.testing import run_ranks

from . import common

RESULTS = Path(__file__).parent / "results"
FP32 = 4
TWIN_WIDTH = 16


@dataclass(frozen=True)
class Case:
    """One model on ``world`` ranks: ``batch`` sequences of ``seq`` tokens in ``m`` microbatches."""

    model: str  # "tiny_gpt" | "tiny_llama"
    world: int
    schedule: str = "1F1B"
    d: int = 256
    layers: int = 8
    heads: int = 4
    seq: int = 128
    batch: int = 16
    m: int = 8
    vocab: int = 64

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.schedule in ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV") else 1

    def twin(self) -> Case:
        """The same model, ranks, schedule and batch at a width (16) where compute is next to
        nothing: its step is the runtime's own cost per action, and the messages'."""
        return replace(self, d=TWIN_WIDTH)

    def entry(self) -> zoo.ZooEntry:
        stages = self.world * self.stages_per_rank
        kw: dict[str, Any] = dict(d_model=self.d, n_layer=self.layers, n_head=self.heads, num_stages=stages,
                                  batch_size=self.batch, seq_len=self.seq, vocab_size=self.vocab)
        kw["block_size" if self.model == "tiny_gpt" else "max_seq"] = self.seq
        return zoo.get(self.model, **kw)

    def shape(self) -> ModelShape:
        """The zoo model as the cost model sees it: GPT's MLP is plain (4d wide, two matrices),
        Llama's gated (SwiGLU, 4d wide, three); both have as many KV heads as heads."""
        return ModelShape(layers=self.layers, hidden=self.d, intermediate=4 * self.d, heads=self.heads,
                          kv_heads=self.heads, vocab=self.vocab, gated=self.model != "tiny_gpt")


def cases(smoke: bool = False) -> list[Case]:
    if smoke:
        return [Case("tiny_gpt", 2, d=32, layers=2, seq=16, batch=4, m=2)]
    return [Case(name, world, schedule) for name in ("tiny_gpt", "tiny_llama")
            for world, schedule in ((2, "1F1B"), (2, "GPipe"), (2, "Interleaved1F1B"), (4, "1F1B"))]


# ---- constants, measured on the ranks -------------------------------------------------


def _matmul_shapes(shape: ModelShape) -> list[tuple[int, int]]:
    """``(in, out)`` of every matmul of one block (q, k, v, o; the MLP's), as the model runs them."""
    h, kv = shape.hidden, shape.hidden * shape.kv_heads // shape.heads
    mlp = [(h, shape.intermediate)] * (2 if shape.gated else 1) + [(shape.intermediate, h)]
    return [(h, h), (h, kv), (h, kv), (h, h)] + mlp


def matmul_rate(shape: ModelShape, tokens: int, seconds: float) -> float:
    """FLOP/s of this process on one block's matmuls (fp32), ``tokens`` rows each."""
    mats = [(torch.randn(tokens, i), torch.randn(i, o)) for i, o in _matmul_shapes(shape)]
    flops = sum(2 * tokens * i * o for i, o in _matmul_shapes(shape))
    for x, w in mats:
        torch.mm(x, w)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for x, w in mats:
            torch.mm(x, w)
        n += 1
    return n * flops / (time.perf_counter() - t0)


def copy_rate(seconds: float, nbytes: int = 64 * 2**20) -> float:
    """Bytes/s of memory traffic of this process copying a tensor (read + write)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        dst.copy_(src)
        n += 1
    return 2 * n * nbytes / (time.perf_counter() - t0)


def one_way_s(rank: int, world: int, sizes: tuple[int, ...], reps: int) -> list[float] | None:
    """Median one-way time of gloo messages of each of ``sizes`` floats between ranks ``2i``
    and ``2i + 1`` (all pairs at once), half a ping-pong, the sizes taking turns; ``None``
    on a rank left without a pair."""
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    if peer >= world:
        return None
    bufs = [torch.zeros(n) for n in sizes]
    times: list[list[float]] = [[] for _ in sizes]
    for i in range(reps + 2):
        for buf, out in zip(bufs, times):
            t0 = time.perf_counter()
            if rank % 2 == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
            if i >= 2:
                out.append((time.perf_counter() - t0) / 2)
    return [statistics.median(t) for t in times]


def block_s(case: Case, seconds: float) -> tuple[float, float]:
    """Seconds of one transformer block's forward and of its backward on one microbatch, in
    this process (the zoo's own block, fp32): what the cost model's per-block time predicts."""
    entry = case.entry()
    mb = case.batch // case.m
    x = torch.randn(mb, case.seq, case.d, requires_grad=True)
    if case.model == "tiny_gpt":
        block, extra = entry.model.blocks[0], ()
    else:
        positions = torch.arange(case.seq).repeat(mb, 1)
        block, extra = entry.model.layers[0], (entry.model.freqs_cis[positions], positions)
    grad = torch.randn(mb, case.seq, case.d)
    fwd, bwd = [], []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(fwd) < 3:
        t0 = time.perf_counter()
        y = block(x, *extra)
        t1 = time.perf_counter()
        y.backward(grad)
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return statistics.median(fwd[1:]), statistics.median(bwd[1:])


def constants(rank: int, world: int, case: Case, seconds: float) -> dict[str, Any]:
    """This rank's measured constants (see the module docstring), every rank at once."""
    tokens = case.batch // case.m * case.seq
    dist.barrier()
    flops = matmul_rate(case.shape(), tokens, seconds)
    dist.barrier()
    bw = copy_rate(seconds / 2)
    dist.barrier()
    p2p = one_way_s(rank, world, (1, tokens * case.d), 20)
    dist.barrier()
    fwd, bwd = block_s(case, seconds)
    return {"flops": flops, "mem_bw": bw, "p2p_small_s": p2p and p2p[0], "p2p_large_s": p2p and p2p[1],
            "p2p_large_bytes": tokens * case.d * FP32, "block_fwd_s": fwd, "block_bwd_s": bwd}


def _body(rank: int, world: int, case: Case, warmup: int, reps: int, seconds: float) -> dict:
    """Constants, a step of the tiny-width twin and a step of the case, taking turns: each
    step is predicted from the constants measured just before it, so a change of the
    machine's load moves both alike."""
    runner = common.build_ours(case.entry(), case.schedule, case.m)
    twin = common.build_ours(case.twin().entry(), case.schedule, case.m)
    common.alternate({"step": runner.step, "twin": twin.step}, 0, warmup)
    consts, steps, twins = [], [], []
    for _ in range(reps):
        consts.append(constants(rank, world, case, seconds))
        twins += common.alternate({"twin": twin.step}, 0, 1)["twin"]["wall"]
        steps += common.alternate({"step": runner.step}, 0, 1)["step"]["wall"]
    return {"constants": consts, "step_s": steps, "twin_s": twins}


# ---- prediction ----------------------------------------------------------------------


def cluster_of(ranks: list[dict], world: int, rep: int) -> tuple[Cluster, dict[str, float]]:
    """A :class:`Cluster` of ``world`` devices from the constants the ranks measured before
    step ``rep`` (mean over ranks). A message's time is the latency (a 1-float message)
    plus bytes over bandwidth; when the boundary-sized message is not measurably slower
    than the tiny one, the bandwidth is unresolved and only the latency counts."""
    def mean(key: str) -> float:
        return statistics.mean(r["constants"][rep][key] for r in ranks if r["constants"][rep][key] is not None)

    latency = mean("p2p_small_s")
    extra = mean("p2p_large_s") - latency
    bandwidth = mean("p2p_large_bytes") / extra if extra > 0 else float("inf")
    consts = {"flops": mean("flops"), "mem_bw": mean("mem_bw"), "p2p_latency_s": latency, "p2p_bw": bandwidth,
              "block_fwd_s": mean("block_fwd_s"), "block_bwd_s": mean("block_bwd_s")}
    cluster = Cluster(gpus=world, gpus_per_node=world, flops=consts["flops"], hbm_bytes=64e9,
                      hbm_bw=consts["mem_bw"], intra_node_bw=min(bandwidth, 1e15), inter_node_bw=min(bandwidth, 1e15),
                      efficiency=1.0, p2p_latency=latency)
    return cluster, consts


def predict(case: Case, cluster: Cluster) -> dict[str, Any]:
    """The planner's step time for ``case`` on ``cluster``, with the terms it is made of."""
    lay = ClusterLayout(pp=case.world, dp=1, tp=1, v=case.stages_per_rank, m=case.m, mb=case.batch // case.m, ac=False)
    cand = price_layout(case.shape(), cluster, lay, case.schedule, case.seq, optimizer="sgd", dtype_bytes=FP32)
    costs = layout_costs(case.shape(), cluster, lay, case.seq, FP32)
    block = block_times(case.shape(), cluster, lay, case.seq, Runtime(), dtype_bytes=FP32).forward
    return {"step_s": cand.step_s, "bubble": cand.bubble, "forward_s": costs.forward, "backward_s": costs.backward,
            "p2p_s": costs.p2p_s, "action_overhead_s": cluster.action_overhead, "block_fwd_s": block,
            "block_bwd_s": 2 * block}


def action_overhead(case: Case, cluster: Cluster, twin_s: float) -> float:
    """The ``action_overhead`` at which the planner predicts the twin's measured step (by
    bisection: the predicted step grows with it); 0 when the twin is no slower than its
    compute and messages."""
    twin = case.twin()
    lo, hi = 0.0, twin_s
    if predict(twin, cluster)["step_s"] >= twin_s:
        return 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict(twin, cluster.with_(action_overhead=mid))["step_s"] < twin_s else (lo, mid)
    return (lo + hi) / 2


def measure(case: Case, warmup: int, reps: int, seconds: float, timeout: float = 1800.0) -> dict[str, Any]:
    """Run ``case`` on its ranks; per step, the prediction from the constants measured just
    before it and the ratio; the row gives medians (with min and max)."""
    load = os.getloadavg()[0]
    ranks = run_ranks(_body, case.world, case, warmup, reps, seconds, timeout=timeout)
    steps = ranks[0]["step_s"]  # fenced by barriers: the same on every rank
    per_rep = []
    for i, measured in enumerate(steps):
        cluster, consts = cluster_of(ranks, case.world, i)
        consts["action_overhead_s"] = action_overhead(case, cluster, ranks[0]["twin_s"][i])
        with_overhead = cluster.with_(action_overhead=consts["action_overhead_s"])
        predicted = predict(case, with_overhead)
        # diagnostic: the efficiency a block reached, measured alone just before this step
        consts["block_efficiency"] = ((predicted["block_fwd_s"] + predicted["block_bwd_s"])
                                      / (consts["block_fwd_s"] + consts["block_bwd_s"]))
        per_rep.append({"constants": consts, "measured_s": measured, "twin_s": ranks[0]["twin_s"][i],
                        "first_principles": predict(case, cluster), "predicted": predicted,
                        "block_measured": predict(case, with_overhead.with_(
                            flops=cluster.flops * consts["block_efficiency"]))})
    ratios = [r["predicted"]["step_s"] / r["measured_s"] for r in per_rep]
    bare = [r["first_principles"]["step_s"] / r["measured_s"] for r in per_rep]
    blocked = [r["block_measured"]["step_s"] / r["measured_s"] for r in per_rep]
    median_rep = per_rep[sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]]
    return {"case": asdict(case), "per_step": per_rep, "constants": median_rep["constants"],
            "predicted": median_rep["predicted"], "measured_s": common.summarize(steps),
            "predicted_s": common.summarize([r["predicted"]["step_s"] for r in per_rep]),
            "ratio": common.summarize(ratios), "ratio_without_overhead": common.summarize(bare),
            "ratio_with_block_efficiency": common.summarize(blocked),
            "twin_s": common.summarize(ranks[0]["twin_s"]),
            "load_before": load, "load_after": os.getloadavg()[0]}


# ---- report --------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    """Markdown: per case, medians over the steps (min-max) of predicted, measured and their
    ratio; the ratio also without the runtime's cost per action, and with the efficiency a
    block reached alone (a diagnostic: it isolates the block's compute term); then, from
    the step whose ratio is the median, one block's time predicted and measured alone, and
    the constants."""
    head = ("| model | ranks | schedule | m | predicted s | measured s | predicted / measured "
            "| same, no cost per action | same, block efficiency measured | cost per action ms "
            "| one block fwd+bwd, predicted / measured ms | matmul GFLOP/s per rank | gloo latency, bandwidth | load |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        c, k, p = r["case"], r["constants"], r["predicted"]
        bw = f"{k['p2p_bw'] / 1e9:.2f} GB/s" if k["p2p_bw"] < float("inf") else "bandwidth unresolved"
        lines.append(f"| {c['model']} d={c['d']} L={c['layers']} | {c['world']} | {c['schedule']} | {c['m']} "
                     f"| {_range(r['predicted_s'])} | {_range(r['measured_s'])} | {_range(r['ratio'], '.2f')} "
                     f"| {_range(r['ratio_without_overhead'], '.2f')} | {_range(r['ratio_with_block_efficiency'], '.2f')} "
                     f"| {1e3 * k['action_overhead_s']:.1f} "
                     f"| {1e3 * (p['block_fwd_s'] + p['block_bwd_s']):.1f} / "
                     f"{1e3 * (k['block_fwd_s'] + k['block_bwd_s']):.1f} | {k['flops'] / 1e9:.1f} "
                     f"| {k['p2p_latency_s'] * 1e6:.0f} us, {bw} | {r['load_before']:.1f}-{r['load_after']:.1f} |")
    return "\n".join(lines)


def report(result: dict) -> str:
    """The ``.md`` file: how it was run, then :func:`table`."""
    return (f"Command: `{result['command']}` ({result['cpus']} CPUs, torch {result['torch']}, "
            f"{result['rows'][0]['measured_s']['n'] if result['rows'] else 0} steps per case)\n\n"
            f"{table(result['rows'])}\n")


def _range(s: dict[str, float], fmt: str = ".3f") -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def block_alone(rounds: int = 4, seconds: float = 0.4) -> list[dict[str, Any]]:
    """One block of each model in this one process (no ranks): its measured forward and
    backward against the cost model's matmul-only time at the matmul rate measured in
    turn with it (medians over ``rounds``): how much the ops besides matmuls add."""
    torch.set_num_threads(1)
    out = []
    for name in ("tiny_gpt", "tiny_llama"):
        case = Case(name, 2)
        tokens = case.batch // case.m * case.seq
        rates, fwd, bwd = [], [], []
        for _ in range(rounds):
            rates.append(matmul_rate(case.shape(), tokens, seconds))
            f, b = block_s(case, seconds)
            fwd.append(f)
            bwd.append(b)
        cluster = Cluster(gpus=1, flops=statistics.median(rates), efficiency=1.0, hbm_bw=1e12)
        lay = ClusterLayout(pp=1, dp=1, tp=1, v=1, m=1, mb=tokens // case.seq, ac=False)
        pred = 3 * block_times(case.shape(), cluster, lay, case.seq, Runtime(), dtype_bytes=FP32).forward
        measured = statistics.median(fwd) + statistics.median(bwd)
        out.append({"model": name, "matmul_flops": cluster.flops, "predicted_fwd_bwd_s": pred,
                    "measured_fwd_bwd_s": measured, "measured_over_predicted": measured / pred})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny case, one step: checks it runs")
    parser.add_argument("--reps", type=int, default=5, help="steps per case, each after its own constants")
    parser.add_argument("--only", default=None, help="model name to run alone")
    parser.add_argument("--out", default=str(RESULTS / "cluster_model_check.json"))
    parser.add_argument("--block-alone", action="store_true",
                        help="only one block of each model in this process, against its matmul-only time")
    args = parser.parse_args(argv)
    if args.block_alone:
        rows_alone = block_alone()
        out = RESULTS / "cluster_model_check_block.json"
        out.write_text(json.dumps({"command": "python -m benchmarks.cluster_model_check --block-alone",
                                   "load": os.getloadavg()[0], "rows": rows_alone}, indent=2))
        print(json.dumps(rows_alone, indent=2))
        return 0
    reps, warmup, seconds = (1, 0, 0.05) if args.smoke else (args.reps, 1, 0.4)
    rows = [measure(c, warmup, reps, seconds) for c in cases(args.smoke) if args.only in (None, c.model)]
    flags = " --smoke" if args.smoke else f" --reps {args.reps}" + (f" --only {args.only}" if args.only else "")
    result = {"command": "python -m benchmarks.cluster_model_check" + flags,
              "cpus": os.cpu_count(), "torch": torch.__version__, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(report(result))
    print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
