"""PP x FSDP2 x TP on a DeviceMesh: per-rank memory and step time, ours against torch.distributed.pipelining.

    python -m benchmarks.nd_parallel            # full run (4 gloo ranks, ~2-4 min on 2 cores)
    python -m benchmarks.nd_parallel --smoke    # one tiny case, 1 rep (the smoke test)

Four gloo ranks, one process and one intra-op thread each, the zoo's tiny Llama
(8 blocks, d=128, 4 heads, vocab 64, global batch 16 of 32 tokens; a block holds 262,400
parameters, 96% of the model), 1F1B with 4 microbatches per pipeline, AdamW:

    pp2         PP2 plain on a (dp=2, pp=2) mesh: two pipeline replicas, each runs its half of
                the global batch (8 rows) and keeps its own gradients (no data-parallel
                reduction). The fair baseline for the FSDP rows: the same work per rank, the
                same 4 ranks busy, only the sharding differs.
    fsdp_stage  PP2 x FSDP2 on the whole stage: ``fully_shard(stage_module, mesh=mesh["dp"])``.
    fsdp_block  PP2 x FSDP2 per block: ours ``ps.parallelize(sched, dp_mesh=mesh["dp"],
                fsdp=["layers.*"])``; the peer ``fully_shard`` on each block, then the root.
    fsdp_once   the same with ``fsdp_gather="once"`` (no ``gather_budget``): ours keeps every
                block and stage root gathered from its first forward of a step to the step's
                end (one all-gather each per step); the peer as in fsdp_block.
    fsdp_budget the same with ``gather_budget="64KiB"``: only the stage root (32 KiB) fits, the
                blocks are gathered per action and the block one action ends with is handed to
                the next when it starts with it; parameter memory as per block's.
    fsdp_1block the same with ``gather_budget="1.1MiB"``: the stage root and one block (1,025 KiB)
                kept, the other three blocks handed over as in fsdp_budget.
    tp2         PP2 x TP2 on a (pp=2, tp=2) mesh, Megatron plan (wq/wk/wv/w1/w3 column-wise,
                wo/w2 row-wise); both TP ranks run the whole batch (16 rows).

Ours: ``ps.pipeline`` + ``ps.build_schedule(..., group=mesh["pp"])`` (traced stages that call
the model's blocks), then the sharding. The peer: hand-built stages, the torchtitan recipe
(a deep copy keeps a slice of layers, ``PipelineStage(module, stage_idx, 2, device,
group=pp_group)``, ``Schedule1F1B``), the same sharding with torch's own calls. Both live in
the same rank processes, on the same groups, and take turns step by step
(``common.alternate``: a step is ``sched.step`` + ``opt.step()`` + ``opt.zero_grad()``);
each time ratio is the median of the per-repetition ratios ours/peer, [min, max].

Memory per rank, measured in one extra step of each tool after the timed ones (sizes are
deterministic, so one is enough):

    state      bytes of parameters + gradients + AdamW state (exp_avg, exp_avg_sq, step) at
               the end of the step (after ``opt.step()``, before ``zero_grad``), each tensor
               counted by its local shard (``DTensor.to_local()``): what a rank keeps.
    held       the most parameter bytes present at once during the step, sampled at every
               parameterised leaf module's forward: local shards plus any parameter FSDP2
               has all-gathered at that moment (the full tensor of an unsharded parameter).
    gather     the largest FSDP2 all-gather (elements), from ``dist.all_gather_single``,
               which FSDP2's default all-gather calls.

The step-time table also gives each row's held ratio (the most of any rank) and the FSDP2
all-gathers of one step on ranks 0 and 1 (stage 0 and stage 1 of replica 0), ours / the peer's.

The machine's load average is recorded before and after; on a shared 2-core machine the
wall-clock ratios are only as even as the load was.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

import pippy_split as ps
from pippy_split import zoo
from pippy_split.testing import run_ranks

from . import common
from .common import git_state, median_range

__all__ = ["Size", "CONFIGS", "run", "main"]

RESULTS = Path(__file__).parent / "results" / "nd_parallel.json"
CONFIGS = ("pp2", "fsdp_stage", "fsdp_block", "fsdp_once", "fsdp_budget", "fsdp_1block", "tp2")
LABELS = {"pp2": "PP2 (2 replicas, no DP reduction)", "fsdp_stage": "PP2 x FSDP2 whole stage",
          "fsdp_block": "PP2 x FSDP2 per block", "fsdp_once": "PP2 x FSDP2 per block, gathered once",
          "fsdp_budget": "PP2 x FSDP2 per block, gathered once within 64 KiB",
          "fsdp_1block": "PP2 x FSDP2 per block, gathered once within 1.1 MiB",
          "tp2": "PP2 x TP2"}
COL = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROW = ("attention.wo", "feed_forward.w2")


@dataclass(frozen=True)
class Size:
    d: int = 128
    n_layer: int = 8
    n_head: int = 4
    batch: int = 16  # global batch (rows); a DP replica runs half
    seq: int = 32
    n_mb: int = 4


FULL, SMOKE = Size(), Size(d=32, n_layer=4, batch=8, seq=8, n_mb=2)


def _entry(size: Size) -> zoo.ZooEntry:
    return zoo.get("tiny_llama", d_model=size.d, n_layer=size.n_layer, n_head=size.n_head,
                   max_seq=max(64, size.seq), num_stages=2, batch_size=size.batch, seq_len=size.seq)


def _mesh(cfg: str):
    from torch.distributed.device_mesh import init_device_mesh

    if cfg == "tp2":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))


def _batch(cfg: str, size: Size, mesh, entry: zoo.ZooEntry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This replica's rows: half the global batch under DP, all of it under TP."""
    tokens, positions = entry.args
    if cfg == "tp2":
        return tokens, positions, entry.target
    n = size.batch // 2
    rows = slice(n * mesh.get_local_rank("dp"), n * mesh.get_local_rank("dp") + n)
    return tokens[rows], positions[rows], entry.target[rows]


