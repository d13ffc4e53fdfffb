"""`python -m benchmarks.compare --readme` writes its table, commit and date between docs/performance.md's markers."""

from __future__ import annotations

import pytest

from benchmarks.compare import BEGIN, END, PERFORMANCE_DOC, REPO, write_readme_table


def test_readme_has_the_markers():
    text = PERFORMANCE_DOC.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and text.index(BEGIN) < text.index(END)


def test_table_written_between_markers_with_commit_and_date(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold table\n{END}\noutro\n")
    meta = {"torch": "2.13.0", "cpus": 2, "load_avg_before": (0.5,), "load_avg_after": (0.7,),
            "command": "python -m benchmarks.compare"}
    write_readme_table(readme, "| a | b |\n|---|---|\n| 1 | 2 |\n", meta)
    text = readme.read_text()
    assert "old table" not in text and "| 1 | 2 |" in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert "Measured at commit `" in text and "torch 2.13.0" in text and "--readme" in text
    with pytest.raises(SystemExit, match="markers"):
        (tmp_path / "bare.md").write_text("no markers")
        write_readme_table(tmp_path / "bare.md", "x", meta)


def test_the_stamp_names_the_tree_the_run_measured_not_the_results_it_wrote(tmp_path):
    from benchmarks.common import git_state

    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n")
    meta = {"commit": "abc1234", "dirty": False, "torch": "2.13.0", "cpus": 2, "load_avg_before": (0.5,),
            "load_avg_after": (0.7,), "command": "python -m benchmarks.compare"}
    write_readme_table(readme, "| a |\n|---|\n", meta)  # the run's own results files are dirty by now
    assert "Measured at commit `abc1234` on" in readme.read_text()
    commit, dirty = git_state(REPO)
    assert commit != "unknown" and isinstance(dirty, bool)
