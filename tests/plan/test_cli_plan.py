"""`pippy-split plan MODEL --ranks N --memory SIZE`: a table of candidates and an SVG."""

from __future__ import annotations

import pytest

from pippy_split.cli import main


def test_plan_prints_table_and_writes_svg(tmp_path, capsys) -> None:
    svg = tmp_path / "best.svg"
    rc = main(["plan", "zoo:mlp_stack", "--ranks", "2", "--memory", "1GB", "--schedules", "1F1B,GPipe,ZBVZeroBubble",
               "--top", "5", "--svg", str(svg)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for word in ("schedule", "split", "m", "AC", "step time", "peak memory", "bubble", "best:"):
        assert word in out
    assert svg.read_text().startswith("<svg")


def test_plan_without_measuring_uses_the_op_sums(tmp_path, capsys) -> None:
    args = ["plan", "zoo:mlp_stack", "--ranks", "2", "--memory", "1GB", "--schedules", "1F1B", "--svg", ""]
    assert main(args) == 0
    measured = capsys.readouterr().out
    assert main(args + ["--no-measure"]) == 0
    op_sums = capsys.readouterr().out
    assert "each split's stages run and timed" in " ".join(measured.split())  # rich wraps the caption
    assert "sums of the profiled ops" in " ".join(op_sums.split())


def test_plan_too_small_budget_says_what_to_change(tmp_path, capsys) -> None:
    rc = main(["plan", "zoo:mlp_stack", "--ranks", "2", "--memory", "10KB", "--schedules", "1F1B",
               "--svg", str(tmp_path / "x.svg")])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps the message
    assert rc == 2
    assert "smallest predicted peak" in out and "Raise memory_budget" in out


@pytest.mark.parametrize("memory", ["lots"])
def test_plan_bad_memory_named(memory, capsys) -> None:
    assert main(["plan", "zoo:mlp_stack", "--ranks", "2", "--memory", memory, "--svg", ""]) == 2
    assert "cannot read memory size 'lots'" in capsys.readouterr().out
