"""One rank of ``pippy-split train``: build its stages, train, checkpoint, resume.

Where this sits: after :mod:`pippy_split.training.setup` (the Pipe), on every rank.
Every rank steps an AdamW over its own stages. With ``--checkpoint-every N`` every
rank writes its stages, AdamW state and the run's position (step, data generator,
losses so far) with :mod:`pippy_split.checkpoint` at the start and after every N
steps; when the launcher restarts the group after a failure
(``TORCHELASTIC_RESTART_COUNT`` > 0), every rank loads the last complete one and
carries on from its step, so the run ends as an uninterrupted one would. The
global RNG is seeded from (seed, step) at every step, so a resumed step draws
what the first attempt drew (dropout).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

import pippy_split as ps

from ..schedule.simulate import simulate
from .batches import count_tokens, heldout_batch, to_device, train_batch
from .chart import write_chart
from .config import TrainConfig
from .errors import as_job_error
from .finish import finish
from .metrics import RunLog, make_run_dir, peak_memory_mib
from .nd import Layout, parallelize_stages
from .optim import average_accumulated, lr_at, make_optimizer
from .planned import planned_config
from .run_dir import METRICS_FILE, TRAIN_STATE_DIR, saved_position
from .setup import SUM_MAX, Prepared, pack_budget, prepare
from .stop import StopRequest

if TYPE_CHECKING:
    from ..schedule.pipeline_schedule import PipelineSchedule

__all__ = ["worker", "train_rank", "RunState", "TRAIN_STATE_DIR", "saved_position"]


@dataclass
class RunState:
    """Where a run stands: the next step, the data generator, rank 0's losses so far."""

    step: int
    data_gen: torch.Generator
    losses: list[float] = field(default_factory=list)
    resumed_from: int | None = None

    def extra(self, cfg: TrainConfig) -> dict:
        return {"step": self.step, "data_rng": self.data_gen.get_state(), "losses": list(self.losses),
                "run_id": os.environ.get("TORCHELASTIC_RUN_ID"), "steps": cfg.steps, "seed": cfg.seed}


def worker(cfg: TrainConfig, prepared: Prepared | None = None) -> int | None:
    """One rank of the training run (call under torchrun or the elastic launcher): None when it trained to
    the end, else the step after which SIGINT or SIGTERM stopped it (its state saved for ``--resume``).

    ``prepared``: a :func:`~pippy_split.training.setup.prepare` result made
    elsewhere (tests); None to prepare here.
    """
    stop = StopRequest().install()  # first: a Ctrl-C while this rank starts is a stop at the first boundary
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    _init_group("nccl" if use_cuda else "gloo")
    try:
        return train_rank(cfg, prepared, dist.get_rank(), dist.get_world_size(), device, stop)
    except BaseException as e:
        found = as_job_error(e)  # an error the job found on purpose: its message, without the traceback
        if found is None or found is e:
            raise
        raise found from None
    finally:
        dist.destroy_process_group()


def train_rank(cfg: TrainConfig, prepared: Prepared | None, rank: int, world: int,
               device: torch.device, stop: StopRequest | None = None) -> int | None:
    """Build this rank's stages, train ``cfg.steps`` steps (resuming if restarted), save, finish; stopped by
    ``stop`` at a step boundary: save, and return that step (None: it trained to the end)."""
    console = job_console()
    log = console.print if rank == 0 else (lambda *a, **k: None)
    if rank == 0:  # first, while the other ranks trace: a directory in the way fails here, named, before any collective
        make_run_dir(cfg.checkpoint)
    layout = Layout.of(cfg, world, rank, device)  # --dp / --tp: a (dp, pp, tp) mesh
    if cfg.plan and prepared is None:
        cfg = planned_config(cfg, layout.pp, log)
    prep = prepared if prepared is not None and prepared.world == layout.pp else \
        prepare(cfg, layout.pp, log, layout.pp_rank)
    sched, opt = _build(cfg, prep, device, layout)
    dcp_dir = os.path.join(cfg.checkpoint, TRAIN_STATE_DIR)
    state = _start(cfg, sched, opt, dcp_dir, log)
    bubble = _banner(cfg, prep, layout, device, log)
    stopped = _loop(cfg, prep, sched, opt, state, rank, device, console, dcp_dir, bubble, layout,
                    stop or StopRequest())
    # every rank writes its stages and optimizer state (DCP, original FQNs) for --resume
    ps.checkpoint.save(dcp_dir, sched, opt, extra=state.extra(cfg))
    if stopped:
        return state.step
    if rank == 0:
        finish(cfg, prep, dcp_dir, state.losses, layout.pp, log)
    return None


