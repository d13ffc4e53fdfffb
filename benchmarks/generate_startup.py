"""Where the start of generation goes (issue 39): ``pippy-split generate RUN_DIR`` on the default run,
and ``pipe.generate``'s first call beside ``ps.pipeline()`` of the same model.

Run with ``python -m benchmarks.generate_startup [--run-dir DIR] [--turns 3] [--smoke]``. Without
``--run-dir`` it first makes the default run (``pippy-split train`` with no arguments but ``--steps 2
--samples 0 --no-tensorboard``: the built-in TinyGPT, ZBVZeroBubble, 4 stages on 2 local ranks; the
step count does not change what generate rebuilds) in a temporary directory. Each turn runs, in
fresh processes and in this order:

    command    ``python -m pippy_split.cli generate RUN --prompt 07+45= --max-new-tokens 3``, its wall
               time from this process (what a user waits for)
    timeline   the same command's code path (``make_request``, then ``generate_worker`` on the run's
               ranks through the job's launcher) with each phase stamped: the interpreter's start, the
               launcher's imports, the request, the ranks' spawn and imports, the process group, the
               run's Pipe rebuilt (its trace), the schedule, generate's argument checks, the decode
               program's trace (and the ``torch.export`` inside it), the decode, the process group's
               teardown, the launcher's return and the process's exit
    first call for each model (the zoo's tiny GPT, a tiny Hugging Face Llama): in a fresh process
               ``ps.pipeline()``, then ``pipe.generate``'s first call (its argument checks, the decode
               program's trace, the decode) and its second, one intra-op thread

Phases are wrapped functions of the library (patched in the timed processes only); a function the
library no longer has is left out and named under the table. Figures are medians over turns; a ratio
is the median of the per-turn ratios (two things measured in one turn share its load). ``--profile
DIR`` also writes a cProfile of each rank of the timeline (``rank0.prof``, ...). Results go to
``benchmarks/results/generate_startup.{json,md}``; the command line and the machine's load come
first in both.
"""

from __future__ import annotations

import time

_T_MODULE = time.time()  # a timed child's interpreter is up (before torch is imported)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]  # run by path (to time another tree): modules beside this one must not shadow any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROMPT = ("--prompt", "07+45=", "--max-new-tokens", "3")
TRAIN = ("train", "--steps", "2", "--samples", "0", "--no-tensorboard")
T0_ENV = "GENERATE_STARTUP_T0"
"""The time the benchmark started a timed child (``time.time()``), handed down in the environment."""

# (module, attribute, phase): what the timeline wraps in a rank. Nested phases (inside another) are
# reported under it; the decode is what generate spends outside its checks and the decode program.
RANK_PHASES = (
    ("torch.distributed", "init_process_group", "process group"),
    ("pippy_split.training.generate_rank", "rebuild_pipe", "run's Pipe rebuilt (trace)"),  # a rank's module, or
    ("pippy_split.training.generate_run", "rebuild_pipe", "run's Pipe rebuilt (trace)"),  # the command's (before)
    ("pippy_split", "build_schedule", "build_schedule"),
    ("pippy_split.schedule.pipeline_schedule", "PipelineSchedule.generate", "sched.generate"),
    ("pippy_split.generate.checks", "decode_signature", "checks (decode_signature)"),
    ("pippy_split.generate.distributed", "decode_program", "decode program (trace)"),  # one driver, or
    ("pippy_split.generate.local", "decode_program", "decode program (trace)"),  # two (before 3b7855e)
    ("pippy_split.generate.distributed", "traced_program", "decode program (trace)"),  # in sched.generate's agreement
    ("pippy_split.generate.distributed", "in_process_program", "decode program (eager, or the trace)"),  # pipe.generate
    ("torch.export", "export", "torch.export"),
    ("torch.export.ExportedProgram", "run_decompositions", "run_decompositions"),
    ("torch.distributed", "destroy_process_group", "process group teardown"),
)
FIRST_CALL_PHASES = RANK_PHASES[4:12]  # sched.generate .. run_decompositions


