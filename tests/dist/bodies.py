"""Rank bodies shared by the distributed tests (top-level so they pickle)."""

from __future__ import annotations


import torch

import pippy_split as ps
from pippy_split import zoo


def reference(name: str, n_mb: int):
    """Loss and grads of the unsplit model on the whole batch (mean over microbatches)."""
    entry = zoo.get(name)
    model = entry.model
    mbs = ps.split_args_kwargs(entry.args, entry.kwargs, n_mb)
    tgts = ps.split_args_kwargs((entry.target,), {}, n_mb)
    total = 0.0
    for (a, k), (t, _) in zip(mbs, tgts):
        loss = entry.loss_fn(model(*a, **k), t[0]) / n_mb
        loss.backward()
        total += loss.item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    return total, grads


def train_step(rank: int, world: int, name: str, schedule: str, n_mb: int, steps: int = 1):
    """Build the zoo model's pipe on every rank, run `steps` steps, return loss and this rank's grads by FQN."""
    entry = zoo.get(name)
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, n_mb))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn)
    losses = []
    for _ in range(steps):
        out = sched.step(*entry.args, target=entry.target, losses=losses, **entry.kwargs)
    grads = {}
    for st in sched.stages:
        for n, p in st.module.named_parameters(remove_duplicate=False):
            if p.grad is not None:
                grads[n] = p.grad.clone()
    return {"loss": float(sched.loss), "grads": grads, "n_losses": len(losses),
            "out_shape": None if out is None else _shape(out)}


def _shape(out):
    return tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__


def _mb_example(entry, n_mb):
    (a, k) = ps.split_args_kwargs(entry.args, entry.kwargs, n_mb)[0]
    return a, k


def eval_then_step(rank: int, world: int, name: str, schedule: str, n_mb: int):
    """eval() before any step() (V placement: stages 0 and 3 on rank 0), then a step."""
    entry = zoo.get(name)
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, n_mb))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn)
    out = sched.eval(*entry.args, **entry.kwargs)
    result = train_step_on(sched, entry)
    result["eval"] = out
    return result


def train_step_on(sched, entry):
    losses = []
    out = sched.step(*entry.args, target=entry.target, losses=losses, **entry.kwargs)
    grads = {n: p.grad.clone() for st in sched.stages
             for n, p in st.module.named_parameters(remove_duplicate=False) if p.grad is not None}
    return {"loss": float(sched.loss), "grads": grads, "n_losses": len(losses),
            "out_shape": None if out is None else _shape(out)}


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return h, self.b(x)  # output 1 skips stage 1


class _Mid(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(6, 6)
        self.bn = torch.nn.BatchNorm1d(6)

    def forward(self, h):
        return self.bn(torch.relu(self.l(h)))


class _Tail(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(6, 3)

    def forward(self, c, skip):
        return self.l(c * skip)


def manual_parts():
    torch.manual_seed(0)
    return [_Head(), _Mid(), _Tail()], torch.randn(8, 6), torch.randn(8, 3)


def manual_reference(n_mb: int):
    parts, x, y = manual_parts()
    head, mid, tail = parts
    for xm, ym in zip(x.chunk(n_mb), y.chunk(n_mb)):
        h, skip = head(xm)
        loss = torch.nn.functional.mse_loss(tail(mid(h), skip), ym) / n_mb
        loss.backward()
    return {f"{i}.{n}": p.grad.clone() for i, m in enumerate(parts) for n, p in m.named_parameters()}, \
        {f"{i}.{n}": b.clone() for i, m in enumerate(parts) for n, b in m.named_buffers()}


def manual_step(rank: int, world: int, schedule: str, n_mb: int):
    """Hand-built stages (no Pipe): shapes inferred lazily, a declared skip 0 -> 2."""
    parts, x, y = manual_parts()
    kw = [dict(outputs_to={1: [(2, 1)]}), {}, dict(inputs_from={1: (0, 1)})][rank]
    stage = ps.PipelineStage(parts[rank], rank, world, "cpu", **kw)
    sched = ps.get_schedule_class(schedule)(stage, n_mb, loss_fn=torch.nn.functional.mse_loss)
    sched.step(x, target=y)
    return ({f"{rank}.{n}": p.grad.clone() for n, p in parts[rank].named_parameters()},
            {f"{rank}.{n}": b.clone() for n, b in parts[rank].named_buffers()})


def failing_rank(rank: int, world: int, fail_stage: int):
    """A stage's forward raises on one rank; every other rank must fail fast, naming its peer."""
    entry = zoo.get("fan_out_skip")
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, 4))
    sched = ps.build_schedule(pipe, "GPipe", 4, loss_fn=entry.loss_fn, timeout=20)
    for st in sched.stages:
        if st.stage_index == fail_stage:
            def boom(module, args, out):
                raise ValueError("injected failure")
            st.module.register_forward_hook(boom)
    sched.step(*entry.args, target=entry.target)