def job_console(file: Any = None) -> Console:
    """Rank 0's console: a line is never wrapped at the width rich assumes for a file or pipe (80 columns),
    so a log keeps one line per message."""
    return Console(file=file, stderr=False, soft_wrap=True)


def _build(cfg: TrainConfig, prep: Prepared, device: torch.device,
           layout: Layout) -> tuple[Any, torch.optim.Optimizer]:
    sched = ps.build_schedule(prep.pipe, cfg.schedule, cfg.microbatches, loss_fn=prep.loss_fn, device=device,
                              loss_count=prep.loss_count, state_dict=prep.state_dict, group=layout.pp_group,
                              activation_checkpoint=checkpoint_setting(cfg.activation_checkpoint),
                              mixed_precision=torch.bfloat16 if cfg.bf16 else None, compile=cfg.compile)
    parallelize_stages(cfg, sched, prep.model, layout)  # before the optimizer: FSDP2/TP replace the parameters
    params = list({id(p): p for st in sched.stages for p in st.module.parameters()}.values())
    return sched, make_optimizer(cfg, params)


def checkpoint_setting(value: str | None) -> str | list[str] | None:
    """``--activation-checkpoint``'s value as ``build_schedule`` takes it: ``"full"``, a
    list of module patterns, or None.

    Example:
        >>> checkpoint_setting("full"), checkpoint_setting("blocks.*.mlp, blocks.*.attn"), checkpoint_setting(None)
        ('full', ['blocks.*.mlp', 'blocks.*.attn'], None)
    """
    if value is None or value == "full":
        return value
    return [p.strip() for p in value.split(",") if p.strip()]


def _init_group(backend: str) -> None:
    """``init_process_group`` from the launcher's environment, its keys under this attempt's prefix.

    After a restart the launcher's store can still hold the killed group's addresses under
    the default keys, and a rank that reads one connects to a dead port ("Connection
    refused"); a prefix per attempt keeps each group's set-up apart."""
    store, rank, world = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"pippy_split/attempt_{restart_count()}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def restart_count() -> int:
    """How many times the launcher has restarted this group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _start(cfg: TrainConfig, sched: PipelineSchedule, opt: torch.optim.Optimizer, dcp_dir: str,
           log: Callable[..., None]) -> RunState:
    """Step 0, or (after a restart) the last complete checkpoint of this run; --resume's optimizer state."""
    state = RunState(0, torch.Generator().manual_seed(cfg.seed))  # same stream on every rank -> same batches
    if cfg.checkpoint_every and restart_count() > 0 and _ours(cfg, dcp_dir):
        extra = ps.checkpoint.load(dcp_dir, sched, opt)
        state.step, state.losses, state.resumed_from = extra["step"], list(extra["losses"]), extra["step"]
        state.data_gen.set_state(extra["data_rng"])
        log(f"[green]restart {restart_count()}: resumed[/] from step {state.step} ({dcp_dir})")
        return state
    if cfg.resume and saved_position(dcp_dir) is not None:  # the newest complete state (model.pt's is older)
        # Weights came from model.pt before pipelining; this restores AdamW's state too,
        # whatever stage layout wrote it (the checkpoint is keyed by original FQNs), and where
        # the run stopped: its step (so the LR schedule and metrics.jsonl go on), data order and losses.
        extra = ps.checkpoint.load(dcp_dir, sched, opt)
        if isinstance(extra, dict) and "step" in extra and "data_rng" in extra:
            state.step, state.losses, state.resumed_from = extra["step"], list(extra["losses"]), extra["step"]
            state.data_gen.set_state(extra["data_rng"])
            log(f"[green]resumed[/] at step {state.step} of {cfg.steps} (weights, AdamW state, LR schedule and "
                f"data order) from {dcp_dir}")
        else:
            log(f"[green]resumed optimizer state[/] from {dcp_dir} (it records no step: counting from 0)")
    if cfg.checkpoint_every:  # a restart before the first N steps finds this, not an older run's
        ps.checkpoint.save(dcp_dir, sched, opt, extra=state.extra(cfg))
    return state


