"""Schedules: the action IR, placement, order generators, lowering, checks, runtime."""

from .actions import Action, ActionKind, order_from_csv, order_to_csv, parse_action
from .lower import lower
from .placement import rank_to_stages, stage_to_rank
from .schedules import (
    ActionTiming,
    PipelineSchedule,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleFromOrder,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    build_schedule,
    get_schedule_class,
)
from .simulate import Simulation, simulate
from .validate import ScheduleError, validate

__all__ = ["Action", "ActionKind", "order_from_csv", "order_to_csv", "parse_action", "lower", "rank_to_stages",
           "stage_to_rank", "PipelineSchedule", "Schedule1F1B", "ScheduleDualPipeV", "ScheduleGPipe",
           "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble", "ScheduleFromOrder",
           "ActionTiming", "build_schedule", "get_schedule_class", "Simulation", "simulate", "ScheduleError", "validate"]
