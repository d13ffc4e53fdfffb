"""What crosses a cut: ``TensorSpec`` (shape, dtype, grad) and ``Edge`` (sender → receiver).

Produced by the partitioner, read by the stage layer (buffer sizes, which values
get gradients) and the schedule lowering (who talks to whom).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import sympy
import torch

__all__ = ["MODEL_INPUT", "TensorSpec", "Edge", "SymbolSource"]

# src_stage of an Edge whose value is a model input. The rank that holds stage 0
# (the one given the data) sends it straight to the stage that reads it.
MODEL_INPUT = -1

Dim = "int | sympy.Expr"


@dataclass(frozen=True)
class TensorSpec:
    """Static description of a tensor crossing a cut.

    ``shape`` holds ints, or sympy expressions of the dynamic dims' symbols
    (declared with ``dynamic_shapes`` at trace time).
    """

    shape: tuple
    dtype: torch.dtype
    requires_grad: bool

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
        return tuple(d if isinstance(d, int) else int(d.xreplace(bindings)) for d in self.shape)

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
    """

    src_stage: int
    src_output: int
    dst_stage: int
    dst_input: int
    spec: TensorSpec
    name: str = ""

    @property
    def from_input(self) -> bool:
        return self.src_stage == MODEL_INPUT

    @property
    def sender_stage(self) -> int:
        """The stage whose rank sends this value (stage 0 for model inputs)."""
        return 0 if self.from_input else self.src_stage

    @property
    def is_skip(self) -> bool:
        """True when the edge jumps over at least one stage."""
        return self.dst_stage - self.sender_stage > 1

    def __str__(self) -> str:
        src = f"input[{self.src_output}]" if self.from_input else f"{self.src_stage}.out[{self.src_output}]"
        return f"{src} -> {self.dst_stage}.in[{self.dst_input}] {self.name} {self.spec.short()}"


@dataclass(frozen=True)
class SymbolSource:
    """A dynamic-shape symbol and where its value is read: ``inputs[input_index].shape[dim]``."""

    symbol: sympy.Symbol
    input_index: int
    dim: int