def _ours(cfg: TrainConfig, dcp_dir: str) -> bool:
    """A complete checkpoint written by this run (same run id, steps and seed)?"""
    extra = saved_position(dcp_dir)
    return (extra is not None and "data_rng" in extra and extra.get("steps") == cfg.steps
            and extra.get("seed") == cfg.seed and extra.get("run_id") == os.environ.get("TORCHELASTIC_RUN_ID"))


def _banner(cfg: TrainConfig, prep: Prepared, layout: Layout, device: torch.device,
            log: Callable[..., None]) -> float:
    pipe, M, world = prep.pipe, cfg.microbatches, layout.pp
    order = ps.get_schedule_class(cfg.schedule).compute_order(world, M, pipe.num_stages // world)
    bubble = simulate(order).bubble_fraction
    log(f"[bold]pippy-split train[/]: {type(prep.model).__name__}, {pipe.num_stages} stages on {world} ranks "
        f"({'nccl' if device.type == 'cuda' else 'gloo'}), schedule {cfg.schedule}, {M} microbatches, "
        f"{sum(s.num_params for s in pipe.stages):,} params, simulated bubble {bubble:.1%}")
    if layout.mesh is not None:
        parts = [f"{layout.dp} pipeline replicas, each on its {cfg.batch_size} rows of a "
                 f"{layout.dp * cfg.batch_size}-row step, blocks sharded by FSDP2"] if layout.dp > 1 else []
        parts += [f"each stage split over {layout.tp} tensor-parallel ranks"] if layout.tp > 1 else []
        log(f"mesh (dp={layout.dp}, pp={layout.pp}, tp={layout.tp}): {'; '.join(parts)}")
    if prep.documents is not None:
        log(f"data: the {len(prep.documents)} lines of {cfg.data} packed whole into one row per microbatch of up "
            f"to {pack_budget(cfg)} characters (each microbatch its own length); loss: mean over the step's "
            "predicted characters")
    if prep.corpus is not None and not cfg.data:
        log(f"data: sums a+b=c of 0..{SUM_MAX}, operands zero-padded, c's digits backwards (07+45=25 is "
            "7+45=52), windows starting at line starts; the loss is the answers' (the operands are random)")
    return bubble


def _maybe_fail(cfg: TrainConfig, rank: int, step: int) -> None:
    """``--simulate-failure RANK:STEP``: SIGKILL this rank there, on the first attempt only."""
    if cfg.simulate_failure and restart_count() == 0:
        r, s = (int(v) for v in cfg.simulate_failure.split(":"))
        if (r, s) == (rank, step):
            os.kill(os.getpid(), signal.SIGKILL)


def _loop(cfg: TrainConfig, prep: Prepared, sched: PipelineSchedule, opt: torch.optim.Optimizer, state: RunState,
          rank: int, device: torch.device, console: Any, dcp_dir: str, bubble: float, layout: Layout,
          stop: StopRequest) -> bool:
    """Train to ``cfg.steps``; True where every rank agreed to stop early (SIGINT / SIGTERM)."""
    plain = not console.is_terminal  # a file, SLURM, CI: lines every --log-every steps instead of a bar
    progress = Progress(TextColumn("[bold blue]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                        TextColumn("bubble {task.fields[bubble]}"), TimeElapsedColumn(), TextColumn("ETA"),
                        TimeRemainingColumn(),
                        console=console, disable=rank != 0 or plain)
    run_log = RunLog(cfg.checkpoint, log_every=cfg.log_every, tensorboard=cfg.tensorboard, plain=plain,
                     print_fn=lambda text: console.print(text, highlight=False),
                     append=state.step > 0 or cfg.resume) if rank == 0 else None
    if run_log is not None and run_log.tensorboard_missing:
        console.print("tensorboard is not installed: metrics go to metrics.jsonl only")
    heldout = heldout_batch(cfg, prep, layout) if cfg.eval_every else None
    evaluates = bool(cfg.eval_every) and _rank0_says(heldout is not None, device)  # ranks without data agree
    if cfg.eval_every and not evaluates and rank == 0:
        console.print("--eval-every: no held-out data (--data under 10 documents, or a factory's own batch): "
                      "not evaluating")
    tokens, t0, first_step, stopped = 0, time.perf_counter(), state.step, False
    with progress:
        task = progress.add_task("train", total=cfg.steps, completed=state.step, loss="-", tps="-",
                                 bubble=f"{bubble:.1%}")
        while state.step < cfg.steps:
            if stop.agreed(device):  # every rank stops after the same step
                stopped = True
                break
            _maybe_fail(cfg, rank, state.step)
            lr = lr_at(cfg, state.step)
            loss, grad_norm, step_tokens = _train_step(cfg, prep, sched, opt, state, lr, device, layout)
            tokens += step_tokens
            if evaluates and (state.step % cfg.eval_every == 0 or state.step == cfg.steps):
                held_loss = held_out_loss(sched, heldout or ((), {}, None), prep, device)
                if run_log is not None:
                    run_log.eval(state.step, held_loss)
            if run_log is not None:
                state.losses.append(loss)
                tps = tokens / max(time.perf_counter() - t0, 1e-9)
                run_log.step(state.step, last=state.step == cfg.steps, loss=loss, lr=lr, grad_norm=grad_norm,
                             tokens_per_s=tps, peak_mib=peak_memory_mib(device))
                progress.update(task, advance=1, loss=f"{loss:.4f}", tps=f"{tps:,.0f}")
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and state.step < cfg.steps:
                ps.checkpoint.save(dcp_dir, sched, opt, extra=state.extra(cfg))
    if run_log is not None:
        run_log.close()
        if state.losses and not stopped:
            console.print(f"loss and tokens/s per step, charted: {write_chart(cfg.checkpoint)}", highlight=False)
    if rank == 0 and state.losses and not stopped:  # the steps this run made (a resumed run: since it resumed)
        console.print(f"first loss {state.losses[0]:.4f}   last loss {state.losses[-1]:.4f}   "
                      f"({state.step - first_step} steps, {time.perf_counter() - t0:.1f} s; per step: "
                      f"{os.path.join(cfg.checkpoint, METRICS_FILE)})")
    return stopped


def _train_step(cfg: TrainConfig, prep: Prepared, sched: PipelineSchedule, opt: torch.optim.Optimizer, state: RunState, lr: float,
                device: torch.device, layout: Layout) -> tuple[float, float, int]:
    """One optimizer step (``--grad-accum`` pipeline steps) at ``lr``: ``(loss, grad norm, tokens)``, the loss
    and norm the same on every rank."""
    for g in opt.param_groups:
        g["lr"] = lr
    torch.manual_seed(cfg.seed + 1_000_003 * (state.step + 1))  # the same draws on a resumed step
    loss, tokens = 0.0, 0
    for _ in range(cfg.grad_accum):  # gradients add up over the pipeline steps, then are averaged
        a, k, y = train_batch(cfg, prep, state.data_gen, layout)
        sched.step(*(to_device(t, device) for t in a), target=to_device(y, device), **k)
        assert sched.loss is not None  # step() sets it on every rank
        loss += layout.mean_over_replicas(float(sched.loss), device) / cfg.grad_accum
        tokens += (count_tokens(a[0]) if a else 0) * layout.dp
    average_accumulated(sched, cfg.grad_accum)
    max_norm = cfg.clip_grad_norm if cfg.clip_grad_norm is not None else float("inf")
    grad_norm = float(ps.clip_grad_norm_(sched, max_norm))  # every rank: one all-reduce
    opt.step()
    opt.zero_grad(set_to_none=True)
    state.step += 1
    return loss, grad_norm, tokens


def _rank0_says(flag: bool, device: torch.device) -> bool:
    """Rank 0's ``flag`` on every rank (rank 0 holds the first stage, so it always reads the data)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.broadcast(value, src=0)
    return bool(value.item())


def held_out_loss(sched: PipelineSchedule, batch: tuple[tuple, dict, Any], prep: Prepared, device: torch.device) -> float:
    """The held-out loss (forward only, no gradients), the same value on every rank: the last
    stage's rank computes it and broadcasts it."""
    a, k, y = batch
    out = sched.eval(*(to_device(t, device) for t in a), **k)
    value = torch.zeros((), dtype=torch.float64, device=device)
    if out is not None:  # this rank holds the last stage
        with torch.no_grad():
            y = to_device(y, device)
            if prep.loss_count is not None:  # summed loss over unequal microbatches / their items
                total = sum(float(prep.loss_fn(o, t)) for o, t in zip(out, y))
                value.fill_(total / max(1.0, float(sum(float(prep.loss_count(t)) for t in y))))
            else:
                value.fill_(float(prep.loss_fn(out, y)))
    if dist.is_available() and dist.is_initialized():  # within this replica's pipeline
        group, last = sched.group, sched.placement[sched.num_stages - 1]
        dist.broadcast(value, src=last if group is None else dist.get_global_rank(group, last), group=group)
    return float(value)
