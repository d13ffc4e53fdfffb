"""A schedule object, a plan and a candidate describe themselves: one line for ``repr``,
an HTML table (and a timeline SVG) for a notebook."""

from __future__ import annotations

import pytest

import pippy_split as ps
from pippy_split import zoo
from pippy_split.schedule.render import html_table


@pytest.fixture(scope="module")
def pipe_and_entry():
    entry = zoo.get("mlp_stack", d=16)
    return ps.pipeline(entry.model, ["layers.4"], (entry.args[0][:2],)), entry  # 2 stages


@pytest.mark.parametrize("name, placement", [("Interleaved1F1B", "loop"), ("ZBVZeroBubble", "v")])
def test_repr_is_one_line_with_stages_ranks_microbatches_placement(pipe_and_entry, name, placement) -> None:
    pipe, entry = pipe_and_entry
    sched = ps.build_schedule(pipe, name, n_microbatches=4, loss_fn=entry.loss_fn)
    text = repr(sched)
    assert "\n" not in text
    assert text == (f"Schedule{name}(stages [0, 1] on rank 0 of 1, n_microbatches=4, "
                    f"placement={placement!r})")


def test_repr_html_is_a_table_and_the_order_timeline(pipe_and_entry) -> None:
    pipe, entry = pipe_and_entry
    sched = ps.build_schedule(pipe, "ZBVZeroBubble", n_microbatches=4, loss_fn=entry.loss_fn)
    page = sched._repr_html_()
    assert page.startswith('<div class="pippy-split-schedule"><table>')
    for text in ("ScheduleZBVZeroBubble", "holds stages [0, 1] of 2", "v: stage 0 -&gt; rank 0", "<svg", "0F3"):
        assert text in page, text


def test_hand_written_order_says_so(pipe_and_entry) -> None:
    pipe, entry = pipe_and_entry
    stages = [pipe.build_stage(i) for i in range(pipe.num_stages)]
    order = "0F0,0F1,1F0,1B0,1F1,1B1,0B0,0B1\n"
    sched = ps.ScheduleFromOrder(stages, 2, entry.loss_fn, order=order)
    assert repr(sched).endswith("placement='from order')")
    assert "from order: stage 0 -&gt; rank 0, stage 1 -&gt; rank 0" in sched._repr_html_()


def test_html_table_escapes_cells() -> None:
    page = html_table([("a<b", "x&y")], ("h",), [("<i>",)], caption="c>d")
    assert "<i>" not in page and "&lt;i&gt;" in page and "a&lt;b" in page and "x&amp;y" in page
    assert "<caption" in page and "c&gt;d" in page


def test_plan_and_candidate_render_tables_and_timelines() -> None:
    entry = zoo.get("mlp_stack", d=16)
    plan = ps.plan(entry.model, (entry.args[0][:2],), num_ranks=2, memory_budget="1GB", loss_fn=entry.loss_fn,
                   global_batch=8, microbatches=(2, 4), schedules=["GPipe", "1F1B"])
    page = plan._repr_html_()
    assert page.startswith('<div class="pippy-split-plan">') and "<table>" in page and "<svg" in page
    assert "<th" in page and "step time" in page and plan.best.schedule in page
    assert page.count("<tr>") == 1 + min(10, len(plan.fitting))  # header + one row per shown candidate
    one = plan.best._repr_html_()
    assert "<table>" in one and "<svg" in one and plan.best.step_label() in one
