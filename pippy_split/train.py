"""`pippy-split train`: train a model pipelined over local ranks.

Where this sits: on top of the whole flow split → Pipe → stage → schedule → runtime.
Every rank has the same model (same seed), traced and split with `ps.pipeline`
(on CPU once, by the launcher, before it forks the ranks), keeps only its own
stages via `ps.build_schedule`, and steps an AdamW over those stages' parameters.
At the end every rank saves its stages and AdamW state with :mod:`pippy_split.checkpoint`
(keyed by the original FQNs); rank 0 loads that into a fresh unsplit model, samples
from it, and saves its state dict as ``model.pt``.

With no arguments it trains a character-level TinyGPT on written-out additions
(``07+45=25``: operands zero-padded, the answer's digits backwards, see
:mod:`pippy_split.data`) over 4 stages on 2 local ranks with ZBVZeroBubble:
400 steps of 128 line-aligned windows of 16 characters in 4 microbatches, under
a minute on 2 idle CPU cores, after which the sampled sums are right. It launches
its own ranks with torch's elastic launcher; under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set) it runs the worker directly:

    python -m pippy_split.train --steps 100
    torchrun --nproc-per-node 2 -m pippy_split.train --steps 100
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import random
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from .testing import free_port

__all__ = ["build_parser", "main", "run", "worker", "load_factory", "failure_line", "DEFAULT_CHECKPOINT"]

DEFAULT_CHECKPOINT = os.path.join("checkpoints", "tiny_gpt")
TRAIN_STATE_DIR = "train_state"  # pippy_split.checkpoint of the stages + AdamW, beside model.pt
SUM_MAX = 99  # operands of the built-in sums: 0..SUM_MAX
CHECKPOINT_FILE = "model.pt"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="pippy-split train", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="module:factory returning a ZooEntry or (model, args[, kwargs]); trains on its example "
                        "batch. Also zoo:NAME. Default: a TinyGPT on --data or the built-in addition corpus.")
    p.add_argument("--split", default=None, help="comma-separated FQNs to split at (beginning of each)")
    p.add_argument("--schedule", default="ZBVZeroBubble", help="schedule name (default ZBVZeroBubble)")
    p.add_argument("--ranks", type=int, default=2, help="local ranks to launch (ignored under torchrun)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=3e-3, help="peak; warmup, then cosine decay to 10%%")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=16, help="characters per window (16 holds one sum and more)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=None, help="default: max(4, number of stages)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help=f"directory (default {DEFAULT_CHECKPOINT})")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint: weights and AdamW state")
    p.add_argument("--data", default=None, help="train on this text file (vocabulary: its characters)")
    p.add_argument("--samples", type=int, default=8, help="lines to sample at the end")
    p.add_argument("--activation-checkpoint", action="store_true",
                   help="recompute each stage right before its backward instead of keeping its activations")
    p.add_argument("--bf16", action="store_true", help="run the stages under torch.autocast(bfloat16), loss in fp32")
    p.add_argument("--compile", action="store_true", help="torch.compile every stage (the first step compiles)")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help="clip the gradients of all stages of all ranks to this total 2-norm (ps.clip_grad_norm_)")
    return p


# --------------------------------------------------------------------------- model


def load_factory(spec: str):
    """``module:factory`` or ``zoo:NAME`` -> a zero-argument callable."""
    if spec.startswith("zoo:"):
        from . import zoo

        name = spec[4:]
        return lambda: zoo.get(name)
    if ":" not in spec:
        raise ValueError(f"expected module:factory or zoo:NAME, got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def unpack_entry(entry: Any) -> tuple[torch.nn.Module, tuple, dict, Any, Any, Any]:
    """(model, args, kwargs, split_spec, loss_fn, target) from a ZooEntry-like or a tuple."""
    if hasattr(entry, "model") and hasattr(entry, "args"):
        return (entry.model, tuple(entry.args), dict(getattr(entry, "kwargs", None) or {}),
                getattr(entry, "split_spec", None), getattr(entry, "loss_fn", None), getattr(entry, "target", None))
    if isinstance(entry, tuple) and len(entry) in (2, 3) and isinstance(entry[0], torch.nn.Module):
        args = entry[1] if isinstance(entry[1], tuple) else (entry[1],)
        kwargs = entry[2] if len(entry) == 3 else {}
        return entry[0], args, dict(kwargs or {}), None, None, None
    raise TypeError("factory must return a ZooEntry-like object (model, args, kwargs, ...) or a tuple "
                    f"(model, args[, kwargs]); got {type(entry).__name__}")


def parse_split(split: str | None) -> list[str] | None:
    return [s.strip() for s in split.split(",") if s.strip()] if split else None


def _stages_per_rank(schedule: str) -> int:
    from .schedule.orders import ORDERS

    return ORDERS[schedule].default_stages_per_rank()


# --------------------------------------------------------------------------- worker


def _gpt_config(cfg: argparse.Namespace, vocab_size: int, num_stages: int) -> dict:
    n_layer = cfg.n_layer or max(4, num_stages)
    return dict(vocab_size=vocab_size, d_model=cfg.d_model, n_layer=n_layer, n_head=4,
                block_size=max(64, cfg.seq_len))


def _corpus(cfg: argparse.Namespace, chars: str = ""):
    """The user's text (plain next-character prediction), or the built-in sums: operands
    zero-padded, answers written backwards, windows starting at line starts, loss on the
    answers only (see :mod:`pippy_split.data`)."""
    from .data import CharCorpus, addition_corpus

    if cfg.data:
        with open(cfg.data, encoding="utf-8") as f:
            text = f.read()
        return CharCorpus(text, chars=chars)
    return CharCorpus(addition_corpus(max_value=SUM_MAX, seed=cfg.seed, reverse=True, pad=True), chars=chars,
                      prompt_end="=")


def _load_checkpoint(path: str) -> dict:
    return torch.load(os.path.join(path, CHECKPOINT_FILE), map_location="cpu", weights_only=False)


def _save_checkpoint(path: str, state_dict: dict, meta: dict) -> str:
    os.makedirs(path, exist_ok=True)
    final = os.path.join(path, CHECKPOINT_FILE)
    fd, tmp = tempfile.mkstemp(prefix=".model-", suffix=".tmp", dir=path)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"state_dict": state_dict, "meta": meta}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)  # a crash before this leaves the previous checkpoint intact
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return final


_PREPARED: SimpleNamespace | None = None  # built by the launcher before it forks the ranks (see run())


def worker(cfg: argparse.Namespace) -> None:
    """One rank of the training run (call under torchrun or the elastic launcher)."""
    import torch.distributed as dist

    import pippy_split as ps
    from .schedule import simulate
    from .zoo.gpt import TinyGPT

    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        _worker(cfg, rank, world, device, ps, simulate, TinyGPT)
    finally:
        dist.destroy_process_group()


def _prepare(cfg: argparse.Namespace, world: int, log) -> SimpleNamespace:
    """Data, model and the traced, split Pipe: the same on every rank (same seed).

    The launcher runs this once before forking the local ranks, which inherit it;
    under torchrun every rank runs it itself."""
    import pippy_split as ps
    from .zoo.gpt import TinyGPT, lm_loss

    spr = _stages_per_rank(cfg.schedule)
    num_stages = world * spr
    M, B, T = cfg.microbatches, cfg.batch_size, cfg.seq_len
    if B % M:
        raise SystemExit(f"--batch-size {B} is not divisible by --microbatches {M}")

    resume_state = _load_checkpoint(cfg.checkpoint) if cfg.resume else None

    corpus = gpt_cfg = None
    args: tuple = ()
    kwargs: dict = {}
    if cfg.model is None:
        saved_chars = resume_state["meta"].get("chars", "") if resume_state else ""
        corpus = _corpus(cfg, chars=saved_chars)
        gpt_cfg = _gpt_config(cfg, corpus.vocab_size, num_stages)
        if resume_state and resume_state["meta"].get("gpt_config"):
            gpt_cfg = resume_state["meta"]["gpt_config"]
        torch.manual_seed(cfg.seed)
        model = TinyGPT(**gpt_cfg)
        from .zoo import layer_split

        split_spec = parse_split(cfg.split) or layer_split("blocks", gpt_cfg["n_layer"], num_stages)
        loss_fn = lm_loss
        x0, _ = corpus.batch(B, T, torch.Generator().manual_seed(cfg.seed + 1))
        ex_args, ex_kwargs, target = (x0[: B // M],), {}, None
    else:
        torch.manual_seed(cfg.seed)
        model, args, kwargs, spec, loss_fn, target = unpack_entry(load_factory(cfg.model)())
        split_spec = parse_split(cfg.split) or spec or num_stages
        if loss_fn is None or target is None:
            raise SystemExit(f"{cfg.model} gives no loss_fn/target; train needs a ZooEntry-like with both")
        B = args[0].shape[0]
        if B % M:
            raise SystemExit(f"the factory's batch ({B}) is not divisible by --microbatches {M}")
        ex_args = tuple(a[: B // M] if isinstance(a, torch.Tensor) else a for a in args)
        ex_kwargs = kwargs
    if resume_state is not None:
        missing, unexpected = model.load_state_dict(resume_state["state_dict"], strict=False)
        if missing or unexpected:
            raise SystemExit(f"checkpoint {cfg.checkpoint} does not match the model: "
                             f"missing {missing}, unexpected {unexpected}")
        log(f"[green]resumed[/] from {os.path.join(cfg.checkpoint, CHECKPOINT_FILE)}")

    pipe = ps.pipeline(model, split_spec, ex_args, ex_kwargs)
    if pipe.num_stages % world:
        raise SystemExit(f"{pipe.num_stages} stages cannot be spread over {world} ranks")
    return SimpleNamespace(world=world, corpus=corpus, gpt_cfg=gpt_cfg, model=model, loss_fn=loss_fn, args=args,
                           kwargs=kwargs, target=target, B=B, pipe=pipe)


def _worker(cfg, rank, world, device, ps, simulate, TinyGPT) -> None:
    from rich.console import Console

    console = Console(stderr=False)
    log = console.print if rank == 0 else (lambda *a, **k: None)
    prep = _PREPARED if _PREPARED is not None and _PREPARED.world == world else _prepare(cfg, world, log)
    corpus, gpt_cfg, model, pipe = prep.corpus, prep.gpt_cfg, prep.model, prep.pipe
    args, kwargs, target, B = prep.args, prep.kwargs, prep.target, prep.B
    M, T = cfg.microbatches, cfg.seq_len
    data_gen = torch.Generator().manual_seed(cfg.seed)  # same stream on every rank -> same batches
    sched = ps.build_schedule(pipe, cfg.schedule, M, loss_fn=prep.loss_fn, device=device,
                              activation_checkpoint="full" if cfg.activation_checkpoint else None,
                              mixed_precision=torch.bfloat16 if cfg.bf16 else None, compile=cfg.compile)
    params = list({id(p): p for st in sched.stages for p in st.module.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)
    dcp_dir = os.path.join(cfg.checkpoint, TRAIN_STATE_DIR)
    if cfg.resume and os.path.isdir(dcp_dir):
        # Weights came from model.pt before pipelining; this restores AdamW's state too,
        # whatever stage layout wrote it (the checkpoint is keyed by original FQNs).
        ps.checkpoint.load(dcp_dir, sched, opt)
        log(f"[green]resumed optimizer state[/] from {dcp_dir}")
    cls = ps.get_schedule_class(cfg.schedule)
    bubble = simulate(cls.compute_order(world, M, pipe.num_stages // world)).bubble_fraction
    log(f"[bold]pippy-split train[/]: {type(model).__name__}, {pipe.num_stages} stages on {world} ranks "
        f"({'nccl' if device.type == 'cuda' else 'gloo'}), schedule {cfg.schedule}, {M} microbatches, "
        f"{sum(s.num_params for s in pipe.stages):,} params, simulated bubble {bubble:.1%}")
    if corpus is not None and not cfg.data:
        log(f"data: sums a+b=c of 0..{SUM_MAX}, operands zero-padded, c's digits backwards (07+45=25 is "
            "7+45=52), windows starting at line starts; the loss is the answers' (the operands are random)")

    def next_batch():
        if corpus is None:
            return args, kwargs, target
        x, y = corpus.batch(B, T, data_gen)
        return (x,), {}, y

    def lr_at(step: int) -> float:  # short warmup, cosine decay to 10%
        warm = max(1, min(20, cfg.steps // 10))
        if step < warm:
            return cfg.lr * (step + 1) / warm
        frac = (step - warm) / max(1, cfg.steps - warm)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    first_loss = last_loss = None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("[bold blue]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                        TextColumn("bubble {task.fields[bubble]}"), TimeElapsedColumn(),
                        console=console, disable=rank != 0)
    tokens = 0
    t0 = time.perf_counter()
    with progress:
        task = progress.add_task("train", total=cfg.steps, loss="-", tps="-", bubble=f"{bubble:.1%}")
        for step in range(cfg.steps):
            a, k, y = next_batch()
            a = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in a)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            sched.step(*a, target=y.to(device), **k)
            if cfg.clip_grad_norm is not None:
                ps.clip_grad_norm_(sched, cfg.clip_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rank != 0:
                continue  # only rank 0 reports: reading sched.loss elsewhere would wait for its broadcast
            loss = float(sched.loss)
            first_loss = loss if first_loss is None else first_loss
            last_loss = loss
            tokens += a[0].numel() if isinstance(a[0], torch.Tensor) else 0
            tps = tokens / max(time.perf_counter() - t0, 1e-9)
            progress.update(task, advance=1, loss=f"{loss:.4f}", tps=f"{tps:,.0f}")
    elapsed = time.perf_counter() - t0
    if rank == 0 and first_loss is not None:
        log(f"first loss {first_loss:.4f}   last loss {last_loss:.4f}   ({cfg.steps} steps, {elapsed:.1f} s)")

    # ---- every rank writes its stages and optimizer state (DCP, original FQNs) for --resume
    ps.checkpoint.save(dcp_dir, sched, opt, extra={"steps": cfg.steps})
    if rank != 0:
        return

    # ---- rank 0 reads every stage's weights back into the unsplit model (the save has
    # returned on every rank, so the checkpoint is complete); no gather of the state dicts
    if corpus is not None:
        fresh = TinyGPT(**gpt_cfg)
    else:
        torch.manual_seed(cfg.seed)
        fresh = unpack_entry(load_factory(cfg.model)())[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ps.checkpoint.load(dcp_dir, fresh, strict=False, no_dist=True)
    for w in caught:
        if issubclass(w.category, UserWarning) and "does not match the model" in str(w.message):
            log(f"[yellow]stages' checkpoint vs fresh model: {w.message}")
    merged = {k: v.detach().cpu() for k, v in fresh.state_dict().items()}
    fresh.eval()
    if corpus is not None:
        _sample(cfg, fresh, corpus, log)

    meta = {"model": cfg.model or "TinyGPT", "gpt_config": gpt_cfg, "chars": corpus.chars if corpus else None,
            "data": cfg.data or "additions (operands padded, answers reversed)", "steps": cfg.steps,
            "schedule": cfg.schedule, "ranks": world,
            "num_stages": pipe.num_stages, "split": [list(s.modules) for s in pipe.stages],
            "first_loss": first_loss, "last_loss": last_loss, "lr": cfg.lr}
    path = _save_checkpoint(cfg.checkpoint, merged, meta)
    log(f"checkpoint saved to {path} ({len(merged)} tensors, original FQNs)")


def _sample(cfg, model, corpus, log) -> None:
    from .data import parse_sum, sum_prompt
    from .zoo.gpt import generate

    rng = random.Random(cfg.seed + 1234)
    if cfg.data:
        lines = [ln for ln in corpus.text.splitlines() if ln.strip()] or [corpus.text]
        prompts = [ln[: max(1, len(ln) // 2)] for ln in rng.sample(lines, min(cfg.samples, len(lines)))]
    else:
        prompts = [sum_prompt(rng.randint(0, SUM_MAX), rng.randint(0, SUM_MAX), SUM_MAX) for _ in range(cfg.samples)]
    reverse = not cfg.data  # the built-in corpus writes answers backwards
    correct = judged = 0
    log("[bold]samples[/] (greedy" + (", the model writes the answer's digits backwards" if reverse else "") + "):")
    for p in prompts:
        ids = corpus.encode(p)[None, -model.block_size:]
        out = generate(model, ids, 8 if not cfg.data else 32)
        text = corpus.decode(out[0].tolist())
        line = text.split("\n", 1)[0] if p.count("\n") == 0 else text
        ok = parse_sum(line, reverse=reverse)
        if ok is not None:
            judged += 1
            correct += ok
        mark = "" if ok is None else ("  [green]✓[/]" if ok else "  [red]✗[/]")
        if reverse and ok is not None:
            lhs, answer = line.split("=", 1)
            a, b = (int(v) for v in lhs.split("+"))
            log(f"  {line!r:12}  i.e. {a:>2} + {b:>2} = {answer[::-1]:<4}{mark}")
        else:
            log(f"  {line!r}{mark}")
    if not cfg.data or judged:
        log(f"correct sums: {correct}/{len(prompts)}")


# --------------------------------------------------------------------------- launcher


def failure_line(error: Any) -> str:
    """One line naming the failed rank and its root cause, from the launcher's ``ChildFailedError``.

    The launcher reports the first rank it saw fail; its cause is the exception that
    rank raised (type and the first line of its message), the signal that killed it,
    or its exit status. For example
    ``pippy-split train: rank 1 failed: RuntimeError: Numpy is not available``.
    """
    rank, failure = error.get_first_failure()
    message = failure.message
    if isinstance(message, Mapping):  # the error file's {"message": "Type: text", "extraInfo": ...}
        message = message.get("message", "")
    lines = [ln.strip() for ln in str(message or "").splitlines() if ln.strip()]
    recorded = failure.error_file_data.get("message") not in (None, "<NONE>")  # an exception, in its file
    if lines and (recorded or failure.exitcode < 0):  # < 0: killed by a signal, which the message names
        cause = lines[0] + (" ..." if len(lines) > 1 else "")
    else:  # e.g. SystemExit: the launcher's message would only be a link to its docs
        cause = f"exit status {failure.exitcode} (its own output above says why)"
    return f"pippy-split train: rank {rank} failed: {cause}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m pippy_split.train``; returns the exit status."""
    return run(build_parser().parse_args(argv))


