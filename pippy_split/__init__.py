"""pippy_split: pipeline parallelism for ordinary PyTorch models.

Public API (re-exports only); see DESIGN.md for the flow
split → Pipe → stage → schedule → runtime.
"""

from .split import (MODEL_INPUT, Edge, Pipe, SplitError, SplitPoint, SymbolSource, TensorSpec, TraceError,
                    pipe_split, pipeline)

__all__ = ["MODEL_INPUT", "Edge", "Pipe", "SplitError", "SplitPoint", "SymbolSource", "TensorSpec", "TraceError",
           "pipe_split", "pipeline"]
