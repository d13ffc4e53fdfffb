"""Run the suite as two pytest processes side by side: ``python -m tests.streams [pytest args]``.

Both processes collect every test; they then take whole test files from one shared queue
(:class:`FileQueue`, a counter under a file lock), the longest files first, until none is left:
together they run every test once, a process that drew short files takes more of them, and a
module's shared fixtures (a rank group several tests read) stay in one process. On 2 cores this
keeps both busy: a single-process test uses one thread (``conftest.py``), and a 2-rank pipeline
waits on its peer part of the time. "Longest" is by :data:`FILE_SECONDS` (each file's seconds in a
whole run; a file not listed counts :data:`UNLISTED_SECONDS_PER_TEST` a test): a stale table only
changes the order, never what runs. The run ends with its slowest files.

Both processes get the same arguments. Each writes to a log, printed whole when both are done
(with a progress line a minute meanwhile); with ``-x`` the first failure stops the other
stream too. The exit status is pytest's: the first stream's failure, else 0 (5 only when
neither stream ran a test).

Example::

    python -m tests.streams -x -p no:cacheprovider tests           # the README's test command
    python -m tests.streams -p no:cacheprovider tests/schedule -k zero_bubble
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable

import pytest

STREAMS = 2
ENV = "PIPPY_SPLIT_TEST_STREAM"
"""The shared queue's path: this pytest process is one stream of :func:`main`'s run."""
FILE_SECONDS: dict[str, float] = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
"""Seconds each test file took in a whole run of the suite (``python -m tests.streams --record ...``
writes it)."""
UNLISTED_SECONDS_PER_TEST = 2.0
_PERCENT = re.compile(r"\[ *(\d+)%\]")
_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?|warnings?)")


class FileQueue:
    """A counter in a file that processes share: :meth:`take` hands each index out once.

    Example:
        >>> import tempfile, os
        >>> q = FileQueue(os.path.join(tempfile.mkdtemp(), "queue"))
        >>> [q.take(), q.take(), FileQueue(q.path).take()]
        [0, 1, 2]
    """

    def __init__(self, path: str):
        self.path = path

    def take(self) -> int:
        with open(self.path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            f.seek(0)
            n = int(f.read() or 0)
            f.seek(0)
            f.truncate()
            f.write(str(n + 1))
            return n


def by_file_longest_first(items: list[pytest.Item]) -> list[list[pytest.Item]]:
    """The items grouped by test file (in collection order within a file), longest file first."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def seconds(f: str) -> float:
        return FILE_SECONDS.get(f, UNLISTED_SECONDS_PER_TEST * len(files[f]))

    return [files[f] for f in sorted(files, key=lambda f: (-seconds(f), f))]


def run_taken_files(session: pytest.Session, queue: FileQueue) -> bool:
    """pytest's run loop, over the files this process takes from ``queue``: the next file is
    taken before the last test of the current one runs, so that test's ``nextitem`` (which
    decides what fixtures it tears down) is what really runs next here."""
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} error(s) during collection")
    if session.config.option.collectonly:
        return True
    files = by_file_longest_first(session.items)

    def take() -> list[pytest.Item]:
        i = queue.take()
        return files[i] if i < len(files) else []

    current = take()
    while current:
        following: list[pytest.Item] = []
        for j, item in enumerate(current):
            if j + 1 < len(current):
                nextitem: pytest.Item | None = current[j + 1]
            else:
                following = take()
                nextitem = following[0] if following else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        current = following
    return True


def pytest_runtestloop(session: pytest.Session) -> bool | None:
    """This module is a pytest plugin in the streams (``-p tests.streams``): their run loop."""
    queue = os.environ.get(ENV)
    return run_taken_files(session, FileQueue(queue)) if queue else None


_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get(ENV):
        f = report.nodeid.split("::")[0]
        _seconds[f] = _seconds.get(f, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if queue := os.environ.get(ENV):
        Path(f"{queue}.seconds.{os.getpid()}.json").write_text(json.dumps(_seconds))


def _merged_seconds(tmp: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for f in Path(tmp).glob("queue.seconds.*.json"):
        for name, s in json.loads(f.read_text()).items():
            out[name] = round(out.get(name, 0.0) + s, 1)
    return dict(sorted(out.items()))


def _progress(logs: list[Path]) -> str:
    """How far the streams are: each stream's progress counts against every collected test, so
    the percentages add up."""
    done = sum(int(m[-1]) for log in logs if (m := _PERCENT.findall(log.read_text(errors="replace"))))
    return f"{done}% of the tests done"


def _run(args: list[str], record: bool = False) -> int:
    exit_first = any(a in ("-x", "--exitfirst") for a in args)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pippy_split_streams_") as tmp:
        logs = [Path(tmp) / f"stream{k}.log" for k in range(STREAMS)]
        procs = []
        for log in logs:
            env = {**os.environ, ENV: str(Path(tmp) / "queue")}
            with open(log, "w") as out:
                procs.append(subprocess.Popen([sys.executable, "-m", "pytest", "-p", "tests.streams", *args], env=env,
                                              stdout=out, stderr=subprocess.STDOUT))
        codes: list[int | None] = [None] * STREAMS
        ended = [0.0] * STREAMS
        last_note = time.monotonic()
        try:
            while any(c is None for c in codes):
                time.sleep(1)
                for k, p in enumerate(procs):
                    if codes[k] is None and (c := p.poll()) is not None:
                        codes[k], ended[k] = c, time.monotonic() - start
                        if exit_first and c not in (0, 5):
                            for q in procs:
                                if q.poll() is None:
                                    q.send_signal(signal.SIGINT)  # pytest prints its summary and stops
                if time.monotonic() - last_note > 60:
                    last_note = time.monotonic()
                    print(f"streams, {last_note - start:.0f} s: {_progress(logs)}", flush=True)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        texts = [log.read_text(errors="replace") for log in logs]
        seconds = _merged_seconds(tmp)
        for k in range(STREAMS):
            print(f"\n======== stream {k} of {STREAMS} (pytest exit {codes[k]}, {ended[k]:.0f} s) ========", flush=True)
            sys.stdout.write(texts[k])
    if seconds:
        slowest = sorted(seconds, key=lambda f: -seconds[f])[:12]
        print("\nstreams: the slowest test files (seconds, setup and teardown included): "
              + ", ".join(f"{f} {seconds[f]:.0f}" for f in slowest), flush=True)
    if record and seconds:
        (Path(__file__).parent / "file_seconds.json").write_text(json.dumps(seconds, indent=1) + "\n")
        print(f"streams: {len(seconds)} files' seconds written to tests/file_seconds.json", flush=True)
    totals: dict[str, int] = {}
    for text in texts:
        for n, what in _SUMMARY.findall(text.splitlines()[-1] if text.strip() else ""):
            totals[what] = totals.get(what, 0) + int(n)
    print(f"\nstreams: {', '.join(f'{n} {w}' for w, n in totals.items()) or 'no test ran'} in {time.monotonic() - start:.0f} s "
          f"of wall time (pytest exits {codes})", flush=True)
    failed = [c for c in codes if c not in (0, 5)]
    if failed:
        return int(failed[0])  # type: ignore[arg-type]
    return 5 if all(c == 5 for c in codes) else 0


def main(argv: Iterable[str]) -> int:
    """``python -m tests.streams [--record] [pytest args]``; ``--record`` writes each file's seconds
    in this run to ``tests/file_seconds.json`` (the order the next runs take files in)."""
    args = list(argv)
    record = args[:1] == ["--record"]
    return _run(args[1:] if record else args, record)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
