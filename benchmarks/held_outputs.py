"""Peak bytes of forward outputs a rank holds for backward: ours with and without freeing
what was sent, and the peer, in one run (issue 10, "free what was sent").

Run: ``python -m benchmarks.held_outputs [--reps N]``. Tiny GPT d=256, 8 blocks, batch 32,
seq 128, 8 microbatches, 2 stages on 2 gloo ranks, GPipe and 1F1B. After every forward,
the distinct storages behind the outputs each tool keeps for its backward (ours:
``PipelineStage``'s saved outputs; the peer: its stages' ``fwd_cache``) are summed; the
figure is the most seen during a step. Unlike RSS, this isolates the one thing freeing
changes: a block's output (a residual add, which autograd does not save) is needed by
backward only for its autograd node once it has been sent. Ours and the peer are built in
the same rank processes; steps alternate between the three.
"""

from __future__ import annotations

import argparse
from typing import Any

from pippy_split.testing import run_ranks

from . import common


def _held_bytes(stages: list, tool: str) -> int:
    seen: dict[int, int] = {}
    for st in stages:
        if tool == "peer":
            outs = [o for outputs, _ in st.fwd_cache.values() for o in outputs]
        else:
            outs = [o for saved in st._saved.values() for o in saved.outputs]
        for o in outs:
            if hasattr(o, "untyped_storage"):
                storage = o.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _probe(stages: list, tool: str, peak: list[int]) -> None:
    name = "forward_one_chunk" if tool == "peer" else "forward"
    for st in stages:
        fn = getattr(st, name)

        def wrapped(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            out = _fn(*args, **kwargs)
            peak[0] = max(peak[0], _held_bytes(stages, tool))
            return out

        setattr(st, name, wrapped)


def _body(rank: int, world: int, schedule: str, reps: int) -> dict:
    runners = {"ours freeing sent": common.build_ours(common.gpt(256, num_stages=2), schedule, 8),
               "ours keeping sent": common.build_ours(common.gpt(256, num_stages=2), schedule, 8),
               "peer": common.build_peer(common.gpt(256, num_stages=2), schedule, 8, rank, world)}
    runners["ours freeing sent"].sched.release_sent_outputs = True
    runners["ours keeping sent"].sched.release_sent_outputs = False
    peaks: dict[str, list[int]] = {name: [] for name in runners}
    for name, r in runners.items():
        r.step()  # warm-up
    for _ in range(reps):
        for name, r in runners.items():
            peak = [0]
            tool = "peer" if name == "peer" else "ours"
            _probe(r.stages, tool, peak)
            r.step()
            for st in r.stages:
                st.__dict__.pop("forward_one_chunk" if tool == "peer" else "forward", None)
            peaks[name].append(peak[0])
    return peaks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    for schedule in ("GPipe", "1F1B"):
        ranks = run_ranks(_body, 2, schedule, args.reps, timeout=900)
        for rank, peaks in enumerate(ranks):
            med = {name: sorted(v)[len(v) // 2] for name, v in peaks.items()}
            free, keep, peer = med["ours freeing sent"], med["ours keeping sent"], med["peer"]
            print(f"{schedule:5s} rank {rank}: outputs held at peak: freeing {free / 2**20:.2f} MiB, keeping "
                  f"{keep / 2**20:.2f} MiB, peer {peer / 2**20:.2f} MiB -> freeing/peer "
                  f"{free / peer if peer else float('nan'):.3f}x")


if __name__ == "__main__":
    main()
