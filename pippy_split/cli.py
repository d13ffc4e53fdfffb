"""The `pippy-split` command: `train`, `generate`, `inspect`, `simulate`, `plan`.

Where this sits: on top of the flow split → Pipe → stage → schedule → runtime.
`simulate` only needs the schedule layer's orders and simulator; `inspect`
traces and splits a model into a Pipe and prints it; `plan` profiles a model and
ranks split x schedule x microbatches x checkpointing under a memory budget
(:mod:`pippy_split.plan`); `train` hands over to :mod:`pippy_split.train`, which runs
the whole flow on local ranks; `generate` to :mod:`pippy_split.training.generate_run`, which
samples from a train run on the stages and ranks it trained with.

    pippy-split simulate --schedule ZBVZeroBubble --ranks 4 --microbatches 8 --compare
    pippy-split inspect zoo:tiny_unet --json
    pippy-split plan zoo:tiny_gpt --ranks 4 --memory 2GB --svg plan.svg
    pippy-split train --steps 100
    pippy-split generate checkpoints/tiny_gpt --prompt "07+45=" --max-new-tokens 3

Importing this module imports no torch: ``--help``, ``--version`` and ``train --help`` answer
at once, and each command imports what it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import TYPE_CHECKING, Any

# torch probes for numpy once per process and warns "Failed to initialize NumPy" where it is
# not installed (torch does not depend on it, and neither do these commands). Ignored here,
# in the command's process, and in the ranks `train` spawns, which import this module first.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

if TYPE_CHECKING:
    from .split.pipe import Pipe

__all__ = ["main", "build_parser", "parse_costs", "simulate_cmd", "inspect_cmd", "plan_cmd", "pipe_to_json", "failure_line",
           "split_hint"]


def parse_costs(text: str | None) -> dict[str, float] | None:
    """``"F=1,I=1,W=1"`` -> ``{"F": 1.0, "I": 1.0, "W": 1.0}`` (keys among F, B, I, W)."""
    if not text:
        return None
    costs: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().upper()
        if not sep or key not in ("F", "B", "I", "W"):
            raise ValueError(f"bad cost {part!r}: expected KIND=NUMBER with KIND among F, B, I, W")
        costs[key] = float(value)
    return costs


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; builds without importing torch (``train``'s flags come from
    its config dataclass)."""
    from . import __version__
    from .training.config import build_train_parser

    p = argparse.ArgumentParser(prog="pippy-split", description="Pipeline parallelism for ordinary PyTorch models.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("simulate", help="simulate a schedule: timeline, bubble, activation memory")
    s.add_argument("--schedule", default="ZBVZeroBubble", help="schedule name")
    s.add_argument("--ranks", type=int, default=4)
    s.add_argument("--microbatches", type=int, default=8)
    s.add_argument("--stages-per-rank", type=int, default=None, help="default: the schedule's own")
    s.add_argument("--costs", default=None, help="cost per action kind, e.g. F=1,I=1,W=1 (B defaults to I+W)")
    s.add_argument("--svg", default=None, help="also write the timeline as SVG here")
    s.add_argument("--compare", action="store_true", help="table of all schedules for the same ranks/microbatches")

    i = sub.add_parser("inspect", help="split a model and show stages, edges and shared parameters")
    i.add_argument("target", help="module:factory (returns a ZooEntry or (model, args[, kwargs])) or zoo:NAME")
    g = i.add_mutually_exclusive_group()
    g.add_argument("--split", default=None, help="comma-separated FQNs to split at (beginning of each)")
    g.add_argument("--stages", type=int, default=None, help="balance this many stages automatically")
    i.add_argument("--json", action="store_true", help="print JSON instead of tables")

    pl = sub.add_parser("plan", help="rank split x schedule x microbatches x checkpointing under a memory budget")
    pl.add_argument("target", nargs="?", help="module:factory (returns a ZooEntry or (model, args[, kwargs])) or "
                    "zoo:NAME (not with --cluster)")
    pl.add_argument("--cluster", default=None, metavar="PRESET",
                    help="plan for a cluster on paper instead (ps.plan_cluster), e.g. h100x512, a100x64")
    pl.add_argument("--model", default=None, help="with --cluster: hf:DIR holding the model's config.json")
    pl.add_argument("--seq-len", type=int, default=None, help="with --cluster: tokens per sequence")
    pl.add_argument("--global-batch-tokens", type=int, default=None, help="with --cluster: tokens per step")
    pl.add_argument("--efficiency", type=float, default=None,
                    help="with --cluster: one flat fraction of peak FLOP/s for every matmul and attention "
                         "(default: each kernel priced by its shape, ps.plan_cluster's kernel model)")
    pl.add_argument("--runtime", default="pippy_split", metavar="NAME",
                    help="with --cluster: the training code priced, pippy_split (default) or torchtitan-2412 "
                         "(ps.Runtime.preset)")
    pl.add_argument("--ranks", type=int, default=4)
    pl.add_argument("--memory", default="2GB", help="per-rank memory budget, e.g. 2GB, 512MiB")
    pl.add_argument("--global-batch", type=int, default=None, help="samples per step (default: the example's batch)")
    pl.add_argument("--schedules", default=None, help="comma-separated schedule names (default: all)")
    pl.add_argument("--bandwidth", type=float, default=None, help="link bandwidth in GB/s (default: measured or 2)")
    pl.add_argument("--latency", type=float, default=None, help="per-message latency in microseconds")
    pl.add_argument("--top", type=int, default=10, help="rows to print")
    pl.add_argument("--svg", default="plan.svg", help="write the best candidate's predicted timeline here")
    pl.add_argument("--no-measure", action="store_true",
                    help="simulate with the profiled op sums instead of running each split's stages (faster)")
    pl.add_argument("--measure-budget", type=float, default=None, metavar="SECONDS",
                    help="seconds the measurement may spend repeating steps until the timings settle "
                         "(default 20; a busy machine needs more)")

    t = sub.add_parser("train", help="train a model pipelined over local ranks (default: a tiny GPT learning sums)")
    build_train_parser(t)

    gen = sub.add_parser("generate", help="sample from a train run on the stages and ranks it trained with")
    gen.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (train's --checkpoint), holding model.pt")
    gen.add_argument("--prompt", action="append", default=[],
                     help="text to continue; repeat for several (left-padded into one batch); without it, a folder "
                          "of runs (checkpoints/) lists its runs")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens added to each prompt (default 32)")
    gen.add_argument("--do-sample", action="store_true", help="sample instead of taking the most likely token")
    gen.add_argument("--temperature", type=float, default=1.0, help="with --do-sample: the logits are divided by it")
    gen.add_argument("--top-k", type=int, default=None, help="with --do-sample: keep the K most likely tokens")
    gen.add_argument("--top-p", type=float, default=None,
                     help="with --do-sample: keep the most likely tokens whose probability reaches P")
    gen.add_argument("--seed", type=int, default=None,
                     help="with --do-sample: the same seed draws the same tokens, whatever the ranks")
    gen.add_argument("--json", action="store_true", help="print a JSON list of {prompt, completion} instead of text")
    return p


# --------------------------------------------------------------------------- simulate


def _simulate_one(name: str, ranks: int, microbatches: int, spr: int | None, costs: dict | None):
    from .schedule import get_schedule_class, simulate

    cls = get_schedule_class(name)
    return simulate(cls.compute_order(ranks, microbatches, spr), costs)


def _compare_spr(spec: Any, requested: int | None) -> int:
    """Stages per rank a --compare row uses: the requested count where the family takes
    it, else the family's fixed count, else at least 2 (as tutorial 03 compares them:
    a looped family run with one stage per rank is just GPipe or 1F1B)."""
    if requested is not None and (spec.stages_per_rank is None or requested == spec.stages_per_rank) \
            and requested >= spec.min_stages_per_rank:
        return requested
    return spec.stages_per_rank or max(spec.min_stages_per_rank, 2)


def _per_stage(costs: dict | None, spr: int) -> dict[str, float]:
    """The same model cut into ``spr`` stages per rank: each action does 1/spr of the work."""
    base = {"F": 1.0, "I": 1.0, "W": 1.0, **(costs or {})}
    return {k: v / spr for k, v in base.items()}


def simulate_cmd(args: argparse.Namespace, console: Any) -> int:
    from rich import box
    from rich.table import Table

    from .schedule.orders import ORDERS
    from .schedule.render import render_rich, render_svg

    costs = parse_costs(args.costs)
    if args.schedule not in ORDERS:
        console.print(f"[red]unknown schedule {args.schedule!r}[/]; choose from {', '.join(ORDERS)}")
        return 2
    spr, top_costs, note = args.stages_per_rank, costs, ""
    if args.compare:  # the run shown on top is its row of the table below
        spr = _compare_spr(ORDERS[args.schedule], args.stages_per_rank)
        top_costs = _per_stage(costs, spr)
        note = f", {spr} stages/rank, costs / {spr}" if spr > 1 else ""
    try:
        sim = _simulate_one(args.schedule, args.ranks, args.microbatches, spr, top_costs)
    except (ValueError, TypeError) as e:
        console.print(f"[red]{args.schedule} rejects ranks={args.ranks}, microbatches={args.microbatches}"
                      f"{'' if spr is None else f', stages-per-rank={spr}'}:[/] {e}")
        return 2
    title = f"{args.schedule}: {args.ranks} ranks, {args.microbatches} microbatches"
    console.print(f"[bold]{title}[/]{note}")
    console.print(render_rich(sim, wrap=True))  # bands of labelled actions, not squeezed letters
    console.print(f"makespan {sim.makespan:g}   bubble fraction {sim.bubble_fraction:.1%}")
    console.print("peak activations per rank: "
                  + ", ".join(f"rank {r}: {n}" for r, n in sorted(sim.peak_activations.items())))
    if args.svg:
        render_svg(sim, args.svg, title=title)
        console.print(f"SVG timeline written to {args.svg}")
    if args.compare:
        table = Table(title=f"All schedules, {args.ranks} ranks, {args.microbatches} microbatches",
                      caption="st/rank: stages per rank; costs / st/rank, so every row is the same model; "
                              "peak act: microbatches held, per rank",
                      box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1), pad_edge=False)
        for col in ("schedule", "place", "st/rank", "I/W", "makespan", "bubble", "peak act"):
            table.add_column(col, justify="left" if col in ("schedule", "place", "peak act") else "right", no_wrap=True)
        for name, spec in ORDERS.items():
            row_spr = _compare_spr(spec, args.stages_per_rank)
            split = "yes" if spec.split_backward else "no"
            try:
                s = _simulate_one(name, args.ranks, args.microbatches, row_spr, _per_stage(costs, row_spr))
            except (ValueError, TypeError) as e:
                table.add_row(name, spec.placement, str(row_spr), split, "-", "-", f"[yellow]skipped: {e}[/]")
                continue
            peaks = [s.peak_activations[r] for r in sorted(s.peak_activations)]
            table.add_row(name, spec.placement, str(row_spr), split, f"{s.makespan:g}", f"{s.bubble_fraction:.1%}",
                          " ".join(map(str, peaks)))
        console.print(table)
    return 0


# --------------------------------------------------------------------------- inspect


def _shape_json(shape: tuple) -> list:
    return [d if isinstance(d, int) else str(d) for d in shape]


def pipe_to_json(pipe: Pipe) -> dict:
    """Stages, edges and shared parameters of a Pipe as JSON-ready data."""
    stages = [{"index": s.index, "modules": list(s.modules), "num_params": s.num_params,
               "param_bytes": s.param_bytes, "flops": int(s.flops), "params": list(s.param_fqns)}
              for s in pipe.stages]
    edges = [{"src": "input" if e.from_input else e.src_stage, "src_output": e.src_output, "dst": e.dst_stage,
              "dst_input": e.dst_input, "name": e.name, "label": e.label, "shape": _shape_json(e.spec.shape),
              "dtype": str(e.spec.dtype).replace("torch.", ""), "grad": bool(e.spec.carries_grad),
              "skip": bool(e.is_skip)} for e in pipe.edges]
    shared = {fqn: [{"stage": st, "names": list(names)} for st, names in uses]
              for fqn, uses in pipe.shared_parameters.items()}
    return {"model": pipe.model_name, "num_stages": pipe.num_stages, "stages": stages, "edges": edges,
            "shared_parameters": shared}


def failure_line(command: str, error: BaseException) -> str:
    """The one line a command prints for an error it expects (a split that cannot be made, a
    model export cannot trace) instead of a traceback.

    Example:
        >>> failure_line("inspect", ValueError("split_spec names 'x'"))
        "pippy-split inspect failed: ValueError: split_spec names 'x'"
    """
    return f"pippy-split {command} failed: {type(error).__name__}: {error}"


def split_hint(model: Any) -> str:
    """What to pass to split a model that nothing split (no split spec, no ``pipe_split()``),
    naming one of its repeated blocks as the example where it has a ``ModuleList``/``Sequential``."""
    from torch import nn

    example = "layers.4"
    for name, module in model.named_modules():
        children = [child for child, _ in module.named_children()]
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) >= 2:
            example = f"{name}.{children[len(children) // 2]}" if name else children[len(children) // 2]
            break
    return (f"hint: nothing splits {type(model).__name__}, so it is 1 stage; split it with --split FQN[,FQN...] "
            f"(a stage begins at each named submodule, e.g. --split {example}) or --stages N (N stages "
            "balanced by cost)")


def inspect_cmd(args: argparse.Namespace, console: Any) -> int:
    """``pippy-split inspect``: split a model and print its Pipe (tables or ``--json``); an
    error of the split is one line and exit status 1."""
    from .split import SplitError, TraceError, pipeline
    from .train import load_factory, parse_split, unpack_entry

    try:
        factory = load_factory(args.target)
        model, margs, mkwargs, spec, _, _ = unpack_entry(factory())
    except (ImportError, AttributeError, KeyError, ValueError, TypeError) as e:
        console.print(f"[red]cannot load {args.target!r}:[/] {e}")
        return 2
    if args.split:
        spec = parse_split(args.split)
    elif args.stages:
        spec = args.stages
    try:
        pipe = pipeline(model, spec, margs, mkwargs)
    except (SplitError, TraceError) as e:
        print(failure_line("inspect", e), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(pipe_to_json(pipe), indent=2))
    else:
        console.print(pipe)
    if spec is None and pipe.num_stages == 1:
        print(split_hint(model), file=sys.stderr if args.json else sys.stdout)
    return 0


# --------------------------------------------------------------------------- plan


def _microbatch_of(args: tuple, kwargs: dict, batch: int, size: int) -> tuple[tuple, dict]:
    """The first ``size`` samples of every tensor whose dim 0 is the batch."""
    import torch

    def cut(v: Any) -> Any:
        return v[:size] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch else v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def plan_cmd(args: argparse.Namespace, console: Any) -> int:
    """``pippy-split plan``: print the top candidates, write the best one's SVG timeline."""
    import torch

    from .plan import CommModel, PlanError, plan
    from .train import load_factory, unpack_entry

    try:
        model, margs, mkwargs, _, loss_fn, target = unpack_entry(load_factory(args.target)())
    except (ImportError, AttributeError, KeyError, ValueError, TypeError) as e:
        console.print(f"[red]cannot load {args.target!r}:[/] {e}")
        return 2
    batch = next((int(a.shape[0]) for a in margs if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    if batch is None:
        console.print(f"[red]{args.target}: plan needs an example tensor with a batch dimension (dim 0)[/]")
        return 2
    global_batch = args.global_batch or batch
    mb_size = max(1, batch // args.ranks)
    mb_args, mb_kwargs = _microbatch_of(margs, mkwargs, batch, mb_size)
    mb_target = _microbatch_of((target,), {}, batch, mb_size)[0][0] if target is not None else None
    comm = None
    if args.bandwidth is not None or args.latency is not None:
        base = CommModel()
        comm = CommModel(bandwidth=args.bandwidth * 1e9 if args.bandwidth else base.bandwidth,
                         latency=args.latency * 1e-6 if args.latency is not None else base.latency, source="given")
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()] if args.schedules else None
    budget = {} if args.measure_budget is None else {"measure_budget": args.measure_budget}
    try:
        result = plan(model, mb_args, num_ranks=args.ranks, memory_budget=args.memory, loss_fn=loss_fn,
                      global_batch=global_batch, schedules=schedules, comm=comm, example_kwargs=mb_kwargs or None,
                      example_target=mb_target, measure=not args.no_measure, **budget)
    except (PlanError, ValueError) as e:
        console.print(f"[red]{e}[/]")
        return 2
    console.print(result.report(top=args.top))
    for line in (result.how_to_run(), _train_line(result.best, args.target, global_batch == batch
                                                   and loss_fn is not None and target is not None, batch)):
        console.print(line, markup=False, highlight=False, soft_wrap=True)  # unwrapped: commands to copy
    if args.svg:
        result.best.to_svg(args.svg)
        console.print(f"predicted timeline of the best candidate: {args.svg}")
    return 0


def _train_line(best: Any, target: str, trains_this_batch: bool, batch: int) -> str:
    """The ``pippy-split train`` command that runs ``best``, or why there is none."""
    if not trains_this_batch:
        return (f"pippy-split train does not run this plan: it trains {target}'s own example batch ({batch} "
                "samples) with its loss_fn and target; plan with the default --global-batch, or run it in Python")
    try:
        return f"run it on local ranks:\n    {best.train_command(target)}"
    except ValueError as e:
        return f"pippy-split train does not run this plan: {e}"


# --------------------------------------------------------------------------- main


def plan_cluster_cmd(args: argparse.Namespace) -> int:
    """``pippy-split plan --cluster PRESET --model hf:DIR``: ``ps.plan_cluster``'s table and the best launch line."""
    from .plan.cluster import Cluster, Runtime, plan_cluster

    missing = [flag for flag, value in (("--model", args.model), ("--seq-len", args.seq_len),
                                        ("--global-batch-tokens", args.global_batch_tokens)) if value is None]
    if missing:
        print(f"plan --cluster needs {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        extra = {"efficiency": args.efficiency} if args.efficiency is not None else {}
        cluster = Cluster.preset(args.cluster, **extra)
        plan = plan_cluster(args.model, cluster, global_batch_tokens=args.global_batch_tokens, seq_len=args.seq_len,
                            runtime=Runtime.preset(args.runtime))
    except ValueError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    print(plan.table(args.top))
    print(f"\nbest, on each of {cluster.nodes} nodes:\n  {plan.best.launch()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = build_parser().parse_args(argv)
    console = Console()
    if args.command == "simulate":
        try:
            return simulate_cmd(args, console)
        except ValueError as e:  # bad --costs
            console.print(f"[red]{e}[/]")
            return 2
    if args.command == "inspect":
        return inspect_cmd(args, console)
    if args.command == "plan" and args.cluster:
        return plan_cluster_cmd(args)
    if args.command == "plan":
        if not args.target:
            console.print("[red]plan needs a target (module:factory or zoo:NAME), or --cluster PRESET --model hf:DIR[/]")
            return 2
        return plan_cmd(args, console)
    if args.command == "generate":
        from .training import generate_run

        return generate_run.run(args)
    from . import train

    return train.run(args)


if __name__ == "__main__":
    sys.exit(main())
