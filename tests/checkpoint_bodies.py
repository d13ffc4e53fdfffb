"""Rank bodies for tests/test_checkpoint.py (top level, so that run_ranks can pickle them)."""

from __future__ import annotations

import os
import signal

import torch

import pippy_split as ps
from pippy_split import checkpoint, zoo

N_MB = 4
LR = 1e-2


def params_of(holders) -> list[torch.nn.Parameter]:
    """Unique parameters of a schedule's stages (or of a list of modules), in a stable order."""
    mods = [st.module for st in holders.stages] if hasattr(holders, "stages") else list(holders)
    return list({id(p): p for m in mods for p in m.parameters()}.values())


def by_fqn(modules, opt=None) -> dict:
    """``{"params": {fqn: tensor}, "exp_avg": {fqn: tensor}, "lr": ...}`` of these modules."""
    out = {"params": {}, "exp_avg": {}, "lr": None if opt is None else opt.param_groups[0]["lr"]}
    for m in modules:
        for n, p in m.named_parameters(remove_duplicate=False):
            out["params"][n] = p.detach().clone()
            if opt is not None and p in opt.state:
                out["exp_avg"][n] = opt.state[p]["exp_avg"].clone()
    return out


def data():
    """The batch every layout trains on (tiny_gpt's seed-0 example)."""
    entry = zoo.get("tiny_gpt")
    return entry.args, entry.target, entry.loss_fn


def _pipe(model, split_spec, args):
    (mb_args, mb_kwargs) = ps.split_args_kwargs(args, {}, N_MB)[0]
    return ps.pipeline(model, split_spec, mb_args, mb_kwargs)


def train_save(rank: int, world: int, path: str, bad_path: str) -> dict:
    """4-stage tiny_gpt on 2 ranks (ZBVZeroBubble: stages 0+3, 1+2), one AdamW step, save."""
    entry = zoo.get("tiny_gpt")
    pipe = _pipe(entry.model, entry.split_spec, entry.args)
    sched = ps.build_schedule(pipe, "ZBVZeroBubble", N_MB, loss_fn=entry.loss_fn)
    opt = torch.optim.AdamW(params_of(sched), lr=LR)
    sched.step(*entry.args, target=entry.target)
    opt.step()
    opt.zero_grad()
    try:
        checkpoint.save(bad_path, sched, opt)
        bad = None
    except checkpoint.CheckpointError as e:
        bad = str(e)
    checkpoint.save(path, sched, opt, extra={"step": 1})
    out = by_fqn([st.module for st in sched.stages], opt)
    out.update(bad=bad, stages=[st.stage_index for st in sched.stages], loss=float(sched.loss))
    return out


def load_step_save(rank: int, world: int, path: str, wrong_path: str, out_path: str) -> dict:
    """Load into 2 stages on 2 ranks (1F1B), then two more AdamW steps, then save again."""
    args, target, loss_fn = data()
    model = zoo.get("tiny_gpt", seed=1).model  # other weights: the load must overwrite every one
    pipe = _pipe(model, ["blocks.2"], args)
    sched = ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=loss_fn)
    opt = torch.optim.AdamW(params_of(sched), lr=0.5)  # lr comes back from the checkpoint
    try:
        checkpoint.load(wrong_path, sched, opt)
        wrong = None
    except checkpoint.CheckpointError as e:
        wrong = str(e)
    extra = checkpoint.load(path, sched, opt)
    out = by_fqn([st.module for st in sched.stages], opt)
    losses = []
    for _ in range(2):
        sched.step(*args, target=target)
        opt.step()
        opt.zero_grad()
        losses.append(float(sched.loss))
    checkpoint.save(out_path, sched, opt, extra={"step": 3})
    out.update(wrong=wrong, extra=extra, losses=losses, stages=[st.stage_index for st in sched.stages])
    return out


def save_replicas(rank: int, world: int, path: str) -> str:
    """Every rank saves the same unsplit model (data-parallel replicas) with rank-valued weights.

    First a save in which rank 1's writer fails: every rank must raise. Returns that error.
    """
    from torch.distributed.checkpoint import FileSystemWriter

    model = zoo.get("mlp_stack").model
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank))
    real_write = FileSystemWriter.write_data
    if rank == 1:
        def fail(self, plan, planner):
            raise OSError(5, "Input/output error")
        FileSystemWriter.write_data = fail
    try:
        checkpoint.save(path, model)
        error = ""
    except checkpoint.CheckpointError as e:
        error = str(e)
    FileSystemWriter.write_data = real_write
    checkpoint.save(path, model, extra={"rank": rank})
    return error


def _mlp():
    entry = zoo.get("mlp_stack")
    return entry.model


def killed_while_writing(rank: int, world: int, path: str) -> None:
    """Start a save and SIGKILL this process once part of the data is on disk."""
    from torch.distributed.checkpoint import FileSystemWriter

    def write_then_die(self, plan, planner):
        with open(os.path.join(str(self.path), "__0_0.distcp"), "wb") as f:
            f.write(b"half a checkpoint")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.write_data = write_then_die
    model = _mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    checkpoint.save(path, model)


def killed_between_renames(rank: int, world: int, path: str) -> None:
    """Force the two-rename fallback and SIGKILL this process between the renames."""
    from pippy_split.checkpoint import files

    files._exchange = lambda a, b: False
    real_rename = os.rename

    def rename_then_die(src, dst):
        real_rename(src, dst)
        if os.fspath(src) == path:  # the old checkpoint is now the backup; the new one not yet in place
            os.kill(os.getpid(), signal.SIGKILL)

    os.rename = rename_then_die
    model = _mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    checkpoint.save(path, model)


def one_rank_is_wrong(rank: int, world: int, path: str) -> list[str]:
    """A problem only rank 1 sees (a foreign optimizer parameter, meta tensors) fails every rank."""
    errors = []
    model = _mlp()
    params = list(model.parameters()) if rank == 0 else [torch.nn.Parameter(torch.zeros(3))]
    try:
        checkpoint.save(path, model, torch.optim.AdamW(params))
    except checkpoint.CheckpointError as e:
        errors.append(str(e))
    checkpoint.save(path, model)
    target = _mlp().to("meta") if rank == 1 else _mlp()
    try:
        checkpoint.load(path, target)
    except checkpoint.CheckpointError as e:
        errors.append(str(e))
    return errors

