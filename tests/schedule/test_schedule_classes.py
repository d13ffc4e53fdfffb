"""The schedule classes are written out: a reader (and ``inspect``) can open each one, each
states its family and placement as the registry does, and the class's placement style is
apart from an instance's ``{stage: rank}`` map. Pure tier (one process, no group)."""

from __future__ import annotations

import inspect

import pytest

import pippy_split as ps
from pippy_split import zoo
from pippy_split.schedule import PipelineSchedule, ScheduleFromOrder, ScheduleGPipe, get_schedule_class
from pippy_split.schedule.orders import ORDERS


def test_getsource_opens_every_schedule_class() -> None:
    assert inspect.getsource(ScheduleGPipe).startswith("class ScheduleGPipe(PipelineSchedule):")
    for name in ORDERS:
        cls = get_schedule_class(name)
        assert inspect.getsource(cls).startswith(f"class {cls.__name__}(PipelineSchedule):")
    assert "class ScheduleFromOrder(PipelineSchedule):" in inspect.getsource(ScheduleFromOrder)


@pytest.mark.parametrize("name", list(ORDERS))
def test_each_class_states_its_family_as_the_registry_does(name: str) -> None:
    spec, cls = ORDERS[name], get_schedule_class(name)
    assert cls.order_name == spec.name
    assert cls.placement_style == spec.placement
    assert cls.placement == spec.placement  # read on the class, `placement` is still the style
    doc = " ".join(cls.__doc__.split())
    assert f"Stages: {spec.stage_rule()}; {spec.placement} placement. From {spec.paper}." in doc
    assert get_schedule_class(f"Schedule{name}") is cls and get_schedule_class(name.upper()) is cls
    default = spec.default_stages_per_rank()
    assert cls.compute_order(2, 4) == spec.compute_order(2, 4, default)


def test_unknown_name_lists_the_registry() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'Fancy'; valid names: GPipe, 1F1B, .*DualPipeV"):
        get_schedule_class("Fancy")


@pytest.mark.parametrize("name, style, override", [("ZBVZeroBubble", "v", None), ("Interleaved1F1B", "loop", None),
                                                    ("Interleaved1F1B", "loop", "v")])
def test_instance_placement_is_its_stage_to_rank_map(name: str, style: str, override: str | None) -> None:
    entry = zoo.get("mlp_stack", d=16)
    pipe = ps.pipeline(entry.model, ["layers.4"], (entry.args[0][:2],))  # 2 stages, both on this one rank
    sched = ps.build_schedule(pipe, name, 4, loss_fn=entry.loss_fn, placement=override)
    assert isinstance(sched, PipelineSchedule)
    assert sched.placement == {0: 0, 1: 0}
    assert type(sched).placement == style and sched.placement_style == style
    assert sched.placement_name == (override or style)