def run(cfg: argparse.Namespace) -> int:
    """Train with parsed options: run the worker under torchrun, else launch ``cfg.ranks`` local ranks."""
    from .schedule.orders import ORDERS

    if cfg.schedule not in ORDERS:
        print(f"unknown schedule {cfg.schedule!r}; choose from {', '.join(ORDERS)}", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        worker(cfg)
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # On CPU the ranks are forked from this process after it has traced and split the
    # model once: they start without importing torch and tracing again (seconds each).
    # With CUDA they are spawned (a forked CUDA runtime is unusable) and prepare themselves.
    start_method = "spawn" if torch.cuda.is_available() else "fork"
    global _PREPARED
    threads = torch.get_num_threads()
    try:
        if start_method == "fork":
            from rich.console import Console

            torch.set_num_threads(1)  # no OpenMP pool in the parent, so none is inherited half-alive
            try:
                _PREPARED = _prepare(cfg, cfg.ranks, Console().print)
            except (SystemExit, KeyboardInterrupt):
                raise
            except Exception as e:  # a bad --split, a model that does not trace, ...: say what, no traceback
                print(f"pippy-split train failed: {type(e).__name__}: {e}", file=sys.stderr)
                return 1
            sys.stdout.flush()
            sys.stderr.flush()
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.ranks, rdzv_backend="c10d",
                              rdzv_endpoint=f"localhost:{free_port()}", run_id=f"pippy-split-{os.getpid()}",
                              max_restarts=0, monitor_interval=0.1, start_method=start_method)
        try:
            elastic_launch(config, worker)(cfg)
        except ChildFailedError as e:
            print(f"pippy-split train failed:\n{e.format_msg()}", file=sys.stderr)
            print(failure_line(e), file=sys.stderr, flush=True)  # last: what to read under the dump
            return 1
        return 0
    finally:
        _PREPARED = None
        torch.set_num_threads(threads)

if __name__ == "__main__":
    sys.exit(main())