def dynamic_steps(rank: int, world: int, schedule: str, lengths: list):
    """One pipe traced with a dynamic sequence dim, steps at several lengths."""
    from torch.export import Dim
    entry = zoo.get("tiny_gpt")
    x = entry.args[0]
    pipe = ps.pipeline(entry.model, entry.split_spec, (x[:2],), dynamic_shapes={"idx": {1: Dim("T", min=2, max=64)}})
    sched = ps.build_schedule(pipe, schedule, 4, loss_fn=entry.loss_fn)
    out = []
    for T in lengths:
        for st in sched.stages:
            st.module.zero_grad(set_to_none=True)
        sched.step(x[:, :T], target=entry.target[:, :T])
        grads = {n: p.grad.clone() for st in sched.stages
                 for n, p in st.module.named_parameters(remove_duplicate=False) if p.grad is not None}
        out.append({"loss": float(sched.loss), "grads": grads,
                    "held": [st.held_microbatches for st in sched.stages]})
    return out


def peak_held(rank: int, world: int, schedule: str, n_mb: int):
    entry = zoo.get("mlp_stack")
    pipe = ps.pipeline(entry.model, ["layers.4"], *_mb_example(entry, n_mb))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn)
    sched.step(*entry.args, target=entry.target)
    return [(st.stage_index, st.peak_held_microbatches, st.held_microbatches) for st in sched.stages]


