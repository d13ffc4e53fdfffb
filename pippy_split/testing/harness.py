"""The parent side of the multi-rank test harness: start the ranks, collect their
results, name every failure, kill what hangs.

Part of :mod:`pippy_split.testing` (import :func:`run_ranks` from there; its docstring
says how ranks start and meet); what runs inside a rank is in ``rank``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

from .rank import RankSpec, rank_main, stack_path

__all__ = ["RankFailure", "RankTimeout", "run_ranks", "free_port"]

# After the first rank fails, how long the others get to report their own
# failures before they are killed (they are usually stuck in a collective
# waiting for the failed rank, so waiting longer only slows the test down).
_FAILURE_GRACE_S = 1.0
# How long a rank gets to dump its Python stacks before it is killed.
_STACK_DUMP_WAIT_S = 0.5
# terminate() -> kill() escalation delay.
_TERMINATE_WAIT_S = 1.0
# What the forkserver imports once, so that forked ranks start with it loaded instead of each
# importing it again: torch, and what tracing and running a pipe import on first use
# (torch.export's tracer pulls in dynamo and AOT autograd: about 2 s a rank, far more when the
# ranks import side by side on a loaded machine). None of these starts a thread.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.export._trace", "pippy_split.testing",
                       "pippy_split.split", "pippy_split.stage", "pippy_split.schedule", "pippy_split.generate"]


class RankFailure(RuntimeError):
    """One or more ranks raised (or died); the message holds every traceback.

    Attributes:
        failures: ``{rank: formatted traceback or exit description}``, in the
            order the ranks failed: the first is usually the root cause, the
            others often just lost their peer.
        killed: ranks that were still running and were killed by the harness.
    """

    def __init__(self, message: str, failures: Mapping[int, str], killed: list[int]):
        super().__init__(message)
        self.failures = dict(failures)
        self.killed = list(killed)


class RankTimeout(RankFailure):
    """Ranks were still running when the timeout expired and were killed.

    Attributes:
        hung: the ranks that did not finish in time.
        stacks: ``{rank: Python stacks dumped just before the kill}`` where available.
    """

    def __init__(
        self,
        message: str,
        failures: Mapping[int, str],
        killed: list[int],
        stacks: Mapping[int, str],
    ):
        super().__init__(message, failures, killed)
        self.hung = list(killed)
        self.stacks = dict(stacks)


def free_port() -> int:
    """Return a TCP port on localhost that was free a moment ago.

    Another process may take it before you bind it; ``run_ranks`` itself does not
    need a port (it rendezvouses through a file), this is for tests that do.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, backend: str = "gloo",
              threads_per_rank: int = 1, env: Mapping[str, str] | None = None,
              start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    Each rank is a fresh process with ``torch.set_num_threads(threads_per_rank)``,
    the caller's environment (plus ``env``), its stdout/stderr, and a default
    process group already initialised (and destroyed afterwards). ``fn`` starts
    once every rank has joined the group, and a rank that returns waits for the
    others before it leaves, so a fast rank never cuts a slow one's connections.
    The forkserver, once started, lives as long as the calling process.

    Args:
        fn: a picklable top-level function ``fn(rank, world_size, *args)``.
        world_size: number of ranks (>= 1).
        *args: extra arguments for ``fn``; must be picklable (tensors are fine).
        timeout: seconds for the whole run, start-up included; also the group's timeout.
        backend: ``torch.distributed`` backend.
        threads_per_rank: intra-op threads per rank (keeps N ranks off each other's cores).
        env: extra environment variables, set in each rank before the group
            starts (after torch is imported: variables torch reads at import
            time, such as OMP_NUM_THREADS, do not take effect).
        start_method: "forkserver" (default where available) or "spawn".

    Returns:
        The return values of ``fn`` in rank order. Tensors inside tuples, lists
        and dicts are detached so that they can be pickled back.

    Raises:
        RankFailure: a rank raised or died; the message has every failing rank's
            traceback (rank number first) and lists the ranks that were killed.
        RankTimeout: ranks were still running after ``timeout`` seconds; they
            are killed and named, with the Python stacks they were stuck in.

    Example (``_rank_times_ten(rank, world_size): return rank * 10`` at module top level)::

        assert run_ranks(_rank_times_ten, 2) == [0, 10]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context(start_method)
    child_env = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="pippy_split_ranks_") as tmp:
        procs: list[mp.process.BaseProcess] = []
        conns: list[Connection] = []
        try:
            for rank in range(world_size):
                spec = RankSpec(rank, world_size, tmp, backend, threads_per_rank, child_env, timeout)
                _start_rank(ctx, spec, fn, args, procs, conns)
            return _collect(procs, conns, tmp, time.monotonic() + timeout, timeout)
        finally:
            # Also reached on KeyboardInterrupt or an error inside the harness.
            _kill(procs)
            for c in conns:
                c.close()


