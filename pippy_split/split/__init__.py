"""Tracing and splitting: markers, trace, partition, Pipe."""

from .errors import SplitError, TraceError
from .markers import SplitPoint, pipe_split
from .pipe import Pipe, pipeline
from .spec import MODEL_INPUT, Edge, SymbolSource, TensorSpec

__all__ = ["SplitError", "TraceError", "SplitPoint", "pipe_split", "Pipe", "pipeline", "MODEL_INPUT", "Edge",
           "SymbolSource", "TensorSpec"]
