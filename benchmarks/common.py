"""Shared pieces of the side-by-side benchmarks: models, both tools' runners, counters.

Used by ``step_time``, ``traffic`` and ``memory`` (and driven by ``compare``). Every
rank body in those modules runs under :func:`pippy_split.testing.run_ranks` (gloo,
one process and one intra-op thread per rank), for ours and for the peer,
``torch.distributed.pipelining``, which is imported here and in the benchmarks only:

    entry = gpt(d=256)                                  # tiny GPT, batch 32, seq 128
    ours = build_ours(entry, "1F1B", n_mb=8)            # .step() runs one training step
    peer = build_peer(entry_again, "1F1B", 8, rank, world)
    times = alternate({"ours": ours.step, "peer": peer.step}, warmup=1, reps=5)

Figures are ratios measured in one run (see :func:`alternate`): absolute times on a
shared 2-core machine are noise, a ratio of two runs interleaved step by step is not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

import pippy_split as ps
from pippy_split import zoo
from pippy_split.schedule import get_schedule_class, stage_to_rank
from pippy_split.schedule.orders import get_order_spec

__all__ = ["summarize", "gpt", "mb_example", "Runner", "build_ours", "build_peer", "build_serial",
           "alternate", "P2PCounter", "count_p2p", "reset_peak_rss", "rss_mb", "peak_rss_mb",
           "expected_traffic", "quiet"]


# ---- statistics --------------------------------------------------------------------


def summarize(values: list[float]) -> dict[str, float]:
    """``{"median", "min", "max", "n"}`` of repeated measurements (or ratios)."""
    if not values:
        raise ValueError("no values to summarize")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# ---- models ------------------------------------------------------------------------


def gpt(d: int = 256, n_layer: int = 8, batch: int = 32, seq: int = 128, num_stages: int = 2,
        n_head: int = 4, seed: int = 0) -> zoo.ZooEntry:
    """The zoo's tiny GPT at benchmark sizes, split evenly over its blocks.

    Call it once per tool: the peer patches the model it splits, so two tools
    never share one model object (the seed makes the copies identical).
    """
    return zoo.get("tiny_gpt", seed=seed, d_model=d, n_layer=n_layer, n_head=n_head, block_size=seq,
                   num_stages=num_stages, batch_size=batch, seq_len=seq)


def mb_example(entry: zoo.ZooEntry, n_mb: int) -> tuple[tuple, dict]:
    """The first microbatch of the entry's batch: what both tools trace on."""
    args, kwargs = ps.split_args_kwargs(entry.args, entry.kwargs, n_mb)[0]
    return tuple(args), dict(kwargs)


# ---- runners -----------------------------------------------------------------------


@dataclass
class Runner:
    """One tool's training step on this rank, ready to call."""

    step: Callable[[], Any]
    stages: list = field(default_factory=list)  # this rank's stage objects (tool-specific type)
    note: str = ""  # how it was built, where that differs from the tool's documented path


def build_ours(entry: zoo.ZooEntry, schedule: str, n_mb: int, split_spec: Any = None, device: Any = None) -> Runner:
    """``ps.pipeline`` + ``ps.build_schedule``: the same ``step(x, target=y)`` on every rank."""
    args, kwargs = mb_example(entry, n_mb)
    pipe = ps.pipeline(entry.model, split_spec if split_spec is not None else entry.split_spec, args, kwargs)
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn, device=device)

    def step() -> Any:
        return sched.step(*entry.args, target=entry.target, **entry.kwargs)

    runner = Runner(step, list(sched.stages))
    runner.pipe, runner.sched = pipe, sched  # type: ignore[attr-defined]
    return runner


_PEER_V = ("ZBVZeroBubble", "DualPipeV")
PEER_V_NOTE = ("peer stages built by hand, PipelineStage(pipe.get_stage_module(i), ...): with V placement "
               "pipe.build_stage's warm-up sends to its own rank, which gloo cannot do")


