"""The runner of the peer's own public-API tests through compat (``tests/peer/peer_suite.py``).

Pure tests check how the peer's imports are switched, how outcomes are read and excused.
``test_the_peers_2_15_public_api_tests_pass_through_compat`` runs the peer's files themselves,
which this repository does not keep: it runs when ``PIPPY_PEER_TESTS`` names a folder holding
them (a PyTorch checkout's ``test/distributed/pipelining``) and ``expecttest`` is installed.

Run: PIPPY_PEER_TESTS=~/pytorch/test/distributed/pipelining python -m pytest tests/peer/test_peer_suite.py
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.peer import peer_suite

# Our own stand-in for a file of the peer's tests: public names, a private one, and names the
# installed torch lacks (a newer release's module, a newer harness helper).
SOURCE = textwrap.dedent("""\
    import torch
    import torch.distributed.pipelining_newer_module as newer
    from torch.distributed.pipelining import (
        pipeline,
        SplitPoint as SP,
    )
    from torch.distributed.pipelining.schedules import _PipelineSchedule, _Action, get_schedule_class
    from torch.distributed.pipelining._newer_private import NewerHelper
    from torch.testing._internal.common_utils import NewerClassification


    class Sub(NewerHelper):
        kind = NewerClassification.GENERIC
""")


def test_public_names_come_from_compat_private_ones_from_the_peer():
    out = peer_suite.switch_imports(SOURCE)
    assert "from pippy_split.compat import pipeline\n" in out
    assert "from pippy_split.compat import SplitPoint as SP\n" in out
    assert "from pippy_split.compat.schedules import get_schedule_class\n" in out
    assert "from pippy_split.compat.schedules import _PipelineSchedule\n" in out  # compat mirrors this private base
    assert "from torch.distributed.pipelining.schedules import _Action\n" in out  # compat has none: the peer's
    assert "NewerHelper = _Missing('torch.distributed.pipelining._newer_private.NewerHelper')" in out
    assert "newer = _Missing('torch.distributed.pipelining_newer_module')" in out
    assert "class Sub(NewerHelper):" in out  # the rest of the file is as it was


def test_without_compat_only_the_missing_names_change():
    out = peer_suite.switch_imports(SOURCE, compat=False)
    assert "pippy_split" not in out
    assert "from torch.distributed.pipelining import pipeline\n" in out
    assert "NewerClassification = _Missing(" in out


def test_switched_file_imports_and_fails_only_where_a_missing_name_is_used(tmp_path):
    (tmp_path / "peer_file.py").write_text(SOURCE)
    out = tmp_path / "out"
    out.mkdir()
    assert peer_suite.prepare(tmp_path, out, ["peer_file.py", "not_there.py"]) == ["peer_file.py"]
    code = ("import peer_file as m, pippy_split.compat as c\n"
            "assert m.pipeline is c.pipeline and m.Sub.__mro__[1] is object\n"
            "assert not hasattr(m.NewerClassification, 'parametrize_fn')\n"
            "try:\n    m.NewerHelper()\nexcept ImportError as e:\n    print(e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(peer_suite.REPO), str(out)]))
    done = subprocess.run([sys.executable, "-c", code], cwd=out, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "_newer_private.NewerHelper is not in the installed torch" in done.stdout


def test_outcomes_are_read_and_excused_by_test_prefix(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(textwrap.dedent("""\
        <testsuites><testsuite>
          <testcase classname="test_a.T" name="test_one_x_0"/>
          <testcase classname="test_a.T" name="test_one_x_1"><failure message="AssertionError: no&#10;more"/></testcase>
          <testcase classname="test_a.T" name="test_two"><error message="TypeError: bad"/></testcase>
          <testcase classname="test_a.T" name="test_three"><skipped/></testcase>
          <testcase classname="test_a.T" name="test_not_selected"><failure message="x"/></testcase>
        </testsuite></testsuites>"""))
    outcome = peer_suite._read_report(report, ["T::test_one", "T::test_two", "T::test_three"])
    assert outcome.results == {"test_a.py::T::test_one_x_0": "passed", "test_a.py::T::test_one_x_1": "failed",
                               "test_a.py::T::test_two": "failed", "test_a.py::T::test_three": "skipped"}
    assert outcome.messages["test_a.py::T::test_one_x_1"] == "AssertionError: no"
    summary = outcome.summary({"T::test_one": "a reason", "T::test_one_x_1": "a closer reason"})
    assert summary["excused"] == ["test_a.py::T::test_one_x_1"]
    assert summary["unexcused"] == ["test_a.py::T::test_two"]
    assert summary["excused_but_passed"] == ["test_a.py::T::test_one_x_0"]
    assert peer_suite.excuse_for("test_a.py::T::test_one_x_1", {"T::test_one": "a", "T::test_one_x_1": "b"}) == "b"


def test_every_excuse_is_one_line_about_a_selected_test():
    data = peer_suite.load()
    for key, reason in data["excused"].items():
        assert any(key.startswith(t) for t in data["tests"]), key
        assert reason.strip() and "\n" not in reason, key
    assert len(set(data["tests"])) == len(data["tests"])


@pytest.mark.timeout(1200)
def test_the_peers_2_15_public_api_tests_pass_through_compat():
    folder = os.environ.get(peer_suite.ENV)
    if not folder:
        pytest.skip(f"the peer's test files are PyTorch's and not kept here; set {peer_suite.ENV} to a PyTorch "
                    "checkout's test/distributed/pipelining to run them")
    if importlib.util.find_spec("expecttest") is None:
        pytest.skip("the peer's tests need expecttest (PyTorch's test harness): pip install expecttest")
    data = peer_suite.load()
    outcome = peer_suite.run(Path(folder), data)
    summary = outcome.summary(data["excused"])
    ran = {t.split("::", 1)[1] for t in outcome.results}
    assert [t for t in data["tests"] if not any(r.startswith(t) for r in ran)] == []  # each selected test ran
    assert {t: outcome.messages[t] for t in summary["unexcused"]} == {}
    assert summary["excused_but_passed"] == []  # an excuse whose test passes now is stale: remove it
