"""The stage layer: PipelineStage, transports, the backward split, errors."""

from ..split.hand_over import provide
from ..split.spec import Edge, StageInput
from .errors import PipelineAborted, PipelineError, PipelineTimeout
from .options import StageOptions
from .stage import LossRule, PipelineStage

InputSlot = StageInput  # earlier names of a stage's input slot and outgoing edge, kept for importers
Route = Edge

__all__ = ["PipelineAborted", "PipelineError", "PipelineTimeout", "PipelineStage", "InputSlot", "Route", "LossRule", "StageOptions"]

provide("stage", PipelineStage.from_pipe)  # Pipe.build_stage calls it (split/ cannot import this layer)