def build_peer(entry: zoo.ZooEntry, schedule: str, n_mb: int, rank: int, world: int,
               split_spec: Any = None) -> Runner:
    """torch.distributed.pipelining, built as its docs say.

    ``pipe = pipeline(model, mb_args=(x_mb,), split_spec={fqn: SplitPoint.BEGINNING})``,
    ``stage = pipe.build_stage(i, device)``, ``Schedule*(stage(s), n_mb, loss_fn=...)``.
    Only the rank with stage 0 passes inputs, only the one with the last stage ``target``.
    """
    from torch.distributed import pipelining as tdp

    args, kwargs = mb_example(entry, n_mb)
    fqns = split_spec if split_spec is not None else entry.split_spec
    with quiet():
        pipe = tdp.pipeline(entry.model, mb_args=args, mb_kwargs=kwargs or None,
                            split_spec={f: tdp.SplitPoint.BEGINNING for f in fqns})
    cls = getattr(tdp, "Schedule" + schedule)
    placement = get_order_spec(schedule).placement
    mine = [s for s, r in stage_to_rank(pipe.num_stages, world, placement).items() if r == rank]
    cpu = torch.device("cpu")
    note = ""
    if schedule in _PEER_V:
        stages = [tdp.PipelineStage(pipe.get_stage_module(s), s, pipe.num_stages, cpu) for s in mine]
        note = PEER_V_NOTE
    else:
        stages = [pipe.build_stage(s, cpu) for s in mine]
    multi = issubclass(cls, tdp.schedules.PipelineScheduleMulti)
    sched = cls(stages if multi else stages[0], n_mb, loss_fn=entry.loss_fn)
    first, last = 0 in mine, pipe.num_stages - 1 in mine

    def step() -> Any:
        with quiet():
            return sched.step(*(entry.args if first else ()), **(entry.kwargs if first else {}),
                              **({"target": entry.target} if last else {}))

    return Runner(step, stages, note)


def build_serial(entry: zoo.ZooEntry, n_mb: int) -> Runner:
    """The unsplit model in this process, microbatch by microbatch: forward, loss / n_mb, backward."""
    mbs = ps.split_args_kwargs(entry.args, entry.kwargs, n_mb)
    targets = [t[0] for t, _ in ps.split_args_kwargs((entry.target,), {}, n_mb)]

    def step() -> None:
        for (a, k), y in zip(mbs, targets):
            (entry.loss_fn(entry.model(*a, **k), y) / n_mb).backward()

    return Runner(step)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the peer's deprecation warnings (pytree LeafSpec) while it runs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


# ---- timing ------------------------------------------------------------------------


