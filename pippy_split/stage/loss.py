"""The last stage's loss and the one place of the loss arithmetic.

Part of the stage layer. The schedule owns ``loss_fn``, what a non-finite loss does,
``scale_grads``, ``loss_count`` and ``loss_scale``; each step it folds them into one
:class:`LossRule` that the runtime hands to the last stage (its forward computes each
microbatch's loss, its backward starts from :meth:`LossRule.backward_root`) and that
the schedule uses again for the step's reported loss (:meth:`LossRule.step_loss`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_map_only

from .errors import PipelineError

__all__ = ["LossRule"]


@dataclass(frozen=True)
class LossRule:
    """How the last stage turns a microbatch's output into its loss, and how the step's
    microbatch losses become gradients and the reported loss.

    The rule, for microbatch losses ``l_0 .. l_{m-1}`` (each ``fn(output, target)``, fp32):

    - backward starts from ``l_mb / (divisor / scale)`` (:meth:`backward_root`), where
      ``divisor`` is the batch's item count with ``loss_count`` (``fn`` returns sums),
      else ``m`` with ``scale_grads`` (the default: gradients of the mean over the
      batch), else 1 (sum losses); ``scale`` is the fp16 loss scale a
      ``PipelineGradScaler`` sets (``loss_scale``, 1 otherwise);
    - the step's loss (``sched.loss``) is ``sum(l) / items`` with ``loss_count``, else
      the mean of ``l`` (:meth:`step_loss`); neither ``scale_grads`` nor ``scale`` change it.

    Example:
        >>> rule = LossRule(torch.nn.functional.mse_loss, on_nonfinite="raise")
        >>> step = LossRule.for_step(rule.fn, n_microbatches=4, scale_grads=True, items=None, scale=1.0)
        >>> step.backward_root(torch.tensor(2.0)), step.step_loss([torch.tensor(1.0), torch.tensor(3.0)])
        (tensor(0.5000), tensor(2.))
    """

    fn: Callable
    on_nonfinite: str = "warn"  # what a NaN/inf loss does: "warn", "raise" or "ignore"
    divisor: float = 1.0  # each microbatch's loss is divided by this in backward (see above)
    scale: float = 1.0  # ... and multiplied by this (fp16 loss scaling)
    counted: bool = False  # ``divisor`` is the batch's item count (``loss_count``)

    @classmethod
    def for_step(cls, fn: Callable, *, n_microbatches: int, scale_grads: bool, items: float | None, scale: float,
                 on_nonfinite: str = "warn") -> LossRule:
        """The rule of one step: ``items`` is the batch's item count when the schedule has
        ``loss_count`` (shared by every rank before the first action), else None."""
        if items is not None:
            return cls(fn, on_nonfinite, float(items), scale, counted=True)
        return cls(fn, on_nonfinite, float(n_microbatches) if scale_grads else 1.0, scale)

    def backward_root(self, loss: torch.Tensor) -> torch.Tensor:
        """What the last stage's backward of one microbatch starts from."""
        return loss / (self.divisor / self.scale)

    def step_loss(self, mb_losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The step's loss from its microbatch losses (detached)."""
        total = torch.stack(list(mb_losses)).detach()
        return total.sum() / self.divisor if self.counted else total.mean()

    def loss(self, output: Any, target: Any, mixed_precision: torch.dtype | None, device_type: str,
             where: str) -> torch.Tensor:
        """``fn(output, target)`` for one microbatch, ``output`` in the model's structure: in fp32
        outside autocast, checked to be a scalar; a NaN/inf loss warns, raises or passes as
        ``on_nonfinite`` says."""
        if mixed_precision is not None:  # the loss in fp32, whatever autocast made of the outputs
            output = tree_map_only(torch.Tensor, lambda o: o.float() if o.dtype == mixed_precision else o, output)
        try:
            with torch.autocast(device_type, enabled=False):
                loss = self.fn(output, target)
        except Exception as e:
            raise PipelineError(f"{where}: loss_fn raised {type(e).__name__}: {e}") from e
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise PipelineError(f"{where}: loss_fn must return a scalar tensor, got {shape}")
        return loss.reshape(())  # checked to be finite with the step's losses (check_finite), not here: no host read

    def check_finite(self, mb_losses: Sequence[torch.Tensor | None], where: Callable[[int], str]) -> None:
        """Warn or raise (``on_nonfinite``) for a NaN/inf among a step's microbatch losses,
        naming the first such microbatch (``where(mb)``), with one host read for them all.

        Example:
            >>> rule = LossRule(torch.nn.functional.mse_loss, on_nonfinite="raise")
            >>> rule.check_finite([torch.tensor(1.0), torch.tensor(float("inf"))], lambda mb: f"microbatch {mb}")
            Traceback (most recent call last):
            ...
            pippy_split.stage.errors.PipelineError: microbatch 1: the loss is inf
        """
        known = [(mb, loss) for mb, loss in enumerate(mb_losses) if loss is not None]
        if self.on_nonfinite == "ignore" or not known:
            return
        values = torch.stack([loss.detach().float() for _, loss in known]).tolist()  # the one host read
        bad = [(mb, v) for (mb, _), v in zip(known, values) if v != v or v in (float("inf"), float("-inf"))]
        if not bad:
            return
        msg = f"{where(bad[0][0])}: the loss is {bad[0][1]}"
        if len(bad) > 1:
            msg += f" (and in {len(bad) - 1} more microbatch{'es' if len(bad) > 2 else ''})"
        if self.on_nonfinite == "raise":
            raise PipelineError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