class LlamaStage(nn.Module):
    """The torchtitan recipe: layers ``lo..hi-1`` of a deep copy of a TinyLlama (plus the
    embedding on the first stage, the norm and head on the last) under the model's FQNs.

    Only the hidden state crosses the stage boundary, as in torchtitan: a later stage
    rebuilds the positions (``arange(T)`` per row, what the zoo's batch holds). Passing the
    int positions along fails in the peer: its first-step shape inference runs stage 1 on
    uninitialised positions (index out of bounds in the rotary table), and with static
    shapes its backward of stage 0 raises "grad can be implicitly created only for scalar
    outputs" for the int output.
    """

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        m = copy.deepcopy(model)
        self.tok_embeddings = m.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): m.layers[i] for i in range(lo, hi)})
        self.norm = m.norm if last else None
        self.output = m.output if last else None
        self.register_buffer("freqs_cis", m.freqs_cis, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        freqs = self.freqs_cis[positions]
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, freqs, positions)
        return h if self.output is None else self.output(self.norm(h))


def _tp_styles() -> tuple[Any, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return ColwiseParallel(), RowwiseParallel()


def _optimizer(modules: list[nn.Module]) -> torch.optim.Optimizer:
    # foreach=False: under TP a stage holds DTensor (blocks) and plain (norms, embedding)
    # parameters side by side; the same for both tools.
    return torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-4, foreach=False)


@dataclass
class Tool:
    step: Callable[[], Any]
    modules: list[nn.Module]
    opt: torch.optim.Optimizer
    run_step: Callable[[], Any]  # sched.step only (the memory measurement wraps opt.step itself)