def ddp_pp(rank: int, world: int, n_mb: int):
    """PP=2 x DP=2 on 4 ranks: pipeline groups {0,1},{2,3}; data-parallel groups {0,2},{1,3}."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp, dp = pp_groups[rank // 2], dp_groups[rank % 2]
    replica = rank // 2
    entry = zoo.get("mlp_stack")
    x, y = entry.args[0], entry.target
    half = x.shape[0] // 2
    xs, ys = x[replica * half:(replica + 1) * half], y[replica * half:(replica + 1) * half]
    mb = xs[: half // n_mb]
    pipe = ps.pipeline(entry.model, ["layers.4"], (mb,))
    stage = pipe.build_stage(rank % 2, group=pp)
    stage.module = DDP(stage.module, process_group=dp)
    sched = ps.Schedule1F1B(stage, n_mb, loss_fn=entry.loss_fn)
    sched.step(xs, target=ys)
    return {n.removeprefix("module."): p.grad.clone() for n, p in stage.module.named_parameters()}


def trajectory(rank: int, world: int, name: str, schedule: str, steps: int, n_mb: int):
    """`steps` AdamW steps of pipelined training; the last-stage rank returns the loss per step."""
    entry = zoo.get(name)
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, n_mb))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn)
    params = {id(p): p for st in sched.stages for p in st.module.parameters()}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2)
    losses = []
    for _ in range(steps):
        sched.step(*entry.args, target=entry.target, **entry.kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(sched.loss))
    return losses


def unsplit_trajectory(name: str, steps: int, n_mb: int):
    entry = zoo.get(name)
    model = entry.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mbs = ps.split_args_kwargs(entry.args, entry.kwargs, n_mb)
    tgts = ps.split_args_kwargs((entry.target,), {}, n_mb)
    out = []
    for _ in range(steps):
        total = 0.0
        for (a, k), (t, _) in zip(mbs, tgts):
            loss = entry.loss_fn(model(*a, **k), t[0]) / n_mb
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(total)
    return out


def no_creep(rank: int, world: int, steps: int):
    """Alternating sequence lengths for many steps: nothing held or buffered grows."""
    from torch.export import Dim
    entry = zoo.get("tiny_gpt", d_model=16, n_layer=4, batch_size=4, seq_len=16)
    x, y = entry.args[0], entry.target
    pipe = ps.pipeline(entry.model, entry.split_spec, (x[:1],), dynamic_shapes={"idx": {1: Dim("T", min=2, max=32)}})
    sched = ps.build_schedule(pipe, "ZBVZeroBubble", 4, loss_fn=entry.loss_fn)
    runtime = sched._runtime
    sizes = []
    for step in range(steps):
        T = 16 if step % 2 else 9
        sched.step(x[:, :T], target=y[:, :T])
        flight = list(runtime._flight.values())  # (stage, microbatch) records still in flight
        sizes.append((sum(st.held_microbatches for st in sched.stages), len(flight),
                      sum(bool(r.inputs or r.arriving_inputs or r.output_grads or r.arriving_grads) for r in flight),
                      sum(bool(r.to_send) for r in flight), sum(bool(r.grads_to_send) for r in flight),
                      len(runtime._sends), sum(len(st.results) for st in sched.stages)))
    return sizes


def shape_change(rank: int, world: int):
    """Hand-built stages learn shapes on step 1; step 2 sends a different shape without declaring it."""
    parts, x, y = manual_parts()
    kw = [dict(outputs_to={1: [(2, 1)]}), {}, dict(inputs_from={1: (0, 1)})][rank]
    stage = ps.PipelineStage(parts[rank], rank, world, "cpu", **kw)
    sched = ps.get_schedule_class("1F1B")(stage, 4, loss_fn=torch.nn.functional.mse_loss, timeout=30)
    sched.step(x, target=y)
    sched.step(torch.cat([x, x[:4]]), target=torch.cat([y, y[:4]]))


def run_orders(rank: int, world: int, csv_orders: list, n_mb: int):
    """Each hand-written order either is rejected at construction on every rank or runs exactly."""
    entry = zoo.get("mlp_stack")
    pipe = ps.pipeline(entry.model, ["layers.4"], *_mb_example(entry, n_mb))
    stage = pipe.build_stage(rank)
    out = []
    for text in csv_orders:
        stage.module.zero_grad(set_to_none=True)
        try:
            sched = ps.ScheduleFromOrder(stage, n_mb, entry.loss_fn, order=text, timeout=30)
        except ps.ScheduleError:
            out.append("rejected")
            continue
        sched.step(*entry.args, target=entry.target)
        out.append(float(sched.loss))
    return out


def killed_rank(rank: int, world: int):
    """Rank 1 is SIGKILLed in the middle of its forward; the others must fail fast naming it."""
    import os
    import signal
    entry = zoo.get("fan_out_skip")
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, 4))
    sched = ps.build_schedule(pipe, "1F1B", 4, loss_fn=entry.loss_fn, timeout=60)
    if rank == 1:
        def die(module, args, out):
            os.kill(os.getpid(), signal.SIGKILL)
        sched.stages[0].module.register_forward_hook(die)
    sched.step(*entry.args, target=entry.target)


def resumable(rank: int, world: int, name: str, schedule: str, path: str, start: int, stop: int, n_mb: int):
    """Steps [start, stop) of AdamW training; loads `path` first when start > 0, saves it at the end."""
    entry = zoo.get(name)
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, n_mb))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn)
    params = {id(p): p for st in sched.stages for p in st.module.parameters()}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2)
    if start > 0:
        extra = ps.checkpoint.load(path, sched, opt)
        assert extra["step"] == start
    losses = []
    for _ in range(start, stop):
        sched.step(*entry.args, target=entry.target, **entry.kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(sched.loss))
    ps.checkpoint.save(path, sched, opt, extra={"step": stop})
    return losses


def fsdp_pp(rank: int, world: int, n_mb: int):
    """PP=2 x FSDP2=2 on a (dp, pp) device mesh: the stage module is fully_shard-ed over dp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh["dp"].get_local_rank()
    entry = zoo.get("mlp_stack")
    x, y = entry.args[0], entry.target
    half = x.shape[0] // 2
    xs, ys = x[replica * half:(replica + 1) * half], y[replica * half:(replica + 1) * half]
    pipe = ps.pipeline(entry.model, ["layers.4"], (xs[: half // n_mb],))
    stage = pipe.build_stage(mesh["pp"].get_local_rank(), group=mesh["pp"])  # a DeviceMesh dimension
    fully_shard(stage.module, mesh=mesh["dp"])
    sched = ps.Schedule1F1B(stage, n_mb, loss_fn=entry.loss_fn)
    sched.step(xs, target=ys)
    return {n: p.grad.full_tensor().clone() for n, p in stage.module.named_parameters()}


def train_step_placed(rank: int, world: int, name: str, schedule: str, n_mb: int, placement: str):
    entry = zoo.get(name)
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, n_mb))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn, placement=placement)
    result = train_step_on(sched, entry)
    result["stages"] = [st.stage_index for st in sched.stages]
    return result


def launched_worker(out_dir: str):
    """A rank started by torch's elastic launcher (the machinery behind torchrun); rank 1
    SIGKILLs itself mid-step, the others record the error they get."""
    import os
    import signal
    import traceback
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    try:
        entry = zoo.get("fan_out_skip")
        pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, 4))
        sched = ps.build_schedule(pipe, "1F1B", 4, loss_fn=entry.loss_fn, timeout=60)
        if rank == 1:
            sched.stages[0].module.register_forward_hook(lambda m, a, o: os.kill(os.getpid(), signal.SIGKILL))
        sched.step(*entry.args, target=entry.target)
    except Exception:
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
