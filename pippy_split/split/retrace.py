"""The same split traced again from another entry point (split → Pipe, for generation).

A training Pipe is traced on one microbatch, static in its shapes and without a cache.
Generation needs another program per stage: the decode step, whose inputs hold the KV
cache and whose sizes change every token. :func:`trace_again` traces a root module that
shares the model's submodules (so every FQN is the user's own) and cuts it where the
training pipe was cut, by module calls, as the autocast retrace does
(:func:`~pippy_split.split.autocast_trace.translate_cuts`). The result is a Pipe of its
own; it knows no ranks, like any Pipe.
"""

from __future__ import annotations

from typing import Any

import torch

from .autocast_trace import TraceRecipe, translate_cuts
from .errors import SplitError
from .partition import plan_from_cuts
from .pipe import Pipe, _build_pipe
from .trace import trace_model

__all__ = ["trace_again"]


def trace_again(pipe: Pipe, root: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
                dynamic_shapes: Any = None) -> Pipe:
    """``root`` (a module whose submodules are the traced model's, under the same FQNs)
    traced on ``args``/``kwargs`` and cut where ``pipe`` was cut.

    Raises :class:`SplitError` when ``pipe`` was not built by ``pipeline()`` or a cut has
    no counterpart in the new trace.
    """
    plan = pipe._plan
    if plan is None or pipe._model is None:
        raise SplitError("this Pipe does not know how it was traced (it was not built by pipeline()), so it "
                         "cannot be traced again; build it with pippy_split.pipeline()")
    # One plain export: the program runs as traced ops (no hooks, wrappers or per-module calls
    # are needed to decode), and keeping calls would cost a failed export on the cache objects
    traced = trace_model(root, tuple(args), dict(kwargs or {}), dynamic_shapes=dynamic_shapes, keep_calls=False)
    ops = [n for n in traced.graph.nodes if n.op == "call_function"]
    new_plan = plan_from_cuts(ops, translate_cuts(plan.ops, plan.cuts, ops))
    if new_plan.num_stages != pipe.num_stages:
        raise SplitError(f"the model traced again has {new_plan.num_stages} stages where the pipe has "
                         f"{pipe.num_stages}; cut it at module FQNs")
    return _build_pipe(root, traced, new_plan, TraceRecipe(tuple(args), dict(kwargs or {}), dynamic_shapes, False))