# --------------------------------------------------------------------------- phase timers


class Phases:
    """Intervals of wrapped calls: ``(name, start, end, parent)``, ``parent`` the enclosing phase."""

    def __init__(self) -> None:
        self.intervals: list[tuple[str, float, float, str | None]] = []
        self.missing: list[str] = []
        self._open: list[str] = []

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            parent = self._open[-1] if self._open else None
            self._open.append(name)
            start = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._open.pop()
                self.intervals.append((name, start, time.time(), parent))
        return timed

    def totals(self) -> dict[str, float]:
        """Seconds per phase in the order the phases first started; a nested phase as ``parent / name``;
        the decode as what generate spent outside its nested phases."""
        out: dict[str, float] = {}
        for name, start, end, parent in sorted(self.intervals, key=lambda i: i[1]):
            key = name if parent is None or name == parent else f"{parent} / {name}"
            out[key] = out.get(key, 0.0) + end - start
        for outer in ("sched.generate", "pipe.generate"):
            if outer in out:
                inner = sum(v for k, v in out.items() if k.startswith(outer + " / "))
                out[f"{outer} / decode (the rest)"] = out[outer] - inner
        return out


def _resolve(module: str, attr: str) -> tuple[Any, str] | None:
    """The object holding ``attr`` (a module, or a class named ``Class.method``) and the attribute's name."""
    try:
        owner: Any = importlib.import_module(module)
    except ImportError:
        try:  # a class given as a module path (torch.export.ExportedProgram)
            head, _, cls = module.rpartition(".")
            owner = getattr(importlib.import_module(head), cls)
        except (ImportError, AttributeError):
            return None
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part, None)
    return (owner, name) if owner is not None and hasattr(owner, name) else None


@contextlib.contextmanager
def wrapped(phases: Phases, table: tuple[tuple[str, str, str], ...]) -> Iterator[Phases]:
    """Every function of ``table`` the library has, wrapped to stamp ``phases``; put back on exit. A phase
    found at none of its places is named in ``phases.missing``."""
    undo = []
    absent: dict[str, str] = {}
    for module, attr, name in table:
        found = _resolve(module, attr)
        if found is None:
            absent.setdefault(name, f"{module}.{attr}")
            continue
        owner, key = found
        old = owner.__dict__.get(key) if isinstance(owner, type) else getattr(owner, key)
        if old is None:  # inherited: wrap what the class resolves
            old = getattr(owner, key)
        setattr(owner, key, phases.wrap(getattr(owner, key), name))
        undo.append((owner, key, old))
    wrapped_names = {name for module, attr, name in table if _resolve(module, attr) is not None}
    phases.missing += [where for name, where in absent.items() if name not in wrapped_names]
    try:
        yield phases
    finally:
        for owner, key, old in reversed(undo):
            setattr(owner, key, old)


# --------------------------------------------------------------------------- the timeline (child process)


def timed_rank(req: Any, launched: float, profile_dir: str, entry: str = "generate_worker") -> dict[str, Any]:
    """One rank of ``pippy-split generate``, as ``generate_run.<entry>`` runs it, its phases stamped
    (``generate_here``: the one rank of a 1-rank run, in the launching process)."""
    entered = time.time()
    from pippy_split.training import generate_run

    phases = Phases()
    profiler = None
    if profile_dir:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    with wrapped(phases, RANK_PHASES):
        start = time.time()
        completions = getattr(generate_run, entry)(req)
        end = time.time()
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.path.join(profile_dir, f"rank{os.environ.get('RANK', '0')}.prof"))
    top = _T_MODULE if entry == "generate_worker" else launched  # in the launcher: no interpreter of its own
    return {"launched": launched, "module_top": top, "entered": entered, "worker_start": start,
            "worker_end": end, "phases": phases.totals(), "missing": phases.missing, "completions": completions}


