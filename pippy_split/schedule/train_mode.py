"""Train-mode ops in a pipe's graphs: what ``eval()`` refuses to run.

Part of the schedule layer (… → **schedule** → runtime): ``PipelineSchedule.eval``
runs the graphs the pipe was traced with, so a pipe traced in train mode (dropout
on, batch norm updating its statistics) would not give the model's eval
behaviour. This module finds those ops once per pipe (cached in ``pipe.derived``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..stage.errors import PipelineError

if TYPE_CHECKING:
    from ..stage.pipe_view import PipeView

__all__ = ["train_mode_ops", "refuse_train_mode_graph"]

# op -> position of its ``train`` / ``training`` argument
_TRAIN_ARG = {"aten.dropout.default": 2, "aten.feature_dropout.default": 2, "aten.alpha_dropout.default": 2,
              "aten.native_dropout.default": 2, "aten.batch_norm.default": 5,
              "aten._native_batch_norm_legit_functional.default": 5, "aten._native_batch_norm_legit.default": 5,
              "aten.instance_norm.default": 5}


def train_mode_ops(pipe: PipeView) -> list[tuple[int, str, str]]:
    """``(stage, op, module)`` for every op of the pipe's graphs that behaves differently
    in train mode and was traced in it (dropout with ``train=True``, batch norm with
    ``training=True``). Empty for a pipe traced in eval mode. Cached on the pipe.

    Example:
        >>> import pippy_split as ps
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1), torch.nn.Linear(4, 2))
        >>> x = torch.randn(2, 4)
        >>> train_mode_ops(ps.pipeline(model.eval(), ["2"], (x,)))
        []
        >>> modules_in_train_mode(ps.pipeline(model.train(), ["2"], (x,)))  # a module call, not a graph op
        [(0, '1')]
    """
    cached = pipe.derived.get("train_mode_ops")
    if cached is None:
        cached = []
        for info in pipe.stages:
            for node in info.module.graph.nodes:
                index = _TRAIN_ARG.get(str(node.target)) if node.op == "call_function" else None
                if index is None or len(node.args) <= index or node.args[index] is not True:
                    continue
                stack = node.meta.get("nn_module_stack") or {}
                module = next(reversed(stack.values()))[0] if stack else "?"
                cached.append((info.index, str(node.target).split(".")[1], module))
        pipe.derived["train_mode_ops"] = cached
    return cached


_MODE_DEPENDENT = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._NormBase)


def modules_in_train_mode(pipe: PipeView) -> list[tuple[int, str]]:
    """``(stage, FQN)`` of each module a stage calls (the user's own, so its ``train()`` /
    ``eval()`` applies) that is in training mode and behaves differently there (dropout,
    batch or instance norm)."""
    found = []
    for info in pipe.stages:
        module = info.module
        for node in module.graph.nodes if isinstance(module, torch.fx.GraphModule) else ():
            if node.op != "call_module":
                continue
            for name, sub in module.get_submodule(str(node.target)).named_modules():
                if sub.training and isinstance(sub, _MODE_DEPENDENT):
                    found.append((info.index, f"{node.target}.{name}" if name else str(node.target)))
    return found


def refuse_train_mode_graph(pipe: PipeView | None) -> None:
    """Raise a ``PipelineError`` naming the first train-mode op of ``pipe``, or the first
    module it calls in training mode (``None``: a hand-built pipeline, whose modules' own
    ``train()``/``eval()`` applies)."""
    if pipe is None:
        return
    called = modules_in_train_mode(pipe)
    if called:
        stage, name = called[0]
        more = f" (and {len(called) - 1} more)" if len(called) > 1 else ""
        raise PipelineError(f"eval(): stage {stage} calls module {name!r} in training mode{more}, so eval() would "
                            "drop activations or use (and update) batch statistics. Call model.eval() first (the "
                            "stages call the model's own modules), or trace an eval pipe: ps.pipeline(model.eval(), ...)")
    found = train_mode_ops(pipe)
    if found:
        stage, op, module = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise PipelineError(f"eval(): stage {stage} runs {op} of module {module!r} in training mode{more}: the "
                            "pipe was traced with the model in train mode, so eval() would drop activations and "
                            "use (and update) batch statistics. Trace an eval pipe for it: "
                            "ps.pipeline(model.eval(), ...) and build a schedule on that pipe")