def _build_ours(cfg: str, size: Size, mesh) -> Tool:
    from torch.distributed.fsdp import fully_shard

    e = _entry(size)
    tokens, positions, target = _batch(cfg, size, mesh, e)
    mb = tokens.shape[0] // size.n_mb
    pipe = ps.pipeline(e.model, e.split_spec, (tokens[:mb], positions[:mb]))
    sched = ps.build_schedule(pipe, "1F1B", size.n_mb, loss_fn=e.loss_fn, group=mesh["pp"])
    if cfg == "fsdp_stage":
        for st in sched.stages:
            fully_shard(st.module, mesh=mesh["dp"])
    elif cfg == "fsdp_block":
        ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["layers.*"])
    elif cfg == "fsdp_once":
        ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["layers.*"], fsdp_gather="once")
    elif cfg in ("fsdp_budget", "fsdp_1block"):
        ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["layers.*"], fsdp_gather="once",
                       gather_budget="64KiB" if cfg == "fsdp_budget" else "1.1MiB")
    elif cfg == "tp2":
        col, row = _tp_styles()
        ps.parallelize(sched, tp_mesh=mesh["tp"], tp_plan={**{f"layers.*.{n}": col for n in COL},
                                                           **{f"layers.*.{n}": row for n in ROW}})
    modules = [st.module for st in sched.stages]
    opt = _optimizer(modules)

    def run_step() -> Any:
        return sched.step(tokens, positions, target=target)

    def step() -> None:
        run_step()
        opt.step()
        opt.zero_grad()

    return Tool(step, modules, opt, run_step)


