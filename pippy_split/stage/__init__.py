"""The stage layer: PipelineStage, transports, the backward split, errors."""

from .errors import PipelineError, PipelineTimeout
from .options import StageOptions
from .stage import InputSlot, LossRule, PipelineStage, Route

__all__ = ["PipelineError", "PipelineTimeout", "PipelineStage", "InputSlot", "Route", "LossRule", "StageOptions"]