def timeline_child(run_dir: str, out: str, profile_dir: str) -> None:
    """The launching process of ``pippy-split generate`` with its phases stamped (``--timeline``): the
    command's own path, ranks launched, or a 1-rank run in this process where the library does that."""
    t_up = _T_MODULE
    started = float(os.environ.get(T0_ENV, t_up))
    from pippy_split.cli import build_parser
    from pippy_split.training import generate_run
    from pippy_split.training.launch import launch

    t_imports = time.time()
    args = build_parser().parse_args(["generate", run_dir, *PROMPT])
    req, _, ranks = generate_run.make_request(args)
    t_request = time.time()
    if ranks == 1 and hasattr(generate_run, "generate_here"):
        results = {0: timed_rank(req, t_request, profile_dir, "generate_here")}
    else:
        results = launch(timed_rank, (req, t_request, profile_dir), ranks=ranks, name="generate-startup",
                         command="generate")
    t_back = time.time()
    getattr(generate_run, "process_ends", lambda: None)()  # as the command ends its process, where it does
    Path(out).write_text(json.dumps({"started": started, "up": t_up, "imports": t_imports, "request": t_request,
                                     "back": t_back, "ranks": {str(r): v for r, v in results.items()}}))


def timeline_row(stamps: dict[str, Any], exited: float) -> dict[str, float]:
    """Seconds per phase of one timeline, rank 0's phases (the ranks run side by side)."""
    r0 = stamps["ranks"]["0"]
    ranks = stamps["ranks"].values()
    row = {"interpreter start": stamps["up"] - stamps["started"],
           "launcher imports": stamps["imports"] - stamps["up"],
           "request (model.pt, prompts)": stamps["request"] - stamps["imports"],
           "ranks spawned (to module top)": r0["module_top"] - r0["launched"],
           "rank imports (to the worker)": r0["worker_start"] - r0["module_top"]}
    row.update({f"rank 0: {k}": v for k, v in r0["phases"].items()})
    inside = sum(v for k, v in r0["phases"].items() if " / " not in k)
    row["rank 0: other work in the worker"] = r0["worker_end"] - r0["worker_start"] - inside
    row["ranks' exit to launcher's return"] = stamps["back"] - max(r["worker_end"] for r in ranks)
    row["launcher's exit"] = exited - stamps["back"]
    row["total"] = exited - stamps["started"]
    return row


# --------------------------------------------------------------------------- first call (child process)


def _first_call_model(name: str) -> tuple[Any, list[str], Any]:
    """(model, cuts, prompt ids): the zoo's tiny GPT, or a tiny Hugging Face Llama."""
    import torch

    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    if name == "tiny_gpt":
        from pippy_split import zoo

        return zoo.get("tiny_gpt").model.eval(), ["blocks.2"], ids
    import transformers as t

    torch.manual_seed(0)
    cfg = t.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, use_cache=False,
                        eos_token_id=None, bos_token_id=None, pad_token_id=0)
    return t.LlamaForCausalLM(cfg).eval(), ["model.layers.2"], ids


def first_call_child(name: str, out: str) -> None:
    """``ps.pipeline()`` then ``pipe.generate`` twice in this fresh process (``--first-call``)."""
    started = float(os.environ.get(T0_ENV, _T_MODULE))
    import torch

    import pippy_split as ps

    torch.set_num_threads(1)
    model, cuts, ids = _first_call_model(name)
    t_ready = time.time()
    pipe = ps.pipeline(model, cuts, (ids,))
    t_pipe = time.time()
    phases = Phases()
    with wrapped(phases, (("pippy_split.split.pipe", "Pipe.generate", "pipe.generate"), *FIRST_CALL_PHASES)):
        pipe.generate(ids, max_new_tokens=4)
    t_first = time.time()
    pipe.generate(ids, max_new_tokens=4)
    t_second = time.time()
    row = {"process start to the model built": t_ready - started, "ps.pipeline()": t_pipe - t_ready,
           "first pipe.generate": t_first - t_pipe, "second pipe.generate": t_second - t_first}
    row.update({f"first: {k.removeprefix('pipe.generate / ')}": v for k, v in phases.totals().items()
                if k != "pipe.generate"})
    Path(out).write_text(json.dumps({"row": row, "missing": phases.missing}))


