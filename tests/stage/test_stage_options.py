"""The stage options travel as one checked value (StageOptions) from build_schedule to every stage."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pippy_split as ps
from pippy_split.stage import StageOptions
from pippy_split.zoo import get


def _pipe():
    entry = get("tiny_gpt")
    return ps.pipeline(entry.model, 4, entry.args)


def test_build_schedule_hands_every_stage_one_checked_options_value():
    sched = ps.build_schedule(_pipe(), "LoopedBFS", 2, loss_fn=get("tiny_gpt").loss_fn,
                              activation_checkpoint=["blocks.*"])
    first, *rest = (st.options for st in sched.stages)
    assert all(o is first for o in rest)
    assert first == StageOptions(activation_checkpoint=("blocks.*",))
    assert sched.stages[2].activation_checkpoint == ("blocks.*",) and sched.stages[2].mixed_precision is None


def test_options_are_frozen_and_checked_where_they_are_given():
    options = StageOptions.of(mixed_precision=torch.bfloat16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.compile = True  # type: ignore[misc]
    with pytest.raises(ValueError, match="build_schedule: mixed_precision=torch.float64 is not an autocast dtype"):
        ps.build_schedule(_pipe(), "LoopedBFS", 2, mixed_precision=torch.float64)
    with pytest.raises(ValueError, match="stage 1: pass options= or activation_checkpoint=/mixed_precision=/compile="):
        _pipe().build_stage(1, "cpu", options=options, activation_checkpoint="full")
    stage = _pipe().build_stage(1, "cpu", options=options)
    assert stage.options is options and stage.mixed_precision is torch.bfloat16