def _build_peer(cfg: str, size: Size, mesh) -> Tool:
    from torch.distributed import pipelining as tdp
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    e = _entry(size)
    tokens, positions, target = _batch(cfg, size, mesh, e)
    pp = mesh.get_local_rank("pp")
    per = size.n_layer // 2
    mod = LlamaStage(e.model, pp * per, (pp + 1) * per, pp == 0, pp == 1)
    if cfg == "fsdp_stage":
        fully_shard(mod, mesh=mesh["dp"])
    elif cfg in ("fsdp_block", "fsdp_once", "fsdp_budget", "fsdp_1block"):
        for block in mod.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(mod, mesh=mesh["dp"])
    elif cfg == "tp2":
        col, row = _tp_styles()
        plan = {f"layers.{i}.{n}": col for i in mod.layers for n in COL}
        plan.update({f"layers.{i}.{n}": row for i in mod.layers for n in ROW})
        parallelize_module(mod, mesh["tp"], plan)
    stage = tdp.PipelineStage(mod, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    sched = tdp.Schedule1F1B(stage, size.n_mb, loss_fn=e.loss_fn)
    opt = _optimizer([mod])

    def run_step() -> Any:
        with common.quiet():
            return sched.step(tokens, positions) if pp == 0 else sched.step(target=target)

    def step() -> None:
        run_step()
        opt.step()
        opt.zero_grad()

    return Tool(step, [mod], opt, run_step)


# ---- memory ------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _slots(modules: list[nn.Module]) -> list[tuple[nn.Module, str]]:
    return [(m, n) for mod in modules for m in mod.modules() for n, p in m._parameters.items() if p is not None]


def _full_param_bytes(modules: list[nn.Module]) -> int:
    """The stage's parameters at full size (DTensors by their global shape)."""
    return sum(p.numel() * p.element_size() for mod in modules for p in mod.parameters())


def _measure(tool: Tool) -> dict:
    """One step with the sampling hooks and the all-gather spy; then the state at its end."""
    slots = _slots(tool.modules)
    at_rest = {(id(m), n): _nbytes(m._parameters[n]) for m, n in slots}
    sharded_at_rest = {k for (m, n), k in zip(slots, at_rest) if hasattr(m._parameters[n], "to_local")}
    held = [0]

    def sample(*_: Any) -> None:
        total = 0
        for m, n in slots:
            p, key = m._parameters[n], (id(m), n)
            if hasattr(p, "to_local") or key not in sharded_at_rest:
                total += _nbytes(p)
            else:  # all-gathered by FSDP2 now: the full tensor, and its shard stays
                total += p.numel() * p.element_size() + at_rest[key]
        held[0] = max(held[0], total)

    leaves = {m for m, _ in slots}
    handles = [m.register_forward_pre_hook(sample) for m in leaves]
    gathers: list[int] = []
    inner = dist.all_gather_single

    def spy(output, input, *a, **kw):
        gathers.append(output.numel())
        return inner(output, input, *a, **kw)

    dist.barrier()
    dist.all_gather_single = spy
    try:
        tool.run_step()
    finally:
        dist.all_gather_single = inner
        for h in handles:
            h.remove()
    sample()
    tool.opt.step()
    params = sum(_nbytes(p) for mod in tool.modules for p in mod.parameters())
    grads = sum(_nbytes(p.grad) for mod in tool.modules for p in mod.parameters() if p.grad is not None)
    opt_state = sum(_nbytes(v) for s in tool.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    tool.opt.zero_grad()
    dist.barrier()
    return {"params": params, "grads": grads, "opt": opt_state, "state": params + grads + opt_state,
            "held_params": held[0], "stage_param_bytes_full": _full_param_bytes(tool.modules),
            "block_numel": sum(p.numel() for p in _entry_block_params(tool)),
            "max_gather": max(gathers, default=0), "gathers": len(gathers)}


def _entry_block_params(tool: Tool) -> list[torch.Tensor]:
    """One block's parameters (global shapes) of this rank's stage."""
    for mod in tool.modules:
        layers = mod.get_submodule("layers")
        for block in layers.children():
            return list(block.parameters())
    return []


# ---- the run -----------------------------------------------------------------------


def _body(rank: int, world: int, cfg: str, size: Size, warmup: int, reps: int) -> dict:
    mesh = _mesh(cfg)
    ours, peer = _build_ours(cfg, size, mesh), _build_peer(cfg, size, mesh)
    times = common.alternate({"ours": ours.step, "peer": peer.step}, warmup, reps)
    return {"times": times, "ours": _measure(ours), "peer": _measure(peer),
            "coords": {name: mesh.get_local_rank(name) for name in mesh.mesh_dim_names}}


def measure(cfg: str, size: Size, warmup: int, reps: int, timeout: float = 900.0) -> dict:
    ranks = run_ranks(_body, 4, cfg, size, warmup, reps, timeout=timeout)
    wall = {n: ranks[0]["times"][n]["wall"] for n in ("ours", "peer")}  # fenced: same on every rank
    cpu = {n: [sum(r["times"][n]["cpu"][i] for r in ranks) for i in range(reps)] for n in wall}
    per_rank = []
    for r, x in enumerate(ranks):
        o, p = x["ours"], x["peer"]
        per_rank.append({"rank": r, "coords": x["coords"], "ours": o, "peer": p,
                         "state_ours_over_peer": o["state"] / p["state"],
                         "held_ours_over_peer": o["held_params"] / p["held_params"],
                         "params_of_stage_ours": o["params"] / o["stage_param_bytes_full"],
                         "params_of_stage_peer": p["params"] / p["stage_param_bytes_full"]})
    return {"config": cfg, "label": LABELS[cfg], "reps": reps, "warmup": warmup, "ranks": per_rank,
            "ours_s": common.summarize(wall["ours"]), "peer_s": common.summarize(wall["peer"]),
            "ours_over_peer": common.summarize([a / b for a, b in zip(wall["ours"], wall["peer"])]),
            "cpu_ours_over_peer": common.summarize([a / b for a, b in zip(cpu["ours"], cpu["peer"])])}


def run(smoke: bool = False, reps: int = 5, warmup: int = 2, configs: tuple[str, ...] | None = None) -> dict:
    size = SMOKE if smoke else FULL
    chosen = configs or (("fsdp_block",) if smoke else CONFIGS)
    if smoke:
        reps, warmup = 1, 1
    meta = {"command": "python -m benchmarks.nd_parallel" + (" --smoke" if smoke else "")
            + ("" if smoke or reps == 5 else f" --reps {reps}")
            + ("" if configs is None else f" --configs {','.join(configs)}"),
            "commit": git_state(Path(__file__).parent)[0], "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "size": asdict(size), "reps": reps, "warmup": warmup,
            "load_avg_before": os.getloadavg()}
    rows = []
    t0 = time.perf_counter()
    for cfg in chosen:
        rows.append(measure(cfg, size, warmup, reps))
        print(f"  {cfg}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    meta["load_avg_after"] = os.getloadavg()
    meta["seconds"] = time.perf_counter() - t0
    return {"meta": meta, "rows": rows}


# ---- the tables --------------------------------------------------------------------


def _kb(b: float) -> str:
    return f"{b / 1024:,.0f} KiB"


def markdown(res: dict) -> str:
    m = res["meta"]
    s = m["size"]
    lines = [f"`{m['command']}`", "",
             f"Commit `{m['commit']}`, torch {m['torch']}, {m['cpus']} CPUs, load average "
             f"{m['load_avg_before'][0]:.2f} before / {m['load_avg_after'][0]:.2f} after "
             f"(1-min; 5-min {m['load_avg_before'][1]:.2f} / {m['load_avg_after'][1]:.2f}). 4 gloo ranks, "
             f"tiny Llama d={s['d']} {s['n_layer']} blocks, global batch {s['batch']} x {s['seq']} tokens, "
             f"1F1B m={s['n_mb']}, AdamW; {m['warmup']} warm-up + {m['reps']} timed steps per tool, "
             "alternating step by step.", "",
             "### Step time (ours / peer: median of per-step ratios [min, max])", "",
             "| config | ours s | peer s | ours/peer wall | ours/peer CPU s (4 ranks) | held params ours/peer "
             "(most of any rank) | all-gathers per step ours / peer (rank 0, rank 1) |",
             "|---|---|---|---|---|---|---|"]
    for row in res["rows"]:
        held = max(x["held_ours_over_peer"] for x in row["ranks"])
        gathers = " / ".join(", ".join(str(x[t]["gathers"]) for x in row["ranks"][:2]) for t in ("ours", "peer"))
        lines.append(f"| {row['label']} | {median_range(row['ours_s'])} | {median_range(row['peer_s'])} | "
                     f"{median_range(row['ours_over_peer'])}x | {median_range(row['cpu_ours_over_peer'])}x | "
                     f"{held:.2f}x | {gathers} |")
    lines += ["", "### Memory per rank (one measured step each; local shards)", "",
              "state = parameters + gradients + AdamW state at the end of the step; params/stage = "
              "local parameter bytes over the stage's full parameter bytes; held = most parameter "
              "bytes present at once, sampled at every leaf module's forward (shards + all-gathered "
              "parameters); gather = largest FSDP2 all-gather in elements (all-gathers in the step; one block = "
              f"{res['rows'][0]['ranks'][0]['ours']['block_numel']:,}).", "",
              "| config | rank (coords) | state ours | state peer | state ours/peer | params/stage ours | "
              "params/stage peer | held ours | held peer | held ours/peer | gather ours | gather peer |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in res["rows"]:
        for x in row["ranks"]:
            o, p = x["ours"], x["peer"]
            coords = ", ".join(f"{k}={v}" for k, v in x["coords"].items())
            lines.append(f"| {row['label']} | {x['rank']} ({coords}) | {_kb(o['state'])} | {_kb(p['state'])} | "
                         f"{x['state_ours_over_peer']:.2f}x | {x['params_of_stage_ours']:.2f} | "
                         f"{x['params_of_stage_peer']:.2f} | {_kb(o['held_params'])} | {_kb(p['held_params'])} | "
                         f"{x['held_ours_over_peer']:.2f}x | {o['max_gather']:,} ({o['gathers']}) | "
                         f"{p['max_gather']:,} ({p['gathers']}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny case (per-block FSDP2), 1 rep")
    parser.add_argument("--reps", type=int, default=5, help="timed steps per tool after the warm-up")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"write the JSON here (default: {RESULTS.relative_to(RESULTS.parents[2])} in a full "
                             "run; nothing in --smoke); the markdown goes beside it")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated rows to run (default: all of {', '.join(CONFIGS)})")
    parser.add_argument("--render", type=Path, default=None, help="print the tables of a saved JSON; run nothing")
    args = parser.parse_args(argv)
    if args.render is not None:
        res = json.loads(args.render.read_text())
        print(markdown(res))
        return res
    cmd = "python -m benchmarks.nd_parallel" + (" --smoke" if args.smoke else "")
    print(cmd, flush=True)
    configs = tuple(args.configs.split(",")) if args.configs else None
    unknown = sorted(set(configs or ()) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    res = run(args.smoke, args.reps, configs=configs)
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