# --------------------------------------------------------------------------- the benchmark


def _env(tree: Path) -> dict[str, str]:
    """The environment of a timed child: ``tree``'s ``pippy_split`` first on the path, the start time."""
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore", T0_ENV: repr(time.time())}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _child(argv: list[str], tree: Path, timeout: float = 600) -> float:
    """Run ``python ARGV`` in ``tree`` (its ``pippy_split``); its wall time (a failure raises with its output)."""
    start = time.time()
    proc = subprocess.run([sys.executable, *argv], cwd=tree, env=_env(tree), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"python {' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-3000:]}")
    return time.time() - start


def make_default_run(where: Path, extra: tuple[str, ...] = ()) -> Path:
    """The default ``pippy-split train`` run (2 steps, no samples, no TensorBoard) in ``where``."""
    _child(["-m", "pippy_split.cli", *TRAIN, *extra, "--checkpoint", str(where / "run")], ROOT)
    return where / "run"


def one_turn(tree: Path, run_dir: Path, models: list[str], work: Path, skip_command: bool, profile_dir: str
             ) -> dict[str, Any]:
    """Each measurement once on ``tree``'s library, in fresh processes, in a fixed order."""
    turn: dict[str, Any] = {}
    this = str(Path(__file__).resolve())  # this script times any tree: it imports only pippy_split from it
    if not skip_command:
        turn["command"] = _child(["-m", "pippy_split.cli", "generate", str(run_dir), *PROMPT], tree)
    out = work / "timeline.json"
    _child([this, "--timeline", str(run_dir), "--child-out", str(out),
            *(("--profile", profile_dir) if profile_dir else ())], tree)
    exited = time.time()  # the child's exit, within this process's wake-up
    stamps = json.loads(out.read_text())
    turn["timeline"] = timeline_row(stamps, exited)
    turn["missing"] = sorted({m for r in stamps["ranks"].values() for m in r["missing"]})
    for name in models:
        out = work / f"first_{name}.json"
        _child([this, "--first-call", name, "--child-out", str(out)], tree)
        got = json.loads(out.read_text())
        turn[f"first_call {name}"] = got["row"]
        turn["missing"] = sorted({*turn["missing"], *got["missing"]})
    return turn


def _median(turns: list[dict[str, Any]], key: str) -> dict[str, float]:
    rows = [t[key] for t in turns if key in t]
    names = list(dict.fromkeys(k for r in rows for k in r))
    return {k: statistics.median(r[k] for r in rows if k in r) for k in names}


def summarize(turns: list[dict[str, Any]], models: list[str]) -> dict[str, Any]:
    """Medians over one tree's turns of every phase; the first call over ``ps.pipeline()`` per turn, its median."""
    out: dict[str, Any] = {"timeline": _median(turns, "timeline")}
    if any("command" in t for t in turns):
        out["command"] = {"pippy-split generate (wall)": statistics.median(t["command"] for t in turns)}
    for name in models:
        key = f"first_call {name}"
        out[key] = _median(turns, key)
        ratios = [t[key]["first pipe.generate"] / t[key]["ps.pipeline()"] for t in turns]
        out[key]["first generate / ps.pipeline() (median of turns)"] = statistics.median(ratios)
    return out


def paired(turns: dict[str, list[dict[str, Any]]], key: str, field: str) -> float | None:
    """The median over turns of this tree's ``field`` over the baseline's, both from the same turn."""
    base, this = turns.get("baseline"), turns["this tree"]
    if not base:
        return None

    def pick(turn: dict[str, Any]) -> float | None:
        return turn.get("command") if key == "command" else turn.get(key, {}).get(field)

    ratios = [t / b for b, t in ((pick(b), pick(t)) for b, t in zip(base, this)) if b and t is not None]
    return statistics.median(ratios) if ratios else None


