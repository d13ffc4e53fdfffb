"""``pippy-split inspect``: split a model and show its stages, edges and shared parameters (tables or JSON).

Where this sits: on the splitter (:func:`pippy_split.pipeline`); it builds no stage and runs
no schedule. :mod:`pippy_split.cli` parses the command line and hands over here.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from torch import nn

from ..split import SplitError, TraceError, pipeline
from ..split.pipe import Pipe
from ..training.factory import load_factory, unpack_entry
from ..training.setup import parse_split

__all__ = ["pipe_to_json", "command_failure_line", "split_hint", "inspect_cmd"]


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


def command_failure_line(command: str, error: BaseException) -> str:
    """The one line a command prints for an error it expects (a split that cannot be made, a
    model export cannot trace) instead of a traceback.

    Example:
        >>> command_failure_line("inspect", ValueError("split_spec names 'x'"))
        "pippy-split inspect failed: ValueError: split_spec names 'x'"
    """
    return f"pippy-split {command} failed: {type(error).__name__}: {error}"


def split_hint(model: Any) -> str:
    """What to pass to split a model that nothing split (no split spec, no ``pipe_split()``),
    naming one of its repeated blocks as the example where it has a ``ModuleList``/``Sequential``."""
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
        print(command_failure_line("inspect", e), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(pipe_to_json(pipe), indent=2))
    else:
        console.print(pipe)
    if spec is None and pipe.num_stages == 1:
        print(split_hint(model), file=sys.stderr if args.json else sys.stdout)
    return 0
