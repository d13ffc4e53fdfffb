"""The `pippy-split` command line: `train`, `generate`, `plot`, `inspect`, `simulate`, `plan`.

Where this sits: on top of the flow split → Pipe → stage → schedule → runtime.
`simulate` only needs the schedule layer's orders and simulator; `inspect`
traces and splits a model into a Pipe and prints it; `plan` profiles a model and
ranks split x schedule x microbatches x checkpointing under a memory budget
(:mod:`pippy_split.plan`); `train` hands over to :mod:`pippy_split.train`, which runs
the whole flow on local ranks; `generate` to :mod:`pippy_split.training.generate_run`, which
samples from a train run on the stages and ranks it trained with; `plot` charts a run's
loss and throughput. What `simulate`, `inspect` and `plot` do lives in
:mod:`pippy_split.commands`, one module a command; this module parses and dispatches.

    pippy-split simulate --schedule ZBVZeroBubble --ranks 4 --microbatches 8 --compare
    pippy-split inspect zoo:tiny_unet --json
    pippy-split plan zoo:tiny_gpt --ranks 4 --memory 2GB --svg plan.svg
    pippy-split train --steps 100
    pippy-split generate checkpoints/tiny_gpt --prompt "07+45=" --max-new-tokens 3
    pippy-split plot checkpoints/tiny_gpt

Importing this module imports no torch: ``--help``, ``--version`` and ``train --help`` answer
at once, and each command imports what it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from typing import Any

# torch probes for numpy once per process and warns "Failed to initialize NumPy" where it is
# not installed (torch does not depend on it, and neither do these commands). Ignored here,
# in the command's process, and in the ranks `train` spawns, which import this module first.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

__all__ = ["main", "build_parser", "plan_cmd", "plan_cluster_cmd"]


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

    _add_plan(sub)

    t = sub.add_parser("train", help="train a model pipelined over local ranks (default: a tiny GPT learning sums)")
    build_train_parser(t)

    _add_generate(sub)

    pt = sub.add_parser("plot", help="chart a train run's loss and tokens/s per step as RUN_DIR/metrics.svg")
    pt.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory, holding metrics.jsonl")
    return p


def _add_plan(sub: Any) -> None:
    """``plan``'s flags: the measured planner on a model, or ``--cluster`` on paper."""
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


def _add_generate(sub: Any) -> None:
    """``generate``'s flags: the run, the prompts, how to choose tokens."""
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


# Names that moved to pippy_split.commands, still importable from here (imported when asked for: no torch
# at import time).
_MOVED = {"parse_costs": "simulate", "simulate_cmd": "simulate", "pipe_to_json": "inspect",
          "split_hint": "inspect", "inspect_cmd": "inspect"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(importlib.import_module(f"pippy_split.commands.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        from .commands.simulate import simulate_cmd

        try:
            return simulate_cmd(args, console)
        except ValueError as e:  # bad --costs
            console.print(f"[red]{e}[/]")
            return 2
    if args.command == "inspect":
        from .commands.inspect import inspect_cmd

        return inspect_cmd(args, console)
    if args.command == "plot":
        from .commands.plot import plot_cmd

        return plot_cmd(args)
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

    return train.train(args)


if __name__ == "__main__":
    sys.exit(main())