def render(command: str, load: tuple[float, float], trees: dict[str, Path], summaries: dict[str, dict[str, Any]],
           turns: dict[str, list[dict[str, Any]]], missing: list[str]) -> str:
    """The markdown the benchmark prints and writes: one table per measurement, a column per tree."""
    names = list(summaries)
    lines = [f"`{command}`", "",
             f"Load average (1 min) before {load[0]:.2f}, after {load[1]:.2f}; {os.cpu_count()} CPUs; "
             f"{len(turns[names[0]])} turn(s), seconds are medians; "
             + "; ".join(f"{n}: {p}" for n, p in trees.items()) + ".", ""]
    sections = {"command": f"`pippy-split generate RUN {' '.join(PROMPT)}` on the default run",
                "timeline": "its phases (timed run of the same code path; rank 0's phases)"}
    for key in summaries[names[0]]:
        title = sections.get(key, f"{key.removeprefix('first_call ')}: ps.pipeline() and pipe.generate's first call")
        ratio = " | this / baseline (median of turns)" if len(names) > 1 else ""
        lines += [f"| {title} | " + " | ".join(names) + ratio + " |", "|---" * (len(names) + 1 + bool(ratio)) + "|"]
        for field in summaries[names[0]][key]:
            cells = [f"{summaries[n][key].get(field, float('nan')):.2f}" for n in names]
            if ratio:
                r = paired(turns, key, field) if "median of turns" not in field else None
                cells.append(f"{r:.2f}" if r is not None else "")
            lines.append(f"| {field} | " + " | ".join(cells) + " |")
        lines.append("")
    if missing:
        lines += ["not in one of the trees (not timed there): " + ", ".join(missing), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, help="a finished run (default: make the default run first)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout of the repository (e.g. git worktree add "
                        "/tmp/base HEAD~3) timed in the same turns, turn about")
    parser.add_argument("--models", nargs="*", default=["tiny_gpt", "hf_llama"], help="first-call models")
    parser.add_argument("--skip-command", action="store_true", help="time the phases only, not the plain command")
    parser.add_argument("--smoke", action="store_true", help="one turn, the timeline only (no plain command, no "
                        "first call); without --run-dir, on a 1-rank run of a 16-wide TinyGPT")
    parser.add_argument("--profile", default="", help="write each timed rank's cProfile to this directory")
    parser.add_argument("--out", type=Path, default=RESULTS / "generate_startup.json")
    parser.add_argument("--timeline", help=argparse.SUPPRESS)
    parser.add_argument("--first-call", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.timeline:
        timeline_child(args.timeline, args.child_out, args.profile)
        return {}
    if args.first_call:
        first_call_child(args.first_call, args.child_out)
        return {}
    command = "python -m benchmarks.generate_startup " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.turns, args.skip_command, args.models = 1, True, []
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    trees = {"this tree": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    load_before = os.getloadavg()[0]
    turns: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        extra = ("--ranks", "1", "--schedule", "GPipe", "--d-model", "16", "--batch-size", "8") if args.smoke else ()
        run_dir = args.run_dir.resolve() if args.run_dir else make_default_run(work, extra)
        for _ in range(args.turns):
            for name in reversed(list(trees)):  # the baseline first in each turn
                turns[name].append(one_turn(trees[name], run_dir, args.models, work, args.skip_command, args.profile))
    load = (load_before, os.getloadavg()[0])
    summaries = {name: summarize(turns[name], args.models) for name in trees}
    missing = sorted({m for ts in turns.values() for t in ts for m in t["missing"]})
    text = render(command, load, {n: p for n, p in trees.items()}, summaries, turns, missing)
    print(text, end="", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": command, "load_avg_before": load[0], "load_avg_after": load[1], "cpus": os.cpu_count(),
            "turns": args.turns, "trees": {n: str(p) for n, p in trees.items()},
            "run_dir": str(args.run_dir) if args.run_dir else "default run (made here)"}
    result = {"meta": meta, "summary": summaries, "turns": turns, "missing": missing}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(text)
    return result


if __name__ == "__main__":
    main()
