"""The cluster planner's cost model against torchtitan's published Llama 3.1 runs of Dec 2024
(issue 33; since issue 43 with no fitted factor: the planner's one set of constants).

Run: ``python -m benchmarks.torchtitan_llama3`` (a few seconds, one process, no GPU). Prints
predicted vs published tokens/s/GPU and reserved memory per GPU for the rows of
``benchmarks/llama3_h100_202412_torchtitan.md`` (Tables 1-6) and writes
``benchmarks/results/torchtitan_llama3.md``. The rows themselves, with the other published
runs, are ``benchmarks.published_runs``; this module keeps the helpers the tests use to
price Tables 4-6 directly.

Each run is priced as torchtitan 9dec370 (Dec 2024) ran it: ``pipeline_parallel_microbatches``
defaulted to the PP degree (8) for every schedule, so Table 5's local batch of 32 ran as 8
microbatches of 4 (torchtitan PR 781, Jan 2025, changed the default to ``pp x stages per
rank``); a multi-stage schedule had 2 stages per rank, cut by ``generate_split_points``;
without PP the local batch runs in one forward; the runtime is
``Runtime.preset("torchtitan-2412")`` with ``torch.compile`` and Float8 linears (Tables 4-6
say both), async TP where the table says so.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pippy_split.plan.cluster import ClusterCandidate

from .published_runs import (
    LLAMA3_70B,
    LLAMA3_405B,
    RUNS,
    TITAN,
    TITAN_FP8,
    errors,
    price,
    titan_split,
)

GiB = 2**30
LLAMA_405B = LLAMA3_405B
LLAMA_70B = LLAMA3_70B
PUBLISHED_405B = {"1F1B": (100.0, 82.5), "Interleaved1F1B": (128.0, 72.7)}
"""Table 5: 405B, 512 GPUs, FSDP 8 TP 8 PP 8, local batch 32, seq 8192: (tokens/s/GPU, GiB)."""
PUBLISHED_405B_32K = (76.0, 75.3)
"""Table 6 row 1: the same mesh (CP 1), seq 32768, local batch 8, 1F1B."""
PUBLISHED_70B = {"2D": (829.0, 71.9), "2D + AsyncTP": (876.0, 67.6)}
"""Table 4: 70B, 256 GPUs, FSDP 32 TP 8, local batch 16, seq 8192."""
__all__ = ["LLAMA_405B", "LLAMA_70B", "PUBLISHED_405B", "PUBLISHED_405B_32K", "PUBLISHED_70B", "TITAN", "TITAN_FP8",
           "price_405b", "price_70b", "titan_split"]

_TABLES = ("torchtitan H100 T1", "torchtitan H100 T2", "torchtitan H100 T3", "torchtitan H100 T4",
           "torchtitan H100 T5", "torchtitan H100 T6")


def _run(table: str, name: str):  # noqa: ANN202 - a published_runs.Run
    return next(r for r in RUNS if r.table == table and r.name == name)


def price_405b(schedule: str, seq_len: int = 8192) -> ClusterCandidate:
    """Table 5 (seq 8192: ``"1F1B"`` or ``"Interleaved1F1B"``) or Table 6's CP 1 row (32768)."""
    if seq_len == 32768:
        return price(_run("torchtitan H100 T6", "405B seq 32768 1F1B"))
    return price(_run("torchtitan H100 T5", f"405B {schedule}"))


def price_70b(async_tp: bool = False) -> ClusterCandidate:
    """Table 4's mesh (no PP: the local batch of 16 runs as one microbatch), 2D or 2D + AsyncTP."""
    return price(_run("torchtitan H100 T4", "70B 2D + AsyncTP" if async_tp else "70B 2D"))


def table() -> str:
    lines = ["| row | predicted tokens/s/GPU | published | ratio | predicted GiB (reserved) | published GiB | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for run in (r for r in RUNS if r.table in _TABLES):
        got = price(run)
        tps, mem = errors(run)
        lines.append(f"| {run.table[-2:]} {run.name} | {got.tokens_per_s_per_gpu:,.0f} | {run.tokens_per_s_per_gpu:,.0f} | "
                     f"{tps:.2f} | {got.memory_bytes / GiB:.1f} | {run.memory_gib:.1f} | {mem:.2f} |")
    one, inter = price_405b("1F1B"), price_405b("Interleaved1F1B")
    lines += ["", f"Interleaved1F1B / 1F1B throughput: predicted "
              f"{inter.tokens_per_s_per_gpu / one.tokens_per_s_per_gpu:.3f}, published 1.280"]
    for c in (one, inter):
        lines += ["", f"{c.schedule} fullest GPU:"] + [f"- {k}: {v / GiB:.2f} GiB" for k, v in c.memory.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "torchtitan_llama3.md"))
    args = parser.parse_args(argv)
    text = table()
    print(text)
    Path(args.out).write_text("# Cost model vs torchtitan's published Llama 3.1 runs\n\n"
                              "`python -m benchmarks.torchtitan_llama3`\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