def alternate(fns: dict[str, Callable[[], Any] | None], warmup: int, reps: int) -> dict[str, dict[str, list[float]]]:
    """Step times of several runners, interleaved: one step of each per repetition.

    The order rotates every repetition, so slow drift of the machine's load hits
    every runner alike; each time is fenced by barriers on both sides (so it is
    the pipeline's time, not one rank's). A ``None`` runner is a rank that sits
    this one out (the serial baseline runs on rank 0 only). Returns this rank's
    ``{name: {"wall": [s, ...], "cpu": [s, ...]}}`` after ``warmup`` untimed
    repetitions; "cpu" is this process's CPU time over the same span, which other
    load on the machine barely changes (waiting in gloo does not spin).
    """
    names = list(fns)
    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in names}
    for i in range(warmup + reps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            fn = fns[name]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if fn is not None:
                fn()
            dist.barrier()
            if i >= warmup:
                times[name]["wall"].append(time.perf_counter() - t0)
                times[name]["cpu"].append(time.process_time() - c0)
    return times


# ---- point-to-point traffic --------------------------------------------------------


@dataclass
class P2PCounter:
    """Point-to-point messages and bytes seen on this rank (plus collective calls)."""

    sent_msgs: int = 0
    sent_bytes: int = 0
    recv_msgs: int = 0
    recv_bytes: int = 0
    sent_to: dict[int, int] = field(default_factory=dict)  # peer group rank -> bytes
    collectives: int = 0
    collective_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def count_p2p() -> Iterator[P2PCounter]:
    """Count every ``isend``/``irecv``/``send``/``recv`` (and collective) on this rank.

    Both ``torch.distributed.X`` and ``torch.distributed.distributed_c10d.X`` are
    wrapped: the peer's ``batch_isend_irecv`` checks ``op is isend`` against the
    latter, and both tools look up ``dist.isend`` at call time.
    """
    c10d = dist.distributed_c10d
    counter = P2PCounter()
    originals = {name: getattr(c10d, name) for name in ("isend", "irecv", "send", "recv", "broadcast",
                                                         "all_reduce", "all_gather")}

    def peer_of(args: tuple, kwargs: dict, key: str) -> int:
        for k in (key, "group_" + key):
            if kwargs.get(k) is not None:
                return int(kwargs[k])
        return int(args[1]) if len(args) > 1 and args[1] is not None else -1

    def sender(fn: Callable) -> Callable:
        def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counter.sent_msgs += 1
            counter.sent_bytes += _nbytes(tensor)
            peer = peer_of((tensor, *args), kwargs, "dst")
            counter.sent_to[peer] = counter.sent_to.get(peer, 0) + _nbytes(tensor)
            return fn(tensor, *args, **kwargs)
        return wrapped

    def receiver(fn: Callable) -> Callable:
        def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counter.recv_msgs += 1
            counter.recv_bytes += _nbytes(tensor)
            return fn(tensor, *args, **kwargs)
        return wrapped

    def collective(fn: Callable) -> Callable:
        def wrapped(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            counter.collectives += 1
            if isinstance(tensor, torch.Tensor):
                counter.collective_bytes += _nbytes(tensor)
            return fn(tensor, *args, **kwargs)
        return wrapped

    wrappers = {"isend": sender, "send": sender, "irecv": receiver, "recv": receiver,
                "broadcast": collective, "all_reduce": collective, "all_gather": collective}
    try:
        for name, fn in originals.items():
            w = wrappers[name](fn)
            setattr(c10d, name, w)
            setattr(dist, name, w)
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


def expected_traffic(pipe: ps.Pipe, placement: dict[int, int], n_mb: int, world: int,
                     shared_loss: bool = False) -> list[dict[str, int]]:
    """The analytical minimum per rank and step, from ``pipe.edges``.

    Each edge whose ends sit on different ranks moves once per microbatch forward
    (from the rank of its sender stage; stage 0's rank for a model input) and,
    when its spec carries a gradient and it is not a model input, once backward.
    Edges between stages on the same rank move nothing. Complex values count
    at their real size (same bytes). With ``shared_loss`` (what ``sched.loss`` on every rank
    costs), the step's fp32 loss goes once from the last stage's rank to every other rank.
    """
    out = [{"sent_msgs": 0, "sent_bytes": 0, "recv_msgs": 0, "recv_bytes": 0} for _ in range(world)]
    if shared_loss:
        last = placement[max(placement)]
        for r in range(world):
            if r != last:
                out[last]["sent_msgs"] += 1
                out[last]["sent_bytes"] += 4
                out[r]["recv_msgs"] += 1
                out[r]["recv_bytes"] += 4
    for e in pipe.edges:
        src, dst = placement[e.sender_stage], placement[e.dst_stage]
        if src == dst:
            continue
        size = 1
        for dim in e.spec.shape:
            size *= int(dim)
        nbytes = size * torch.empty((), dtype=e.spec.dtype).element_size()
        moves = [(src, dst)] + ([(dst, src)] if e.spec.carries_grad and not e.from_input else [])
        for a, b in moves:
            out[a]["sent_msgs"] += n_mb
            out[a]["sent_bytes"] += n_mb * nbytes
            out[b]["recv_msgs"] += n_mb
            out[b]["recv_bytes"] += n_mb * nbytes
    return out


def our_placement(schedule: str, num_stages: int, world: int) -> dict[int, int]:
    """``{stage: rank}`` that ``ps.build_schedule`` uses for this schedule."""
    return stage_to_rank(num_stages, world, get_schedule_class(schedule).placement_style)


# ---- memory ------------------------------------------------------------------------


def _status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux ``clear_refs`` 5); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_mb() -> float:
    """Resident set size now, MB (0.0 where /proc is missing)."""
    kb = _status_kb("VmRSS")
    return (kb or 0) / 1024


def peak_rss_mb() -> float:
    """Peak RSS since the last :func:`reset_peak_rss` (``VmHWM``), else since start (maxrss), MB."""
    kb = _status_kb("VmHWM")
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024


def item_main(doc: str, run: Callable[[str, int], dict], report: Callable[[dict], None],
              argv: list[str] | None = None) -> dict:
    """Command line of one benchmark item: ``--mode``, ``--reps``, ``--out``; prints each row."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--mode", choices=["full", "quick", "smoke"], default="full")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    out = run(args.mode, args.reps)
    if args.out is not None:  # the record is compare.json; this is for a look at one item
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    for row in out["rows"]:
        report(row)
    return out


def median_range(s: dict, fmt: str = "{:.2f}") -> str:
    """``median [min, max]`` of a :func:`summarize` result, each number in ``fmt``."""
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}, {fmt.format(s['max'])}]"


def git_state(where: Path) -> tuple[str, bool]:
    """The short commit and whether tracked files differ from it (``("unknown", False)`` outside git)."""
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False
    return commit, bool(dirty)
