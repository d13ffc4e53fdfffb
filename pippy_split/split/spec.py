"""What crosses a cut: ``TensorSpec`` (shape, dtype, grad), ``Edge`` (sender → receiver)
and ``StageInput`` (where each positional input of a stage comes from).

Produced by the partitioner, read by the stage layer (buffer sizes, which values
get gradients), the runtime (what to receive, what to send: a stage's routes are
its outgoing ``Edge`` objects) and the schedule lowering (who talks to whom). The one
description of a stage's inputs, for a Pipe's stages and hand-built ones alike.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import sympy
import torch

__all__ = ["MODEL_INPUT", "TensorSpec", "Edge", "SymbolSource", "InputKind", "StageInput", "sender_of",
           "gather_inputs"]

# src_stage of an Edge whose value is a model input. The rank that holds stage 0
# (the one given the data) sends it straight to the stage that reads it.
MODEL_INPUT = -1

Dim = "int | sympy.Expr"


def sender_of(src_stage: int) -> int:
    """The stage whose rank sends a value produced by ``src_stage``: itself, or stage 0
    (the rank given the data) for a model input (``src_stage == MODEL_INPUT``).

    Example:
        >>> sender_of(MODEL_INPUT), sender_of(3)
        (0, 3)
    """
    return 0 if src_stage == MODEL_INPUT else src_stage


@dataclass(frozen=True)
class TensorSpec:
    """Static description of a tensor crossing a cut.

    ``shape`` holds ints, or sympy expressions of the dynamic dims' symbols
    (declared with ``dynamic_shapes`` at trace time).
    """

    shape: tuple
    dtype: torch.dtype
    requires_grad: bool
    dim_order: tuple[int, ...] | None = None
    """The order of its dims in memory, outermost first, where it is not row-major (a
    channels-last activation: ``(0, 2, 3, 1)``); None for row-major. A message keeps it, so a
    receiving stage's kernels see the strides they see in the unsplit model."""

    @property
    def is_complex(self) -> bool:
        return self.dtype.is_complex

    @property
    def is_dynamic(self) -> bool:
        return any(not isinstance(d, int) for d in self.shape)

    @property
    def carries_grad(self) -> bool:
        """Whether a gradient flows back along this value (float/complex and needs grad)."""
        return self.requires_grad and (self.dtype.is_floating_point or self.dtype.is_complex)

    def concrete_shape(self, bindings: Mapping[sympy.Symbol, int] | None = None) -> tuple[int, ...]:
        """The shape with every symbol replaced by its value for this step."""
        if not self.is_dynamic:
            return self.shape  # type: ignore[return-value]
        if not bindings:
            raise ValueError(f"shape {self.shape} is dynamic but no symbol values were given")
        from ..stage.arguments import concrete_shape  # local: stage/__init__ imports this module (a cycle at import)

        return concrete_shape(self.shape, bindings)

    def short(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        dtype = str(self.dtype).replace("torch.", "")
        grad = "" if self.carries_grad else ", no grad"
        return f"({dims}) {dtype}{grad}"


@dataclass(frozen=True)
class Edge:
    """A value produced by ``src_stage`` (output ``src_output``) read by ``dst_stage``
    (input ``dst_input``). A value read by several stages has one edge per reader,
    all from its true producer — never relayed through stages in between.

    For a model input, ``src_stage`` is :data:`MODEL_INPUT` and ``src_output`` is the
    input's index among the model's flattened inputs.

    Example:
        >>> e = Edge(1, 0, 2, 0, TensorSpec((8, 32), torch.float32, True), "add_4", "blocks.1")
        >>> e.display_name, str(e)
        ('blocks.1 (add_4)', '1.out[0] -> 2.in[0] blocks.1 (add_4) (8, 32) float32')
    """

    src_stage: int
    src_output: int
    dst_stage: int
    dst_input: int
    """Input position at ``dst_stage``; ``-1`` on a hand-built stage's route: the next free chain input."""
    spec: TensorSpec
    name: str = ""
    """The value's node name in the traced graph (``add_4``; a model input's own name), one per value."""
    label: str = ""
    """What the value is, in the model's terms: the module call it is the output of (``blocks.1``),
    else ``add_14 in blocks.1.attn`` for a value computed inside a module, else :attr:`name`.
    Empty on a hand-built stage's route."""

    @property
    def display_name(self) -> str:
        """``label (name)`` where they differ, else whichever there is: the value as tables show it."""
        if self.label and self.name and self.label != self.name and not self.label.startswith(f"{self.name} in "):
            return f"{self.label} ({self.name})"
        return self.label or self.name

    @property
    def from_input(self) -> bool:
        return self.src_stage == MODEL_INPUT

    @property
    def sender_stage(self) -> int:
        """The stage whose rank sends this value (stage 0 for model inputs)."""
        return sender_of(self.src_stage)

    @property
    def is_skip(self) -> bool:
        """True when the edge jumps over at least one stage."""
        return self.dst_stage - self.sender_stage > 1

    def __str__(self) -> str:
        src = f"input[{self.src_output}]" if self.from_input else f"{self.src_stage}.out[{self.src_output}]"
        return f"{src} -> {self.dst_stage}.in[{self.dst_input}] {self.display_name} {self.spec.short()}"


@dataclass(frozen=True)
class SymbolSource:
    """A dynamic-shape symbol and where its value is read: ``inputs[input_index].shape[dim]``;
    ``lower``/``upper`` are the range it was traced for (``Dim(min=, max=)``; ``upper``
    None: unbounded)."""

    symbol: sympy.Symbol
    input_index: int
    dim: int
    lower: int = 0
    upper: int | None = None


class InputKind(str, enum.Enum):
    """Where a stage input's value comes from (a ``str`` enum: ``InputKind.MODEL == "input"``)."""

    MODEL = "input"
    """A model input the stage reads itself (from ``step()``'s arguments)."""
    EDGE = "edge"
    """A value another stage sends along :attr:`StageInput.edge` (a model input forwarded
    by stage 0's rank included: its edge starts at :data:`MODEL_INPUT`)."""
    SYMBOL = "symbol"
    """A size computed from the step's dynamic-shape symbols (:attr:`StageInput.expr`)."""


@dataclass(frozen=True)
class StageInput:
    """Positional input ``index`` of a stage module and where its value comes from.

    The one description of a stage input: a Pipe's stages list them
    (``StageInfo.inputs``), a ``PipelineStage`` holds them as ``in_slots`` (their edges'
    specs as its precision gives them; a hand-built stage learns its own on the first
    step), and :class:`~pippy_split.stage.arguments.StageArgs` turns them into arguments, in
    one process (``pipe(x)``, through :func:`gather_inputs`) and in the runtime alike (one per
    stage, made once).

    Example:
        >>> e = Edge(MODEL_INPUT, 1, 2, 0, TensorSpec((4,), torch.float32, False), "y")
        >>> slot = StageInput(0, InputKind.EDGE, "y", edge=e)
        >>> slot.sender_stage, slot.key
        (0, (-1, 1))
    """

    index: int
    kind: InputKind
    name: str = ""
    """The graph value it carries (for messages); empty on hand-built stages."""
    edge: Edge | None = None
    """:attr:`InputKind.EDGE`: the edge that brings the value."""
    model_input: int = -1
    """:attr:`InputKind.MODEL`: the input's index among the model's flattened inputs."""
    expr: Any = None
    """:attr:`InputKind.SYMBOL`: a sympy expression of the symbols."""

    def __post_init__(self) -> None:
        if (self.kind is InputKind.EDGE) != (self.edge is not None):
            raise ValueError(f"stage input {self.index}: an edge input needs edge=, other kinds take none")

    @property
    def src_stage(self) -> int:
        """The producing stage (:data:`MODEL_INPUT` for a model input)."""
        return self.edge.src_stage if self.edge is not None else MODEL_INPUT

    @property
    def src_output(self) -> int:
        """The producer's output index, or the model input's flat index."""
        return self.edge.src_output if self.edge is not None else self.model_input

    @property
    def spec(self) -> TensorSpec | None:
        return self.edge.spec if self.edge is not None else None

    @property
    def sender_stage(self) -> int:
        """The stage whose rank sends this value (see :func:`sender_of`)."""
        return sender_of(self.src_stage)

    @property
    def key(self) -> tuple[int, int]:
        """``(src_stage, src_output)``: which produced value this is."""
        return (self.src_stage, self.src_output)


def gather_inputs(inputs: Sequence[StageInput], flat_inputs: Sequence[Any] | None,
                  produced: Mapping[tuple[int, int], Any], bindings: Mapping[sympy.Symbol, int],
                  on_missing: Callable[[StageInput], None] | None = None) -> list[Any]:
    """One stage's positional arguments: model inputs from ``flat_inputs``, edge values from
    ``produced`` (keyed by :attr:`StageInput.key`, a forwarded model input under
    ``(MODEL_INPUT, index)``), sizes from ``bindings``.

    ``on_missing(slot)`` raises the caller's error for an edge value not in ``produced``
    (default: a ``KeyError``).

    Example:
        >>> spec = TensorSpec((1,), torch.float32, True)
        >>> slots = [StageInput(0, InputKind.MODEL, model_input=1), StageInput(1, InputKind.EDGE, edge=Edge(0, 0, 1, 1, spec))]
        >>> gather_inputs(slots, ["x", "y"], {(0, 0): "h"}, {})
        ['y', 'h']
    """
    from ..stage.arguments import StageArgs  # local: stage/__init__ imports this module (a cycle at import)

    return StageArgs(inputs)(flat_inputs, produced, bindings, on_missing)
