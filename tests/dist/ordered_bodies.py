"""Rank bodies for the order-matched (NCCL-like) dist tests (top-level so they pickle)."""

from __future__ import annotations

import torch

import pippy_split as ps
from pippy_split.stage.transport import P2P


class SkipStack(torch.nn.Module):
    """8 blocks; block 0's output fans out to block 5 (with a gradient) and block 7, and
    block 2's output skips to block 6: skips cross ranks in both loop and V placement."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(8))
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.tanh(self.blocks[0](x))
        h = h0
        for i in range(1, 8):
            h = torch.tanh(self.blocks[i](h))
            if i == 2:
                h2 = h
            if i == 5:
                h = h + h0
            if i == 6:
                h = h * torch.sigmoid(h2)
        return self.head(h + h0)


def skip_stack_case():
    torch.manual_seed(0)
    return SkipStack(), torch.randn(16, 8), torch.randn(16, 3)


def skip_stack_reference(n_mb: int):
    model, x, y = skip_stack_case()
    total = 0.0
    for xm, ym in zip(x.chunk(n_mb), y.chunk(n_mb)):
        loss = torch.nn.functional.mse_loss(model(xm), ym) / n_mb
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def skip_stack_step(rank: int, world: int, schedule: str, n_mb: int, device: str = "cpu"):
    """One step of the 8-stage skip model; ``device`` "cuda" puts rank r on cuda:r (NCCL tier)."""
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    model, x, y = skip_stack_case()
    pipe = ps.pipeline(model, [f"blocks.{i}" for i in range(1, 8)], (x.chunk(n_mb)[0],))
    assert any(e.is_skip for e in pipe.edges)
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=torch.nn.functional.mse_loss, device=device)
    sched.release_sent_outputs = True  # the default on GPUs, forced here so CPU runs check it too
    sched.step(x.to(device), target=y.to(device))
    grads = {n: p.grad.detach().cpu().clone() for st in sched.stages for n, p in st.module.named_parameters()
             if p.grad is not None}
    return {"loss": float(sched.loss), "grads": grads, "stages": [st.stage_index for st in sched.stages]}


def tags_ignored(rank: int, world: int, ordered: bool):
    """Rank 0 sends A (tag 1) then B (tag 2); rank 1 receives with tags 2 then 1.
    Order-matched (NCCL's rule): the first receive gets A. Tagged (gloo): it gets B."""
    p2p = P2P(None, timeout=30, ordered=ordered)
    if rank == 0:
        ops = [P2P.send_op(torch.full((4,), 1.0), 1, "A", tag=1), P2P.send_op(torch.full((4,), 2.0), 1, "B", tag=2)]
        p2p.wait(p2p.post(ops))
        return None
    first, _ = P2P.recv_op((4,), torch.float32, torch.device("cpu"), 0, "first", tag=2)
    second, _ = P2P.recv_op((4,), torch.float32, torch.device("cpu"), 0, "second", tag=1)
    p2p.wait(p2p.post([first, second]))
    return [float(first.tensor[0]), float(second.tensor[0])]


def mismatched_microbatches(rank: int, world: int):
    """Ranks disagree on n_microbatches: a named error on every rank, not a hang."""
    model, x, y = skip_stack_case()
    pipe = ps.pipeline(model, ["blocks.4"], (x.chunk(4)[0],))
    try:
        ps.build_schedule(pipe, "1F1B", 4 if rank == 0 else 8, loss_fn=torch.nn.functional.mse_loss)
    except ps.ScheduleError as e:
        return str(e)
    return None


def clean_exit_worker(out_dir: str, schedule: str) -> None:
    """Under the elastic launcher: steps, then destroy_process_group() straight away."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, x, y = skip_stack_case()
    world = dist.get_world_size()
    split = {2: ["blocks.4"], 3: ["blocks.3", "blocks.6"]}[world]
    pipe = ps.pipeline(model, split, (x.chunk(4)[0],))
    sched = ps.build_schedule(pipe, schedule, 4, loss_fn=torch.nn.functional.mse_loss)
    for _ in range(2):
        sched.step(x, target=y)
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.ok"), "w") as f:
        f.write("ok")


def released_outputs_step(rank: int, world: int, schedule: str, n_mb: int, release: bool):
    """tiny GPT on 2 stages; record stage 0's forward outputs: after sending they hold no memory
    (a block ends in a residual add, which autograd does not save), and the step stays exact."""
    from pippy_split import zoo

    entry = zoo.get("tiny_gpt")
    mb = ps.split_args_kwargs(entry.args, entry.kwargs, n_mb)[0][0]
    pipe = ps.pipeline(entry.model, ["blocks.2"], mb)
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn)
    sched.release_sent_outputs = release
    outputs = []
    for st in sched.stages:
        forward = st.forward

        def recording(*args, _forward=forward, **kwargs):
            out = _forward(*args, **kwargs)
            outputs.extend(o for o in out if isinstance(o, torch.Tensor) and o.is_floating_point())
            return out

        st.forward = recording
    sched.step(*entry.args, target=entry.target, **entry.kwargs)
    grads = {n: p.grad.clone() for st in sched.stages for n, p in st.module.named_parameters() if p.grad is not None}
    held = [o.untyped_storage().nbytes() for o in outputs] if sched.stages[0].stage_index == 0 else []
    return {"loss": float(sched.loss), "grads": grads, "held_bytes": held,
            "full_bytes": [o.numel() * o.element_size() for o in outputs] if held else []}