# --------------------------------------------------------------------------- #
# Parent side
# --------------------------------------------------------------------------- #


def _start_rank(ctx: Any, spec: RankSpec, fn: Callable, args: tuple, procs: list,
                conns: list[Connection]) -> None:
    recv, send = ctx.Pipe(duplex=False)
    # Not daemonic: a rank may start its own workers (e.g. a DataLoader).
    p = ctx.Process(target=rank_main, args=(spec, fn, args, send), name=f"rank{spec.rank}")
    p.start()
    send.close()  # the child holds the write end; EOF then means "child gone"
    procs.append(p)
    conns.append(recv)


def _context(start_method: str | None) -> mp.context.BaseContext:
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start_method not in ("forkserver", "spawn"):
        # "fork" would copy the caller's threads and torch state into the ranks.
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Only read when the server starts. Test modules import pytest, so a rank
        # that unpickles a test function would otherwise import it every time.
        extra = ["pytest"] if "pytest" in sys.modules else []
        if "transformers" in sys.modules:  # the caller works with HF models: each rank building one would
            extra.append("transformers.modeling_utils")  # import this again, which takes seconds
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD + extra)
    return ctx


def _collect(procs: list, conns: list[Connection], tmp: str, deadline: float, timeout: float) -> list:
    """Wait for every rank's report; raise on failure or timeout."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    failures: dict[int, tuple[float, str]] = {}  # rank -> (time of failure, text)
    pending = {conns[r]: r for r in range(world_size)}
    while pending:
        now = time.monotonic()
        if failures:
            deadline = min(deadline, now + _FAILURE_GRACE_S)
        ready = wait(list(pending), timeout=max(0.0, deadline - now))
        if not ready:
            break
        for conn in ready:
            assert isinstance(conn, Connection)
            rank = pending.pop(conn)
            _receive(rank, conn, procs[rank], results, failures)
    hung = sorted(pending.values())
    if hung and not failures:
        stacks = _dump_stacks(procs, hung, tmp)
        _kill(procs)
        raise RankTimeout(_timeout_message(hung, timeout, stacks), {}, hung, stacks)
    if failures:
        _kill(procs)
        ordered = {r: text for r, (_, text) in sorted(failures.items(), key=lambda kv: kv[1][0])}
        raise RankFailure(_failure_message(ordered, hung, world_size), ordered, hung)
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
    return [results[r] for r in range(world_size)]


def _receive(rank: int, conn: Connection, proc: Any, results: dict, failures: dict) -> None:
    try:
        status, payload, when = conn.recv()
    except EOFError:
        # The pipe closed without a report: the process died (signal, os._exit, OOM).
        proc.join(timeout=_TERMINATE_WAIT_S)
        died = (
            f"exited with {_describe_exit(proc.exitcode)} without reporting a result "
            "(its stderr, above, may say why)"
        )
        failures[rank] = (time.time(), died)
        return
    if status == "ok":
        try:
            results[rank] = pickle.loads(payload)
        except Exception:
            failures[rank] = (when, "its result could not be unpickled:\n" + traceback.format_exc())
    else:
        failures[rank] = (when, payload)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _failure_message(failures: dict[int, str], killed: list[int], world_size: int) -> str:
    """``failures`` is in failure order; the first block is the likely root cause."""
    ranks = ", ".join(str(r) for r in failures)
    head = f"{len(failures)} of {world_size} ranks failed (in order: rank {ranks})"
    if killed:
        head += f"; ranks {killed} were still running and were killed"
    blocks = [f"--- rank {r} ---\n{text.rstrip()}" for r, text in failures.items()]
    return "\n\n".join([head, *blocks])


def _timeout_message(hung: list[int], timeout: float, stacks: dict[int, str]) -> str:
    head = f"ranks {hung} were still running after {timeout:g} s and were killed"
    blocks = [f"--- rank {r}: stacks at the timeout ---\n{stacks[r].rstrip()}" for r in hung if stacks.get(r)]
    return "\n\n".join([head, *blocks])


def _dump_stacks(procs: list, hung: list[int], tmp: str) -> dict[int, str]:
    """Ask hung ranks to write their Python stacks (faulthandler) and read them back."""
    if not hasattr(signal, "SIGUSR1"):
        return {}
    for r in hung:
        if procs[r].is_alive():
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(_STACK_DUMP_WAIT_S)
    stacks = {}
    for r in hung:
        try:
            with open(stack_path(tmp, r)) as f:
                stacks[r] = f.read()
        except OSError:
            pass
    return stacks


def _kill(procs: list) -> None:
    """Terminate, then kill, every rank still alive, and reap them all."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    end = time.monotonic() + _TERMINATE_WAIT_S
    for p in alive:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()
    for p in procs:
        if p.exitcode is not None:
            p.join()  # reap, so no zombie is left behind
