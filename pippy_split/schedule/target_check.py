"""The target checked against the output before a step's first message.

Part of the schedule layer, run by ``PipelineSchedule`` on the rank holding the last
stage among the checks it makes alone (before :func:`.agree.agree_before_step`). A
target that does not fit the last stage's output (12 rows for 16 inputs, another
sequence length) would make ``loss_fn`` raise in the middle of the step, after
messages flowed, which stops the pipeline for good (:class:`.agree.FailureChannel`).
Here ``loss_fn`` runs once on fake tensors of the output's traced shape (its dynamic
dims read off this rank's inputs) and the target's shape: no data, no host sync, no
message, and each distinct pair of shapes is checked once per schedule. A failure is a
:class:`PipelineError` on every rank before any message, and the next step works.

Where the shapes do not allow it, nothing is checked: hand-built stages, outputs that
are not tensors, dynamic dims where this rank does not hold stage 0 (the step's sizes
are those of stage 0's inputs, agreed on only after this check), and
a ``loss_fn`` that fake tensors cannot run (it reads values: ``.item()``, ``.numpy()``,
a mask's nonzero count) — those fail, if at all, in the step itself.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._pytree import tree_flatten, tree_map_only

from ..stage.arguments import concrete_shape
from ..stage.errors import PipelineError

if TYPE_CHECKING:
    from ..split.spec import TensorSpec
    from ..stage.pipe_view import PipeView

__all__ = ["TargetCheck"]

# What fake tensors cannot do, as opposed to shapes that do not fit.
_FAKE_LIMITS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException,
                UnsupportedOperatorException, GuardOnDataDependentSymNode, NotImplementedError)
_FAKE_WORDS = ("fake", "subclass", "data pointer", "meta", "storage", "symbolic", "symint")
_REMEMBERED = 64  # distinct shape pairs kept per schedule


class TargetCheck:
    """``loss_fn(output, target)`` on the shapes alone, once per distinct pair of shapes.

    Args:
        loss_fn: the schedule's loss function.
        pipe: the traced pipe (its last stage's output specs and the model's output structure).
        last_stage: the last stage's index; device: where it runs.

    Example:
        >>> import pippy_split as ps
        >>> pipe = ps.pipeline(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), ["1"],
        ...                    (torch.randn(2, 4),))
        >>> check = TargetCheck(torch.nn.functional.mse_loss, pipe, 1, torch.device("cpu"))
        >>> check([torch.zeros(2, 2)], None)  # fits: nothing happens
        >>> check([torch.zeros(3, 2)], None)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        PipelineError: stage 1 (the last), microbatch 0: the target does not fit the output ...
    """

    def __init__(self, loss_fn: Callable, pipe: PipeView, last_stage: int, device: torch.device) -> None:
        self.loss_fn, self.last_stage, self.device = loss_fn, last_stage, device
        self.outputs = pipe.model_outputs
        self.specs: list[TensorSpec | None] = list(pipe.stages[last_stage].output_specs)
        self.symbols = list(pipe.symbols)
        known = all(s is not None and not s.is_dynamic for s in self.specs)
        self._static = tuple(s.shape for s in self.specs if s is not None) if known else None  # type: ignore[misc]
        self._seen: dict[tuple, str | None] = {}

    def __call__(self, targets: list[Any], flat_inputs: list[list[Any]] | None) -> None:
        """Refuse the first microbatch whose target does not fit; ``flat_inputs`` are the flat model
        inputs of stage 0's microbatches where this rank holds it (dynamic dims are read off their
        shapes), else None (only a pipe without dynamic dims is checked then)."""
        if any(s is None for s in self.specs) or (self._static is None and flat_inputs is None):
            return
        passed = None  # the last key that passed: microbatches of one step mostly share their shapes
        for mb, target in enumerate(targets):
            shapes = self._static
            if shapes is None:
                bindings = {s.symbol: int(flat_inputs[mb][s.input_index].shape[s.dim])  # type: ignore[index]
                            for s in self.symbols}
                shapes = tuple(concrete_shape(spec.shape, bindings) for spec in self.specs)  # type: ignore[union-attr]
            key = (shapes, _signature(target))
            if key == passed:
                continue
            if key not in self._seen:
                if len(self._seen) >= _REMEMBERED:
                    self._seen.clear()
                self._seen[key] = self._fails(shapes, target)
            failure = self._seen[key]
            if failure is None:
                passed = key
                continue
            got = [tuple(x.shape) for x in tree_flatten(target)[0] if isinstance(x, torch.Tensor)]
            raise PipelineError(
                f"stage {self.last_stage} (the last), microbatch {mb}: the target does not fit the output: "
                f"loss_fn on an output of shape {', '.join(str(s) for s in shapes)} and a target of shape "
                f"{', '.join(str(g) for g in got) or '(no tensor)'} fails ({failure}), checked on the shapes "
                "before any message; give step() a target that matches its inputs")

    def _fails(self, shapes: tuple[tuple[int, ...], ...], target: Any) -> str | None:
        """Why ``loss_fn`` refuses these shapes, or None (it runs, or fake tensors cannot tell)."""
        specs = [s for s in self.specs if s is not None]
        try:
            with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), \
                    torch.autocast(self.device.type, enabled=False), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outs = [torch.empty(shape, dtype=spec.dtype, device=self.device) for shape, spec in zip(shapes, specs)]
                fake_target = tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype,
                                                                                 device=self.device), target)
                self.loss_fn(self.outputs(outs), fake_target)
        except _FAKE_LIMITS:
            return None
        except (RuntimeError, ValueError, IndexError) as e:
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            if any(w in text.lower() for w in _FAKE_WORDS):
                return None
            return f"{type(e).__name__}: {text}"
        except Exception:  # anything else is not about shapes: the step will tell
            return None
        return None


def _signature(target: Any) -> Any:
    """What of a target the check depends on: its tensors' shapes and dtypes (a plain tensor fast)."""
    if isinstance(target, torch.Tensor):
        return target.shape, target.dtype
    return tuple((x.shape, x.dtype) if isinstance(x, torch.Tensor) else type(x) for x in tree_flatten(target)[0])
