"""The last stage's loss: the rule the schedule gives it, and one microbatch's loss.

Part of the stage layer. The schedule owns ``loss_fn`` and what a non-finite loss
does; each step hands them to the last stage as a :class:`LossRule`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import PipelineError

__all__ = ["LossRule", "microbatch_loss"]


@dataclass(frozen=True)
class LossRule:
    """How the last stage turns a microbatch's outputs into its loss: ``fn(output, target)``,
    and what a NaN/inf loss does (``"warn"``, ``"raise"`` or ``"ignore"``). The schedule
    hands it to :meth:`PipelineStage.forward` with each step's context.

    Example:
        >>> rule = LossRule(torch.nn.functional.mse_loss, on_nonfinite="raise")
    """

    fn: Callable
    on_nonfinite: str = "warn"


def microbatch_loss(rule: LossRule, model_output: Callable[[tuple], Any], outputs: tuple, target: Any,
                    mixed_precision: torch.dtype | None, device_type: str, where: str) -> torch.Tensor:
    """``rule.fn(model_output(outputs), target)`` in fp32 outside autocast, checked to be a
    scalar; a NaN/inf loss warns, raises or passes as ``rule.on_nonfinite`` says."""
    if mixed_precision is not None:  # the loss in fp32, whatever autocast made of the outputs
        outputs = tuple(o.float() if isinstance(o, torch.Tensor) and o.dtype == mixed_precision else o
                        for o in outputs)
    try:
        with torch.autocast(device_type, enabled=False):
            loss = rule.fn(model_output(outputs), target)
    except Exception as e:
        raise PipelineError(f"{where}: loss_fn raised {type(e).__name__}: {e}") from e
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise PipelineError(f"{where}: loss_fn must return a scalar tensor, got {shape}")
    loss = loss.reshape(())
    if rule.on_nonfinite != "ignore" and not bool(torch.isfinite(loss.detach())):
        msg = f"{where}: the loss is {loss.item()}"
        if rule.on_nonfinite == "raise":
            raise PipelineError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return loss
